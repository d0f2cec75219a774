"""Chunk-parallel Triton selective scan, forward and backward by recomputation (Mamba paper Alg. 2, §3.3.2,
App. D): the Triton bodies of ``hf_densessm::selective_scan`` / ``_backward``, three launches each (per-chunk
summaries, a carry across chunks, per-chunk outputs or gradients) through ``torch.library.wrap_triton``,
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

from ..backend import GPUArch, device_arch, inputs_compute_dtype
from ..triton_utils import acc, launch, silu, softplus

__all__ = [
    "SelectiveScanConfig", "selective_scan_config", "selective_scan_triton_bwd", "selective_scan_triton_fwd",
]

#: The most chunks a launch takes: they are the grid's second axis (CUDA allows 65535 there).
MAX_CHUNKS = 65535


@dataclass(frozen=True)
class SelectiveScanConfig:
    """Launch choices of the scan (see :func:`selective_scan_config`): ``chunk`` tokens (a power of 2, the spacing
    of ``chunk_states``: the backward pass must use the forward pass's), channels per tile (a power of 2), tiles
    per program and warps of the forward-side kernels (state, output, adjoint: ``fwd_*``) and of the backward's
    gradient kernel (``bwd_*``), elements and warps per program of the carry kernel, pipelining stages."""

    chunk: int = 64
    fwd_block_d: int = 2
    fwd_d_steps: int = 4
    fwd_warps: int = 4
    bwd_block_d: int = 2
    bwd_d_steps: int = 4
    bwd_warps: int = 8
    carry_block: int = 512
    carry_warps: int = 4
    num_stages: int = 2


def selective_scan_config(arch: GPUArch, dtype: torch.dtype, nstate: int) -> SelectiveScanConfig:
    """Chunk, tiles and warps of the scan (docs/kernels.md, "Tile, warp and stage choices"): the same for every
    ``arch`` and ``dtype`` (registers bind, and every architecture has the same register file); a tile of
    ``block_d x state x chunk = 2048`` elements, shorter chunks and fewer channels for larger states.

    Args:
        arch: the GPU's limits (:func:`hf_densessm.ops.backend.device_arch`). dtype: of ``u``. nstate: ``N``.

    Returns:
        A :class:`SelectiveScanConfig`.
    """
    del arch, dtype
    block_n = triton.next_power_of_2(nstate)
    warps = 4
    chunk = 64 if block_n <= 32 else 32 if block_n <= 64 else 16
    block_d = max(1, 2048 // (block_n * chunk))
    d_steps = max(1, 8 // block_d)
    return SelectiveScanConfig(chunk=chunk, fwd_block_d=block_d, fwd_d_steps=d_steps, fwd_warps=warps,
                               bwd_block_d=block_d, bwd_d_steps=d_steps, bwd_warps=2 * warps)


@triton.jit
def _combine(a1, b1, a2, b2):
    """Composition of two affine maps ``h -> a h + b``: first ``(a1, b1)``, then ``(a2, b2)``."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _load_dt(delta_ptr, pid_b, offs_d, offs_l, mask_dl, s_dt_b, s_dt_d, s_dt_l, bias,
             SOFTPLUS: tl.constexpr, USE_FP64: tl.constexpr):
    """``(delta + bias, dt)`` of a ``(BLOCK_D, BLOCK_L)`` tile: ``dt`` is ``softplus(delta + bias)`` (or
    ``delta + bias``), 0 outside ``mask_dl`` (padding: decay 1, input 0)."""
    dt_raw = acc(tl.load(delta_ptr + pid_b * s_dt_b + offs_d[:, None] * s_dt_d + offs_l[None, :] * s_dt_l,
                         mask=mask_dl, other=0.0), USE_FP64)
    dt_raw += bias[:, None]
    dt = dt_raw
    if SOFTPLUS:
        dt = softplus(dt_raw)
    return dt_raw, tl.where(mask_dl, dt, 0.0)


@triton.jit
def _selective_scan_chunk_state_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, bias_ptr, reset_ptr,
    end_ptr, decay_ptr,
    s_u_b, s_u_d, s_u_l,
    s_dt_b, s_dt_d, s_dt_l,
    s_A_d, s_A_n,
    s_B_b, s_B_n, s_B_l,
    dim, length, nstate, n_chunks,
    SOFTPLUS: tl.constexpr, USE_FP64: tl.constexpr, HAS_RESET: tl.constexpr,
    BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Forward phase 1: the state at the end of chunk ``c`` from a zero state at its start, and its total decay,
    into ``end_ptr``, ``decay_ptr`` (``(batch, n_chunks, dim, state)``, contiguous)."""
    pid_d = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_L)
    offs_l = pid_c * BLOCK_L + offs_t
    mask_l = offs_l < length
    mask_n = offs_n < nstate
    mask_nl = mask_n[:, None] & mask_l[None, :]
    Bt = acc(tl.load(B_ptr + pid_b * s_B_b + offs_n[:, None] * s_B_n + offs_l[None, :] * s_B_l,
                     mask=mask_nl, other=0.0), USE_FP64)
    if HAS_RESET:  # terms before the chunk's last document start do not reach its end
        r = tl.load(reset_ptr + pid_b * length + offs_l, mask=mask_l, other=0)
        last_reset = tl.max(tl.where(r != 0, offs_t, -1), axis=0)
        keep = offs_t >= last_reset
    for j in range(D_STEPS):
        offs_d = (pid_d * D_STEPS + j) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < dim
        mask_dn = mask_d[:, None] & mask_n[None, :]
        mask_dl = mask_d[:, None] & mask_l[None, :]
        A = acc(tl.load(A_ptr + offs_d[:, None] * s_A_d + offs_n[None, :] * s_A_n, mask=mask_dn, other=0.0),
                USE_FP64)
        bias = acc(tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
        _, dt = _load_dt(delta_ptr, pid_b, offs_d, offs_l, mask_dl, s_dt_b, s_dt_d, s_dt_l, bias, SOFTPLUS, USE_FP64)
        u = acc(tl.load(u_ptr + pid_b * s_u_b + offs_d[:, None] * s_u_d + offs_l[None, :] * s_u_l,
                        mask=mask_dl, other=0.0), USE_FP64)
        after = tl.cumsum(dt, axis=1, reverse=True) - dt  # sum of dt over the chunk's positions after t
        w = tl.exp(A[:, :, None] * after[:, None, :]) * (dt * u)[:, None, :] * Bt[None, :, :]
        if HAS_RESET:
            w = tl.where(keep[None, None, :], w, 0.0)
        h_end = tl.sum(w, axis=2)
        decay = tl.exp(A * tl.sum(dt, axis=1)[:, None])
        if HAS_RESET:
            decay = tl.where(last_reset >= 0, 0.0, decay)
        offs = (pid_b * n_chunks + pid_c) * dim * nstate + offs_d[:, None] * nstate + offs_n[None, :]
        tl.store(end_ptr + offs, h_end, mask=mask_dn)
        tl.store(decay_ptr + offs, decay, mask=mask_dn)


@triton.jit
def _selective_scan_chunk_adjoint_kernel(
    dy_ptr, delta_ptr, A_ptr, C_ptr, z_ptr, bias_ptr, reset_ptr,
    mu_ptr, decay_ptr,
    s_dy_b, s_dy_d, s_dy_l,
    s_dt_b, s_dt_d, s_dt_l,
    s_A_d, s_A_n,
    s_C_b, s_C_n, s_C_l,
    s_z_b, s_z_d, s_z_l,
    dim, length, nstate, n_chunks,
    HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr, USE_FP64: tl.constexpr, HAS_RESET: tl.constexpr,
    BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Backward phase 1: ``mu_c = sum_t exp(A sum_{s <= t} dt_s) C_t gy_t`` over chunk ``c`` (the adjoint of the
    state entering the chunk, from a zero adjoint at its end) and the chunk's total decay, into ``mu_ptr``,
    ``decay_ptr`` (``(batch, n_chunks, dim, state)``, contiguous)."""
    pid_d = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_L)
    offs_l = pid_c * BLOCK_L + offs_t
    mask_l = offs_l < length
    mask_n = offs_n < nstate
    mask_nl = mask_n[:, None] & mask_l[None, :]
    Ct = acc(tl.load(C_ptr + pid_b * s_C_b + offs_n[:, None] * s_C_n + offs_l[None, :] * s_C_l,
                     mask=mask_nl, other=0.0), USE_FP64)
    if HAS_RESET:  # terms from the chunk's first document start on do not reach its start
        r = tl.load(reset_ptr + pid_b * length + offs_l, mask=mask_l, other=0)
        first_reset = tl.min(tl.where(r != 0, offs_t, BLOCK_L), axis=0)
        keep = offs_t < first_reset
    for j in range(D_STEPS):
        offs_d = (pid_d * D_STEPS + j) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < dim
        mask_dn = mask_d[:, None] & mask_n[None, :]
        mask_dl = mask_d[:, None] & mask_l[None, :]
        A = acc(tl.load(A_ptr + offs_d[:, None] * s_A_d + offs_n[None, :] * s_A_n, mask=mask_dn, other=0.0),
                USE_FP64)
        bias = acc(tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
        _, dt = _load_dt(delta_ptr, pid_b, offs_d, offs_l, mask_dl, s_dt_b, s_dt_d, s_dt_l, bias, SOFTPLUS, USE_FP64)
        gy = acc(tl.load(dy_ptr + pid_b * s_dy_b + offs_d[:, None] * s_dy_d + offs_l[None, :] * s_dy_l,
                         mask=mask_dl, other=0.0), USE_FP64)
        if HAS_Z:
            z = acc(tl.load(z_ptr + pid_b * s_z_b + offs_d[:, None] * s_z_d + offs_l[None, :] * s_z_l,
                            mask=mask_dl, other=0.0), USE_FP64)
            gy = gy * silu(z)
        w = tl.exp(A[:, :, None] * tl.cumsum(dt, axis=1)[:, None, :]) * Ct[None, :, :] * gy[:, None, :]
        if HAS_RESET:
            w = tl.where(keep[None, None, :], w, 0.0)
        mu = tl.sum(w, axis=2)
        decay = tl.exp(A * tl.sum(dt, axis=1)[:, None])
        if HAS_RESET:
            decay = tl.where(first_reset < BLOCK_L, 0.0, decay)
        offs = (pid_b * n_chunks + pid_c) * dim * nstate + offs_d[:, None] * nstate + offs_n[None, :]
        tl.store(mu_ptr + offs, mu, mask=mask_dn)
        tl.store(decay_ptr + offs, decay, mask=mask_dn)


@triton.jit
def _selective_scan_carry_kernel(x0_ptr, vals_ptr, decay_ptr, out_ptr, size, n_chunks,
                                 REVERSE: tl.constexpr, USE_FP64: tl.constexpr, BLOCK: tl.constexpr):
    """Phase 2, sequential over the chunks: ``x <- decay_c x + vals_c`` from ``x0`` (``(batch, size)``), over the
    chunks in order (forward) or in reverse (backward). ``vals_c`` is overwritten with the ``x`` that enters step
    ``c``; ``out`` receives the final ``x``. ``vals``, ``decay``: ``(batch, n_chunks, size)``; all contiguous."""
    pid_b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    x = acc(tl.load(x0_ptr + pid_b * size + offs, mask=mask, other=0.0), USE_FP64)
    for i in range(n_chunks):
        if REVERSE:
            c = n_chunks - 1 - i
        else:
            c = i
        at = (pid_b * n_chunks + c) * size + offs
        v = tl.load(vals_ptr + at, mask=mask, other=0.0)
        p = tl.load(decay_ptr + at, mask=mask, other=0.0)
        tl.store(vals_ptr + at, x, mask=mask)
        x = p * x + v
    tl.store(out_ptr + pid_b * size + offs, x, mask=mask)


@triton.jit
def _selective_scan_chunk_output_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, reset_ptr, hchunk_ptr,
    y_ptr,
    s_u_b, s_u_d, s_u_l,
    s_dt_b, s_dt_d, s_dt_l,
    s_A_d, s_A_n,
    s_B_b, s_B_n, s_B_l,
    s_C_b, s_C_n, s_C_l,
    s_z_b, s_z_d, s_z_l,
    dim, length, nstate, n_chunks,
    HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr, USE_FP64: tl.constexpr, HAS_RESET: tl.constexpr,
    BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Forward phase 3: ``y`` of chunk ``c``, its scan started from its entry state (``hchunk_ptr``,
    ``(batch, n_chunks, dim, state)``, contiguous); ``y`` is ``(batch, dim, length)``, contiguous."""
    pid_d = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_L)
    offs_l = pid_c * BLOCK_L + offs_t
    mask_l = offs_l < length
    mask_n = offs_n < nstate
    mask_nl = mask_n[:, None] & mask_l[None, :]
    Bt = acc(tl.load(B_ptr + pid_b * s_B_b + offs_n[:, None] * s_B_n + offs_l[None, :] * s_B_l,
                     mask=mask_nl, other=0.0), USE_FP64)
    Ct = acc(tl.load(C_ptr + pid_b * s_C_b + offs_n[:, None] * s_C_n + offs_l[None, :] * s_C_l,
                     mask=mask_nl, other=0.0), USE_FP64)
    if HAS_RESET:
        r = tl.load(reset_ptr + pid_b * length + offs_l, mask=mask_l, other=0)
    for j in range(D_STEPS):
        offs_d = (pid_d * D_STEPS + j) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < dim
        mask_dn = mask_d[:, None] & mask_n[None, :]
        mask_dl = mask_d[:, None] & mask_l[None, :]
        A = acc(tl.load(A_ptr + offs_d[:, None] * s_A_d + offs_n[None, :] * s_A_n, mask=mask_dn, other=0.0),
                USE_FP64)
        Dv = acc(tl.load(D_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
        bias = acc(tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
        _, dt = _load_dt(delta_ptr, pid_b, offs_d, offs_l, mask_dl, s_dt_b, s_dt_d, s_dt_l, bias, SOFTPLUS, USE_FP64)
        u = acc(tl.load(u_ptr + pid_b * s_u_b + offs_d[:, None] * s_u_d + offs_l[None, :] * s_u_l,
                        mask=mask_dl, other=0.0), USE_FP64)
        h = acc(tl.load(hchunk_ptr + (pid_b * n_chunks + pid_c) * dim * nstate + offs_d[:, None] * nstate
                        + offs_n[None, :], mask=mask_dn, other=0.0), USE_FP64)
        a = tl.exp(dt[:, None, :] * A[:, :, None])
        if HAS_RESET:  # a document starts here: the state before it is dropped (decay 0)
            a = tl.where((r != 0)[None, None, :], 0.0, a)
        b = (dt * u)[:, None, :] * Bt[None, :, :]
        a_cum, h_loc = tl.associative_scan((a, b), axis=2, combine_fn=_combine)
        hs = h_loc + a_cum * h[:, :, None]
        y = tl.sum(hs * Ct[None, :, :], axis=1) + Dv[:, None] * u
        if HAS_Z:
            z = acc(tl.load(z_ptr + pid_b * s_z_b + offs_d[:, None] * s_z_d + offs_l[None, :] * s_z_l,
                            mask=mask_dl, other=0.0), USE_FP64)
            y = y * silu(z)
        tl.store(y_ptr + pid_b * dim * length + offs_d[:, None] * length + offs_l[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask_dl)


@triton.jit
def _selective_scan_chunk_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, reset_ptr, hchunk_ptr, dy_ptr, lam_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dB_ptr, dC_ptr, dD_ptr,
    s_u_b, s_u_d, s_u_l,
    s_dt_b, s_dt_d, s_dt_l,
    s_A_d, s_A_n,
    s_B_b, s_B_n, s_B_l,
    s_C_b, s_C_n, s_C_l,
    s_z_b, s_z_d, s_z_l,
    s_dy_b, s_dy_d, s_dy_l,
    dim, length, nstate, n_chunks,
    HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr, USE_FP64: tl.constexpr, HAS_RESET: tl.constexpr,
    BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Backward phase 3: every gradient of chunk ``c`` from its entry state (``hchunk_ptr``) and the adjoint
    reaching its end (``lam_ptr``; both ``(batch, n_chunks, dim, state)``, contiguous). ``du``, ``ddelta``, ``dz``:
    stored, ``(batch, dim, length)``; ``dB``, ``dC``: atomic adds into ``(batch, state, length)``; the chunk's share
    of ``dA`` overwrites its ``lam`` (read first by this same program), and of ``dD`` goes to
    ``(batch, n_chunks, dim)``."""
    pid_d = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_b = tl.program_id(2)
    t0 = pid_c * BLOCK_L
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_L)
    offs_l = t0 + offs_t
    mask_l = offs_l < length
    mask_n = offs_n < nstate
    mask_nl = mask_n[:, None] & mask_l[None, :]
    first = (offs_t == 0)[None, None, :]
    # positions t - 1 (the scan recomputing h_{t-1}) and t + 1 (the adjoint's decays), both inside the chunk
    offs_p = offs_l - 1
    mask_p = (offs_t > 0) & (offs_p < length)
    offs_q = offs_l + 1
    mask_q = (offs_t < BLOCK_L - 1) & (offs_q < length)
    mask_pnl = mask_n[:, None] & mask_p[None, :]
    Bt = acc(tl.load(B_ptr + pid_b * s_B_b + offs_n[:, None] * s_B_n + offs_l[None, :] * s_B_l,
                     mask=mask_nl, other=0.0), USE_FP64)
    Ct = acc(tl.load(C_ptr + pid_b * s_C_b + offs_n[:, None] * s_C_n + offs_l[None, :] * s_C_l,
                     mask=mask_nl, other=0.0), USE_FP64)
    B_p = acc(tl.load(B_ptr + pid_b * s_B_b + offs_n[:, None] * s_B_n + offs_p[None, :] * s_B_l,
                      mask=mask_pnl, other=0.0), USE_FP64)
    if HAS_RESET:
        r = tl.load(reset_ptr + pid_b * length + offs_l, mask=mask_l, other=0)
        r_p = tl.load(reset_ptr + pid_b * length + offs_p, mask=mask_p, other=0)
        r_q = tl.load(reset_ptr + pid_b * length + offs_q, mask=mask_q, other=0)
    dB_acc = Bt * 0.0
    dC_acc = Bt * 0.0
    for j in range(D_STEPS):
        offs_d = (pid_d * D_STEPS + j) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < dim
        mask_dn = mask_d[:, None] & mask_n[None, :]
        mask_dl = mask_d[:, None] & mask_l[None, :]
        mask_pdl = mask_d[:, None] & mask_p[None, :]
        mask_qdl = mask_d[:, None] & mask_q[None, :]
        io_dl = pid_b * dim * length + offs_d[:, None] * length + offs_l[None, :]  # contiguous (batch, dim, length)
        state_offs = (pid_b * n_chunks + pid_c) * dim * nstate + offs_d[:, None] * nstate + offs_n[None, :]
        A = acc(tl.load(A_ptr + offs_d[:, None] * s_A_d + offs_n[None, :] * s_A_n, mask=mask_dn, other=0.0),
                USE_FP64)
        Dv = acc(tl.load(D_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
        bias = acc(tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
        entry = acc(tl.load(hchunk_ptr + state_offs, mask=mask_dn, other=0.0), USE_FP64)
        lam = acc(tl.load(lam_ptr + state_offs, mask=mask_dn, other=0.0), USE_FP64)

        dt_raw, dt = _load_dt(delta_ptr, pid_b, offs_d, offs_l, mask_dl, s_dt_b, s_dt_d, s_dt_l, bias, SOFTPLUS,
                              USE_FP64)
        u = acc(tl.load(u_ptr + pid_b * s_u_b + offs_d[:, None] * s_u_d + offs_l[None, :] * s_u_l,
                        mask=mask_dl, other=0.0), USE_FP64)
        dy = acc(tl.load(dy_ptr + pid_b * s_dy_b + offs_d[:, None] * s_dy_d + offs_l[None, :] * s_dy_l,
                         mask=mask_dl, other=0.0), USE_FP64)

        # 1. h_{t-1}: scan over the inputs of position t - 1, the first element replaced by the entry state
        _, dt_p = _load_dt(delta_ptr, pid_b, offs_d, offs_p, mask_pdl, s_dt_b, s_dt_d, s_dt_l, bias, SOFTPLUS,
                           USE_FP64)
        u_p = acc(tl.load(u_ptr + pid_b * s_u_b + offs_d[:, None] * s_u_d + offs_p[None, :] * s_u_l,
                          mask=mask_pdl, other=0.0), USE_FP64)
        a_p = tl.where(first, 0.0, tl.exp(dt_p[:, None, :] * A[:, :, None]))
        a = tl.exp(dt[:, None, :] * A[:, :, None])
        if HAS_RESET:  # the decays of positions t - 1 and t, 0 where a document starts
            a_p = tl.where((r_p != 0)[None, None, :], 0.0, a_p)
            a = tl.where((r != 0)[None, None, :], 0.0, a)
        b_p = tl.where(first, entry[:, :, None], (dt_p * u_p)[:, None, :] * B_p[None, :, :])
        _, h_prev = tl.associative_scan((a_p, b_p), axis=2, combine_fn=_combine)
        h = a * h_prev + (dt * u)[:, None, :] * Bt[None, :, :]

        # 2. output gate and skip
        if HAS_Z:
            z = acc(tl.load(z_ptr + pid_b * s_z_b + offs_d[:, None] * s_z_d + offs_l[None, :] * s_z_l,
                            mask=mask_dl, other=0.0), USE_FP64)
            y = tl.sum(h * Ct[None, :, :], axis=1) + Dv[:, None] * u
            sig = tl.sigmoid(z)
            tl.store(dz_ptr + io_dl, dy * y * sig * (1.0 + z * (1.0 - sig)), mask=mask_dl)
            gy = dy * z * sig
        else:
            gy = dy
        tl.store(dD_ptr + (pid_b * n_chunks + pid_c) * dim + offs_d, tl.sum(gy * u, axis=1), mask=mask_d)

        # adjoint: reverse scan over (a_{t+1}, C_t gy_t), a = 1 after the chunk's last position, from lam_c
        _, dt_q = _load_dt(delta_ptr, pid_b, offs_d, offs_q, mask_qdl, s_dt_b, s_dt_d, s_dt_l, bias, SOFTPLUS,
                           USE_FP64)
        a_q = tl.exp(dt_q[:, None, :] * A[:, :, None])
        if HAS_RESET:
            a_q = tl.where((r_q != 0)[None, None, :], 0.0, a_q)
        a_cum, g_loc = tl.associative_scan((a_q, Ct[None, :, :] * gy[:, None, :]), axis=2, combine_fn=_combine,
                                           reverse=True)
        g = g_loc + a_cum * lam[:, :, None]  # dL/dh_t

        # 3. gradients
        X = g * a * h_prev  # dL/d(dt_t A)
        gB = tl.sum(g * Bt[None, :, :], axis=1)  # sum_n g_t B_t
        ddt = tl.sum(X * A[:, :, None], axis=1) + gB * u
        if SOFTPLUS:
            ddt = ddt * tl.sigmoid(dt_raw)
        tl.store(du_ptr + io_dl, gB * dt + Dv[:, None] * gy, mask=mask_dl)
        tl.store(ddelta_ptr + io_dl, ddt, mask=mask_dl)
        dB_acc += tl.sum(g * (dt * u)[:, None, :], axis=0)
        dC_acc += tl.sum(h * gy[:, None, :], axis=0)
        tl.store(lam_ptr + state_offs, tl.sum(X * dt[:, None, :], axis=2), mask=mask_dn)  # dA, this chunk's share

    # sums over channels: this program's share, added into (batch, state, length)
    io_nl = pid_b * nstate * length + offs_n[:, None] * length + offs_l[None, :]
    tl.atomic_add(dB_ptr + io_nl, dB_acc, mask=mask_nl)
    tl.atomic_add(dC_ptr + io_nl, dC_acc, mask=mask_nl)


def _strides3(t):
    return (t.stride(0), t.stride(1), t.stride(2)) if t is not None else (0, 0, 0)


def _config(config, u, nstate) -> SelectiveScanConfig:
    if config is None:
        config = selective_scan_config(device_arch(u.device), u.dtype, nstate)
    for name in ("chunk", "fwd_block_d", "bwd_block_d", "carry_block"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"config.{name} must be a power of 2, got {value}")
    if config.fwd_d_steps < 1 or config.bwd_d_steps < 1:
        raise ValueError(f"config.fwd_d_steps and bwd_d_steps must be >= 1, got {config}")
    return config


def _n_chunks(length, config) -> int:
    n_chunks = triton.cdiv(length, config.chunk)
    if n_chunks > MAX_CHUNKS:
        raise ValueError(f"length {length} needs {n_chunks} chunks of {config.chunk} tokens, over {MAX_CHUNKS}: "
                         f"take a longer config.chunk")
    return n_chunks


def _grid(batch, dim, n_chunks, block_d, d_steps):
    return (triton.cdiv(dim, block_d * d_steps), n_chunks, batch)


def selective_scan_triton_fwd(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              initial_state=None, reset=None, save_states=True, config=None):
    """The Triton body of ``hf_densessm::selective_scan``, no checks: :func:`_selective_scan_chunk_state_kernel`,
    :func:`_selective_scan_carry_kernel`, :func:`_selective_scan_chunk_output_kernel`.

    Args:
        u, delta, z: (batch, dim, length); B, C: (batch, state, length); float32, bfloat16 or float16 (float64 for
            tests), any strides. A: (dim, state), entries <= 0 (not checked here). D, delta_bias: (dim,) or None
            (zeros). initial_state: (batch, dim, state) or None (zeros). delta_softplus: apply softplus to
            ``delta + delta_bias``. reset: (batch, length) bool, True where a packed document starts (the state
            before that token is dropped), or None.
        save_states: return the state entering each chunk, which :func:`selective_scan_triton_bwd` starts from.
        config: a :class:`SelectiveScanConfig` (default :func:`selective_scan_config`); the backward pass must
            be given the same ``chunk``.

    Returns:
        ``(y, last_state, chunk_states)``: ``y`` (batch, dim, length) in ``u``'s dtype; ``last_state``
        (batch, dim, state) and ``chunk_states`` (batch, n_chunks, dim, state) in float32 (float64 for float64
        inputs), contiguous; ``n_chunks = ceil(length / config.chunk)``, or 0 without ``save_states``.

    Raises:
        ValueError: a power-of-2 field of ``config`` is not one, a ``d_steps`` is < 1, or the length needs more
        than :data:`MAX_CHUNKS` chunks.
    """
    batch, dim, length = u.shape
    nstate = A.shape[1]
    config = _config(config, u, nstate)
    n_chunks = _n_chunks(length, config)
    use_fp64 = inputs_compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state) == torch.float64
    kw = dict(dtype=torch.float64 if use_fp64 else torch.float32, device=u.device)
    # the kernels index these (dim,) and (batch, dim, state) tensors as contiguous
    D_k = torch.zeros(dim, **kw) if D is None else D.contiguous()
    bias_k = torch.zeros(dim, **kw) if delta_bias is None else delta_bias.contiguous()
    h0 = torch.zeros(batch, dim, nstate, **kw) if initial_state is None else initial_state.to(kw["dtype"]).contiguous()
    reset_k = None if reset is None else reset.to(dtype=torch.int8).contiguous()
    block_d = min(config.fwd_block_d, triton.next_power_of_2(dim))
    block_n = triton.next_power_of_2(nstate)
    grid = _grid(batch, dim, n_chunks, block_d, config.fwd_d_steps)
    flags = dict(SOFTPLUS=bool(delta_softplus), USE_FP64=use_fp64, HAS_RESET=reset_k is not None,
                 BLOCK_D=block_d, D_STEPS=config.fwd_d_steps, BLOCK_L=config.chunk, BLOCK_N=block_n,
                 num_warps=config.fwd_warps, num_stages=config.num_stages)
    # 1. each chunk's end state from zero (into the buffer that phase 2 turns into the entry states) and decay
    states = torch.empty(batch, n_chunks, dim, nstate, **kw)
    decay = torch.empty(batch, n_chunks, dim, nstate, **kw)
    launch(_selective_scan_chunk_state_kernel)[grid](
        u, delta, A, B, bias_k, reset_k, states, decay,
        *_strides3(u), *_strides3(delta), A.stride(0), A.stride(1), *_strides3(B),
        dim, length, nstate, n_chunks, **flags,
    )
    # 2. the states entering the chunks, and the last state
    last_state = torch.empty(batch, dim, nstate, **kw)
    launch(_selective_scan_carry_kernel)[(batch, triton.cdiv(dim * nstate, config.carry_block))](
        h0, states, decay, last_state, dim * nstate, n_chunks,
        REVERSE=False, USE_FP64=use_fp64, BLOCK=config.carry_block, num_warps=config.carry_warps,
        num_stages=config.num_stages,
    )
    # 3. the outputs
    y = torch.empty(batch, dim, length, dtype=u.dtype, device=u.device)
    launch(_selective_scan_chunk_output_kernel)[grid](
        u, delta, A, B, C, D_k, z, bias_k, reset_k, states, y,
        *_strides3(u), *_strides3(delta), A.stride(0), A.stride(1), *_strides3(B), *_strides3(C), *_strides3(z),
        dim, length, nstate, n_chunks, HAS_Z=z is not None, **flags,
    )
    if not save_states:
        states = torch.empty(batch, 0, dim, nstate, **kw)
    return y, last_state, states


def selective_scan_triton_bwd(dy, dlast, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              initial_state=None, reset=None, chunk_states=None, config=None):
    """The Triton body of ``hf_densessm::selective_scan_backward``, recomputation from the chunk entry states:
    :func:`_selective_scan_chunk_adjoint_kernel`, :func:`_selective_scan_carry_kernel` (reverse),
    :func:`_selective_scan_chunk_bwd_kernel`.

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
        ValueError: as :func:`selective_scan_triton_fwd` for ``config``, or ``chunk_states`` does not hold
        ``ceil(length / config.chunk)`` chunks (e.g. a forward pass without ``save_states``).
    """
    batch, dim, length = u.shape
    nstate = A.shape[1]
    config = _config(config, u, nstate)
    n_chunks = _n_chunks(length, config)
    if chunk_states is None or chunk_states.shape[1] != n_chunks:
        raise ValueError(
            f"chunk_states must hold the {n_chunks} chunk states of a forward pass with save_states=True and chunk "
            f"{config.chunk}, got {None if chunk_states is None else tuple(chunk_states.shape)}"
        )
    use_fp64 = inputs_compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state) == torch.float64
    kw = dict(dtype=torch.float64 if use_fp64 else torch.float32, device=u.device)
    dy = torch.zeros(batch, dim, length, **kw) if dy is None else dy
    D_k = torch.zeros(dim, **kw) if D is None else D.contiguous()
    bias_k = torch.zeros(dim, **kw) if delta_bias is None else delta_bias.contiguous()
    dlast = torch.zeros(batch, dim, nstate, **kw) if dlast is None else dlast.to(kw["dtype"]).contiguous()
    reset_k = None if reset is None else reset.to(dtype=torch.int8).contiguous()
    h_chunks = chunk_states.to(kw["dtype"]).contiguous()
    block_n = triton.next_power_of_2(nstate)
    common = dict(HAS_Z=z is not None, SOFTPLUS=bool(delta_softplus), USE_FP64=use_fp64,
                  HAS_RESET=reset_k is not None, BLOCK_L=config.chunk, BLOCK_N=block_n, num_stages=config.num_stages)

    # 1. each chunk's adjoint at its start from a zero adjoint at its end (into the buffer that phase 2 turns into
    # the adjoints reaching the chunks' ends, and phase 3 into dA's partial sums), and its decay
    lam = torch.empty(batch, n_chunks, dim, nstate, **kw)
    decay = torch.empty(batch, n_chunks, dim, nstate, **kw)
    block_d = min(config.fwd_block_d, triton.next_power_of_2(dim))
    launch(_selective_scan_chunk_adjoint_kernel)[_grid(batch, dim, n_chunks, block_d, config.fwd_d_steps)](
        dy, delta, A, C, z, bias_k, reset_k, lam, decay,
        *_strides3(dy), *_strides3(delta), A.stride(0), A.stride(1), *_strides3(C), *_strides3(z),
        dim, length, nstate, n_chunks,
        BLOCK_D=block_d, D_STEPS=config.fwd_d_steps, num_warps=config.fwd_warps, **common,
    )
    # 2. the adjoints reaching the chunks' ends, and d initial_state
    dh0 = torch.empty(batch, dim, nstate, **kw)
    launch(_selective_scan_carry_kernel)[(batch, triton.cdiv(dim * nstate, config.carry_block))](
        dlast, lam, decay, dh0, dim * nstate, n_chunks,
        REVERSE=True, USE_FP64=use_fp64, BLOCK=config.carry_block, num_warps=config.carry_warps,
        num_stages=config.num_stages,
    )
    # 3. every gradient
    du = torch.empty(batch, dim, length, **kw)
    ddelta = torch.empty(batch, dim, length, **kw)
    dz = torch.empty(batch, dim, length, **kw) if z is not None else None
    dB = torch.zeros(batch, nstate, length, **kw)
    dC = torch.zeros(batch, nstate, length, **kw)
    dD = torch.empty(batch, n_chunks, dim, **kw)
    block_d = min(config.bwd_block_d, triton.next_power_of_2(dim))
    launch(_selective_scan_chunk_bwd_kernel)[_grid(batch, dim, n_chunks, block_d, config.bwd_d_steps)](
        u, delta, A, B, C, D_k, z, bias_k, reset_k, h_chunks, dy, lam,
        du, ddelta, dz, dB, dC, dD,
        *_strides3(u), *_strides3(delta), A.stride(0), A.stride(1), *_strides3(B), *_strides3(C), *_strides3(z),
        *_strides3(dy),
        dim, length, nstate, n_chunks,
        BLOCK_D=block_d, D_STEPS=config.bwd_d_steps, num_warps=config.bwd_warps, **common,
    )
    dA = lam  # phase 3 left each chunk's share of dA there

    def cast(g, like):
        return None if g is None else g.to(like.dtype) if like is not None else g

    return (
        cast(du, u), cast(ddelta, delta), cast(dA.sum((0, 1)), A), cast(dB, B), cast(dC, C),
        None if D is None else cast(dD.sum((0, 1)), D), cast(dz, z),
        None if delta_bias is None else cast(ddelta.sum((0, 2)), delta_bias), cast(dh0, initial_state),
    )
