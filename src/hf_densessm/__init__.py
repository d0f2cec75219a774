"""hf-densessm: DenseSSM language models (DenseMamba, DenseRetNet; He et al. 2024) for Hugging Face transformers.

Importing the package registers every family (``modeling.FAMILIES``: ``"densemamba"``, ``"denseretnet"``) with
``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM`` and ``AutoModelForSequenceClassification``, so
``from_config`` / ``from_pretrained`` work as for any model."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from . import configuration, modeling
from .configuration import *  # noqa: F403 (the config classes, presets and knob table)
from .modeling import *  # noqa: F403 (every family's model classes)
from .modeling.modeling_densessm import DenseSSMForCausalLM, DenseSSMForSequenceClassification, DenseSSMModel
from .recipes import paper_training_arguments

__version__ = "0.1.0"

for _module in modeling.FAMILIES:  # each Auto class gets the family's class built on the matching shared class
    _classes = [getattr(_module, name) for name in _module.__all__]
    _config = _classes[0].config_class
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    for _auto, _base in ((AutoModel, DenseSSMModel), (AutoModelForCausalLM, DenseSSMForCausalLM),
                         (AutoModelForSequenceClassification, DenseSSMForSequenceClassification)):
        for _cls in _classes:
            if issubclass(_cls, _base):
                _auto.register(_config, _cls, exist_ok=True)

__all__ = [*configuration.__all__, *modeling.__all__, "paper_training_arguments"]
