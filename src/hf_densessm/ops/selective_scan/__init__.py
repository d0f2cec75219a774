"""Selective scan of Mamba (Mamba paper, Algorithm 2, §3.3, App. D): the public entry points :func:`selective_scan`
(whole sequence; ``mamba_ssm``'s ``selective_scan_fn`` layout) and :func:`selective_state_update` (one decoding
token, state updated in place), their argument checks, and the ``torch.library`` ops ``hf_densessm::selective_scan``
(+ ``_backward``) and ``hf_densessm::selective_state_update`` they call. Each op's body is the one dispatch
(:func:`hf_densessm.ops.backend.resolve_backend`) between the chunk-parallel Triton kernels (``chunk.py``,
``fused_recurrent.py``) and the PyTorch path (``chunked_torch.py``, or on CPU tensors the C++ kernel of
``../cpu_kernel.py``); the forms, schemas and backends are in docs/kernels.md ("Layout", "The ops"). ``A <= 0`` is
checked by :func:`selective_scan` (a host read: skipped while compiling or capturing a CUDA graph), not per decoding
step.
"""

from typing import Optional

import torch

from ..backend import OpGroup, chosen_backend, inputs_compute_dtype, own_precision, require, resolve_backend

try:  # remote code ships no C++ build code (docs/hub_and_conversion.md): the PyTorch path runs
    from ..cpu_kernel import CHECKPOINT, scan_bwd as cpu_scan_bwd, scan_fwd as cpu_scan_fwd, use_kernel
except ImportError:
    CHECKPOINT = 64

    def use_kernel(u, state_size):
        return False
from ..packing import check_reset
from .chunked_torch import selective_scan_torch_bwd, selective_scan_torch_fwd, selective_state_update_torch

__all__ = ["selective_scan", "selective_state_update"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
Tensor = torch.Tensor
_ops = OpGroup()


def _check_tensor(name, t, shape, device, optional=False):
    """``shape``: (expected sizes, None = any; the dimension names used in the message)."""
    if t is None:
        if optional:
            return
        raise TypeError(f"{name} is required, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    sizes, names = shape
    if t.dim() != len(sizes) or any(s is not None and s != got for s, got in zip(sizes, t.shape)):
        want = ", ".join(f"{n}={s}" if s is not None else n for n, s in zip(names, sizes))
        raise ValueError(
            f"{name} must have shape ({', '.join(names)}) with {want}, got shape {tuple(t.shape)}"
        )
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in _FLOAT_DTYPES]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but u/x is on {device}: all tensors must be on one device")


def _check_decay(A: torch.Tensor) -> None:
    """``A <= 0`` with no host sync (:func:`~..backend.require`)."""
    require((A <= 0).all(), "A must have entries <= 0 (continuous-time decay, e.g. A = -exp(A_log)); got a positive "
            "entry", host_read=False)


def _check_scan_args(u, delta, A, B, C, D, z, delta_bias, initial_state):
    if not isinstance(u, torch.Tensor):
        raise TypeError(f"u must be a torch.Tensor, got {type(u).__name__}")
    if u.dim() != 3:
        raise ValueError(f"u must have shape (batch, dim, length) (3 dims), got shape {tuple(u.shape)}")
    batch, dim, length = u.shape
    if length == 0:
        raise ValueError("u must have length >= 1 (shape (batch, dim, length)), got length 0")
    dev = u.device
    _check_tensor("u", u, ((batch, dim, length), ("batch", "dim", "length")), dev)
    _check_tensor("delta", delta, ((batch, dim, length), ("batch", "dim", "length")), dev)
    _check_tensor("A", A, ((dim, None), ("dim", "state")), dev)
    n = A.shape[1]
    _check_tensor("B", B, ((batch, n, length), ("batch", "state", "length")), dev)
    _check_tensor("C", C, ((batch, n, length), ("batch", "state", "length")), dev)
    _check_tensor("D", D, ((dim,), ("dim",)), dev, optional=True)
    _check_tensor("z", z, ((batch, dim, length), ("batch", "dim", "length")), dev, optional=True)
    _check_tensor("delta_bias", delta_bias, ((dim,), ("dim",)), dev, optional=True)
    _check_tensor(
        "initial_state", initial_state, ((batch, dim, n), ("batch", "dim", "state")), dev, optional=True
    )


def _or_empty(grad: Optional[Tensor], like: Tensor) -> Tensor:
    """An op returns a tensor in every slot: an absent gradient (its input was None) is an empty tensor."""
    return like.new_empty(0) if grad is None else grad


# ------------------------------------------------------------------------------------------------------ the ops
#
# Each op's body is its one dispatch: ``resolve_backend(backend, device)`` picks the Triton kernels (launched
# through ``torch.library.wrap_triton``) or the PyTorch path. ``triton_op`` registers the body as the fake
# implementation too, and ``torch.compile`` decomposes the op into it, so the bodies read no tensor values.
# The whole-sequence PyTorch path is itself a ``custom_op`` (``selective_scan_torch`` and its backward), opaque to
# ``torch.compile``: its Python loop over chunks would otherwise be unrolled into the graph (measured: 350 s to
# compile a 4-block micro model's training step at 37 tokens, growing with the length); it runs eagerly inside a
# compiled graph, which fuses everything around it.


def _scan_torch(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    delta_bias: Optional[Tensor], delta_softplus: bool, initial_state: Optional[Tensor], reset: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, last_state, chunk_states)``, all contiguous; ``chunk_states`` 3-D (a 4-D output's channels-last test
    would guard a dynamic length to one chunk): the kernel's ``(batch, dim, n_chunks * state)``, the chunked path's
    ``(batch, n_chunks, state * dim)``."""
    with own_precision(u.device):
        if use_kernel(u, A.shape[1]):  # CPU tensors: the C++ kernel (ops/cpu_kernel.py), when it is built
            # the kernel returns y token-major (a (batch, dim, length) view of a (batch, length, dim) tensor); the
            # op hands out contiguous tensors on both paths: Inductor asserted contiguous strides for this op's
            # outputs although its fake gave the kernel's (tests/ops/test_selective_scan.py::
            # test_compile_fullgraph_inductor_forward_backward; cause not found yet)
            y, last, states = cpu_scan_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset)
            return y.contiguous(), last, states.flatten(2)
        y, last, states = selective_scan_torch_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                                   initial_state, reset)
        return y, last, states.flatten(2)


def _scan_torch_backward(
    dy: Optional[Tensor], dlast: Optional[Tensor], u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Optional[Tensor], z: Optional[Tensor], delta_bias: Optional[Tensor], delta_softplus: bool,
    initial_state: Optional[Tensor], reset: Optional[Tensor], chunk_states: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    n = A.shape[1]
    with own_precision(u.device):
        # the forward op chose its path by the same test: chunk_states has that path's layout (each refuses the other's)
        if use_kernel(u, n):
            bwd, chunk_states = cpu_scan_bwd, chunk_states.unflatten(2, (-1, n))
        else:
            bwd, chunk_states = selective_scan_torch_bwd, chunk_states.unflatten(2, (n, -1))
        grads = bwd(dy, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset, chunk_states)
    # contiguous on both paths (the kernel's du, ddelta, dz, dB, dC are token-major): see _scan_torch
    return tuple(_or_empty(g, u).contiguous() for g in grads)


def _scan_torch_fake(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset):
    """Shapes, dtypes and strides of :func:`_scan_torch`'s outputs, with no guard on the length: the kernel saves a
    state every ``CHECKPOINT`` tokens (a ceil-division of the length); the chunked path's chunk length follows the
    length (``default_chunk_size``), so its number of chunks is a size only the run knows (an unbacked size)."""
    batch, dim, length = u.shape
    n = A.shape[1]
    cdt = inputs_compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    if use_kernel(u, n):
        states = u.new_empty(batch, dim, (length + CHECKPOINT - 1) // CHECKPOINT * n, dtype=cdt)
    else:
        states = u.new_empty(batch, torch.library.get_ctx().new_dynamic_size(min=1), n * dim, dtype=cdt)
    return u.new_empty(batch, dim, length), u.new_empty(batch, dim, n, dtype=cdt), states


def _scan_torch_backward_fake(dy, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset,
                              chunk_states):
    """Shapes and dtypes of :func:`_scan_torch_backward`'s gradients (contiguous)."""
    grads = [u.new_empty(0) if t is None else u.new_empty(t.shape, dtype=t.dtype)
             for t in (u, delta, A, B, C, D, z, delta_bias)]
    dtype = inputs_compute_dtype(u, delta, A, B, C, D, z, delta_bias) if initial_state is None else initial_state.dtype
    return (*grads, u.new_empty(u.shape[0], u.shape[1], A.shape[1], dtype=dtype))


# ``hf_densessm::selective_scan_torch`` / ``selective_scan_torch_backward``: the PyTorch path as opaque ops.
_ops.custom_op("selective_scan_torch", _scan_torch, fake=_scan_torch_fake)
_ops.custom_op("selective_scan_torch_backward", _scan_torch_backward, fake=_scan_torch_backward_fake)


@_ops.triton_op("selective_scan")
def _selective_scan_op(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    delta_bias: Optional[Tensor], delta_softplus: bool, initial_state: Optional[Tensor], reset: Optional[Tensor],
    save_states: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``hf_densessm::selective_scan``: ``(y, last_state, chunk_states)``; see :func:`selective_scan` for the
    arguments. ``reset`` is a (batch, length) bool tensor or None. ``chunk_states`` holds what the backward pass
    starts from (its layout depends on the backend: ``chunk.py`` / ``chunked_torch.py``); with ``save_states``
    False the Triton kernel stores none and returns it with 0 chunks (the backward pass then recomputes them)."""
    form = resolve_backend(backend, u.device)
    if form == "triton":
        from .chunk import selective_scan_triton_fwd

        return selective_scan_triton_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset,
                                         save_states)
    return _ops.selective_scan_torch(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset)


@_ops.triton_op("selective_scan_backward")
def _selective_scan_backward_op(
    dy: Optional[Tensor], dlast: Optional[Tensor], u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Optional[Tensor], z: Optional[Tensor], delta_bias: Optional[Tensor], delta_softplus: bool,
    initial_state: Optional[Tensor], reset: Optional[Tensor], chunk_states: Tensor, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``hf_densessm::selective_scan_backward``: ``(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state)``
    from the gradients ``dy`` (batch, dim, length) and ``dlast`` (batch, dim, state) (None: zero), the forward
    op's arguments and its ``chunk_states`` (with all its chunks). Each gradient is in its input's dtype; the
    gradient of an absent ``D``, ``z`` or ``delta_bias`` is an empty tensor."""
    form = resolve_backend(backend, u.device)
    if form == "triton":
        from .chunk import selective_scan_triton_bwd

        grads = selective_scan_triton_bwd(dy, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                          initial_state, reset, chunk_states)
        return tuple(_or_empty(g, u) for g in grads)
    return _ops.selective_scan_torch_backward(dy, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                              initial_state, reset, chunk_states)


def _scan_setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset, save_states, backend = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, output[2])
    ctx.delta_softplus = delta_softplus
    ctx.backend = backend
    ctx.save_states = save_states
    ctx.mark_non_differentiable(output[2])


def _scan_backward(ctx, dy, dlast, _dchunk_states):
    u, delta, A, B, C, D, z, delta_bias, initial_state, reset, chunk_states = ctx.saved_tensors
    args = (u, delta, A, B, C, D, z, delta_bias, ctx.delta_softplus, initial_state, reset)
    if not ctx.save_states:  # the forward op ran with save_states=False (the Triton kernel saved no chunk states)
        chunk_states = _ops.selective_scan(*args, True, ctx.backend)[2]
    grads = _ops.selective_scan_backward(dy, dlast, *args, chunk_states, ctx.backend)
    du, ddelta, dA, dB, dC, dD, dz, dbias, dinitial = (
        g if t is not None and ctx.needs_input_grad[i] else None
        for g, t, i in zip(grads, (u, delta, A, B, C, D, z, delta_bias, initial_state), (0, 1, 2, 3, 4, 5, 6, 7, 9))
    )
    return du, ddelta, dA, dB, dC, dD, dz, dbias, None, dinitial, None, None, None


_ops.register_autograd("selective_scan", _scan_backward, setup_context=_scan_setup_context)


@_ops.triton_op("selective_state_update", mutates_args=("state",))
def _selective_state_update_op(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    dt_bias: Optional[Tensor], dt_softplus: bool, backend: str,
) -> Tensor:
    """``hf_densessm::selective_state_update``: one decoding step, ``state`` updated in place, ``y`` returned; see
    :func:`selective_state_update`. No autograd formula: decoding only."""
    form = resolve_backend(backend, state.device)
    if form == "triton":
        from .fused_recurrent import selective_state_update_triton

        return selective_state_update_triton(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                             dt_softplus=dt_softplus)
    with own_precision(state.device):
        return selective_state_update_torch(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)


_ops.define()


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    return_last_state: bool = False,
    backend: str | None = None,
    reset: torch.Tensor | None = None,
):
    """Selective scan over a whole sequence (Mamba paper, Algorithm 2; fused kernel of §3.3.2 and App. D).

    For each channel ``d`` and state index ``n``, with ``dt = softplus(delta + delta_bias)`` (bias and softplus
    optional, eq. 4's discretization as in the authors' code: ZOH for ``A``, Euler for ``B``)::

        h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t        (eq. 2a; h_0 = initial_state or 0)
        y_t = sum_n C_{t,n} h_{t,n} + D * u_t                   (eq. 2b plus the skip)
        y_t = y_t * silu(z_t)                                   (the gate of the Mamba block, if z is given)

    Args:
        u: (batch, dim, length) SSM input; float32, bfloat16, float16 (float64 allowed, for tests).
        delta: (batch, dim, length) time step, before ``delta_bias`` and softplus.
        A: (dim, state), entries <= 0; usually float32 (any float dtype is cast to the accumulation dtype).
        B, C: (batch, state, length) input-dependent projections (the "selective" parameters).
        D: (dim,) skip weight, optional. z: (batch, dim, length) gate, optional.
        delta_bias: (dim,) optional. delta_softplus: apply softplus to ``delta + delta_bias``.
        initial_state: (batch, dim, state) state before the first token (e.g. a cache), any float dtype.
        return_last_state: also return the state after the last token.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see the module docstring); ``None``: the active one
            (:class:`~..backend.use_backend`, ``"auto"`` by default).
        reset: (batch, length) bool, True at the first token of each packed document: ``h_{t-1}`` is taken as 0
            there (the initial state too at ``t = 0``), so no state crosses a document boundary (:mod:`..packing`).

    Returns:
        ``y`` (batch, dim, length) in ``u``'s dtype; with ``return_last_state``, ``(y, last_state)`` where
        ``last_state`` is (batch, dim, state) float32 (float64 for float64 inputs). Accumulation is in float32
        (float64 for float64 inputs). Differentiable in every tensor argument on every backend.

    Raises:
        ValueError: ``backend`` not one of the backends; a tensor of the wrong rank or shape; tensors on different
            devices; ``length == 0``; ``A`` with a positive entry (not checked while compiling or capturing).
        TypeError: a non-tensor argument or an unsupported dtype.
        RuntimeError: ``backend="triton"`` without triton installed, or on CPU tensors without
            ``TRITON_INTERPRET=1``.
    """
    _check_scan_args(u, delta, A, B, C, D, z, delta_bias, initial_state)
    reset = check_reset(reset, u.shape[0], u.shape[2], u.device)
    _check_decay(A)
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    save_states = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    backend = chosen_backend(backend)
    y, last_state, _ = _ops.selective_scan(
        u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), initial_state, reset, save_states, backend
    )
    return (y, last_state) if return_last_state else y


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """One decoding step of the selective SSM (Mamba paper eq. 2a/2b in recurrent mode), O(1) in the context.

    ``state`` is updated IN PLACE to ``h_t = exp(dt * A) * h_{t-1} + dt * B * x`` and the function returns
    ``y = (sum_n C_n h_n + D * x) * silu(z)``, with ``dt = softplus(dt + dt_bias)`` (both optional).

    Args:
        state: (batch, dim, state) SSM state, e.g. a cache entry; float32 is intended (another float dtype
            works: the step computes in float32, or float64 for float64, and writes back in ``state``'s dtype).
        x: (batch, dim) this token's SSM input; float32, bfloat16, float16 (float64 allowed).
        dt: (batch, dim) time step before ``dt_bias`` and softplus.
        A: (dim, state), entries <= 0 (not checked here, see the module docstring).
        B, C: (batch, state). D: (dim,) optional. z: (batch, dim) gate, optional. dt_bias: (dim,) optional.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        backend: as :func:`selective_scan`.

    Returns:
        ``y`` (batch, dim) in ``x``'s dtype.

    Raises:
        ValueError: bad ``backend``, wrong rank or shape, mixed devices.
        TypeError: a non-tensor argument or an unsupported dtype.
        RuntimeError: called with gradients enabled on an input that requires one (the step has no backward: run
            :func:`selective_scan` with ``initial_state`` instead); ``backend="triton"`` without triton, or on CPU
            tensors without ``TRITON_INTERPRET=1``.
    """
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"state must be a torch.Tensor, got {type(state).__name__}")
    if state.dim() != 3:
        raise ValueError(f"state must have shape (batch, dim, state) (3 dims), got shape {tuple(state.shape)}")
    batch, dim, n = state.shape
    dev = state.device
    _check_tensor("state", state, ((batch, dim, n), ("batch", "dim", "state")), dev)
    _check_tensor("x", x, ((batch, dim), ("batch", "dim")), dev)
    _check_tensor("dt", dt, ((batch, dim), ("batch", "dim")), dev)
    _check_tensor("A", A, ((dim, n), ("dim", "state")), dev)
    _check_tensor("B", B, ((batch, n), ("batch", "state")), dev)
    _check_tensor("C", C, ((batch, n), ("batch", "state")), dev)
    _check_tensor("D", D, ((dim,), ("dim",)), dev, optional=True)
    _check_tensor("z", z, ((batch, dim), ("batch", "dim")), dev, optional=True)
    _check_tensor("dt_bias", dt_bias, ((dim,), ("dim",)), dev, optional=True)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (state, x, dt, A, B, C, D, z, dt_bias)
    ):
        raise RuntimeError(
            "selective_state_update is a decoding step without gradients: call it under torch.no_grad() (or "
            "torch.inference_mode()), or run the whole sequence through selective_scan(..., initial_state=state, "
            "return_last_state=True), which is differentiable"
        )
    return _ops.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus),
                                       chosen_backend(backend))
