"""hf-densessm: DenseSSM language models (DenseMamba, DenseRetNet; He et al. 2024) for Hugging Face transformers.

Importing the package registers ``"densemamba"`` and ``"denseretnet"`` with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM``, so ``AutoModelForCausalLM.from_config`` / ``from_pretrained`` work as for any model.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration import DenseMambaConfig, DenseRetNetConfig
from .modeling import (
    DenseMambaForCausalLM,
    DenseMambaModel,
    DenseMambaPreTrainedModel,
    DenseRetNetForCausalLM,
    DenseRetNetModel,
    DenseRetNetPreTrainedModel,
)

__version__ = "0.1.0"

for _config, _model, _lm in (
    (DenseMambaConfig, DenseMambaModel, DenseMambaForCausalLM),
    (DenseRetNetConfig, DenseRetNetModel, DenseRetNetForCausalLM),
):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)

__all__ = [
    "DenseMambaConfig",
    "DenseMambaForCausalLM",
    "DenseMambaModel",
    "DenseMambaPreTrainedModel",
    "DenseRetNetConfig",
    "DenseRetNetForCausalLM",
    "DenseRetNetModel",
    "DenseRetNetPreTrainedModel",
]
