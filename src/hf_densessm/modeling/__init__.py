"""DenseSSM models: the dense connection (``dense.py``, shared), one file per family, and the cache glue."""

from .modeling_densemamba import DenseMambaForCausalLM, DenseMambaModel, DenseMambaPreTrainedModel
from .modeling_denseretnet import DenseRetNetForCausalLM, DenseRetNetModel, DenseRetNetPreTrainedModel

__all__ = [
    "DenseMambaForCausalLM",
    "DenseMambaModel",
    "DenseMambaPreTrainedModel",
    "DenseRetNetForCausalLM",
    "DenseRetNetModel",
    "DenseRetNetPreTrainedModel",
]
