"""Fused Triton selective scan, forward and backward by recomputation (Mamba paper Alg. 2, §3.3.2, App. D): the
Triton bodies of ``hf_densessm::selective_scan`` / ``_backward``, launched through ``torch.library.wrap_triton``,
accumulating in float32 (float64 for float64 inputs). How the kernels work, packed documents and tile choices:
docs/kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # triton: needed only when a kernel of this file runs
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(f"{__name__} holds Triton kernels and needs the `triton` package") from error

from ..backend import GPUArch, device_arch
from ..triton_utils import acc, launch, silu, softplus

__all__ = ["SelectiveScanConfig", "selective_scan_config", "selective_scan_triton_bwd", "selective_scan_triton_fwd"]


@dataclass(frozen=True)
class SelectiveScanConfig:
    """Launch choices of the fused scan: ``chunk`` tokens (``BLOCK_L``, a power of 2, the same in both passes),
    channels per program and warps of each kernel (powers of 2), pipelining stages."""

    chunk: int = 16
    fwd_block_d: int = 8
    fwd_warps: int = 4
    bwd_block_d: int = 8
    bwd_warps: int = 4
    num_stages: int = 2


def selective_scan_config(arch: GPUArch, dtype: torch.dtype, nstate: int) -> SelectiveScanConfig:
    """Tiles, warps and stages of the fused scan (docs/kernels.md, "Tile, warp and stage choices"): the same for
    every ``arch`` and ``dtype`` (registers bind, and every architecture has the same register file); channels per
    program scale with the state size ``nstate`` (``A.shape[1]``).

    Args:
        arch: the GPU's limits (:func:`hf_densessm.ops.backend.device_arch`). dtype: of ``u``. nstate: ``N``.

    Returns:
        A :class:`SelectiveScanConfig`.
    """
    del arch, dtype
    block_n = triton.next_power_of_2(nstate)
    fwd_block_d = max(2, 2 * 16 // block_n)
    bwd_block_d = max(2, 4 * 16 // block_n)
    return SelectiveScanConfig(chunk=16, fwd_block_d=fwd_block_d, fwd_warps=2, bwd_block_d=bwd_block_d, bwd_warps=2)


@triton.jit
def _combine(a1, b1, a2, b2):
    """Composition of two affine maps ``h -> a h + b``: first ``(a1, b1)``, then ``(a2, b2)``."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _selective_scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, h0_ptr, reset_ptr,
    y_ptr, hlast_ptr, hchunk_ptr,
    s_u_b, s_u_d, s_u_l,
    s_dt_b, s_dt_d, s_dt_l,
    s_A_d, s_A_n,
    s_B_b, s_B_n, s_B_l,
    s_C_b, s_C_n, s_C_l,
    s_z_b, s_z_d, s_z_l,
    dim, length, nstate, n_chunks,
    HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr, STORE_CHUNKS: tl.constexpr, USE_FP64: tl.constexpr,
    HAS_RESET: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_L)
    mask_d = offs_d < dim
    mask_n = offs_n < nstate
    mask_dn = mask_d[:, None] & mask_n[None, :]

    A = acc(tl.load(A_ptr + offs_d[:, None] * s_A_d + offs_n[None, :] * s_A_n, mask=mask_dn, other=0.0), USE_FP64)
    Dv = acc(tl.load(D_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
    bias = acc(tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
    # states are (batch, [chunk,] dim, state), contiguous
    state_offs = offs_d[:, None] * nstate + offs_n[None, :]
    h = acc(tl.load(h0_ptr + pid_b * dim * nstate + state_offs, mask=mask_dn, other=0.0), USE_FP64)

    for c in range(n_chunks):
        offs_l = c * BLOCK_L + offs_t
        mask_l = offs_l < length
        mask_dl = mask_d[:, None] & mask_l[None, :]
        mask_nl = mask_n[:, None] & mask_l[None, :]
        dt = acc(tl.load(delta_ptr + pid_b * s_dt_b + offs_d[:, None] * s_dt_d + offs_l[None, :] * s_dt_l,
                          mask=mask_dl, other=0.0), USE_FP64)
        dt += bias[:, None]
        if SOFTPLUS:
            dt = softplus(dt)
        dt = tl.where(mask_dl, dt, 0.0)  # padding: decay 1, input 0
        u = acc(tl.load(u_ptr + pid_b * s_u_b + offs_d[:, None] * s_u_d + offs_l[None, :] * s_u_l,
                         mask=mask_dl, other=0.0), USE_FP64)
        Bt = acc(tl.load(B_ptr + pid_b * s_B_b + offs_n[:, None] * s_B_n + offs_l[None, :] * s_B_l,
                          mask=mask_nl, other=0.0), USE_FP64)
        Ct = acc(tl.load(C_ptr + pid_b * s_C_b + offs_n[:, None] * s_C_n + offs_l[None, :] * s_C_l,
                          mask=mask_nl, other=0.0), USE_FP64)
        if STORE_CHUNKS:
            tl.store(hchunk_ptr + (pid_b * n_chunks + c) * dim * nstate + state_offs, h, mask=mask_dn)
        # (BLOCK_D, BLOCK_N, BLOCK_L): discretized A and B u (eq. 4), then the scan (eq. 2a)
        a = tl.exp(dt[:, None, :] * A[:, :, None])
        if HAS_RESET:  # a document starts here: the state before it is dropped (decay 0)
            r = tl.load(reset_ptr + pid_b * length + offs_l, mask=mask_l, other=0)
            a = tl.where((r != 0)[None, None, :], 0.0, a)
        b = (dt * u)[:, None, :] * Bt[None, :, :]
        a_cum, h_loc = tl.associative_scan((a, b), axis=2, combine_fn=_combine)
        hs = h_loc + a_cum * h[:, :, None]
        y = tl.sum(hs * Ct[None, :, :], axis=1)  # eq. 2b
        y += Dv[:, None] * u
        if HAS_Z:
            z = acc(tl.load(z_ptr + pid_b * s_z_b + offs_d[:, None] * s_z_d + offs_l[None, :] * s_z_l,
                             mask=mask_dl, other=0.0), USE_FP64)
            y = y * silu(z)
        # y is (batch, dim, length) contiguous
        tl.store(y_ptr + pid_b * dim * length + offs_d[:, None] * length + offs_l[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask_dl)
        # state after the chunk's last position (padding leaves it unchanged)
        h = tl.sum(tl.where((offs_t == BLOCK_L - 1)[None, None, :], hs, 0.0), axis=2)

    tl.store(hlast_ptr + pid_b * dim * nstate + state_offs, h, mask=mask_dn)


@triton.jit
def _selective_scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, hchunk_ptr, dy_ptr, dlast_ptr, reset_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dh0_ptr,
    s_u_b, s_u_d, s_u_l,
    s_dt_b, s_dt_d, s_dt_l,
    s_A_d, s_A_n,
    s_B_b, s_B_n, s_B_l,
    s_C_b, s_C_n, s_C_l,
    s_z_b, s_z_d, s_z_l,
    s_dy_b, s_dy_d, s_dy_l,
    dim, length, nstate, n_chunks,
    HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr, USE_FP64: tl.constexpr, HAS_RESET: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_L)
    mask_d = offs_d < dim
    mask_n = offs_n < nstate
    mask_dn = mask_d[:, None] & mask_n[None, :]
    first = (offs_t == 0)[None, None, :]

    A = acc(tl.load(A_ptr + offs_d[:, None] * s_A_d + offs_n[None, :] * s_A_n, mask=mask_dn, other=0.0), USE_FP64)
    Dv = acc(tl.load(D_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
    bias = acc(tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
    state_offs = offs_d[:, None] * nstate + offs_n[None, :]
    # adjoint of the state after the current chunk's last position (carried from the next chunk)
    g_carry = acc(tl.load(dlast_ptr + pid_b * dim * nstate + state_offs, mask=mask_dn, other=0.0), USE_FP64)
    dA_acc = g_carry * 0.0
    dh0 = g_carry * 0.0
    dD_acc = Dv * 0.0

    for i in range(n_chunks):
        c = n_chunks - 1 - i
        t0 = c * BLOCK_L
        offs_l = t0 + offs_t
        mask_l = offs_l < length
        mask_dl = mask_d[:, None] & mask_l[None, :]
        mask_nl = mask_n[:, None] & mask_l[None, :]
        io_dl = offs_d[:, None] * length + offs_l[None, :]  # offsets in the contiguous (batch, dim, length) grads
        io_nl = offs_n[:, None] * length + offs_l[None, :]  # ... and in the (batch, state, length) ones

        # inputs of position t
        dt_raw = acc(tl.load(delta_ptr + pid_b * s_dt_b + offs_d[:, None] * s_dt_d + offs_l[None, :] * s_dt_l,
                              mask=mask_dl, other=0.0), USE_FP64)
        dt_raw += bias[:, None]
        dt = dt_raw
        if SOFTPLUS:
            dt = softplus(dt_raw)
        dt = tl.where(mask_dl, dt, 0.0)
        u = acc(tl.load(u_ptr + pid_b * s_u_b + offs_d[:, None] * s_u_d + offs_l[None, :] * s_u_l,
                         mask=mask_dl, other=0.0), USE_FP64)
        Bt = acc(tl.load(B_ptr + pid_b * s_B_b + offs_n[:, None] * s_B_n + offs_l[None, :] * s_B_l,
                          mask=mask_nl, other=0.0), USE_FP64)
        Ct = acc(tl.load(C_ptr + pid_b * s_C_b + offs_n[:, None] * s_C_n + offs_l[None, :] * s_C_l,
                          mask=mask_nl, other=0.0), USE_FP64)
        dy = acc(tl.load(dy_ptr + pid_b * s_dy_b + offs_d[:, None] * s_dy_d + offs_l[None, :] * s_dy_l,
                          mask=mask_dl, other=0.0), USE_FP64)

        # 1. h_{t-1}: scan over the inputs of position t - 1, the first element replaced by the entry state
        offs_p = offs_l - 1
        mask_pdl = mask_d[:, None] & ((offs_p >= t0) & (offs_p < length))[None, :]
        mask_pnl = mask_n[:, None] & ((offs_p >= t0) & (offs_p < length))[None, :]
        dt_p = acc(tl.load(delta_ptr + pid_b * s_dt_b + offs_d[:, None] * s_dt_d + offs_p[None, :] * s_dt_l,
                            mask=mask_pdl, other=0.0), USE_FP64)
        dt_p += bias[:, None]
        if SOFTPLUS:
            dt_p = softplus(dt_p)
        dt_p = tl.where(mask_pdl, dt_p, 0.0)
        u_p = acc(tl.load(u_ptr + pid_b * s_u_b + offs_d[:, None] * s_u_d + offs_p[None, :] * s_u_l,
                           mask=mask_pdl, other=0.0), USE_FP64)
        B_p = acc(tl.load(B_ptr + pid_b * s_B_b + offs_n[:, None] * s_B_n + offs_p[None, :] * s_B_l,
                           mask=mask_pnl, other=0.0), USE_FP64)
        entry = acc(tl.load(hchunk_ptr + (pid_b * n_chunks + c) * dim * nstate + state_offs, mask=mask_dn,
                             other=0.0), USE_FP64)
        a_p = tl.where(first, 0.0, tl.exp(dt_p[:, None, :] * A[:, :, None]))
        a = tl.exp(dt[:, None, :] * A[:, :, None])
        if HAS_RESET:  # the decays of positions t - 1 and t, 0 where a document starts
            r_p = tl.load(reset_ptr + pid_b * length + offs_p, mask=(offs_p >= t0) & (offs_p < length), other=0)
            a_p = tl.where((r_p != 0)[None, None, :], 0.0, a_p)
            r = tl.load(reset_ptr + pid_b * length + offs_l, mask=mask_l, other=0)
            a = tl.where((r != 0)[None, None, :], 0.0, a)
        b_p = tl.where(first, entry[:, :, None], (dt_p * u_p)[:, None, :] * B_p[None, :, :])
        _, h_prev = tl.associative_scan((a_p, b_p), axis=2, combine_fn=_combine)
        h = a * h_prev + (dt * u)[:, None, :] * Bt[None, :, :]

        # 2. output gate and skip
        if HAS_Z:
            z = acc(tl.load(z_ptr + pid_b * s_z_b + offs_d[:, None] * s_z_d + offs_l[None, :] * s_z_l,
                             mask=mask_dl, other=0.0), USE_FP64)
            y = tl.sum(h * Ct[None, :, :], axis=1)
            y += Dv[:, None] * u
            sig = tl.sigmoid(z)
            dz = dy * y * sig * (1.0 + z * (1.0 - sig))
            tl.store(dz_ptr + pid_b * dim * length + io_dl, dz, mask=mask_dl)
            gy = dy * z * sig
        else:
            gy = dy
        dD_acc += tl.sum(gy * u, axis=1)

        # adjoint: reverse scan over (exp(dt_{t+1} A), C_t gy_t), started from the carried adjoint
        offs_q = offs_l + 1
        mask_qdl = mask_d[:, None] & (offs_q < length)[None, :]
        dt_q = acc(tl.load(delta_ptr + pid_b * s_dt_b + offs_d[:, None] * s_dt_d + offs_q[None, :] * s_dt_l,
                            mask=mask_qdl, other=0.0), USE_FP64)
        dt_q += bias[:, None]
        if SOFTPLUS:
            dt_q = softplus(dt_q)
        dt_q = tl.where(mask_qdl, dt_q, 0.0)
        a_q = tl.exp(dt_q[:, None, :] * A[:, :, None])
        if HAS_RESET:
            r_q = tl.load(reset_ptr + pid_b * length + offs_q, mask=offs_q < length, other=0)
            a_q = tl.where((r_q != 0)[None, None, :], 0.0, a_q)
        a_cum, g_loc = tl.associative_scan((a_q, Ct[None, :, :] * gy[:, None, :]), axis=2, combine_fn=_combine,
                                           reverse=True)
        g = g_loc + a_cum * g_carry[:, :, None]  # dL/dh_t

        # 3. gradients
        X = g * a * h_prev  # dL/d(dt_t A)
        gB = tl.sum(g * Bt[None, :, :], axis=1)  # sum_n g_t B_t
        ddt = tl.sum(X * A[:, :, None], axis=1) + gB * u
        du = gB * dt
        du += Dv[:, None] * gy
        if SOFTPLUS:
            ddt = ddt * tl.sigmoid(dt_raw)
        tl.store(du_ptr + pid_b * dim * length + io_dl, du, mask=mask_dl)
        tl.store(ddelta_ptr + pid_b * dim * length + io_dl, ddt, mask=mask_dl)
        # sums over channels: this block's share, added into (batch, state, length)
        tl.atomic_add(dB_ptr + pid_b * nstate * length + io_nl, tl.sum(g * (dt * u)[:, None, :], axis=0),
                      mask=mask_nl)
        tl.atomic_add(dC_ptr + pid_b * nstate * length + io_nl, tl.sum(h * gy[:, None, :], axis=0), mask=mask_nl)
        dA_acc += tl.sum(X * dt[:, None, :], axis=2)

        g_carry = tl.sum(tl.where(first, g, 0.0), axis=2)
        dh0 = tl.sum(tl.where(first, a * g, 0.0), axis=2)

    tl.store(dA_ptr + pid_b * dim * nstate + state_offs, dA_acc, mask=mask_dn)
    tl.store(dh0_ptr + pid_b * dim * nstate + state_offs, dh0, mask=mask_dn)
    tl.store(dD_ptr + pid_b * dim + offs_d, dD_acc, mask=mask_d)


def _strides3(t):
    return (t.stride(0), t.stride(1), t.stride(2)) if t is not None else (0, 0, 0)


def _fp64(*tensors) -> bool:
    return any(t is not None and t.dtype == torch.float64 for t in tensors)


def _config(config, u, nstate) -> SelectiveScanConfig:
    if config is None:
        config = selective_scan_config(device_arch(u.device), u.dtype, nstate)
    if config.chunk < 1 or config.chunk & (config.chunk - 1):
        raise ValueError(f"config.chunk must be a power of 2, got {config.chunk}")
    return config


def selective_scan_triton_fwd(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              initial_state=None, reset=None, save_states=True, config=None):
    """The Triton body of ``hf_densessm::selective_scan``, no checks.

    Args:
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset: as
            :func:`hf_densessm.ops.selective_scan` (any strides; ``A`` not checked).
        save_states: store the state entering each chunk, which :func:`selective_scan_triton_bwd` starts from.
        config: a :class:`SelectiveScanConfig` (default :func:`selective_scan_config`); the backward pass must
            be given the same one.

    Returns:
        ``(y, last_state, chunk_states)``: ``y`` (batch, dim, length) in ``u``'s dtype; ``last_state``
        (batch, dim, state) and ``chunk_states`` (batch, n_chunks, dim, state) in float32 (float64 for float64
        inputs); ``n_chunks = ceil(length / config.chunk)``, or 0 without ``save_states``.

    Raises:
        ValueError: ``config.chunk`` is not a power of 2.
    """
    batch, dim, length = u.shape
    nstate = A.shape[1]
    config = _config(config, u, nstate)
    use_fp64 = _fp64(u, delta, A, B, C, D, z, delta_bias, initial_state)
    kw = dict(dtype=torch.float64 if use_fp64 else torch.float32, device=u.device)
    # the kernels index these (dim,) and (batch, dim, state) tensors as contiguous
    D_k = torch.zeros(dim, **kw) if D is None else D.contiguous()
    bias_k = torch.zeros(dim, **kw) if delta_bias is None else delta_bias.contiguous()
    h0 = torch.zeros(batch, dim, nstate, **kw) if initial_state is None else initial_state.to(kw["dtype"]).contiguous()
    # (batch, length) int8, 1 where a packed document starts; the kernels index it as contiguous
    reset_k = None if reset is None else reset.to(dtype=torch.int8).contiguous()
    block_d = min(config.fwd_block_d, triton.next_power_of_2(dim))
    n_chunks = triton.cdiv(length, config.chunk)
    y = torch.empty(batch, dim, length, dtype=u.dtype, device=u.device)
    last_state = torch.empty(batch, dim, nstate, **kw)
    # without save_states the kernel stores nothing; it is still handed a valid buffer
    h_chunks = torch.empty(batch, n_chunks if save_states else 1, dim, nstate, **kw)
    launch(_selective_scan_fwd_kernel)[(batch, triton.cdiv(dim, block_d))](
        u, delta, A, B, C, D_k, z, bias_k, h0, reset_k, y, last_state, h_chunks,
        *_strides3(u), *_strides3(delta), A.stride(0), A.stride(1), *_strides3(B), *_strides3(C), *_strides3(z),
        dim, length, nstate, n_chunks,
        HAS_Z=z is not None, SOFTPLUS=bool(delta_softplus), STORE_CHUNKS=bool(save_states), USE_FP64=use_fp64,
        HAS_RESET=reset_k is not None,
        BLOCK_D=block_d, BLOCK_L=config.chunk, BLOCK_N=triton.next_power_of_2(nstate),
        num_warps=config.fwd_warps, num_stages=config.num_stages,
    )
    if not save_states:
        h_chunks = torch.empty(batch, 0, dim, nstate, **kw)
    return y, last_state, h_chunks


def selective_scan_triton_bwd(dy, dlast, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              initial_state=None, reset=None, chunk_states=None, config=None):
    """The Triton body of ``hf_densessm::selective_scan_backward``: recomputation from the chunk entry states.

    Args:
        dy: (batch, dim, length) gradient of ``y`` or None (zero); dlast: (batch, dim, state) gradient of
            ``last_state`` or None (zero); any float dtype, any strides.
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset: the forward pass's arguments.
        chunk_states: (batch, n_chunks, dim, state), what the forward pass returned with ``save_states``.
        config: the forward pass's :class:`SelectiveScanConfig` (None there: None here).

    Returns:
        ``(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state)``, each in the dtype of its input; ``dD``,
        ``dz``, ``ddelta_bias`` are None when ``D``, ``z``, ``delta_bias`` are; ``dinitial_state`` is float32
        (float64) when ``initial_state`` is None. ``dB``, ``dC``: atomic adds, last bits may vary between runs.

    Raises:
        ValueError: ``config.chunk`` is not a power of 2, or ``chunk_states`` does not hold
        ``ceil(length / config.chunk)`` chunks (e.g. a forward pass without ``save_states``).
    """
    batch, dim, length = u.shape
    nstate = A.shape[1]
    config = _config(config, u, nstate)
    n_chunks = triton.cdiv(length, config.chunk)
    if chunk_states is None or chunk_states.shape[1] != n_chunks:
        raise ValueError(
            f"chunk_states must hold the {n_chunks} chunk states of a forward pass with save_states=True and chunk "
            f"{config.chunk}, got {None if chunk_states is None else tuple(chunk_states.shape)}"
        )
    use_fp64 = _fp64(u, delta, A, B, C, D, z, delta_bias, initial_state)
    kw = dict(dtype=torch.float64 if use_fp64 else torch.float32, device=u.device)
    block_d = min(config.bwd_block_d, triton.next_power_of_2(dim))
    dy = torch.zeros(batch, dim, length, **kw) if dy is None else dy
    D_k = torch.zeros(dim, **kw) if D is None else D.contiguous()
    bias_k = torch.zeros(dim, **kw) if delta_bias is None else delta_bias.contiguous()
    dlast = torch.zeros(batch, dim, nstate, **kw) if dlast is None else dlast.to(kw["dtype"]).contiguous()
    reset_k = None if reset is None else reset.to(dtype=torch.int8).contiguous()
    h_chunks = chunk_states.to(kw["dtype"]).contiguous()
    du = torch.empty(batch, dim, length, **kw)
    ddelta = torch.empty(batch, dim, length, **kw)
    dz = torch.empty(batch, dim, length, **kw) if z is not None else None
    dB = torch.zeros(batch, nstate, length, **kw)
    dC = torch.zeros(batch, nstate, length, **kw)
    dA = torch.empty(batch, dim, nstate, **kw)
    dD = torch.empty(batch, dim, **kw)
    dh0 = torch.empty(batch, dim, nstate, **kw)
    launch(_selective_scan_bwd_kernel)[(batch, triton.cdiv(dim, block_d))](
        u, delta, A, B, C, D_k, z, bias_k, h_chunks, dy, dlast, reset_k,
        du, ddelta, dz, dB, dC, dA, dD, dh0,
        *_strides3(u), *_strides3(delta), A.stride(0), A.stride(1), *_strides3(B), *_strides3(C), *_strides3(z),
        *_strides3(dy),
        dim, length, nstate, n_chunks,
        HAS_Z=z is not None, SOFTPLUS=bool(delta_softplus), USE_FP64=use_fp64, HAS_RESET=reset_k is not None,
        BLOCK_D=block_d, BLOCK_L=config.chunk, BLOCK_N=triton.next_power_of_2(nstate),
        num_warps=config.bwd_warps, num_stages=config.num_stages,
    )

    def cast(g, like):
        return None if g is None else g.to(like.dtype) if like is not None else g

    return (
        cast(du, u), cast(ddelta, delta), cast(dA.sum(0), A), cast(dB, B), cast(dC, C),
        None if D is None else cast(dD.sum(0), D), cast(dz, z),
        None if delta_bias is None else cast(ddelta.sum((0, 2)), delta_bias), cast(dh0, initial_state),
    )
