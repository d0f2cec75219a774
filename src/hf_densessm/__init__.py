"""hf-densessm: DenseSSM language models (DenseMamba, DenseRetNet; He et al. 2024) for Hugging Face transformers.

Importing the package registers ``"densemamba"`` and ``"denseretnet"`` with ``AutoConfig``, ``AutoModel``,
``AutoModelForCausalLM`` and ``AutoModelForSequenceClassification``, so ``from_config`` / ``from_pretrained`` work as
for any model."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from . import modeling
from .configuration import DenseMambaConfig, DenseRetNetConfig
from .modeling import (
    DenseMambaForCausalLM,
    DenseMambaForSequenceClassification,
    DenseMambaModel,
    DenseMambaPreTrainedModel,
    DenseRetNetForCausalLM,
    DenseRetNetForSequenceClassification,
    DenseRetNetModel,
    DenseRetNetPreTrainedModel,
)

from .recipes import paper_training_arguments

__version__ = "0.1.0"

for _config, _model, _lm, _classifier in (
    (DenseMambaConfig, DenseMambaModel, DenseMambaForCausalLM, DenseMambaForSequenceClassification),
    (DenseRetNetConfig, DenseRetNetModel, DenseRetNetForCausalLM, DenseRetNetForSequenceClassification),
):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)
    AutoModelForSequenceClassification.register(_config, _classifier, exist_ok=True)

__all__ = ["DenseMambaConfig", "DenseRetNetConfig", *modeling.__all__, "paper_training_arguments"]
