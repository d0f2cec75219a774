"""DenseSSM models: the classes every family builds on (``modeling_densessm.py``), one file per family, the dense
connection, the cache, the input and save checks (which module holds what: docs/design.md §1)."""

from . import modeling_densemamba, modeling_denseretnet
from .modeling_densemamba import *  # noqa: F403 (its __all__: the DenseMamba model classes)
from .modeling_denseretnet import *  # noqa: F403 (its __all__: the DenseRetNet model classes)

#: Every family's modeling module; ``import hf_densessm`` registers their classes (docs/contributing.md).
FAMILIES = (modeling_densemamba, modeling_denseretnet)

__all__ = [name for module in FAMILIES for name in module.__all__]
