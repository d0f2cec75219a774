"""Scratch buffers kept from one training step to the next, reused only when nothing else holds them.

Why: a CPU training step at a 32000-word vocabulary allocates the logits and their gradient, (batch * length) x
vocabulary values each (262 MB for 2 x 1024 tokens in float32), and frees them a moment later. glibc's ``malloc``
serves a block that large with a fresh ``mmap`` and gives it back with ``munmap`` (its threshold for that stops
rising at 32 MB), so every step the kernel maps and zeroes 64,000 new pages per tensor on first touch: the loss's
backward took 107-494 ms per step on the 2-core VM of docs/benchmarks.md, 27 ms of it its own work. Keeping the
buffers makes that cost go away (run U in docs/benchmarks.md: training steps 1.11-1.46x faster, paired) without
touching the allocator of the user's process (which ``MALLOC_MMAP_MAX_=0``, docs/training.md, does for
everything).

Safety: :meth:`Workspace.take` hands out a new tensor on a kept buffer's memory only when the workspace's own
reference is the last one to the buffer's storage (PyTorch's storage use count, measured against a fresh tensor's:
nothing else, no earlier view, no ``.grad``, no hook, holds any part of it). Otherwise, say the user kept last
step's gradient, it allocates a new buffer and keeps that one instead. A tensor that is handed out therefore never
shares memory with a tensor anyone can still read. Where the count cannot be read (a PyTorch without
``torch._C._storage_Use_Count``), or under ``torch.compile``, every call allocates (the behaviour without a
workspace).

The models keep two such buffers: the loss's gradient of the logits, and the logits themselves (:func:`linear_into`,
the LM head while the model trains on the CPU). The logits are the user's output: while a user holds them (an
outputs object kept from the last step), the next step finds the buffer taken and allocates, exactly as without a
workspace; ``Trainer`` and loops that drop the outputs get the reuse.

Lifetime: each causal-LM model owns one (``model.loss_workspace()``), made at its first forward with gradients on
the CPU, and kept while the model lives, through evaluation too: a training loop that evaluates between steps would
otherwise pay the fresh allocation again after each evaluation.
``model.loss_workspace().clear()`` frees it. ``copy.deepcopy`` and pickling give an empty workspace.
"""

from __future__ import annotations

import math
import threading

import torch

__all__ = ["Workspace", "linear_into"]


def _use_count(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


try:  # the count of a storage held by exactly one tensor, as _use_count reads it (its own handle included)
    _SOLE = _use_count(torch.empty(1))
except (AttributeError, RuntimeError, TypeError):  # no such private function in this PyTorch: never reuse
    _SOLE = None


class Workspace:
    """Reusable scratch tensors, one per key (module docstring).

    Example: ``grad = workspace.take("cross_entropy_grad", (rows, vocab), torch.float32)`` returns an uninitialized
    ``(rows, vocab)`` float32 CPU tensor, the same memory as the last call's when that is free again.

    Thread-safe: two threads never get the same memory at once (the check and the hand-out are one locked step).
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous CPU tensor of ``shape`` and ``dtype``.

        It lies on the memory of the buffer kept under ``key`` when that buffer is large enough, of ``dtype``, and
        held by nothing but this workspace; else on a new buffer of exactly ``shape``, which is then kept under
        ``key`` instead (the old one stays with whoever holds it, or is freed). It is a tensor of its own (``set_``
        on the storage), not an autograd view of the kept one.

        Raises:
            ValueError: a negative entry in ``shape``.
        """
        shape = tuple(int(size) for size in shape)
        if any(size < 0 for size in shape):
            raise ValueError(f"shape must have entries >= 0, got {shape}")
        numel = math.prod(shape)
        if _SOLE is None or torch.compiler.is_compiling():
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            kept = self._buffers.get(key)
            if kept is None or kept.dtype != dtype or kept.numel() < numel or _use_count(kept) != _SOLE:
                kept = self._buffers[key] = torch.empty(numel, dtype=dtype)
            # a tensor of its own on the kept storage, not an autograd view of it: what it is handed to (an
            # autograd function's output, a gradient) behaves as a freshly allocated tensor would
            return torch.empty(0, dtype=dtype).set_(kept.untyped_storage(), 0, shape)

    def clear(self) -> None:
        """Drop every kept buffer (memory still held by a handed-out tensor is freed when that tensor goes)."""
        with self._lock:
            self._buffers.clear()

    def nbytes(self) -> int:
        """Bytes of the buffers kept now."""
        with self._lock:
            return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def __deepcopy__(self, memo) -> "Workspace":
        return Workspace()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state) -> None:
        self.__init__()

    def __repr__(self) -> str:
        return f"Workspace({len(self._buffers)} buffers, {self.nbytes()} bytes)"


class _LinearIntoFn(torch.autograd.Function):
    """``(x (..., in), weight (out, in), workspace, key) -> x @ weight^T`` written into ``workspace.take(key, ...)``;
    the backward pass is ``nn.Linear``'s: ``d x = g @ weight``, ``d weight = g^T @ x`` (rows flattened)."""

    @staticmethod
    def forward(ctx, x, weight, workspace, key):
        out = workspace.take(key, (*x.shape[:-1], weight.shape[0]), x.dtype)
        torch.matmul(x, weight.t(), out=out)
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        d_x = (rows @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        d_weight = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return d_x, d_weight, None, None


def linear_into(x: torch.Tensor, weight: torch.Tensor, workspace: Workspace, key: str) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight)`` (no bias) with its output in ``workspace``'s buffer ``key``
    (:meth:`Workspace.take`): the causal-LM models' logits while they train on the CPU, (batch, length, vocabulary),
    the other tensor as large as the loss's gradient that a step would otherwise allocate afresh.

    Args:
        x: ``(..., in)`` float32 or float64 CPU tensor.
        weight: ``(out, in)``, ``x``'s dtype and device.
        workspace: where the output goes.
        key: the buffer's name in ``workspace``.

    Returns:
        ``(..., out)`` contiguous, differentiable in ``x`` and ``weight`` as ``F.linear``'s output (same matrix
        products forward and backward).

    Raises:
        ValueError: ``x`` and ``weight`` of different dtypes or devices, a non-CPU tensor, or a dtype other than
            float32/float64; ``weight`` not 2-D or its ``in`` not ``x``'s last dimension.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must have shape (out, {x.shape[-1]}), got {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"x and weight must both be float32 or float64, got {x.dtype} and {weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"x and weight must be CPU tensors, got {x.device} and {weight.device}")
    return _LinearIntoFn.apply(x, weight, workspace, key)
