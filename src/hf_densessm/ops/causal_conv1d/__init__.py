"""Mamba's causal depthwise convolution (Mamba paper §3.4, Fig. 3), SiLU optional, token-major: :func:`causal_conv1d`,
its table (:data:`~..dispatch.TABLES`: ``chunk.py``'s Triton kernels, ``torch_path.py``, both traced) and the ops
``hf_densessm::causal_conv1d`` / ``_backward`` that run the entry chosen. Formulas and kernels: docs/kernels.md.
"""

from typing import Optional

import torch
from torch import Tensor

from ..backend import OpGroup, in_own_precision
from ..dispatch import TABLES, Implementation, choose, implementation, triton_entry
from ..packing import check_reset
from .torch_path import causal_conv1d_backward_torch, causal_conv1d_torch

__all__ = ["causal_conv1d"]

_ACTIVATIONS = (None, "silu")
_ops = OpGroup()


def _triton(name):
    """``chunk.py``'s function ``name``, imported when called (``chunk.py`` needs triton)."""
    def call(*args):
        from . import chunk
        return getattr(chunk, name)(*args)
    return call


# The entries' functions (docs/kernels.md, "The dispatch table"): "forward"(x, taps, bias, window, reset, silu) -> out
# and "backward"(grad_out, x, taps, bias, window, reset, silu) -> the gradients of x, taps, bias, window; "direct"
# (optional, a decoding step's entry): "forward" as a registered operator the public function calls itself.
TABLES["causal_conv1d"] = [
    triton_entry(forward=_triton("causal_conv1d_triton_fwd"), backward=_triton("causal_conv1d_triton_bwd")),
    Implementation("torch", ("auto", "torch"), traced=True, calls=dict(
        forward=in_own_precision(causal_conv1d_torch), backward=in_own_precision(causal_conv1d_backward_torch))),
]


@_ops.triton_op("causal_conv1d")
def _causal_conv1d_op(x: Tensor, taps: Tensor, bias: Optional[Tensor], window: Optional[Tensor],
                      reset: Optional[Tensor], silu: bool, impl: str) -> Tensor:
    """The implementation ``impl``'s forward, no checks (``taps``: ``(channels, kernel)``)."""
    return implementation("causal_conv1d", impl).calls["forward"](x, taps, bias, window, reset, silu)


@_ops.triton_op("causal_conv1d_backward")
def _causal_conv1d_backward_op(grad_out: Tensor, x: Tensor, taps: Tensor, bias: Optional[Tensor],
                               window: Optional[Tensor], reset: Optional[Tensor], silu: bool,
                               impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``x``, ``taps``, ``bias``, ``window`` by the implementation ``impl``."""
    return implementation("causal_conv1d", impl).calls["backward"](grad_out, x, taps, bias, window, reset, silu)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])  # x, taps, bias, window, reset
    ctx.silu, ctx.impl = inputs[5:]


def _backward(ctx, grad_out):
    x, taps, bias, window, reset = ctx.saved_tensors
    grads = _ops.causal_conv1d_backward(grad_out, x, taps, bias, window, reset, ctx.silu, ctx.impl)
    return *grads[:2], None if bias is None else grads[2], None if window is None else grads[3], None, None, None


_ops.register_autograd("causal_conv1d", _backward, setup_context=_setup_context)
_ops.define()


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, window: Tensor | None = None,
                  reset: Tensor | None = None, activation: str | None = None, backend: str | None = None) -> Tensor:
    """``act(bias + sum_k weight[:, k] * x_{t - (kernel - 1) + k})``: ``nn.Conv1d(groups=channels)`` with ``kernel - 1``
    zeros (or a cached window) on the left, over tokens.

    Args:
        x: ``(batch, seq_len, channels)`` float, any strides. weight: ``(channels, 1, kernel)`` or ``(channels,
            kernel)``. bias: ``(channels,)`` or ``None``.
        window: ``(batch, channels, kernel)`` cached inputs, newest last (its last ``kernel - 1`` columns are used),
            or ``None`` (zeros); copied with gradients on, so the caller may update it in place afterwards.
        reset: ``(batch, seq_len)`` bool (or 0/1 integer) or ``None``: a tap reads only its token's packed document;
            the window precedes the row's first document only.
        activation: ``None`` or ``"silu"``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (docs/kernels.md, "The dispatch table"); ``None``: the
            active one (:func:`~..dispatch.use_backend`).

    Returns:
        ``(batch, seq_len, channels)`` contiguous in ``x``'s dtype (computed in float32, float64 for float64 ``x``),
        differentiable in ``x``, ``weight``, ``bias`` and ``window``.

    Raises:
        ValueError: a shape that does not match, a bad ``activation`` or ``backend``, a ``weight``, ``bias``,
            ``window`` or ``reset`` on another device than ``x``, a ``reset`` with values other than 0/1
            (:func:`~..backend.require`).
        TypeError: a non-tensor or non-float ``x``, ``weight``, ``bias`` or ``window``, a non-bool/integer ``reset``.
        RuntimeError: ``backend="triton"`` without triton, or on CPU tensors without the Triton interpreter.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor (batch, seq_len, channels), got {x!r:.60}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape (batch, seq_len, channels), got shape {tuple(x.shape)}")
    batch, length, channels = x.shape
    for name, value in (("weight", weight), ("bias", bias), ("window", window)):
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        if not floating and (value is not None or name == "weight"):
            raise TypeError(f"{name} must be a floating-point tensor{'' if name == 'weight' else ' or None'}, got "
                            f"{value!r:.60}")
        if value is not None and value.device != x.device:
            raise ValueError(f"{name} is on {value.device} but x is on {x.device}")
    if weight.dim() not in (2, 3) or weight.shape[0] != channels or (weight.dim() == 3 and weight.shape[1] != 1):
        raise ValueError(f"weight must have shape ({channels}, 1, kernel) or ({channels}, kernel), "
                         f"got {tuple(weight.shape)}")
    kernel = weight.shape[-1]
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias must have shape ({channels},), got {tuple(bias.shape)}")
    if window is not None and tuple(window.shape) != (batch, channels, kernel):
        raise ValueError(f"window must have shape (batch, channels, kernel) = ({batch}, {channels}, {kernel}), "
                         f"got {tuple(window.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    reset = check_reset(reset, batch, length, x.device)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, window))
    step = length == 1 and window is not None and reset is None and not grads
    impl = choose("causal_conv1d", x.device, backend, step=step)
    taps = weight.reshape(channels, kernel)
    direct = implementation("causal_conv1d", impl).calls.get("direct")
    if direct is not None:  # an operator dispatched in C++: no Python op in between (eager decoding steps)
        return direct(x, taps, bias, window, reset, activation == "silu")
    if window is not None and torch.is_grad_enabled():  # the caller may update its cache in place after the call
        window = window.clone()
    return _ops.causal_conv1d(x, taps, bias, window, reset, activation == "silu", impl)
