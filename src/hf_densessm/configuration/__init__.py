"""Configurations of the DenseSSM model families: the shared base and knob table (``configuration_densessm.py``),
one file per family."""

from .configuration_densemamba import DENSEMAMBA_PRESETS, DenseMambaConfig
from .configuration_denseretnet import DENSERETNET_PRESETS, DenseRetNetConfig
from .configuration_densessm import DENSE_KNOBS

__all__ = [
    "DENSEMAMBA_PRESETS",
    "DENSERETNET_PRESETS",
    "DENSE_KNOBS",
    "DenseMambaConfig",
    "DenseRetNetConfig",
]
