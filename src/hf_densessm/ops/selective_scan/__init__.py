"""Selective scan of Mamba (Mamba paper, Algorithm 2, §3.3, App. D): public entry points, argument checks, dispatch.

- :func:`selective_scan`: the whole sequence at once (training, prefill); layout and arguments as
  ``mamba_ssm``'s ``selective_scan_fn``.
- :func:`selective_state_update`: one token (decoding), updating the state in place; as ``mamba_ssm``'s
  ``selective_state_update``.

The forms of the op, one file each (the layout of flash-linear-attention's ``fla/ops/<op>/``):

- ``naive.py``: ``selective_scan_naive``, the token-by-token loop in float64, the ground truth of the tests;
- ``chunked_torch.py``: ``selective_scan_torch`` / ``selective_state_update_torch``, the vectorized
  PyTorch path (chunked over the length, hand-written backward), what the models run on the CPU;
- ``cpu.py``: ``selective_scan_cpu`` / ``selective_state_update_cpu``, the compiled CPU kernel (C, built on
  first use with the system compiler), what the models run on the CPU where a C compiler exists;
- ``chunk.py``: ``selective_scan_triton``, the fused Triton kernels for training and prefill;
- ``fused_recurrent.py``: ``selective_state_update_triton``, the Triton decode step.

Backends (``backend=``, resolved by :func:`hf_densessm.ops.backend.resolve_backend`): ``"auto"`` runs the Triton
kernel on CUDA tensors (when triton is installed), the compiled CPU kernel on CPU tensors (when it builds: a C
compiler is needed) and the PyTorch path otherwise; ``"triton"`` forces the Triton kernel (on CPU tensors only
under ``TRITON_INTERPRET=1``, the interpreter, for tests); ``"cpu"`` forces the compiled CPU kernel; ``"torch"``
forces the PyTorch path. The Triton files are imported only when a kernel runs.

Choices made here:

- Inputs may have any strides: the Triton kernels take strides (no copy is made for e.g. ``B`` and ``C``
  sliced and transposed out of ``x_proj``'s output), and the reference does not care.
- ``A`` must be ``<= 0`` (a decay). Checking it reads ``A`` on the host: a reduction on the CPU, a device
  synchronization on CUDA. :func:`selective_scan` checks on every call (one sync next to a whole-sequence
  kernel), except while a CUDA graph is being captured. :func:`selective_state_update` does not check: it runs
  per token and layer, where the check would cost as much as the step, and a decode step follows a prefill
  :func:`selective_scan` with the same ``A``.
"""

from __future__ import annotations

import torch

from ..backend import own_precision, resolve_backend
from ..packing import check_reset
from .chunked_torch import selective_scan_torch, selective_state_update_torch
from .cpu import MAX_STATE, cpu_kernel_available, selective_scan_cpu, selective_state_update_cpu

__all__ = ["selective_scan", "selective_state_update"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _cpu_kernel_for(nstate: int, backend: str):
    """The availability check handed to :func:`resolve_backend`: the compiled kernel takes ``state <= MAX_STATE``
    (``backend="cpu"`` with a larger state is refused: ValueError)."""
    if nstate <= MAX_STATE:
        return cpu_kernel_available
    if backend == "cpu":
        raise ValueError(f"backend='cpu' takes state sizes <= {MAX_STATE}, got A with state size {nstate}")
    return None


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
    if A.numel() and bool(A.max() > 0):
        raise ValueError(
            "A must have entries <= 0 (continuous-time decay, e.g. A = -exp(A_log)); got a positive entry, "
            f"max(A) = {A.max().item():.4g}"
        )


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
    backend: str = "auto",
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
        backend: ``"auto"`` | ``"triton"`` | ``"cpu"`` | ``"torch"`` (see the module docstring).
        reset: (batch, length) bool, True at the first token of each packed document: ``h_{t-1}`` is taken as 0
            there (the initial state too at ``t = 0``), so no state crosses a document boundary (:mod:`..packing`).

    Returns:
        ``y`` (batch, dim, length) in ``u``'s dtype; with ``return_last_state``, ``(y, last_state)`` where
        ``last_state`` is (batch, dim, state) float32 (float64 for float64 inputs). Accumulation is in float32
        (float64 for float64 inputs). Differentiable in every tensor argument on every backend.

    Raises:
        ValueError: ``backend`` not one of ``"auto"``, ``"triton"``, ``"cpu"``, ``"torch"``; a tensor of the wrong
            rank or shape; tensors on different devices; ``length == 0``; ``A`` with a positive entry;
            ``backend="cpu"`` with a state size over ``cpu.MAX_STATE`` (256).
        TypeError: a non-tensor argument or an unsupported dtype.
        RuntimeError: ``backend="triton"`` without triton installed, or on CPU tensors without
            ``TRITON_INTERPRET=1``; ``backend="cpu"`` where the kernel cannot be built or on non-CPU tensors.
    """
    _check_scan_args(u, delta, A, B, C, D, z, delta_bias, initial_state)
    reset = check_reset(reset, u.shape[0], u.shape[2], u.device)
    form = resolve_backend(backend, u.device, _cpu_kernel_for(A.shape[1], backend))
    if not (u.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_decay(A)
    if form == "triton":
        from .chunk import selective_scan_triton

        return selective_scan_triton(
            u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
            initial_state=initial_state, return_last_state=return_last_state, reset=reset,
        )
    scan = selective_scan_cpu if form == "cpu" else selective_scan_torch
    with own_precision(u.device):
        return scan(
            u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
            initial_state=initial_state, return_last_state=return_last_state, reset=reset,
        )


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
    backend: str = "auto",
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
        backend: ``"auto"`` | ``"triton"`` | ``"cpu"`` | ``"torch"``.

    Returns:
        ``y`` (batch, dim) in ``x``'s dtype.

    Raises:
        ValueError: bad ``backend``, wrong rank or shape, mixed devices; ``backend="cpu"`` with a state size over
            256.
        TypeError: a non-tensor argument or an unsupported dtype.
        RuntimeError: ``backend="triton"`` without triton, or on CPU tensors without ``TRITON_INTERPRET=1``;
            ``backend="cpu"`` where the kernel cannot be built or on non-CPU tensors.
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
    form = resolve_backend(backend, dev, _cpu_kernel_for(n, backend))
    if form == "triton":
        from .fused_recurrent import selective_state_update_triton

        return selective_state_update_triton(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)
    step = selective_state_update_torch
    if form == "cpu" and state.dtype in (torch.float32, torch.float64) and state.is_contiguous():
        step = selective_state_update_cpu
    with own_precision(dev):
        return step(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)
