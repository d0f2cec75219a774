"""The dense-connection knobs shared by every DenseSSM config, and their validation.

Source: DenseSSM paper (He et al. 2024, arXiv 2403.00818) §3.3, Eq. 10-17, and its ablations, Tables 5, 7, 8, 9.
Both :class:`~hf_densessm.DenseMambaConfig` and :class:`~hf_densessm.DenseRetNetConfig` call
:func:`set_dense_knobs`, so the knobs have one meaning and one set of checks.
"""

from __future__ import annotations

DENSE_PROJECTIONS = ("identity", "linear")
DENSE_SELECTIONS = ("mlp", "linear", "none")
DENSE_FUSIONS = ("add", "concat")
KERNEL_BACKENDS = ("auto", "triton", "torch")


def check_int(name: str, value, minimum: int) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) ``>= minimum``.

    Raises:
        TypeError: ``value`` is not an integer.
        ValueError: ``value < minimum``. Both messages name the field ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int >= {minimum}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value}.")
    return value


def check_positive_float(name: str, value) -> float:
    """Return ``float(value)`` if it is a real number ``> 0``; raise ``ValueError``/``TypeError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a positive number, got {value!r} ({type(value).__name__}).")
    if not value > 0:
        raise ValueError(f"`{name}` must be > 0, got {value}.")
    return float(value)


def check_choice(name: str, value, allowed: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``allowed``; else raise ``ValueError`` naming ``name`` and the allowed values."""
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}.")
    return value


def set_dense_knobs(
    config,
    *,
    dense_layers: int,
    dense_projection: str,
    dense_selection: str,
    dense_shared_gate: bool,
    dense_fusion: str,
    dense_every: int,
    dense_gate_hidden_size: int | None,
) -> None:
    """Validate the dense-connection knobs and set them on ``config``.

    Args:
        dense_layers: ``m``, how many preceding layers feed each layer (paper Eq. 10; Table 7 uses 1, 2, 4).
            ``0`` gives the plain model (the paper's baseline rows).
        dense_projection: ``Proj`` of Eq. 15: ``"identity"`` or ``"linear"`` (Table 5).
        dense_selection: ``Gate`` of Eq. 16, computed from the layer's own normalized input:
            ``"mlp"`` (2-layer MLP with SiLU), ``"linear"``, or ``"none"`` (no gate) (Table 5).
        dense_shared_gate: one gate shared by the ``m`` predecessors (``True``) or one per predecessor
            (``False``, Table 7 "Diff. gates").
        dense_fusion: ``Fuse`` of Eq. 11: ``"add"`` (Eq. 17) or ``"concat"`` followed by a linear reduction (Table 8).
        dense_every: only layers whose index is a multiple of ``dense_every`` receive the dense connection
            (Table 9: every layer, every 2, every 4 layers); their predecessors are still the ``m`` layers below.
        dense_gate_hidden_size: hidden width of the ``"mlp"`` gate; ``None`` means ``max(1, hidden_size // 32)``
            (the published DenseRetNet's ``d -> d/32 -> d_out``). Must be set on ``config.hidden_size`` first.

    Raises:
        ValueError, TypeError: a knob outside its allowed values; the message names the knob.
    """
    config.dense_layers = check_int("dense_layers", dense_layers, 0)
    config.dense_projection = check_choice("dense_projection", dense_projection, DENSE_PROJECTIONS)
    config.dense_selection = check_choice("dense_selection", dense_selection, DENSE_SELECTIONS)
    if not isinstance(dense_shared_gate, bool):
        raise TypeError(f"`dense_shared_gate` must be a bool, got {dense_shared_gate!r}.")
    config.dense_shared_gate = dense_shared_gate
    config.dense_fusion = check_choice("dense_fusion", dense_fusion, DENSE_FUSIONS)
    config.dense_every = check_int("dense_every", dense_every, 1)
    if dense_gate_hidden_size is None:
        dense_gate_hidden_size = max(1, config.hidden_size // 32)
    config.dense_gate_hidden_size = check_int("dense_gate_hidden_size", dense_gate_hidden_size, 1)


def resolve_preset(presets: dict, name: str, family: str) -> dict:
    """Return a copy of ``presets[name]``; raise ``ValueError`` listing the known names of ``family``."""
    if name not in presets:
        raise ValueError(f"Unknown {family} preset {name!r}; known presets: {', '.join(sorted(presets))}.")
    return dict(presets[name])
