"""Multi-scale retention (DenseSSM paper Eq. 18, 19, 24): :func:`chunk_retention`, :func:`retention_state_update`,
their checks and tables (:data:`~..dispatch.TABLES`) and the ops ``hf_densessm::chunk_retention`` (+ ``_backward``) and
``::retention_state_update`` that run the entry chosen. Forms, dispatch and compile behaviour: docs/kernels.md.
"""

import math
import numbers
from typing import Optional

import torch

from ..backend import OpGroup, compute_dtype, in_own_precision
from ..dispatch import TABLES, Implementation, choose, implementation, triton_entry
from ..packing import check_reset
from .chunked_torch import chunk_retention_torch, chunk_retention_torch_backward, retention_state_update_torch
from .naive import retention_gamma, retention_log2_gamma

__all__ = ["chunk_retention", "retention_gamma", "retention_log2_gamma", "retention_state_update"]
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The most tokens of an eager call without resets that a decoding-sized ("step") entry takes.
STEP_TOKENS = 16
Tensor = torch.Tensor
_ops = OpGroup()


def _check(q, k, v, layout, scale, state_name, state):
    """Check that q, k, v are tensors of one supported dtype and device, shaped ``layout + (key/value_dim,)``, and
    ``state`` a recurrent state for them (an ``initial_state`` may be None); return ``scale`` as a float,
    ``key_dim ** -0.5`` for None."""
    rank = len(layout) + 1
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != rank:
            dim = "value_dim" if name == "v" else "key_dim"
            raise ValueError(f"{name} must have shape ({', '.join(layout + (dim,))}), got shape {tuple(x.shape)}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if q.shape != k.shape:
        names = ", ".join(layout + ("key_dim",))
        raise ValueError(f"q and k must have the same shape ({names}), got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v must match q in ({', '.join(layout)}), got q {tuple(q.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"key_dim and value_dim must be positive, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale)
                              or scale <= 0):
        raise ValueError(f"scale must be a positive finite number (default key_dim ** -0.5), got {scale!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if state is None and state_name == "initial_state":
        return scale
    expected = (q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1])
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"{state_name} must be a torch.Tensor, got {type(state).__name__}")
    if tuple(state.shape) != expected:
        raise ValueError(f"{state_name} must have shape (batch, heads, key_dim, value_dim) = {expected}, got "
                         f"{tuple(state.shape)}")
    if state.dtype not in ((torch.float32, torch.float64) if v.dtype == torch.float64 else (torch.float32,)):
        raise TypeError(f"{state_name} must be float32 (or float64 with float64 inputs), got {state.dtype} with "
                        f"{v.dtype} inputs")
    if state.device != q.device:
        raise ValueError(f"{state_name} must be on the device of q ({q.device}), got {state.device}")
    return scale


def _triton(module: str, name: str):
    """The function ``name`` of ``chunk.py`` or ``fused_recurrent.py`` (``module``), imported when called (both need
    triton)."""
    def call(*args):
        from . import chunk  # one module per statement: transformers' remote-code scan reads one per line
        from . import fused_recurrent
        return getattr(chunk if module == "chunk" else fused_recurrent, name)(*args)
    return call


# ---------------------------------------------------------------------------------------------- the tables
# The entries' functions (docs/kernels.md, "The dispatch table"), arguments as the ops below take them:
#   "forward"(q, k, v, scale, initial_state, reset) -> (o, final_state), o in v's dtype (where not traced:
#       contiguous), final_state in the compute dtype;
#   "backward"(d_o, d_final_state, q, k, v, scale, initial_state, reset) -> (dq, dk, dv, d_initial_state) (where not
#       traced: dq, dk, dv contiguous);
#   "direct" (optional, a step entry's): "forward" as a registered operator the public function calls itself when
#       nothing is differentiated (else the op runs "forward", its autograd "backward");
#   "step"(state, q, k, v, scale) -> o, state updated in place (retention_state_update's entries).
TABLES["chunk_retention"] = [
    triton_entry(forward=_triton("chunk", "chunk_retention_fwd_triton"),
                 backward=_triton("chunk", "chunk_retention_bwd_triton")),
    Implementation("torch", ("auto", "torch"), calls=dict(
        forward=lambda q, k, v, scale, s0, reset: chunk_retention_torch(q, k, v, scale, s0, True, reset=reset),
        backward=lambda *args: chunk_retention_torch_backward(*args[:7], reset=args[7]))),
]
TABLES["retention_state_update"] = [
    triton_entry(step=_triton("fused_recurrent", "retention_state_update_triton")),
    Implementation("torch", ("auto", "torch"), traced=True,
                   calls=dict(step=in_own_precision(retention_state_update_torch))),
]


# ---------------------------------------------------------------------------------------------------- the ops
# They run the entry named by ``impl`` (:meth:`~..backend.OpGroup.run`).


def _eager_fake(q, k, v, scale, initial_state, reset, impl):
    return v.new_empty(v.shape), q.new_empty(*q.shape[:1], *q.shape[2:], v.shape[3], dtype=compute_dtype(v.dtype))


def _eager_backward_fake(d_o, d_final_state, q, k, v, scale, initial_state, reset, impl):
    return q.new_empty(q.shape), k.new_empty(k.shape), *_eager_fake(q, k, v, scale, initial_state, reset, impl)


@_ops.triton_op("chunk_retention")
def _chunk_retention_op(q: Tensor, k: Tensor, v: Tensor, scale: float, initial_state: Optional[Tensor],
                        reset: Optional[Tensor], impl: str) -> tuple[Tensor, Tensor]:
    """``(o, final_state)`` of :func:`chunk_retention` (arguments checked there) by the implementation ``impl``."""
    return _ops.run("chunk_retention", "forward", q, k, v, scale, initial_state, reset, impl)


@_ops.triton_op("chunk_retention_backward")
def _chunk_retention_backward_op(d_o: Tensor, d_final_state: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                                 scale: float, initial_state: Optional[Tensor], reset: Optional[Tensor],
                                 impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, d_initial_state)`` of ``hf_densessm::chunk_retention`` by the implementation ``impl``
    (``d_final_state`` None: zero); ``d_initial_state`` in ``initial_state``'s dtype, else the state dtype."""
    dq, dk, dv, d_initial_state = _ops.run("chunk_retention", "backward", d_o, d_final_state, q, k, v, scale,
                                           initial_state, reset, impl)
    return dq, dk, dv, d_initial_state.to(compute_dtype(v.dtype) if initial_state is None else initial_state.dtype)


def _chunk_retention_setup(ctx, inputs, output):
    q, k, v, scale, initial_state, reset, impl = inputs
    ctx.save_for_backward(q, k, v, initial_state, reset)
    ctx.scale, ctx.impl = scale, impl
    ctx.set_materialize_grads(False)  # an unused final state arrives as None: the kernel skips reading it


def _chunk_retention_backward(ctx, d_o, d_final_state):
    q, k, v, initial_state, reset = ctx.saved_tensors
    if d_o is None:  # only the final state was used
        d_o = torch.zeros_like(v)
    grads = _ops.chunk_retention_backward(d_o, d_final_state, q, k, v, ctx.scale, initial_state, reset, ctx.impl)
    return *grads[:3], None, (None if initial_state is None else grads[3]), None, None


_ops.opaque("chunk_retention", "forward", _chunk_retention_op, fake=_eager_fake)
_ops.opaque("chunk_retention", "backward", _chunk_retention_backward_op, fake=_eager_backward_fake)
_ops.register_autograd("chunk_retention", _chunk_retention_backward, setup_context=_chunk_retention_setup)


@_ops.triton_op("retention_state_update", mutates_args=("state",))
def _retention_state_update_op(state: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, impl: str) -> Tensor:
    """``o`` of :func:`retention_state_update` (arguments checked there) by the implementation ``impl``; ``state``
    updated in place."""
    return implementation("retention_state_update", impl).calls["step"](state, q, k, v, scale)


_ops.define()


# ---------------------------------------------------------------------------------------------- public functions


def chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, backend=None, reset=None):
    """Multi-scale retention over a sequence in chunkwise form, accumulated in float32 (float64 for float64 inputs).
    Per head ``h``, ``gamma_h = 1 - 2**(-5 - h)``: ``S_t = gamma_h S_{t-1} + k_t^T v_t`` (Eq. 18, ``S_0 =
    initial_state`` or 0), ``o_t = (scale q_t) S_t`` (Eq. 19, equal to Eq. 24). fla's plain semantics, without the
    published row normalizations (docs/design.md §3).

    Args:
        q, k (Tensor): ``(batch, length, heads, key_dim)``; v (Tensor): ``(batch, length, heads, value_dim)``; one
            dtype among float16, bfloat16, float32, float64, one device.
        scale (float, optional): positive factor on ``q``; defaults to ``key_dim ** -0.5``.
        initial_state (Tensor, optional): ``(batch, heads, key_dim, value_dim)`` float32 (float64 allowed with
            float64 inputs), the state before token 0; gradients flow into it if it requires grad.
        output_final_state (bool): also return the state after the last token.
        backend (str, optional): ``"auto"``, ``"triton"`` or ``"torch"`` (docs/kernels.md, "The dispatch table");
            ``None``: the active one (:func:`~..dispatch.use_backend`, ``"auto"`` by default).
        reset (Tensor, optional): ``(batch, length)`` bool, True at the first token of each packed document (the
            state before it is dropped; docs/kernels.md, "Packed sequences").

    Returns:
        o (Tensor): ``(batch, length, heads, value_dim)`` in ``v``'s dtype.
        final_state (Tensor or None): ``(batch, heads, key_dim, value_dim)`` float32 (float64 with float64
            inputs) if ``output_final_state``, else None; gradients flow back through it.

    Raises:
        TypeError: a non-tensor argument, an unsupported or mixed dtype, an initial_state that is not float32.
        ValueError: wrong ranks, q/k/v shapes that disagree, mixed devices, a bad ``initial_state`` shape, a
            non-positive ``scale``, an unknown ``backend``.
        RuntimeError: ``backend="triton"`` without triton, or on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    scale = _check(q, k, v, ("batch", "length", "heads"), scale, "initial_state", initial_state)
    reset = check_reset(reset, q.shape[0], q.shape[1], q.device)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, initial_state))
    step = reset is None and not torch.compiler.is_compiling() and q.shape[1] <= STEP_TOKENS  # e.g. a verification
    impl = choose("chunk_retention", q.device, backend, step=step)
    direct, args = implementation("chunk_retention", impl).calls.get("direct"), (q, k, v, scale, initial_state, reset)
    o, final_state = direct(*args) if direct is not None and not grads else _ops.chunk_retention(*args, impl)
    return o, (final_state if output_final_state else None)


def retention_state_update(state, q, k, v, scale=None, backend=None):
    """One decoding step of multi-scale retention (Eq. 18, 19): ``state <- gamma_h state + k^T v``, then
    ``o = (scale q) state``; continues :func:`chunk_retention`'s ``final_state`` by one token.

    Args:
        state (Tensor): ``(batch, heads, key_dim, value_dim)`` float32 (float64 allowed with float64 inputs),
            updated in place.
        q, k (Tensor): ``(batch, heads, key_dim)``; v (Tensor): ``(batch, heads, value_dim)``; one dtype and device.
        scale, backend: as :func:`chunk_retention`.

    Returns:
        o (Tensor): ``(batch, heads, value_dim)`` in ``v``'s dtype.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`chunk_retention`, with ``state`` in place of
        ``initial_state``.
    """
    scale = _check(q, k, v, ("batch", "heads"), scale, "state", state)
    return _ops.retention_state_update(state, q, k, v, scale, choose("retention_state_update", q.device, backend))
