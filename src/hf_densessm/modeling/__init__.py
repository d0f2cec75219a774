"""DenseSSM models: one file per family, the dense connection (``dense_connection.py``), what both families share
above the block (``modeling_densessm.py``), the cache (``cache.py``) and the RMSNorm (``norm.py``)."""

from . import modeling_densemamba, modeling_denseretnet
from .modeling_densemamba import *  # noqa: F403 (its __all__: the DenseMamba model classes)
from .modeling_denseretnet import *  # noqa: F403 (its __all__: the DenseRetNet model classes)

__all__ = modeling_densemamba.__all__ + modeling_denseretnet.__all__
