"""Configurations of the DenseSSM model families (one file per family; the dense knobs in ``dense.py``)."""

from .configuration_densemamba import DENSEMAMBA_PRESETS, DenseMambaConfig
from .configuration_denseretnet import DENSERETNET_PRESETS, DenseRetNetConfig

__all__ = ["DENSEMAMBA_PRESETS", "DENSERETNET_PRESETS", "DenseMambaConfig", "DenseRetNetConfig"]
