"""hf-densessm: DenseSSM language models (DenseMamba, DenseRetNet; He et al. 2024) for Hugging Face transformers.

Importing it registers every family (``modeling.FAMILIES``) with ``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM``
and ``AutoModelForSequenceClassification``, so ``from_config`` / ``from_pretrained`` work as for any model."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from . import configuration, modeling
from .configuration import *  # noqa: F403 (the config classes, presets and knob table)
from .modeling import *  # noqa: F403 (every family's model classes)
from .configuration.configuration_densemamba import DENSEMAMBA_PAPER_TRAINING
from .configuration.configuration_densessm import resolve_preset
from .configuration.configuration_denseretnet import DENSERETNET_PAPER_TRAINING
from .modeling.modeling_densessm import DenseSSMForCausalLM, DenseSSMForSequenceClassification, DenseSSMModel

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


def paper_training_arguments(preset: str) -> dict:
    """The paper's training settings for a paper preset as ``transformers.TrainingArguments`` keywords: the learning
    rate and Adam betas (Tables 2, 3) and ``PAPER_OPTIMIZER`` (§4.2; docs/design.md §7). Raises ``ValueError``
    (listing the presets) for another ``preset``."""
    return resolve_preset({**DENSEMAMBA_PAPER_TRAINING, **DENSERETNET_PAPER_TRAINING}, preset, "paper-trained")


__all__ = [*configuration.__all__, *modeling.__all__, "paper_training_arguments"]
