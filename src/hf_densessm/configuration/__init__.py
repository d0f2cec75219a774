"""Configurations of the DenseSSM families: the shared base and knob table, one file per family (docs/design.md §1)."""

from .configuration_densemamba import DENSEMAMBA_PRESETS, DenseMambaConfig
from .configuration_denseretnet import DENSERETNET_PRESETS, DenseRetNetConfig
from .configuration_densessm import DENSE_KNOBS

__all__ = ["DENSEMAMBA_PRESETS", "DENSERETNET_PRESETS", "DENSE_KNOBS", "DenseMambaConfig", "DenseRetNetConfig"]
