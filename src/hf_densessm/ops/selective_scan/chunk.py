"""Fused Triton selective scan, forward and backward (Mamba paper §3.3.2 and Appendix D).

**Forward** (:func:`_selective_scan_fwd_kernel`): one program per (sequence, block of ``BLOCK_D`` channels). It
walks the sequence in chunks of ``BLOCK_L`` tokens with the state ``h`` (``BLOCK_D x state``) in registers.
Per chunk it loads ``delta, u, z`` (``BLOCK_D x BLOCK_L``) and ``B, C`` (``state x BLOCK_L``), discretizes
(``dt = softplus(delta + delta_bias)``, ``exp(dt A)``, ``dt B u``) in registers, runs a parallel associative
scan over the chunk (the "parallel scan" of §3.3.2) started from the carried state, contracts with ``C``,
adds ``D u``, multiplies by ``silu(z)`` and writes ``y``. Only ``(batch, dim, length)`` tensors cross global
memory; the expanded state ``(batch, length, dim, state)`` never does.

**Backward** (:func:`_selective_scan_bwd_kernel`), recomputation as in App. D: the forward pass stores only
the state entering each chunk, ``(batch, n_chunks, dim, state)`` float32 (``1 / BLOCK_L`` of the expanded
state, and only when a gradient is needed). The backward program walks the chunks in reverse; per chunk it

1. recomputes ``h_{t-1}`` for every position with one forward associative scan whose first element is the
   stored entry state (the scan runs on the inputs of position ``t - 1``, loaded shifted by one), then
   ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t`` elementwise;
2. recomputes ``y`` for the gate's gradient, and runs the adjoint recurrence
   ``g_t = C_t gy_t + exp(dt_{t+1} A) g_{t+1}`` as a reverse associative scan (inputs of position ``t + 1``
   loaded shifted by one) started from the adjoint carried from the next chunk (or ``d last_state``);
3. forms every gradient from ``g_t``, ``h_{t-1}`` and the decay: ``d(dt A) = g exp(dt A) h_{t-1}``.

Gradients that sum over channels (``dB``, ``dC``) are added by each block of channels into one
``(batch, state, length)`` float32 buffer with atomic adds (so their summation order, and their last bits, may
vary from run to run); ``dA``, ``dD`` are accumulated in registers per sequence and summed over the batch in
PyTorch.

Accumulation is in float32 (float64 when an input is float64, for tests). Runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

try:  # triton: needed only when a kernel of this file runs
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(f"{__name__} holds Triton kernels and needs the `triton` package") from error

from ..triton_utils import acc, silu, softplus

__all__ = ["SelectiveScanTritonFn", "selective_scan_triton"]

# Tile sizes (not tuned on hardware yet): the 3-D scan tiles hold BLOCK_D * state * BLOCK_L elements per
# tensor. BLOCK_L (the chunk, ``chunk_size``, default CHUNK_SIZE) is shared by both passes: the backward
# restarts from the states the forward stored at chunk boundaries.
FWD_BLOCK_D, FWD_WARPS = 16, 8
BWD_BLOCK_D, BWD_WARPS = 8, 8
CHUNK_SIZE = 32


@triton.jit
def _combine(a1, b1, a2, b2):
    """Composition of two affine maps ``h -> a h + b``: first ``(a1, b1)``, then ``(a2, b2)``."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _selective_scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, h0_ptr,
    y_ptr, hlast_ptr, hchunk_ptr,
    s_u_b, s_u_d, s_u_l,
    s_dt_b, s_dt_d, s_dt_l,
    s_A_d, s_A_n,
    s_B_b, s_B_n, s_B_l,
    s_C_b, s_C_n, s_C_l,
    s_z_b, s_z_d, s_z_l,
    dim, length, nstate, n_chunks,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_CHUNKS: tl.constexpr, USE_FP64: tl.constexpr,
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
    if HAS_D:
        Dv = acc(tl.load(D_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
    if HAS_BIAS:
        bias = acc(tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
    # states are (batch, [chunk,] dim, state), contiguous
    state_offs = offs_d[:, None] * nstate + offs_n[None, :]
    if HAS_H0:
        h = acc(tl.load(h0_ptr + pid_b * dim * nstate + state_offs, mask=mask_dn, other=0.0), USE_FP64)
    else:
        h = acc(tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32), USE_FP64)

    for c in range(n_chunks):
        offs_l = c * BLOCK_L + offs_t
        mask_l = offs_l < length
        mask_dl = mask_d[:, None] & mask_l[None, :]
        mask_nl = mask_n[:, None] & mask_l[None, :]
        dt = acc(tl.load(delta_ptr + pid_b * s_dt_b + offs_d[:, None] * s_dt_d + offs_l[None, :] * s_dt_l,
                          mask=mask_dl, other=0.0), USE_FP64)
        if HAS_BIAS:
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
        b = (dt * u)[:, None, :] * Bt[None, :, :]
        a_cum, h_loc = tl.associative_scan((a, b), axis=2, combine_fn=_combine)
        hs = h_loc + a_cum * h[:, :, None]
        y = tl.sum(hs * Ct[None, :, :], axis=1)  # eq. 2b
        if HAS_D:
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
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, hchunk_ptr, dy_ptr, dlast_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dh0_ptr,
    s_u_b, s_u_d, s_u_l,
    s_dt_b, s_dt_d, s_dt_l,
    s_A_d, s_A_n,
    s_B_b, s_B_n, s_B_l,
    s_C_b, s_C_n, s_C_l,
    s_z_b, s_z_d, s_z_l,
    s_dy_b, s_dy_d, s_dy_l,
    dim, length, nstate, n_chunks,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_DLAST: tl.constexpr, USE_FP64: tl.constexpr,
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
    if HAS_D:
        Dv = acc(tl.load(D_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
    if HAS_BIAS:
        bias = acc(tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
    state_offs = offs_d[:, None] * nstate + offs_n[None, :]
    # adjoint of the state after the current chunk's last position (carried from the next chunk)
    if HAS_DLAST:
        g_carry = acc(tl.load(dlast_ptr + pid_b * dim * nstate + state_offs, mask=mask_dn, other=0.0), USE_FP64)
    else:
        g_carry = acc(tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32), USE_FP64)
    dA_acc = g_carry * 0.0
    dh0 = g_carry * 0.0
    if HAS_D:
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
        if HAS_BIAS:
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
        if HAS_BIAS:
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
        b_p = tl.where(first, entry[:, :, None], (dt_p * u_p)[:, None, :] * B_p[None, :, :])
        _, h_prev = tl.associative_scan((a_p, b_p), axis=2, combine_fn=_combine)
        a = tl.exp(dt[:, None, :] * A[:, :, None])
        h = a * h_prev + (dt * u)[:, None, :] * Bt[None, :, :]

        # 2. output gate and skip
        if HAS_Z:
            z = acc(tl.load(z_ptr + pid_b * s_z_b + offs_d[:, None] * s_z_d + offs_l[None, :] * s_z_l,
                             mask=mask_dl, other=0.0), USE_FP64)
            y = tl.sum(h * Ct[None, :, :], axis=1)
            if HAS_D:
                y += Dv[:, None] * u
            sig = tl.sigmoid(z)
            dz = dy * y * sig * (1.0 + z * (1.0 - sig))
            tl.store(dz_ptr + pid_b * dim * length + io_dl, dz, mask=mask_dl)
            gy = dy * z * sig
        else:
            gy = dy
        if HAS_D:
            dD_acc += tl.sum(gy * u, axis=1)

        # adjoint: reverse scan over (exp(dt_{t+1} A), C_t gy_t), started from the carried adjoint
        offs_q = offs_l + 1
        mask_qdl = mask_d[:, None] & (offs_q < length)[None, :]
        dt_q = acc(tl.load(delta_ptr + pid_b * s_dt_b + offs_d[:, None] * s_dt_d + offs_q[None, :] * s_dt_l,
                            mask=mask_qdl, other=0.0), USE_FP64)
        if HAS_BIAS:
            dt_q += bias[:, None]
        if SOFTPLUS:
            dt_q = softplus(dt_q)
        dt_q = tl.where(mask_qdl, dt_q, 0.0)
        a_q = tl.exp(dt_q[:, None, :] * A[:, :, None])
        a_cum, g_loc = tl.associative_scan((a_q, Ct[None, :, :] * gy[:, None, :]), axis=2, combine_fn=_combine,
                                           reverse=True)
        g = g_loc + a_cum * g_carry[:, :, None]  # dL/dh_t

        # 3. gradients
        X = g * a * h_prev  # dL/d(dt_t A)
        gB = tl.sum(g * Bt[None, :, :], axis=1)  # sum_n g_t B_t
        ddt = tl.sum(X * A[:, :, None], axis=1) + gB * u
        du = gB * dt
        if HAS_D:
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
    if HAS_D:
        tl.store(dD_ptr + pid_b * dim + offs_d, dD_acc, mask=mask_d)


def _strides3(t):
    return (t.stride(0), t.stride(1), t.stride(2)) if t is not None else (0, 0, 0)


class SelectiveScanTritonFn(torch.autograd.Function):
    """Autograd wrapper of the fused kernels: ``(u, delta, A, B, C, D, z, delta_bias, initial_state) ->
    (y, last_state)``; see :func:`selective_scan_triton` for shapes. The forward pass saves the inputs and the
    chunk entry states (only when an input needs a gradient); the backward pass recomputes the rest."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, block_l):
        batch, dim, length = u.shape
        nstate = A.shape[1]
        # the kernels index these (dim,) and (batch, dim, state) tensors as contiguous
        D = None if D is None else D.contiguous()
        delta_bias = None if delta_bias is None else delta_bias.contiguous()
        use_fp64 = any(t is not None and t.dtype == torch.float64 for t in (u, delta, A, B, C, D, z, delta_bias,
                                                                           initial_state))
        sdtype = torch.float64 if use_fp64 else torch.float32
        block_d = min(FWD_BLOCK_D, triton.next_power_of_2(dim))
        n_chunks = triton.cdiv(length, block_l)
        store_chunks = any(ctx.needs_input_grad[:9])
        y = torch.empty(batch, dim, length, dtype=u.dtype, device=u.device)
        last_state = torch.empty(batch, dim, nstate, dtype=sdtype, device=u.device)
        h_chunks = torch.empty(batch, n_chunks if store_chunks else 1, dim, nstate, dtype=sdtype, device=u.device)
        h0 = None if initial_state is None else initial_state.to(sdtype).contiguous()
        grid = (batch, triton.cdiv(dim, block_d))
        _selective_scan_fwd_kernel[grid](
            u, delta, A, B, C, D, z, delta_bias, h0, y, last_state, h_chunks,
            *_strides3(u), *_strides3(delta), A.stride(0), A.stride(1), *_strides3(B), *_strides3(C), *_strides3(z),
            dim, length, nstate, n_chunks,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=bool(delta_softplus),
            HAS_H0=h0 is not None, STORE_CHUNKS=store_chunks, USE_FP64=use_fp64,
            BLOCK_D=block_d, BLOCK_L=block_l, BLOCK_N=triton.next_power_of_2(nstate), num_warps=FWD_WARPS,
        )
        if store_chunks:
            ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, h_chunks)
            ctx.delta_softplus = bool(delta_softplus)
            ctx.block_l = block_l
            ctx.use_fp64 = use_fp64
        return y, last_state

    @staticmethod
    def backward(ctx, dy, dlast):
        u, delta, A, B, C, D, z, delta_bias, initial_state, h_chunks = ctx.saved_tensors
        batch, dim, length = u.shape
        nstate = A.shape[1]
        n_chunks = h_chunks.shape[1]
        block_d = min(BWD_BLOCK_D, triton.next_power_of_2(dim))
        n_dblocks = triton.cdiv(dim, block_d)
        gdtype = torch.float64 if ctx.use_fp64 else torch.float32
        kw = dict(dtype=gdtype, device=u.device)
        if dy is None:
            dy = torch.zeros(batch, dim, length, **kw)
        du = torch.empty(batch, dim, length, **kw)
        ddelta = torch.empty(batch, dim, length, **kw)
        dz = torch.empty(batch, dim, length, **kw) if z is not None else None
        dB = torch.zeros(batch, nstate, length, **kw)
        dC = torch.zeros(batch, nstate, length, **kw)
        dA = torch.empty(batch, dim, nstate, **kw)
        dD = torch.empty(batch, dim, **kw) if D is not None else None
        dh0 = torch.empty(batch, dim, nstate, **kw)
        dlast = None if dlast is None else dlast.to(gdtype).contiguous()
        _selective_scan_bwd_kernel[(batch, n_dblocks)](
            u, delta, A, B, C, D, z, delta_bias, h_chunks, dy, dlast,
            du, ddelta, dz, dB, dC, dA, dD, dh0,
            *_strides3(u), *_strides3(delta), A.stride(0), A.stride(1), *_strides3(B), *_strides3(C), *_strides3(z),
            *_strides3(dy),
            dim, length, nstate, n_chunks,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=ctx.delta_softplus,
            HAS_DLAST=dlast is not None, USE_FP64=ctx.use_fp64,
            BLOCK_D=block_d, BLOCK_L=ctx.block_l, BLOCK_N=triton.next_power_of_2(nstate), num_warps=BWD_WARPS,
        )

        def cast(g, like):
            return None if like is None or g is None else g.to(like.dtype)

        return (
            cast(du, u), cast(ddelta, delta), cast(dA.sum(0), A), cast(dB, B), cast(dC, C),
            cast(None if dD is None else dD.sum(0), D), cast(dz, z),
            cast(None if delta_bias is None else ddelta.sum((0, 2)), delta_bias),
            cast(dh0, initial_state), None, None,
        )


def selective_scan_triton(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                          initial_state=None, return_last_state=False, chunk_size=CHUNK_SIZE):
    """Fused Triton selective scan (Mamba paper Algorithm 2, kernel of §3.3.2 / App. D), differentiable.

    Args and returns as :func:`hf_densessm.ops.selective_scan` (which checks the arguments and should be
    called instead): ``u, delta, z`` (batch, dim, length) and ``B, C`` (batch, state, length) in float32,
    bfloat16 or float16 (float64 for tests), any strides; ``A`` (dim, state); ``D, delta_bias`` (dim,);
    ``initial_state`` (batch, dim, state). ``y`` comes back in ``u``'s dtype, ``last_state`` in float32
    (float64 for float64 inputs). ``chunk_size``: tokens per chunk of the in-register scan (a power of 2);
    it changes speed and register use only.
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of 2, got {chunk_size}")
    y, last_state = SelectiveScanTritonFn.apply(
        u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, chunk_size
    )
    return (y, last_state) if return_last_state else y
