"""DenseSSM models: one file per family, the dense connection (``dense_connection.py``), what both families share
above the block (``modeling_densessm.py``), the cache (``cache.py``) and the RMSNorm (``norm.py``)."""

from .modeling_densemamba import (
    DenseMambaForCausalLM,
    DenseMambaForSequenceClassification,
    DenseMambaModel,
    DenseMambaPreTrainedModel,
)
from .modeling_denseretnet import (
    DenseRetNetForCausalLM,
    DenseRetNetForSequenceClassification,
    DenseRetNetModel,
    DenseRetNetPreTrainedModel,
)

__all__ = [
    "DenseMambaForCausalLM",
    "DenseMambaForSequenceClassification",
    "DenseMambaModel",
    "DenseMambaPreTrainedModel",
    "DenseRetNetForCausalLM",
    "DenseRetNetForSequenceClassification",
    "DenseRetNetModel",
    "DenseRetNetPreTrainedModel",
]
