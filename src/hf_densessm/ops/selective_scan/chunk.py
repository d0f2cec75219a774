"""Chunk-parallel Triton selective scan, forward and backward by recomputation (Mamba paper Alg. 2, §3.3.2,
App. D): the Triton bodies of ``hf_densessm::selective_scan`` / ``_backward``, accumulating in float32 (float64 for
float64 inputs). How the kernels work, packed documents, tile choices: docs/kernels.md, "Selective scan".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backend import GPUArch, device_arch, inputs_compute_dtype, token_major_like
from ..triton_utils import launch, sigmoid, softplus, tl, triton  # raises ImportError without triton

__all__ = ["SelectiveScanConfig", "selective_scan_config", "selective_scan_triton_bwd", "selective_scan_triton_fwd"]

#: The most chunks a launch takes: they are the grid's second axis (CUDA allows 65535 there).
MAX_CHUNKS = 65535
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@dataclass(frozen=True)
class SelectiveScanConfig:
    """Launch choices of the scan (docs/kernels.md): ``chunk`` tokens per program (the backward pass must use the
    forward pass's); channels per program (``block_d``), channel blocks per program and warps of the walks (``fwd_*``:
    both passes' phase 1, the forward's output) and of the backward kernel (``bwd_*``); the carry kernel's ``(channel,
    state)`` entries per program, warps and chunks held at once; pipelining stages. ``chunk``, ``*_block_d``,
    ``carry_*`` but warps: powers of 2."""

    chunk: int = 32
    fwd_block_d: int = 64
    fwd_d_steps: int = 1
    fwd_warps: int = 1
    bwd_block_d: int = 512
    bwd_d_steps: int = 1
    bwd_warps: int = 16
    carry_block: int = 512
    carry_warps: int = 4
    carry_chunks: int = 16
    num_stages: int = 1


def selective_scan_config(arch: GPUArch, dtype: torch.dtype, nstate: int) -> SelectiveScanConfig:
    """The :class:`SelectiveScanConfig` of ``nstate`` states, the same for every ``arch`` and ``dtype`` (``u``'s):
    up to 16 states, two channels per thread in the walks and 16-warp backward programs (at most 128 registers a
    thread), else one channel and one warp (docs/kernels.md, "Tile, warp...")."""
    del arch, dtype
    return SelectiveScanConfig() if nstate <= 16 else SelectiveScanConfig(fwd_block_d=32, bwd_block_d=32, bwd_warps=1)


# ------------------------------------------------------------------------------------------------ device code
# A program's states: a (BLOCK_N, BLOCK_D) tile built only from vectors, so that a thread holds whole columns; the
# token loops call no helper but softplus, sigmoid, _sum_rows, _add_over_channels (docs/kernels.md, "Selective scan").


@triton.jit
def _rows(ptr, offs_d, mask_d, s_d, s_n, offs_n, NSTATE: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    """(BLOCK_N, BLOCK_D) tile ``[n, d] = ptr[d * s_d + n * s_n]``, 0 from ``n = NSTATE``: one load per state."""
    tile = tl.zeros((BLOCK_N, offs_d.shape[0]), ACC)
    for n in tl.static_range(NSTATE):
        row = tl.load(ptr + offs_d * s_d + n * s_n, mask=mask_d, other=0.0).to(ACC)
        tile = tl.where(offs_n[:, None] == n, row[None, :], tile)
    return tile


@triton.jit
def _store_rows(ptr, tile, offs_d, mask_d, offs_n, NSTATE: tl.constexpr):
    """Store a tile of :func:`_rows` into ``(dim, NSTATE)`` rows, one store per state."""
    for n in tl.static_range(NSTATE):
        tl.store(ptr + offs_d * NSTATE + n, tl.sum(tl.where(offs_n[:, None] == n, tile, -0.0), axis=0), mask=mask_d)


@triton.jit
def _sum_rows(x, acc, NSTATE: tl.constexpr, w=None):
    """``acc + sum_n x[n, :]`` (times ``w[n, :]``, a tile or a ``(BLOCK_N, 1)`` column) over the ``NSTATE`` rows of a
    :func:`_rows` tile, in order: one add or ``tl.fma`` per row (a multiply-add whatever triton's FP-fusion default,
    off from Triton 3.10), each row picked by a constant mask (which folds away), against ``tl.sum``'s tree."""
    rows = tl.arange(0, x.shape[0])[:, None]
    for n in tl.static_range(NSTATE):
        row = tl.sum(tl.where(rows == n, x, -0.0), axis=0)
        if w is None:
            acc += row
        else:
            acc = tl.fma(row, tl.sum(tl.where(rows == n, tl.broadcast_to(w, x.shape), -0.0), axis=0), acc)
    return acc


@triton.jit
def _channels(tile, BLOCK_D: tl.constexpr, CPT: tl.constexpr):
    """The channels of channel block ``tile``: column ``j`` holds channel ``CPT (j % T) + j // T``, ``T = BLOCK_D /
    CPT``, so that a thread's ``CPT`` columns (``i, i + T, ...``) are adjacent channels (docs/kernels.md)."""
    cols = tl.arange(0, BLOCK_D)
    return tile * BLOCK_D + (cols % (BLOCK_D // CPT)) * CPT + cols // (BLOCK_D // CPT)


@triton.jit
def _channel(ptr, offs_d, mask_d, HAS: tl.constexpr, ACC: tl.constexpr):
    """A (dim,) parameter of the program's channels (``D``, ``delta_bias``), 0 when absent."""
    if HAS:
        return tl.load(ptr + offs_d, mask=mask_d, other=0.0).to(ACC)
    return tl.zeros(offs_d.shape, ACC)


@triton.jit
def _program(length, n_chunks, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, NSTATE: tl.constexpr):
    """A per-chunk program's ``(pid_d, pid_b, start, end, row, offs_n, mask_n)``: its tokens ``[start, end)``, its
    chunk's index ``row`` in ``(batch, n_chunks)``, the states ``offs_n``."""
    pid_d, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = pid_c * CHUNK
    offs_n = tl.arange(0, BLOCK_N)
    return pid_d, pid_b, start, tl.minimum(start + CHUNK, length), pid_b * n_chunks + pid_c, offs_n, offs_n < NSTATE


@triton.jit
def _selective_scan_chunk_state_kernel(
    x_ptr, delta_ptr, A_ptr, V_ptr, z_ptr, bias_ptr, reset_ptr,
    out_ptr, dtsum_ptr,
    s_x_b, s_x_d, s_x_l, s_dt_b, s_dt_d, s_dt_l, s_A_d, s_A_n, s_V_b, s_V_n, s_V_l, s_z_b, s_z_d, s_z_l,
    dim, length, n_chunks,
    CHUNK: tl.constexpr, NSTATE: tl.constexpr, REVERSE: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_RESET: tl.constexpr, ACC: tl.constexpr,
    BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr, BLOCK_N: tl.constexpr, CPT: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Phase 1 of either pass, grid (channel blocks, chunks, batch): a chunk walked from zero, forward (``x = u``,
    ``V = B``) ``h <- a_t h + dt_t u_t B_t`` to its end state, or ``REVERSE`` (``x = dy``, ``V = C``) ``m <- a_t (m
    + C_t dy_t silu(z_t))`` to the adjoint leaving its start, into ``out`` ``(batch, n_chunks, dim, state)``;
    ``dtsum``: ``sum dt`` ``(batch, n_chunks, dim)``; ``reset``: ``(batch, length)``, -inf where a document starts,
    else 0."""
    pid_d, pid_b, start, end, row, offs_n, mask_n = _program(length, n_chunks, CHUNK, BLOCK_N, NSTATE)
    v_base = V_ptr + pid_b * s_V_b + offs_n * s_V_n
    for j in range(D_STEPS):
        offs_d = _channels(pid_d * D_STEPS + j, BLOCK_D, CPT)
        mask_d = (offs_d < dim) | EVEN_D
        A2 = _rows(A_ptr, offs_d, mask_d, s_A_d, s_A_n, offs_n, NSTATE, BLOCK_N, ACC) * LOG2E
        bias = _channel(bias_ptr, offs_d, mask_d, HAS_BIAS, ACC)
        x_base = x_ptr + pid_b * s_x_b + offs_d * s_x_d
        dt_base = delta_ptr + pid_b * s_dt_b + offs_d * s_dt_d
        if HAS_Z:
            z_base = z_ptr + pid_b * s_z_b + offs_d * s_z_d
        state = A2 * 0.0
        dtsum = bias * 0.0
        for i in range(0, end - start):
            t = end - 1 - i if REVERSE else start + i
            dt = tl.load(dt_base + t * s_dt_l, mask=mask_d, other=0.0).to(ACC) + bias
            dt = softplus(dt) if SOFTPLUS else dt
            s = tl.load(x_base + t * s_x_l, mask=mask_d, other=0.0).to(ACC)
            vt = tl.load(v_base + t * s_V_l, mask=mask_n, other=0.0).to(ACC)
            # -inf where a document starts: a_t = exp2(dt A2 - inf) = 0, the state before it is dropped
            shift = tl.load(reset_ptr + pid_b * length + t) if HAS_RESET else 0.0
            a = tl.exp2(tl.fma(dt[None, :], A2, shift))
            if REVERSE:
                if HAS_Z:
                    z = tl.load(z_base + t * s_z_l, mask=mask_d, other=0.0).to(ACC)
                    s = s * z * sigmoid(z)
                state = a * tl.fma(vt[:, None], s[None, :], state)
            else:
                state = tl.fma(vt[:, None], (s * dt)[None, :], a * state)
            dtsum += dt
        _store_rows(out_ptr + row * dim * NSTATE, state, offs_d, mask_d, offs_n, NSTATE)
        tl.store(dtsum_ptr + row * dim + offs_d, dtsum, mask=mask_d)


@triton.jit
def _selective_scan_chunk_adjoint_kernel(
    x_ptr, delta_ptr, A_ptr, V_ptr, z_ptr, bias_ptr, reset_ptr,
    out_ptr, dtsum_ptr,
    s_x_b, s_x_d, s_x_l, s_dt_b, s_dt_d, s_dt_l, s_A_d, s_A_n, s_V_b, s_V_n, s_V_l, s_z_b, s_z_d, s_z_l,
    dim, length, n_chunks,
    CHUNK: tl.constexpr, NSTATE: tl.constexpr, REVERSE: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_RESET: tl.constexpr, ACC: tl.constexpr,
    BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr, BLOCK_N: tl.constexpr, CPT: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Backward phase 1: :func:`_selective_scan_chunk_state_kernel` in reverse (``x = dy``, ``V = C``)."""
    _selective_scan_chunk_state_kernel(
        x_ptr, delta_ptr, A_ptr, V_ptr, z_ptr, bias_ptr, reset_ptr, out_ptr, dtsum_ptr, s_x_b, s_x_d, s_x_l,
        s_dt_b, s_dt_d, s_dt_l, s_A_d, s_A_n, s_V_b, s_V_n, s_V_l, s_z_b, s_z_d, s_z_l, dim, length, n_chunks, CHUNK,
        NSTATE, REVERSE, HAS_Z, HAS_BIAS, SOFTPLUS, HAS_RESET, ACC, BLOCK_D, D_STEPS, BLOCK_N, CPT, EVEN_D)


@triton.jit
def _combine(a1, b1, a2, b2):
    """Composition of two affine maps ``h -> a h + b``: first ``(a1, b1)``, then ``(a2, b2)``."""
    return a1 * a2, tl.fma(a2, b1, b2)


@triton.jit
def _selective_scan_carry_kernel(
    x0_ptr, vals_ptr, dtsum_ptr, flag_ptr, A_ptr, out_ptr, final_ptr,
    s_A_d, s_A_n, dim, n_chunks,
    NSTATE: tl.constexpr, HAS_X0: tl.constexpr, REVERSE: tl.constexpr, HAS_RESET: tl.constexpr,
    ACC: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Phase 2, grid (batch, blocks of ``dim * state``): ``x <- P_c x + vals_c`` over the chunks from ``x0``, in order
    or ``REVERSE``, ``P_c = exp(A dtsum_c + flag_c)`` (``flag_c`` -inf where a document starts, else 0), ``BLOCK_C``
    chunks at a time: ``out``, ``final`` as :func:`_carry` returns them; ``vals``: ``(batch, n_chunks, dim, state)``;
    ``x0``: ``(batch, dim, state)``."""
    pid_b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    size = dim * NSTATE
    mask = offs < size
    d = offs // NSTATE
    A2 = tl.load(A_ptr + d * s_A_d + (offs % NSTATE) * s_A_n, mask=mask, other=0.0).to(ACC) * LOG2E
    x = tl.load(x0_ptr + pid_b * size + offs, mask=mask, other=0.0).to(ACC) if HAS_X0 else A2 * 0.0
    rows = tl.arange(0, BLOCK_C)
    for i in range(0, tl.cdiv(n_chunks, BLOCK_C)):
        c0 = n_chunks - (i + 1) * BLOCK_C if REVERSE else i * BLOCK_C
        offs_c = c0 + rows
        mask_c = (offs_c >= 0) & (offs_c < n_chunks)
        mask2 = mask_c[:, None] & mask[None, :]
        at = (pid_b * n_chunks + offs_c)[:, None]
        v = tl.load(vals_ptr + at * size + offs[None, :], mask=mask2, other=0.0).to(ACC)
        p = A2[None, :] * tl.load(dtsum_ptr + at * dim + d[None, :], mask=mask2, other=0.0).to(ACC)
        if HAS_RESET:
            p += tl.load(flag_ptr + pid_b * n_chunks + offs_c, mask=mask_c, other=0.0)[:, None]
        p = tl.where(mask2, tl.exp2(p), 1.0)
        p_cum, v_cum = tl.associative_scan((p, v), axis=0, combine_fn=_combine, reverse=REVERSE)
        after = tl.fma(p_cum, x[None, :], v_cum)  # x after chunk c (in the walk's order)
        if REVERSE:
            nxt, first, last = offs_c - 1, c0 + BLOCK_C - 1, 0
            keep = (rows > 0) & (nxt >= 0)
        else:
            nxt, first, last = offs_c + 1, c0, BLOCK_C - 1
            keep = (rows < BLOCK_C - 1) & (nxt < n_chunks)
        tl.store(out_ptr + (pid_b * n_chunks + nxt)[:, None] * size + offs[None, :], after,
                 mask=keep[:, None] & mask[None, :])
        tl.store(out_ptr + (pid_b * n_chunks + first) * size + offs, x, mask=mask)
        x = tl.sum(tl.where(rows[:, None] == last, after, -0.0), axis=0)
    tl.store(final_ptr + pid_b * size + offs, x, mask=mask)


@triton.jit
def _selective_scan_chunk_output_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, reset_ptr, states_ptr,
    y_ptr,
    s_u_b, s_u_d, s_u_l, s_dt_b, s_dt_d, s_dt_l, s_A_d, s_A_n, s_B_b, s_B_n, s_B_l, s_C_b, s_C_n, s_C_l,
    s_z_b, s_z_d, s_z_l,
    dim, length, n_chunks,
    CHUNK: tl.constexpr, NSTATE: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, HAS_RESET: tl.constexpr, ACC: tl.constexpr,
    BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr, BLOCK_N: tl.constexpr, CPT: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Forward phase 3, grid (channel blocks, chunks, batch): the chunk walked from the state entering it
    (``states``, ``(batch, n_chunks, dim, state)``), ``y_t = (C_t . h_t + D u_t) silu(z_t)`` stored per token."""
    pid_d, pid_b, start, end, row, offs_n, mask_n = _program(length, n_chunks, CHUNK, BLOCK_N, NSTATE)
    b_base = B_ptr + pid_b * s_B_b + offs_n * s_B_n
    c_base = C_ptr + pid_b * s_C_b + offs_n * s_C_n
    for j in range(D_STEPS):
        offs_d = _channels(pid_d * D_STEPS + j, BLOCK_D, CPT)
        mask_d = (offs_d < dim) | EVEN_D
        A2 = _rows(A_ptr, offs_d, mask_d, s_A_d, s_A_n, offs_n, NSTATE, BLOCK_N, ACC) * LOG2E
        bias = _channel(bias_ptr, offs_d, mask_d, HAS_BIAS, ACC)
        Dv = _channel(D_ptr, offs_d, mask_d, HAS_D, ACC)
        h = _rows(states_ptr + row * dim * NSTATE, offs_d, mask_d, NSTATE, 1, offs_n, NSTATE, BLOCK_N, ACC)
        u_base = u_ptr + pid_b * s_u_b + offs_d * s_u_d
        dt_base = delta_ptr + pid_b * s_dt_b + offs_d * s_dt_d
        y_base = y_ptr + pid_b.to(tl.int64) * length * dim + offs_d  # token-major, contiguous
        if HAS_Z:
            z_base = z_ptr + pid_b * s_z_b + offs_d * s_z_d
        for t in range(start, end):
            dt = tl.load(dt_base + t * s_dt_l, mask=mask_d, other=0.0).to(ACC) + bias
            dt = softplus(dt) if SOFTPLUS else dt
            u = tl.load(u_base + t * s_u_l, mask=mask_d, other=0.0).to(ACC)
            bt = tl.load(b_base + t * s_B_l, mask=mask_n, other=0.0).to(ACC)
            ct = tl.load(c_base + t * s_C_l, mask=mask_n, other=0.0).to(ACC)
            shift = tl.load(reset_ptr + pid_b * length + t) if HAS_RESET else 0.0  # a_t = 0 where a document starts
            h = tl.fma(bt[:, None], (dt * u)[None, :], tl.exp2(tl.fma(dt[None, :], A2, shift)) * h)
            y = _sum_rows(h * ct[:, None], Dv * u, NSTATE)
            if HAS_Z:
                z = tl.load(z_base + t * s_z_l, mask=mask_d, other=0.0).to(ACC)
                y = y * z * sigmoid(z)
            tl.store(y_base + t * dim, y.to(y_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _sum_over_channels(x, BLOCK_N: tl.constexpr, W: tl.constexpr, L: tl.constexpr):
    """Row sums of a (BLOCK_N, W * L) tile over each of its ``W`` groups of ``L`` columns, by a reduce-scatter
    (docs/kernels.md): ``(s, rows, own)``, (max(1, BLOCK_N / L), W, L) tiles, ``s[k, w, j]`` the sum of row ``rows[k,
    w, j]`` of group ``w``, ``own`` one ``j`` per row. Constexpr arithmetic stays inline (a name assigned one would
    make it a tensor)."""
    x = tl.reshape(x, (BLOCK_N, W, L))
    cols = tl.arange(0, L)[None, None, :]
    base = tl.zeros((1, W, L), tl.int32)
    own = base >= 0
    for lvl in tl.static_range(16):
        if (L >> (lvl + 1)) >= 1:
            upper = (cols & (L >> (lvl + 1))) != 0
            partner = tl.broadcast_to(cols ^ (L >> (lvl + 1)), (max(BLOCK_N >> (lvl + 1), 1), W, L))
            if (BLOCK_N >> lvl) >= 2:  # keep the upper or lower half of the rows, add the partner's
                lo, hi = tl.split(tl.permute(tl.reshape(x, (2, BLOCK_N >> (lvl + 1), W, L)), (1, 2, 3, 0)))
                x = tl.where(upper, hi, lo) + tl.gather(tl.where(upper, lo, hi), partner, axis=2)
                base += tl.where(upper, BLOCK_N >> (lvl + 1), 0)
            else:  # one row left: add the partner's, both keep the sum
                x = x + tl.gather(x, partner, axis=2)
                own = own & (upper == 0)
    rows = base + tl.arange(0, max(BLOCK_N // L, 1))[:, None, None]
    return x, rows, own & (rows >= 0)


@triton.jit
def _add_over_channels(ptr, x, offs_n, NSTATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       CPT: tl.constexpr):
    """``ptr[n] += sum_j x[n, j]`` (float atomic adds, relaxed): by :func:`_sum_over_channels` over each warp's
    columns (its shuffles stay in the warp; one atomic add per warp) when a thread holds one channel or the block
    is one warp, else ``tl.sum``."""
    if CPT == 1 or BLOCK_D == 32 * CPT:
        sums, rows, own = _sum_over_channels(x, BLOCK_N, BLOCK_D // min(BLOCK_D, 32 * CPT), min(BLOCK_D, 32 * CPT))
        tl.atomic_add(ptr + rows, sums, mask=own & (rows < NSTATE), sem="relaxed")
    else:
        tl.atomic_add(ptr + offs_n, tl.sum(x, axis=1), mask=offs_n < NSTATE, sem="relaxed")


@triton.jit
def _selective_scan_chunk_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, reset_ptr, dy_ptr, states_ptr, lam_ptr,
    dtsum_ptr, w_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dbias_ptr,
    s_u_b, s_u_d, s_u_l, s_dt_b, s_dt_d, s_dt_l, s_A_d, s_A_n, s_B_b, s_B_n, s_B_l, s_C_b, s_C_n, s_C_l,
    s_z_b, s_z_d, s_z_l, s_dy_b, s_dy_d, s_dy_l,
    dim, length, n_chunks,
    CHUNK: tl.constexpr, NSTATE: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, HAS_RESET: tl.constexpr, ACC: tl.constexpr,
    BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr, BLOCK_N: tl.constexpr, CPT: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Backward phase 3, grid (channel blocks, chunks, batch): every gradient of one chunk from ``states`` and the
    adjoint reaching its end (``lam``), in two walks (docs/kernels.md), ``w`` a ``(batch, length, dim)`` scratch;
    per-chunk ``dA`` ``(batch, n_chunks, dim, state)``, ``dD``, ``d delta_bias`` ``(batch, n_chunks, dim)``."""
    pid_d, pid_b, start, end, row, offs_n, mask_n = _program(length, n_chunks, CHUNK, BLOCK_N, NSTATE)
    b_base = B_ptr + pid_b * s_B_b + offs_n * s_B_n
    c_base = C_ptr + pid_b * s_C_b + offs_n * s_C_n
    dbc_base = pid_b * length * NSTATE  # dB, dC: (batch, length, state)
    for j in range(D_STEPS):
        offs_d = _channels(pid_d * D_STEPS + j, BLOCK_D, CPT)
        mask_d = (offs_d < dim) | EVEN_D
        A2 = _rows(A_ptr, offs_d, mask_d, s_A_d, s_A_n, offs_n, NSTATE, BLOCK_N, ACC) * LOG2E
        bias = _channel(bias_ptr, offs_d, mask_d, HAS_BIAS, ACC)
        Dv = _channel(D_ptr, offs_d, mask_d, HAS_D, ACC)
        d_total = tl.load(dtsum_ptr + row * dim + offs_d, mask=mask_d, other=0.0).to(ACC)
        u_base = u_ptr + pid_b * s_u_b + offs_d * s_u_d
        dt_base = delta_ptr + pid_b * s_dt_b + offs_d * s_dt_d
        dy_base = dy_ptr + pid_b * s_dy_b + offs_d * s_dy_d
        o_base = pid_b.to(tl.int64) * length * dim + offs_d  # w, du, d delta, dz: token-major, contiguous
        if HAS_Z:
            z_base = z_ptr + pid_b * s_z_b + offs_d * s_z_d
        # reverse walk: g_t = C_t gy_t + a_{t+1} g_{t+1} from lam; gn = a_t g_t flows on to t - 1
        gn = _rows(lam_ptr + row * dim * NSTATE, offs_d, mask_d, NSTATE, 1, offs_n, NSTATE, BLOCK_N, ACC)
        d_rem = d_total  # sum of dt over the chunk's positions up to t
        q_suf = d_total * 0.0  # sum over positions >= t of q = sum_n A2_n g_n b_n
        dA = A2 * 0.0
        dDv = d_total * 0.0
        for i in range(0, end - start):
            t = end - 1 - i
            dt = tl.load(dt_base + t * s_dt_l, mask=mask_d, other=0.0).to(ACC) + bias
            dt = softplus(dt) if SOFTPLUS else dt
            u = tl.load(u_base + t * s_u_l, mask=mask_d, other=0.0).to(ACC)
            gy = tl.load(dy_base + t * s_dy_l, mask=mask_d, other=0.0).to(ACC)
            if HAS_Z:
                z = tl.load(z_base + t * s_z_l, mask=mask_d, other=0.0).to(ACC)
                gy = gy * z * sigmoid(z)
            bt = tl.load(b_base + t * s_B_l, mask=mask_n, other=0.0).to(ACC)
            ct = tl.load(c_base + t * s_C_l, mask=mask_n, other=0.0).to(ACC)
            g = tl.fma(ct[:, None], gy[None, :], gn)
            gb = g * bt[:, None]
            sum_gb = _sum_rows(gb, -0.0, NSTATE)
            dtu = dt * u
            q_suf = tl.fma(dtu, _sum_rows(gb, -0.0, NSTATE, A2), q_suf)
            dA = tl.fma(-gb, (d_rem * dtu)[None, :], dA)
            _add_over_channels(dB_ptr + dbc_base + t * NSTATE, g * dtu[None, :], offs_n, NSTATE, BLOCK_N, BLOCK_D,
                               CPT)
            tl.store(du_ptr + o_base + t * dim, tl.fma(dt, sum_gb, Dv * gy).to(du_ptr.dtype.element_ty), mask=mask_d)
            tl.store(w_ptr + o_base + t * dim, tl.fma(sum_gb, u, -LN2 * q_suf), mask=mask_d)
            dDv = tl.fma(gy, u, dDv)
            d_rem -= dt
            shift = tl.load(reset_ptr + pid_b * length + t) if HAS_RESET else 0.0
            gn = tl.exp2(tl.fma(dt[None, :], A2, shift)) * g
        h = _rows(states_ptr + row * dim * NSTATE, offs_d, mask_d, NSTATE, 1, offs_n, NSTATE, BLOCK_N, ACC)
        # sum_n A_n X_n at the chunk's first position, X = dL/d(dt A) = g a h_{t-1}; then X_t = X_{t-1} - p + q
        base = LN2 * (q_suf + tl.sum(A2 * gn * h, axis=0))
        p_pre = d_total * 0.0  # sum over positions < t of p = sum_n A2_n gy C_n h_n
        d_pre = d_total * 0.0
        dbias = d_total * 0.0
        for t in range(start, end):
            dt = tl.load(dt_base + t * s_dt_l, mask=mask_d, other=0.0).to(ACC) + bias
            raw = dt
            dt = softplus(raw) if SOFTPLUS else raw
            u = tl.load(u_base + t * s_u_l, mask=mask_d, other=0.0).to(ACC)
            dy = tl.load(dy_base + t * s_dy_l, mask=mask_d, other=0.0).to(ACC)
            gy = dy
            if HAS_Z:
                z = tl.load(z_base + t * s_z_l, mask=mask_d, other=0.0).to(ACC)
                sig = sigmoid(z)
                gy = dy * z * sig
            bt = tl.load(b_base + t * s_B_l, mask=mask_n, other=0.0).to(ACC)
            ct = tl.load(c_base + t * s_C_l, mask=mask_n, other=0.0).to(ACC)
            shift = tl.load(reset_ptr + pid_b * length + t) if HAS_RESET else 0.0
            h = tl.fma(tl.exp2(tl.fma(dt[None, :], A2, shift)), h, bt[:, None] * (dt * u)[None, :])
            ch = ct[:, None] * h
            d_pre += dt
            dA = tl.fma(ch, (d_pre * gy)[None, :], dA)
            _add_over_channels(dC_ptr + dbc_base + t * NSTATE, h * gy[None, :], offs_n, NSTATE, BLOCK_N, BLOCK_D,
                               CPT)
            ddt = tl.load(w_ptr + o_base + t * dim, mask=mask_d, other=0.0) + base - LN2 * p_pre
            p_pre = tl.fma(gy, _sum_rows(ch, -0.0, NSTATE, A2), p_pre)
            ddt = ddt * sigmoid(raw) if SOFTPLUS else ddt
            tl.store(ddelta_ptr + o_base + t * dim, ddt.to(ddelta_ptr.dtype.element_ty), mask=mask_d)
            dbias += ddt
            if HAS_Z:
                y = _sum_rows(ch, Dv * u, NSTATE)
                tl.store(dz_ptr + o_base + t * dim,
                         (dy * y * sig * (1.0 + z * (1.0 - sig))).to(dz_ptr.dtype.element_ty), mask=mask_d)
        lam = _rows(lam_ptr + row * dim * NSTATE, offs_d, mask_d, NSTATE, 1, offs_n, NSTATE, BLOCK_N, ACC)
        dA = tl.fma(lam * h, d_total[None, :], dA)
        _store_rows(dA_ptr + row * dim * NSTATE, dA, offs_d, mask_d, offs_n, NSTATE)
        tl.store(dD_ptr + row * dim + offs_d, dDv, mask=mask_d)
        tl.store(dbias_ptr + row * dim + offs_d, dbias, mask=mask_d)


# ------------------------------------------------------------------------------------------------------ host


def _strides3(t):
    """The three strides of ``t``, zeros for None."""
    return (t.stride(0), t.stride(1), t.stride(2)) if t is not None else (0, 0, 0)


def _grid(batch, dim, n_chunks, block_d, d_steps):
    """The per-chunk kernels' grid: (channel blocks, chunks, batch)."""
    return (triton.cdiv(dim, block_d * d_steps), n_chunks, batch)


def _tiles(config, dim, backward):
    """Launch constants of the per-chunk kernels: the channel block shrunk to ``dim``, at most one warp per 32
    channels, the channels per thread ``CPT``, and whether the blocks cover ``dim`` exactly (no channel masks)."""
    block_d = min(config.bwd_block_d if backward else config.fwd_block_d, triton.next_power_of_2(dim))
    d_steps = config.bwd_d_steps if backward else config.fwd_d_steps
    warps = max(1, min(config.bwd_warps if backward else config.fwd_warps, block_d // 32))
    return dict(BLOCK_D=block_d, D_STEPS=d_steps, CPT=max(1, block_d // (32 * warps)),
                EVEN_D=dim % (block_d * d_steps) == 0, num_warps=warps)


def _vectors(x, dtype):
    """``B`` or ``C`` as a (batch, state, length) view of a token-major tensor in the accumulation ``dtype`` (a copy
    unless ``x`` is one already): the kernels read each token's states as one vector."""
    return x if x.dtype == dtype and x.stride(1) == 1 else x.transpose(1, 2).to(
        dtype, memory_format=torch.contiguous_format).transpose(1, 2)


def _setup(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset, config):
    """Both passes' launch inputs: the checked config, ``kw`` (accumulation dtype, device), ``D``, ``delta_bias``,
    ``reset``, ``B``, ``C`` as the kernels index them, the walks' grid and constants but ``HAS_Z``, ``HAS_D``."""
    batch, dim, length = u.shape
    nstate = A.shape[1]
    config = config or selective_scan_config(device_arch(u.device), u.dtype, nstate)
    for name in ("chunk", "fwd_block_d", "bwd_block_d", "carry_block", "carry_chunks"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"config.{name} must be a power of 2, got {value}")
    if config.fwd_d_steps < 1 or config.bwd_d_steps < 1:
        raise ValueError(f"config.fwd_d_steps and bwd_d_steps must be >= 1, got {config}")
    n_chunks = triton.cdiv(length, config.chunk)
    if n_chunks > MAX_CHUNKS:
        raise ValueError(f"length {length} needs {n_chunks} chunks of {config.chunk} tokens, over {MAX_CHUNKS}: "
                         f"take a longer config.chunk")
    use_fp64 = inputs_compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state) == torch.float64
    kw = dict(dtype=torch.float64 if use_fp64 else torch.float32, device=u.device)
    D, delta_bias = (None if t is None else t.contiguous() for t in (D, delta_bias))  # indexed as contiguous
    reset = None if reset is None else torch.where(reset.bool(), -float("inf"), 0.0)  # exp2(... + reset): 0
    tiles = _tiles(config, dim, backward=False)
    flags = dict(CHUNK=config.chunk, NSTATE=nstate, HAS_BIAS=delta_bias is not None, SOFTPLUS=bool(delta_softplus),
                 HAS_RESET=reset is not None, ACC=tl.float64 if use_fp64 else tl.float32,
                 BLOCK_N=triton.next_power_of_2(nstate), num_stages=config.num_stages, **tiles)
    grid = _grid(batch, dim, n_chunks, tiles["BLOCK_D"], tiles["D_STEPS"])
    return config, kw, D, delta_bias, reset, _vectors(B, kw["dtype"]), _vectors(C, kw["dtype"]), grid, flags


def _carry(kernel, x, delta, A, V, z, bias, reset, x0, kw, grid, flags, config):
    """Phases 1 and 2 of a pass: each chunk's summary by ``kernel``, then :func:`_selective_scan_carry_kernel` from
    ``x0`` (None: zero). Returns the ``x`` entering each chunk (backward: reaching its end), ``(batch, n_chunks, dim,
    state)``, the last ``x``, ``(batch, dim, state)``, and each chunk's sum of dt, ``(batch, n_chunks, dim)``."""
    batch, dim, length = x.shape
    n_chunks, nstate, reverse = grid[1], A.shape[1], kernel is _selective_scan_chunk_adjoint_kernel
    vals, dtsum = torch.empty(batch, n_chunks, dim, nstate, **kw), torch.empty(batch, n_chunks, dim, **kw)
    flag = None if reset is None else torch.nn.functional.pad(reset, (0, n_chunks * flags["CHUNK"] - length)).view(
        batch, n_chunks, -1).amin(-1)  # -inf where a document starts in the chunk
    launch(kernel)[grid](
        x, delta, A, V, z, bias, reset, vals, dtsum,
        *_strides3(x), *_strides3(delta), A.stride(0), A.stride(1), *_strides3(V), *_strides3(z),
        dim, length, n_chunks, REVERSE=reverse, HAS_Z=z is not None, **flags)
    out, final = torch.empty_like(vals), torch.empty(batch, dim, nstate, **kw)
    launch(_selective_scan_carry_kernel)[(batch, triton.cdiv(dim * nstate, config.carry_block))](
        None if x0 is None else x0.to(kw["dtype"]).contiguous(), vals, dtsum, flag, A, out, final, A.stride(0),
        A.stride(1), dim, n_chunks, NSTATE=nstate, HAS_X0=x0 is not None, REVERSE=reverse,
        HAS_RESET=flag is not None, ACC=flags["ACC"], BLOCK=config.carry_block,
        BLOCK_C=min(config.carry_chunks, triton.next_power_of_2(n_chunks)), num_warps=config.carry_warps,
        num_stages=config.num_stages)
    return out, final, dtsum


def selective_scan_triton_fwd(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              initial_state=None, reset=None, save_states=True, config=None):
    """The Triton body of ``hf_densessm::selective_scan`` (three kernels, docs/kernels.md), no checks: arguments as
    :func:`hf_densessm.ops.selective_scan` (``reset`` bool or None; any strides), plus ``save_states`` (return the
    states entering the chunks) and ``config`` (default :func:`selective_scan_config`; the backward takes the same).
    Returns ``(y, last_state, chunk_states)``: ``y`` (batch, dim, length) in ``u``'s dtype, token-major;
    ``last_state`` (batch, dim, state) and ``chunk_states`` (batch, ceil(length / config.chunk) or 0 without
    ``save_states``, dim, state), contiguous, in float32 (float64 for float64 inputs). Raises ValueError: a
    power-of-2 field of ``config`` is not one, a ``d_steps`` < 1, over :data:`MAX_CHUNKS` chunks.
    """
    batch, dim, length = u.shape
    config, kw, D, delta_bias, reset_k, Bv, Cv, grid, flags = _setup(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset, config)
    states, last_state, _ = _carry(_selective_scan_chunk_state_kernel, u, delta, A, Bv, None, delta_bias, reset_k,
                                   initial_state, kw, grid, flags, config)
    y = token_major_like(u)
    launch(_selective_scan_chunk_output_kernel)[grid](
        u, delta, A, Bv, Cv, D, z, delta_bias, reset_k, states, y,
        *_strides3(u), *_strides3(delta), A.stride(0), A.stride(1), *_strides3(Bv), *_strides3(Cv), *_strides3(z),
        dim, length, grid[1], HAS_D=D is not None, HAS_Z=z is not None, **flags)
    return y, last_state, states if save_states else torch.empty(batch, 0, dim, A.shape[1], **kw)


def selective_scan_triton_bwd(dy, dlast, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              initial_state=None, reset=None, chunk_states=None, config=None):
    """The Triton body of ``hf_densessm::selective_scan_backward`` (three kernels, docs/kernels.md), recomputing
    from ``chunk_states``: ``dy`` (batch, dim, length) and ``dlast`` (batch, dim, state), the gradients of ``y`` and
    ``last_state`` (None: zero); the other arguments and ``chunk_states`` those of :func:`selective_scan_triton_fwd`.
    Returns ``(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state)``, each in its input's dtype (None for
    an absent ``D``, ``z``, ``delta_bias``; float32 (float64) for an absent ``initial_state``); ``du``, ``ddelta``,
    ``dz``, ``dB``, ``dC`` token-major, ``dB``, ``dC`` by atomic adds (last bits vary). Raises ValueError: as
    :func:`selective_scan_triton_fwd`, or ``chunk_states`` does not hold its chunks (e.g. without ``save_states``).
    """
    batch, dim, length = u.shape
    config, kw, D_k, bias_k, reset_k, Bv, Cv, grid, flags = _setup(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset, config)
    n_chunks = grid[1]
    if chunk_states is None or chunk_states.shape[1] != n_chunks:
        raise ValueError(f"chunk_states must hold the {n_chunks} chunk states of a forward pass with save_states=True "
                         f"and chunk {config.chunk}, got {None if chunk_states is None else tuple(chunk_states.shape)}")
    dy = torch.zeros(batch, dim, length, **kw) if dy is None else dy
    lam, dh0, dtsum = _carry(_selective_scan_chunk_adjoint_kernel, dy, delta, A, Cv, z, bias_k, reset_k, dlast, kw,
                             grid, flags, config)
    du, ddelta, dz = (None if t is None else token_major_like(t) for t in (u, delta, z))
    dB, dC = torch.zeros(batch, length, A.shape[1], **kw), torch.zeros(batch, length, A.shape[1], **kw)
    dA = torch.empty(batch, n_chunks, dim, A.shape[1], **kw)
    dD, dbias = torch.empty(batch, n_chunks, dim, **kw), torch.empty(batch, n_chunks, dim, **kw)
    tiles = _tiles(config, dim, backward=True)
    launch(_selective_scan_chunk_bwd_kernel)[_grid(batch, dim, n_chunks, tiles["BLOCK_D"], tiles["D_STEPS"])](
        u, delta, A, Bv, Cv, D_k, z, bias_k, reset_k, dy, chunk_states.to(kw["dtype"]).contiguous(), lam, dtsum,
        torch.empty(batch, length, dim, **kw), du, ddelta, dz, dB, dC, dA, dD, dbias,
        *_strides3(u), *_strides3(delta), A.stride(0), A.stride(1), *_strides3(Bv), *_strides3(Cv), *_strides3(z),
        *_strides3(dy), dim, length, n_chunks, HAS_D=D is not None, HAS_Z=z is not None, **dict(flags, **tiles))
    return (du, ddelta, dA.sum((0, 1)).to(A.dtype), dB.to(B.dtype).transpose(1, 2), dC.to(C.dtype).transpose(1, 2),
            None if D is None else dD.sum((0, 1)).to(D.dtype), dz,
            None if delta_bias is None else dbias.sum((0, 1)).to(delta_bias.dtype),
            dh0 if initial_state is None else dh0.to(initial_state.dtype))
