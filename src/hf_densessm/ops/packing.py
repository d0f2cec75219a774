"""Packed sequences in the ops: the per-token ``reset`` flag (True at each packed document's first token; the state
before it is dropped) and its check (docs/kernels.md, "Packed sequences").
"""

from __future__ import annotations

import torch

from .backend import require

__all__ = ["check_reset", "document_positions"]


def check_reset(reset, batch: int, length: int, device: torch.device) -> torch.Tensor | None:
    """Return ``reset`` as a ``(batch, length)`` bool tensor (or ``None``). ``TypeError``: not a bool or integer
    tensor; ``ValueError``: another shape, another device, or an integer ``reset`` holding values other than 0 and 1
    (:func:`~.backend.require`: a ``RuntimeError`` when traced or on an accelerator). Messages name ``reset``."""
    if reset is None:
        return None
    if not isinstance(reset, torch.Tensor) or reset.dtype.is_floating_point or reset.is_complex():
        raise TypeError(f"reset must be a bool (or 0/1 integer) tensor of shape (batch, length), got {reset!r:.80}")
    if tuple(reset.shape) != (batch, length):
        raise ValueError(f"reset must have shape (batch, length) = ({batch}, {length}), got {tuple(reset.shape)}")
    if reset.device != device:
        raise ValueError(f"reset is on {reset.device} but the inputs are on {device}")
    if reset.dtype != torch.bool:
        require(((reset == 0) | (reset == 1)).all(), "reset must hold only 0 and 1 (True where a packed document "
                "starts)", host_read=False)
        reset = reset.bool()
    return reset


def document_positions(reset: torch.Tensor) -> torch.Tensor:
    """``(batch, seq_len)`` int64 position of each token inside its packed document: 0 at each ``reset``, counting
    from the row's start before the first one. ``reset``: ``(batch, seq_len)`` bool."""
    index = torch.arange(reset.shape[1], device=reset.device).expand_as(reset)
    return index - torch.where(reset, index, torch.zeros_like(index)).cummax(dim=1).values  # minus its start
