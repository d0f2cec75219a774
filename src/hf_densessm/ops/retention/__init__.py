"""Multi-scale retention (DenseSSM paper Eq. 18, 19, 24; RetNet) as ``torch.library`` ops, with the public functions
that check their arguments and call them.

- :func:`chunk_retention`: training / prefill, chunkwise form, ``(batch, length, heads, dim)`` layout; calls
  ``hf_densessm::chunk_retention`` (autograd: ``hf_densessm::chunk_retention_backward``);
- :func:`retention_state_update`: one decoding step, the recurrent state updated in place; calls
  ``hf_densessm::retention_state_update`` (``mutates_args=("state",)``).

The ops (``torch.library.triton_op``; schemas in :data:`OP_SCHEMAS`)::

    hf_densessm::chunk_retention(Tensor q, Tensor k, Tensor v, float scale, Tensor? initial_state,
                                 Tensor? reset, str backend) -> (Tensor o, Tensor final_state)
    hf_densessm::chunk_retention_backward(Tensor d_o, Tensor? d_final_state, Tensor q, Tensor k, Tensor v,
                                          float scale, Tensor? initial_state, Tensor? reset, str backend)
                                          -> (Tensor dq, Tensor dk, Tensor dv, Tensor d_initial_state)
    hf_densessm::retention_state_update(Tensor(a!) state, Tensor q, Tensor k, Tensor v, float scale,
                                        str backend) -> Tensor o

Each op body is the one dispatch: :func:`hf_densessm.ops.backend.resolve_backend` picks the Triton kernels
(``chunk.py``, ``fused_recurrent.py``, launched through ``torch.library.wrap_triton``) or the PyTorch path
(``chunked_torch.py``, run in its own precision under autocast). The bodies trace with FakeTensors (no host syncs,
no data-dependent branches, outputs never alias inputs), so they are also the ops' fake implementations, and under
``torch.compile`` each op decomposes into its body: Inductor sees the Triton kernels on CUDA. The whole-sequence
PyTorch path is an opaque ``custom_op`` (``hf_densessm::chunk_retention_torch`` and its backward), run eagerly inside
a compiled graph rather than unrolled into it; the step's PyTorch path is fused. ``chunk_retention`` always returns the final state (the public function drops it unless asked);
its backward always returns the gradient of the initial state (of a zero one when there is none).

The forms of the op, one file each (the layout of flash-linear-attention's ``fla/ops/retention/``):

- ``naive.py``: ``chunk_retention_naive``, the quadratic parallel form (Eq. 24), the ground truth of the tests,
  and the per-head decay :func:`retention_gamma` / :func:`retention_log2_gamma` that every form and the model use;
- ``chunked_torch.py``: ``chunk_retention_torch`` / ``chunk_retention_torch_backward`` /
  ``retention_state_update_torch``, the vectorized PyTorch path (chunkwise form; loop over chunks), what the
  models run on the CPU;
- ``chunk.py``: ``chunk_retention_fwd_triton`` / ``chunk_retention_bwd_triton``, the chunkwise Triton kernels;
- ``fused_recurrent.py``: ``retention_state_update_triton``, the Triton decode step.

``backend="auto"`` runs the Triton kernels on CUDA tensors and the PyTorch path otherwise. Triton is imported only
when a Triton branch runs, so the package and the PyTorch path work where triton is not installed.
"""

import math
import numbers
from typing import Optional

import torch

from ..backend import own_precision, resolve_backend
from ..packing import check_reset
from .chunked_torch import chunk_retention_torch, chunk_retention_torch_backward, retention_state_update_torch
from .naive import retention_gamma, retention_log2_gamma

__all__ = ["OP_SCHEMAS", "chunk_retention", "retention_gamma", "retention_log2_gamma", "retention_state_update"]

#: The values of the ops' ``backend`` argument.
BACKENDS = ("auto", "triton", "torch")

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_scale(scale, key_dim):
    if scale is None:
        return key_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number (default key_dim ** -0.5), got {scale!r}")
    return float(scale)


def _check_qkv(q, k, v, layout):
    """Check that q, k, v are tensors of one supported dtype and device, shaped ``layout + (key/value_dim,)``."""
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
        names = ", ".join(layout)
        raise ValueError(f"v must match q in ({names}), got q {tuple(q.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"key_dim and value_dim must be positive, got q {tuple(q.shape)}, v {tuple(v.shape)}")


def _check_state(name, state, q, v):
    """Check a recurrent state against q (..., heads, key_dim) and v (..., heads, value_dim)."""
    expected = (q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1])
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(state).__name__}")
    if tuple(state.shape) != expected:
        raise ValueError(
            f"{name} must have shape (batch, heads, key_dim, value_dim) = {expected}, got {tuple(state.shape)}"
        )
    allowed = (torch.float32, torch.float64) if v.dtype == torch.float64 else (torch.float32,)
    if state.dtype not in allowed:
        raise TypeError(
            f"{name} must be float32 (or float64 with float64 inputs), got {state.dtype} with {v.dtype} inputs"
        )
    if state.device != q.device:
        raise ValueError(f"{name} must be on the device of q ({q.device}), got {state.device}")


def _check_backend(backend):
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")


# ---------------------------------------------------------------------------------------------------- the ops


def _retention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
    reset: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    with own_precision(q.device):
        return chunk_retention_torch(q, k, v, scale, initial_state, True, reset=reset)


def _retention_torch_backward(
    d_o: torch.Tensor, d_final_state: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scale: float, initial_state: Optional[torch.Tensor], reset: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with own_precision(q.device):
        return chunk_retention_torch_backward(d_o, d_final_state, q, k, v, scale, initial_state, reset=reset)


# ``hf_densessm::chunk_retention_torch`` / ``chunk_retention_torch_backward``: the whole-sequence PyTorch path as
# opaque ops (their fake implementations the same functions, which read no values), so that ``torch.compile`` runs
# them eagerly inside a graph instead of unrolling their loop over chunks into it (as the selective scan's).
torch.library.custom_op("hf_densessm::chunk_retention_torch", mutates_args=())(_retention_torch).register_fake(
    _retention_torch
)
torch.library.custom_op("hf_densessm::chunk_retention_torch_backward", mutates_args=())(
    _retention_torch_backward
).register_fake(_retention_torch_backward)


@torch.library.triton_op("hf_densessm::chunk_retention", mutates_args=())
def _chunk_retention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
    reset: Optional[torch.Tensor], backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, final_state)`` of :func:`chunk_retention` (arguments checked there): the Triton kernels or the
    PyTorch path."""
    if resolve_backend(backend, q.device) == "triton":
        from .chunk import chunk_retention_fwd_triton

        return chunk_retention_fwd_triton(q, k, v, scale, initial_state, reset)
    return torch.ops.hf_densessm.chunk_retention_torch(q, k, v, scale, initial_state, reset)


@torch.library.triton_op("hf_densessm::chunk_retention_backward", mutates_args=())
def _chunk_retention_backward_op(
    d_o: torch.Tensor, d_final_state: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scale: float, initial_state: Optional[torch.Tensor], reset: Optional[torch.Tensor], backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, d_initial_state)`` of ``hf_densessm::chunk_retention``: the Triton backward kernels or the
    PyTorch path's written-out backward. ``d_final_state`` None means zero; ``d_initial_state`` is the gradient of
    the state before token 0 (of a zero one without ``initial_state``), in ``initial_state``'s dtype (else the
    state dtype)."""
    if resolve_backend(backend, q.device) == "triton":
        from .chunk import chunk_retention_bwd_triton

        dq, dk, dv, d_initial_state = chunk_retention_bwd_triton(d_o, d_final_state, q, k, v, scale, initial_state,
                                                                 reset)
    else:
        dq, dk, dv, d_initial_state = torch.ops.hf_densessm.chunk_retention_torch_backward(
            d_o, d_final_state, q, k, v, scale, initial_state, reset
        )
    return dq, dk, dv, d_initial_state.to(_state_dtype(v, initial_state))


def _state_dtype(v, initial_state):
    if initial_state is not None:
        return initial_state.dtype
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def _chunk_retention_setup(ctx, inputs, output):
    q, k, v, scale, initial_state, reset, backend = inputs
    ctx.save_for_backward(q, k, v, initial_state, reset)
    ctx.scale, ctx.backend = scale, backend
    ctx.set_materialize_grads(False)  # an unused final state arrives as None: the kernel skips reading it


def _chunk_retention_backward(ctx, d_o, d_final_state):
    q, k, v, initial_state, reset = ctx.saved_tensors
    if d_o is None:  # only the final state was used
        d_o = torch.zeros_like(v)
    dq, dk, dv, d_initial_state = torch.ops.hf_densessm.chunk_retention_backward(
        d_o, d_final_state, q, k, v, ctx.scale, initial_state, reset, ctx.backend
    )
    return dq, dk, dv, None, (None if initial_state is None else d_initial_state), None, None


_chunk_retention_op.register_autograd(_chunk_retention_backward, setup_context=_chunk_retention_setup)


@torch.library.triton_op("hf_densessm::retention_state_update", mutates_args=("state",))
def _retention_state_update_op(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str
) -> torch.Tensor:
    """``o`` of :func:`retention_state_update` (arguments checked there); ``state`` updated in place."""
    if resolve_backend(backend, q.device) == "triton":
        from .fused_recurrent import retention_state_update_triton

        return retention_state_update_triton(state, q, k, v, scale)
    with own_precision(q.device):
        return retention_state_update_torch(state, q, k, v, scale)


#: The schemas of the three ops, as registered.
OP_SCHEMAS = {
    name: str(getattr(torch.ops.hf_densessm, name).default._schema)
    for name in ("chunk_retention", "chunk_retention_backward", "retention_state_update")
}


# ---------------------------------------------------------------------------------------------- public functions


def chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, backend="auto", reset=None):
    """Multi-scale retention over a sequence, chunkwise form (DenseSSM paper Eq. 18, 19, 24; RetNet).

    Per head ``h`` with decay ``gamma_h = 1 - 2**(-5 - h)`` (``h = 0 .. heads-1``, from the number of heads):

        S_t = gamma_h S_{t-1} + k_t^T v_t,    S_0 = initial_state (or 0)        (Eq. 18)
        o_t = (scale q_t) S_t                                                  (Eq. 19)
            = scale sum_{s<=t} gamma_h^(t-s) (q_t . k_s) v_s + scale gamma_h^t q_t S_0    (Eq. 24)

    so token ``t`` sees itself. The sequence is cut into chunks of ``C`` tokens (64 in the Triton kernel; the
    torch path picks ``C`` from ``key_dim * value_dim``, see ``chunked_torch.default_chunk_size``): inside a chunk,
    ``((q k^T) * D) v`` with ``D[i, j] = gamma^(i-j)`` for ``j <= i``; from earlier chunks,
    ``gamma^(i+1) q_i S_prev``, with ``S_prev`` carried chunk to chunk (``S <- gamma^C S + sum_j gamma^(C-1-j)
    k_j^T v_j``). This is the same sum as Eq. 24 and as the recurrence, accumulated in float32 (float64 for
    float64 inputs).

    Relation to the published RetNet parallel form: it also divides each row ``t`` of the decay mask by the
    square root of its sum, and each row of ``(q k^T) * D`` by ``max(1, sum of its absolute values)``. Both are
    positive factors per token and head, and the model applies a per-head RMSNorm to ``o`` right after
    retention, which is invariant to a positive factor per row (up to its eps). So this op, like fast retention
    kernels, leaves them out; its chunked form, ``naive.chunk_retention_naive`` (Eq. 24 with the plain decay mask)
    and the recurrent step :func:`retention_state_update` agree exactly with each other (docs/design.md, on DenseRetNet's retention).

    Args:
        q (Tensor): queries ``(batch, length, heads, key_dim)``.
        k (Tensor): keys ``(batch, length, heads, key_dim)``.
        v (Tensor): values ``(batch, length, heads, value_dim)``. q, k, v share one dtype among float16,
            bfloat16, float32, float64 (meant for tests) and one device.
        scale (float, optional): positive factor on ``q``; defaults to ``key_dim ** -0.5``.
        initial_state (Tensor, optional): ``(batch, heads, key_dim, value_dim)`` float32 (float64 allowed with
            float64 inputs), the state before token 0; gradients flow into it if it requires grad.
        output_final_state (bool): also return the state after the last token (to fill a decoding cache).
        backend (str): ``"auto"`` (Triton on CUDA tensors, PyTorch otherwise), ``"triton"`` or ``"torch"``.
        reset (Tensor, optional): ``(batch, length)`` bool, True at the first token of each packed document: the
            state before it is dropped (the initial state too at ``t = 0``), so nothing crosses a document boundary.

    Returns:
        o (Tensor): ``(batch, length, heads, value_dim)`` in ``v``'s dtype.
        final_state (Tensor or None): ``(batch, heads, key_dim, value_dim)`` float32 (float64 with float64
            inputs) if ``output_final_state``, else None; gradients flow back through it.

    Raises:
        TypeError: a non-tensor argument, an unsupported or mixed dtype, an initial_state that is not float32.
        ValueError: wrong ranks, q/k/v shapes that disagree, tensors on different devices, a bad
            ``initial_state`` shape, a non-positive ``scale``, an unknown ``backend``.
        RuntimeError: ``backend="triton"`` without triton, or on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _check_qkv(q, k, v, ("batch", "length", "heads"))
    scale = _check_scale(scale, q.shape[-1])
    if initial_state is not None:
        _check_state("initial_state", initial_state, q, v)
    reset = check_reset(reset, q.shape[0], q.shape[1], q.device)
    _check_backend(backend)
    o, final_state = torch.ops.hf_densessm.chunk_retention(q, k, v, scale, initial_state, reset, backend)
    return o, (final_state if output_final_state else None)


def retention_state_update(state, q, k, v, scale=None, backend="auto"):
    """One decoding step of multi-scale retention (DenseSSM paper Eq. 18, 19), the state updated in place.

    ``state <- gamma_h state + k^T v`` and then ``o = (scale q) state``, per head ``h`` with
    ``gamma_h = 1 - 2**(-5 - h)``: the step that continues :func:`chunk_retention`'s ``final_state`` by one token.

    Args:
        state (Tensor): ``(batch, heads, key_dim, value_dim)`` float32 (float64 allowed with float64 inputs);
            overwritten with the new state.
        q (Tensor): ``(batch, heads, key_dim)``.
        k (Tensor): ``(batch, heads, key_dim)``.
        v (Tensor): ``(batch, heads, value_dim)``; q, k, v share one dtype and device.
        scale (float, optional): positive factor on ``q``; defaults to ``key_dim ** -0.5``.
        backend (str): ``"auto"`` (Triton on CUDA tensors, PyTorch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        o (Tensor): ``(batch, heads, value_dim)`` in ``v``'s dtype.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`chunk_retention`, with ``state`` in place of
        ``initial_state``.
    """
    _check_qkv(q, k, v, ("batch", "heads"))
    scale = _check_scale(scale, q.shape[-1])
    _check_state("state", state, q, v)
    _check_backend(backend)
    return torch.ops.hf_densessm.retention_state_update(state, q, k, v, scale, backend)
