"""Selective scan of Mamba (Mamba paper, Algorithm 2, §3.3, App. D): :func:`selective_scan` (``mamba_ssm``'s
``selective_scan_fn`` layout) and :func:`selective_state_update` (one token), the ops' tables and the ``torch.library``
ops ``hf_densessm::selective_scan`` (+ ``_backward``) and ``::selective_state_update`` (docs/kernels.md).
"""

from typing import Optional

import torch

from ..backend import OpGroup, flat_saved, in_own_precision, inputs_compute_dtype, require, token_major_like
from ..dispatch import TABLES, Implementation, choose, implementation, triton_entry

from ..packing import check_reset
from .chunked_torch import selective_scan_torch_bwd, selective_scan_torch_fwd, selective_state_update_torch

__all__ = ["selective_scan", "selective_state_update"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
Tensor = torch.Tensor
Opt = Optional[Tensor]
_ops = OpGroup()


def _check_tensors(sizes: dict, *specs) -> None:
    """Type, shape, dtype and device of each ``(name, tensor, dims[, optional])`` of ``specs``: ``dims`` the dimension
    names, each of the size ``sizes`` gives it, else of any size, which ``sizes`` then records (its ``"device"`` too,
    the first tensor's); ``tensor`` may be ``None`` if ``optional``."""
    for name, t, dims, *optional in specs:
        if t is None:
            if optional:
                continue
            raise TypeError(f"{name} is required, got None")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        names = dims.split()
        if t.dim() != len(names) or any(sizes.get(n, got) != got for n, got in zip(names, t.shape)):
            want = ", ".join(f"{n}={sizes[n]}" if n in sizes else n for n in names)
            want = f"with {want}" if any(n in sizes for n in names) else f"({len(names)} dims)"
            raise ValueError(f"{name} must have shape ({', '.join(names)}) {want}, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must have dtype in {[str(d) for d in _FLOAT_DTYPES]}, got {t.dtype}")
        if t.device != sizes.setdefault("device", t.device):
            raise ValueError(f"{name} is on {t.device} but u/x is on {sizes['device']}: all tensors must be on one "
                             "device")
        sizes.update(zip(names, t.shape))


def _or_empty(grad: Opt, like: Tensor) -> Tensor:
    """An op returns a tensor in every slot: an absent gradient (its input was None) is an empty tensor."""
    return like.new_empty(0) if grad is None else grad


# ---------------------------------------------------------------------------------------------- the tables
# The entries' functions (docs/kernels.md, "The dispatch table"), with ``args`` = (u, delta, A, B, C, D, z,
# delta_bias, delta_softplus, initial_state, reset) as :func:`selective_scan` takes them (reset: bool or None):
#   "forward"(*args, save_states) -> (y, last_state, saved): y (batch, dim, length) in u's dtype (an untraced entry's
#       y, du, ddelta, dB, dC, dz are handed out token-major, the layout of the model's tensors: copied if need be);
#       last_state (batch, dim, state) in the compute dtype; saved: what "backward" starts from, in the entry's own
#       layout (a traced entry may return it with no elements when save_states is False: it is then recomputed);
#   "backward"(dy, dlast, *args, saved) -> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state), each in
#       its input's dtype (None or empty for an absent input), dy / dlast None for zero;
#   "saved"(u, A, compute_dtype) -> an empty tensor with the shape, dtype and strides of "saved" (entries that are
#       not traced: the fake of the opaque op that runs them).
# selective_state_update's entries: "step"(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus) -> y, state updated;
#   "direct" (optional): the same, a registered operator the public function calls itself (no Python op between).


def _triton(module: str, name: str):
    """The function ``name`` of ``chunk.py`` or ``fused_recurrent.py`` (``module``), imported when called."""
    def call(*args):
        from . import chunk  # one module per statement: transformers' remote-code scan reads one per line
        from . import fused_recurrent
        return getattr(chunk if module == "chunk" else fused_recurrent, name)(*args)
    return call


def _torch_saved(u, A, dtype):
    """The chunked path's chunk length follows the length (``default_chunk_size``): its chunk count is a size only
    the run knows (an unbacked size), so a graph over a dynamic length holds no guard on it."""
    chunks = torch.library.get_ctx().new_dynamic_size(min=1)
    return u.new_empty(u.shape[0], chunks, A.shape[1] * u.shape[1], dtype=dtype)


TABLES["selective_scan"] = [
    triton_entry(forward=_triton("chunk", "selective_scan_triton_fwd"),
                 backward=_triton("chunk", "selective_scan_triton_bwd")),
    Implementation("torch", ("auto", "torch"), calls=dict(saved=_torch_saved, **flat_saved(
        selective_scan_torch_fwd, selective_scan_torch_bwd, lambda A: (A.shape[1], -1)))),
]
TABLES["selective_state_update"] = [
    triton_entry(step=_triton("fused_recurrent", "selective_state_update_triton")),
    Implementation("torch", ("auto", "torch"), traced=True,
                   calls=dict(step=in_own_precision(selective_state_update_torch))),
]


# ------------------------------------------------------------------------------------------------------ the ops
# The ops run the entry named by ``impl`` (:meth:`~..backend.OpGroup.run`), the backward the forward's.


_Grads = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # the backward ops' outputs
_Outs = tuple[Tensor, Tensor, Tensor]  # the forward ops' outputs
_TOKEN_MAJOR_GRADS = (0, 1, 3, 4, 6)  # du, ddelta, dB, dC, dz: the layout of the model's u, delta, B, C, z


def _token_major(x: Tensor) -> Tensor:
    """``x`` (batch, channels, length) laid out token-major as the model's tensors (no copy if it already is)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _eager_fake(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset, save_states, impl):
    cdt = inputs_compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    saved = implementation("selective_scan", impl).calls["saved"](u, A, cdt)
    return token_major_like(u), u.new_empty(u.shape[0], u.shape[1], A.shape[1], dtype=cdt), saved


def _eager_backward_fake(dy, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, *_):
    grads = [u.new_empty(0) if t is None else token_major_like(t) if i in _TOKEN_MAJOR_GRADS else
             u.new_empty(t.shape, dtype=t.dtype) for i, t in enumerate((u, delta, A, B, C, D, z, delta_bias))]
    dtype = inputs_compute_dtype(u, delta, A, B, C, D, z, delta_bias) if initial_state is None else initial_state.dtype
    return (*grads, u.new_empty(u.shape[0], u.shape[1], A.shape[1], dtype=dtype))


@_ops.triton_op("selective_scan")
def _selective_scan_op(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, delta_bias: Opt,
                       delta_softplus: bool, initial_state: Opt, reset: Opt, save_states: bool, impl: str) -> _Outs:
    """``hf_densessm::selective_scan``: the table's "forward" of ``impl``; arguments as :func:`selective_scan`."""
    return _ops.run("selective_scan", "forward", u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
                    reset, save_states, impl)


@_ops.triton_op("selective_scan_backward")
def _selective_scan_backward_op(dy: Opt, dlast: Opt, u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
                                D: Opt, z: Opt, delta_bias: Opt, delta_softplus: bool, initial_state: Opt, reset: Opt,
                                saved: Tensor, impl: str) -> _Grads:
    """``hf_densessm::selective_scan_backward``: the table's "backward" of ``impl`` (an absent input's grad empty)."""
    return tuple(_or_empty(g, u) for g in _ops.run("selective_scan", "backward", dy, dlast, u, delta, A, B, C, D, z,
                                                    delta_bias, delta_softplus, initial_state, reset, saved, impl))


def _eager_grads(grads, dy, dlast, u, *args):
    """The opaque backward's gradients: token-major or contiguous, an absent one empty."""
    return tuple(_token_major(g) if i in _TOKEN_MAJOR_GRADS and g is not None else _or_empty(g, u).contiguous()
                 for i, g in enumerate(grads))


_ops.opaque("selective_scan", "forward", _selective_scan_op, fake=_eager_fake,
            after=lambda out, *args: (_token_major(out[0]), *out[1:]))
_ops.opaque("selective_scan", "backward", _selective_scan_backward_op, fake=_eager_backward_fake, after=_eager_grads)


def _scan_setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset, save_states, impl = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, output[2])
    ctx.delta_softplus, ctx.impl, ctx.save_states = delta_softplus, impl, save_states
    ctx.mark_non_differentiable(output[2])


def _scan_backward(ctx, dy, dlast, _dsaved):
    u, delta, A, B, C, D, z, delta_bias, initial_state, reset, saved = ctx.saved_tensors
    args = (u, delta, A, B, C, D, z, delta_bias, ctx.delta_softplus, initial_state, reset)
    if not ctx.save_states:  # the forward op ran with save_states=False (it may have saved nothing)
        saved = _ops.selective_scan(*args, True, ctx.impl)[2]
    grads = _ops.selective_scan_backward(dy, dlast, *args, saved, ctx.impl)
    grads = [g if ctx.needs_input_grad[i] else None for g, i in zip(grads, (0, 1, 2, 3, 4, 5, 6, 7, 9))]
    return *grads[:8], None, grads[8], None, None, None


_ops.register_autograd("selective_scan", _scan_backward, setup_context=_scan_setup_context)


@_ops.triton_op("selective_state_update", mutates_args=("state",))
def _selective_state_update_op(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt,
                               dt_bias: Opt, dt_softplus: bool, impl: str) -> Tensor:
    """``hf_densessm::selective_state_update``: the table's "step" of ``impl`` (:func:`selective_state_update`)."""
    return implementation("selective_state_update", impl).calls["step"](state, x, dt, A, B, C, D, z, dt_bias,
                                                                         dt_softplus)


_ops.define()


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                   z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = False,
                   initial_state: Tensor | None = None, return_last_state: bool = False, backend: str | None = None,
                   reset: Tensor | None = None):
    """Selective scan over a whole sequence (Mamba paper, Algorithm 2; fused kernel of §3.3.2 and App. D): with
    ``dt = softplus(delta + delta_bias)`` (bias and softplus optional; eq. 4: ZOH for ``A``, Euler for ``B``),
    ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t`` (eq. 2a; ``h_0 = initial_state`` or 0) and ``y_t = (sum_n C_{t,n}
    h_{t,n} + D u_t) silu(z_t)`` (eq. 2b, the skip ``D`` and the Mamba block's gate ``z`` optional).

    Args:
        u: (batch, dim, length) SSM input; float32, bfloat16, float16 (float64 for tests); the others: any of them.
        delta: (batch, dim, length) time step, before ``delta_bias`` and softplus. A: (dim, state), entries <= 0.
        B, C: (batch, state, length) input-dependent projections. D: (dim,) skip weight, optional.
        z: (batch, dim, length) gate, optional. delta_bias: (dim,) optional. delta_softplus: apply softplus.
        initial_state: (batch, dim, state) state before the first token. return_last_state: also return the last state.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (docs/kernels.md, "The dispatch table"); ``None``: the
            active one (:func:`~..dispatch.use_backend`, ``"auto"`` by default).
        reset: (batch, length) bool, True at the first token of each packed document: ``h_{t-1}`` is taken as 0
            there (the initial state too at ``t = 0``), so no state crosses a document boundary (:mod:`..packing`).

    Returns:
        ``y`` (batch, dim, length) in ``u``'s dtype; with ``return_last_state``, ``(y, last_state)``, ``last_state``
        (batch, dim, state). Accumulated and ``last_state`` in float32 (float64 for float64 inputs). Differentiable
        in every tensor argument on every backend.

    Raises:
        ValueError: ``backend`` not one of the backends; a tensor of the wrong rank or shape; tensors on different
            devices; ``length == 0``; ``A`` with a positive entry (not checked while compiling or capturing).
        TypeError: a non-tensor argument or an unsupported dtype.
        RuntimeError: ``backend="triton"`` without triton, or on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    seq, sizes = "batch dim length", {}
    _check_tensors(sizes, ("u", u, seq))
    if sizes["length"] == 0:
        raise ValueError("u must have length >= 1 (shape (batch, dim, length)), got length 0")
    _check_tensors(sizes, ("delta", delta, seq), ("A", A, "dim state"), ("B", B, "batch state length"),
                   ("C", C, "batch state length"), ("D", D, "dim", True), ("z", z, seq, True),
                   ("delta_bias", delta_bias, "dim", True), ("initial_state", initial_state, "batch dim state", True))
    reset = check_reset(reset, sizes["batch"], sizes["length"], u.device)
    require((A <= 0).all(), "A must have entries <= 0 (continuous-time decay, e.g. A = -exp(A_log)); got a positive "
            "entry", host_read=False)  # no host sync
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    save_states = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    impl = choose("selective_scan", u.device, backend, state_size=sizes["state"])
    y, last_state, _ = _ops.selective_scan(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), initial_state,
                                           reset, save_states, impl)
    return (y, last_state) if return_last_state else y


def selective_state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
                           dt_softplus: bool = False, backend: str | None = None) -> Tensor:
    """One decoding step of the selective SSM (Mamba paper eq. 2a/2b in recurrent mode), O(1) in the context:
    ``state`` updated IN PLACE to ``h_t = exp(dt A) h_{t-1} + dt B x``, ``y = (sum_n C_n h_n + D x) silu(z)``
    returned, with ``dt = softplus(dt + dt_bias)`` (both optional).

    Args:
        state: (batch, dim, state) SSM state, e.g. a cache entry; float32 is intended (another float dtype is
            computed in float32, float64 in float64, and written back in ``state``'s dtype).
        x: (batch, dim) this token's SSM input; float32, bfloat16, float16 (float64 allowed).
        dt: (batch, dim) time step before ``dt_bias`` and softplus. A: (dim, state), entries <= 0 (not checked).
        B, C: (batch, state). D: (dim,) optional. z: (batch, dim) gate, optional. dt_bias: (dim,) optional.
        dt_softplus: apply softplus to ``dt + dt_bias``. backend: as :func:`selective_scan`.

    Returns:
        ``y`` (batch, dim) in ``x``'s dtype.

    Raises:
        ValueError: bad ``backend``, wrong rank or shape, mixed devices.
        TypeError: a non-tensor argument or an unsupported dtype.
        RuntimeError: called with gradients enabled on an input that requires one (the step has no backward: run
            :func:`selective_scan` with ``initial_state`` instead); ``backend="triton"`` without triton, or on CPU
            tensors without ``TRITON_INTERPRET=1``.
    """
    sizes = {}
    _check_tensors(sizes, ("state", state, "batch dim state"), ("x", x, "batch dim"), ("dt", dt, "batch dim"),
                   ("A", A, "dim state"), ("B", B, "batch state"), ("C", C, "batch state"), ("D", D, "dim", True),
                   ("z", z, "batch dim", True), ("dt_bias", dt_bias, "dim", True))
    tensors = (state, x, dt, A, B, C, D, z, dt_bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError("selective_state_update is a decoding step without gradients: call it under torch.no_grad() "
                           "(or torch.inference_mode()), or run the whole sequence through selective_scan(..., "
                           "initial_state=state, return_last_state=True), which is differentiable")
    impl = choose("selective_state_update", state.device, backend, state_size=sizes["state"],
                  step=state.is_contiguous() and state.dtype in (torch.float32, torch.float64))
    direct = implementation("selective_state_update", impl).calls.get("direct")  # an operator dispatched in C++
    args = (state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus))
    return direct(*args) if direct is not None else _ops.selective_state_update(*args, impl)  # no Python op between
