"""DenseSSM models: the classes every family builds on and the RMSNorm (``modeling_densessm.py``), one file per
family, the dense connection (``dense_connection.py``), the cache (``cache.py``, ``cache_names.py``), input checks
(``inputs.py``)."""

from . import modeling_densemamba, modeling_denseretnet
from .modeling_densemamba import *  # noqa: F403 (its __all__: the DenseMamba model classes)
from .modeling_denseretnet import *  # noqa: F403 (its __all__: the DenseRetNet model classes)

#: Every family's modeling module; ``import hf_densessm`` registers their classes (docs/contributing.md).
FAMILIES = (modeling_densemamba, modeling_denseretnet)

__all__ = [name for module in FAMILIES for name in module.__all__]
