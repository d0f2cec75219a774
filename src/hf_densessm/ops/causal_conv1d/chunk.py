"""Fused Triton causal depthwise convolution (Mamba paper §3.4), token-major, one launch each way: the kernels of
``hf_densessm::causal_conv1d`` / ``_backward``. How they work, tiles, cost: docs/kernels.md, "Causal convolution".
"""

from __future__ import annotations

import torch

from ..backend import compute_dtype
from ..triton_utils import launch, tl, triton  # raises ImportError without triton

__all__ = ["causal_conv1d_triton_bwd", "causal_conv1d_triton_fwd"]

LOG2E = tl.constexpr(1.4426950408889634)

# ------------------------------------------------------------------------------------------------ device code
# ``xs``: the inputs of the last K - 1 tokens, newest first, so tap K - 1 - s of token t reads ``xs[s - 1]``, where
# the token's position in its document ``pos >= s``. A scalar condition joins a channel mask as ``tl.where(cond,
# mask_c, False)``: ``mask_c & cond`` is an int32 array under triton 3.9's interpreter, which refuses it as a mask.


@triton.jit
def _push(xs, new, N: tl.constexpr):
    """``(new, xs[0], ..., xs[N - 2])``: the newest ``N`` values after ``new``, newest first."""
    out = ()
    for s in tl.static_range(N):
        out = out + ((new,) if s == 0 else (xs[s - 1],))
    return out


@triton.jit
def _zeros(like, N: tl.constexpr):
    """``N`` zero vectors shaped as ``like``."""
    out = ()
    for s in tl.static_range(N):
        out = out + (tl.zeros(like.shape, like.dtype),)
    return out


@triton.jit
def _fma(acc, a, b, pos, s: tl.constexpr, HAS_RESET: tl.constexpr):
    """``acc + a b`` where tap distance ``s`` stays in the token's document (``pos >= s``), else ``acc``."""
    out = acc + a * b
    return tl.where(pos >= s, out, acc) if HAS_RESET else out


@triton.jit
def _token(x_ptrs, reset_ptr, r_off, s_x_l, s_r_l, i, inside, pos, mask_c, K: tl.constexpr,
           HAS_RESET: tl.constexpr, ACC: tl.constexpr):
    """Token ``i`` of the block (``inside`` the sequence, else zeros): its input, and its position in its document
    ``pos`` (at most ``K``) from the previous token's."""
    if HAS_RESET:
        r = tl.load(reset_ptr + r_off + i * s_r_l, mask=inside, other=0) != 0
        pos = tl.where(r, 0, tl.minimum(pos + 1, K))
    return tl.load(x_ptrs + i * s_x_l, mask=tl.where(inside, mask_c, False), other=0.0).to(ACC), pos


@triton.jit
def _sigmoid(x):
    """``1 / (1 + 2^(-x log2(e)))``, in float32 by ``div.approx`` (exact limits, 2 ulp; docs/kernels.md)."""
    if x.dtype == tl.float32:
        return tl.fdiv(1.0, 1.0 + tl.exp2(x * -LOG2E), approx=True)
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _pre(ws, xs, xt, bias, pos, K: tl.constexpr, HAS_RESET: tl.constexpr):
    """``bias + sum_s w_{K-1-s} x_{t-s}`` over the taps in the token's document."""
    pre = bias + ws[K - 1] * xt
    for s in tl.static_range(1, K):
        pre = _fma(pre, ws[K - 1 - s], xs[s - 1], pos, s, HAS_RESET)
    return pre


@triton.jit
def _setup(x_ptr, w_ptr, bias_ptr, win_ptr, reset_ptr, s_x_b, s_x_l, s_x_c, s_w_c, s_w_k, s_win_b, s_win_c,
           s_win_k, s_r_b, s_r_l, length, channels, K: tl.constexpr, HAS_BIAS: tl.constexpr,
           HAS_WINDOW: tl.constexpr, HAS_RESET: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
           BLOCK_C: tl.constexpr):
    """The program's channels, taps, bias and block offsets, with ``xs`` / ``pos`` after the ``K - 1`` tokens
    before the block (before token 0: the window's newest inputs, or zeros, and no document start)."""
    pid_b = tl.program_id(0) // tl.cdiv(length, BLOCK_T)
    t0 = (tl.program_id(0) - pid_b * tl.cdiv(length, BLOCK_T)) * BLOCK_T
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < channels
    ws = ()
    for k in tl.static_range(K):
        ws = ws + (tl.load(w_ptr + offs_c * s_w_c + k * s_w_k, mask=mask_c, other=0.0).to(ACC),)
    bias = tl.zeros((BLOCK_C,), ACC)
    if HAS_BIAS:
        bias += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(ACC)
    x_ptrs = x_ptr + pid_b.to(tl.int64) * s_x_b + t0.to(tl.int64) * s_x_l + offs_c * s_x_c
    r_off = pid_b.to(tl.int64) * s_r_b + t0.to(tl.int64) * s_r_l  # the block's first reset flag
    xs = _zeros(bias, K - 1)
    pos = t0 * 0 + K
    for j in tl.static_range(1 - K, 0):
        inside = (t0 + j >= 0) & (t0 + j < length)
        xt, pos = _token(x_ptrs, reset_ptr, r_off, s_x_l, s_r_l, j, inside, pos, mask_c, K, HAS_RESET, ACC)
        if HAS_WINDOW:  # before token 0: the window's column K + p
            xt += tl.load(win_ptr + pid_b * s_win_b + offs_c * s_win_c + (K + t0 + j) * s_win_k,
                          mask=tl.where(t0 + j < 0, mask_c, False), other=0.0).to(ACC)
        xs = _push(xs, xt, K - 1)
    return t0, pid_b, offs_c, mask_c, ws, bias, x_ptrs, r_off, xs, pos


@triton.jit
def _causal_conv1d_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, win_ptr, reset_ptr, out_ptr,
    s_x_b, s_x_l, s_x_c, s_w_c, s_w_k, s_win_b, s_win_c, s_win_k, s_r_b, s_r_l,
    length, channels,
    K: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_RESET: tl.constexpr,
    ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
):
    """Grid (batch x token blocks, channel blocks): ``out_t = act(pre_t)`` for the block's tokens, ``out``
    ``(batch, length, channels)`` contiguous."""
    t0, pid_b, offs_c, mask_c, ws, bias, x_ptrs, r_off, xs, pos = _setup(
        x_ptr, w_ptr, bias_ptr, win_ptr, reset_ptr, s_x_b, s_x_l, s_x_c, s_w_c, s_w_k, s_win_b, s_win_c, s_win_k,
        s_r_b, s_r_l, length, channels, K, HAS_BIAS, HAS_WINDOW, HAS_RESET, ACC, BLOCK_T, BLOCK_C)
    out_ptrs = out_ptr + (pid_b.to(tl.int64) * length + t0) * channels + offs_c
    rem = length - t0
    for i0 in range(0, tl.minimum(rem, BLOCK_T), UNROLL):
        for u in tl.static_range(UNROLL):
            i = i0 + u
            xt, pos = _token(x_ptrs, reset_ptr, r_off, s_x_l, s_r_l, i, i < rem, pos, mask_c, K, HAS_RESET, ACC)
            pre = _pre(ws, xs, xt, bias, pos, K, HAS_RESET)
            if SILU:
                pre = pre * _sigmoid(pre)
            tl.store(out_ptrs + i * channels, pre, mask=tl.where(i < rem, mask_c, False))
            xs = _push(xs, xt, K - 1)


@triton.jit
def _backward_token(block, i, walk, K: tl.constexpr, SILU: tl.constexpr, HAS_RESET: tl.constexpr, ACC: tl.constexpr,
                    SUMS: tl.constexpr):
    """Token ``t = t0 + i`` of the backward walk (``walk``: ``(xs, pos, accs, dws, dbias)``): ``g_t = dL/dpre_t``
    (``pre`` recomputed) added to the partial gradients ``accs`` of ``x_{t-1} .. x_{t-K+1}`` (same document) and,
    with ``SUMS`` (the block's own tokens), to the sums ``dws`` (``sum_t g_t x_{t-s}``, ``s = 0 .. K - 1``) and
    ``dbias``. Returns the walk for the next token and the complete gradient of ``x_{t-K+1}``."""
    x_ptrs, g_ptrs, reset_ptr, r_off, s_x_l, s_g_l, s_r_l, rem, ws, bias, mask_c = block
    xs, pos, accs, dws, dbias = walk
    xt, pos = _token(x_ptrs, reset_ptr, r_off, s_x_l, s_r_l, i, i < rem, pos, mask_c, K, HAS_RESET, ACC)
    g = tl.load(g_ptrs + i * s_g_l, mask=tl.where(i < rem, mask_c, False), other=0.0).to(ACC)
    if SILU:
        pre = _pre(ws, xs, xt, bias, pos, K, HAS_RESET)
        sig = _sigmoid(pre)
        g = g * sig * (1.0 + pre * (1.0 - sig))
    new, d = (), (dws[0] + g * xt,)
    for s in tl.static_range(1, K):
        new = new + (_fma(accs[s - 1], ws[K - 1 - s], g, pos, s, HAS_RESET),)
        d = d + (_fma(dws[s], g, xs[s - 1], pos, s, HAS_RESET),)
    done = new[K - 2] if K > 1 else ws[K - 1] * g
    if SUMS:
        dws, dbias = d, dbias + g
    return (_push(xs, xt, K - 1), pos, _push(new, ws[K - 1] * g, K - 1), dws, dbias), done


@triton.jit
def _causal_conv1d_bwd_kernel(
    x_ptr, w_ptr, bias_ptr, win_ptr, reset_ptr, g_ptr, dx_ptr, dwin_ptr, dw_ptr, db_ptr,
    s_x_b, s_x_l, s_x_c, s_w_c, s_w_k, s_win_b, s_win_c, s_win_k, s_r_b, s_r_l, s_g_b, s_g_l, s_g_c,
    length, channels,
    K: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_RESET: tl.constexpr,
    ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
):
    """Grid as the forward's: walks the block's tokens and ``K - 1`` more (docs/kernels.md); the gradient of
    ``x_{t-K+1}`` is complete at token ``t``, stored into ``dx`` ``(batch, length, channels)`` or, before token 0,
    columns ``1 .. K - 1`` of ``dwin`` ``(batch, channels, K)``. The block's sums for the taps and the bias go to
    ``dw`` ``(batch x token blocks, channels, K)`` and ``db`` ``(batch x token blocks, channels)``, contiguous."""
    t0, pid_b, offs_c, mask_c, ws, bias, x_ptrs, r_off, xs, pos = _setup(
        x_ptr, w_ptr, bias_ptr, win_ptr, reset_ptr, s_x_b, s_x_l, s_x_c, s_w_c, s_w_k, s_win_b, s_win_c, s_win_k,
        s_r_b, s_r_l, length, channels, K, HAS_BIAS, HAS_WINDOW, HAS_RESET, ACC, BLOCK_T, BLOCK_C)
    g_ptrs = g_ptr + pid_b.to(tl.int64) * s_g_b + t0.to(tl.int64) * s_g_l + offs_c * s_g_c
    dx_ptrs = dx_ptr + (pid_b.to(tl.int64) * length + t0 - (K - 1)) * channels + offs_c  # row i: input i - (K - 1)
    rem = length - t0
    own = tl.minimum(rem, BLOCK_T)
    n = own + K - 1  # rows of dx_ptrs in the block
    block = (x_ptrs, g_ptrs, reset_ptr, r_off, s_x_l, s_g_l, s_r_l, rem, ws, bias, mask_c)
    walk = (xs, pos, _zeros(bias, K - 1), _zeros(bias, K), tl.zeros((BLOCK_C,), ACC))
    HEAD: tl.constexpr = (K - 2 + UNROLL) // UNROLL * UNROLL  # the tokens completing inputs before the block
    for j in tl.static_range(HEAD):
        walk, done = _backward_token(block, j, walk, K, SILU, HAS_RESET, ACC, j < BLOCK_T)
        if j >= K - 1:
            tl.store(dx_ptrs + j * channels, done, mask=tl.where(j < n, mask_c, False))
        elif HAS_WINDOW:
            if t0 == 0:
                tl.store(dwin_ptr + (pid_b * channels + offs_c) * K + 1 + j, done, mask=mask_c)
    end = tl.maximum(tl.cdiv(own, UNROLL) * UNROLL, HEAD)
    for i0 in range(HEAD, end, UNROLL):  # no token past the block's end but past the sequence's (g = 0)
        for u in tl.static_range(UNROLL):
            i = i0 + u
            walk, done = _backward_token(block, i, walk, K, SILU, HAS_RESET, ACC, True)
            tl.store(dx_ptrs + i * channels, done, mask=tl.where(i < n, mask_c, False))
    for u in tl.static_range(K - 1):  # the tokens after the block complete its last inputs
        walk, done = _backward_token(block, end + u, walk, K, SILU, HAS_RESET, ACC, False)
        tl.store(dx_ptrs + (end + u) * channels, done, mask=tl.where(end + u < n, mask_c, False))
    row, dws, dbias = tl.program_id(0) * channels + offs_c, walk[3], walk[4]
    for s in tl.static_range(K):
        tl.store(dw_ptr + row * K + K - 1 - s, dws[s], mask=mask_c)
    if HAS_BIAS:
        tl.store(db_ptr + row, dbias, mask=mask_c)


# ------------------------------------------------------------------------------------------------- launches


def _launch_args(x, taps, bias, window, reset, block_t, per_thread, unroll):
    """Grid, the arguments shared by both kernels, and the tiles: ``per_thread`` channels per thread, up to 4 warps
    of them per program, ``block_t`` tokens walked ``unroll`` at a time."""
    batch, length, channels = x.shape
    block_c = min(32 * per_thread * 4, triton.next_power_of_2(channels))
    grid = (batch * triton.cdiv(length, block_t), triton.cdiv(channels, block_c))
    args = (x, taps, bias, window, reset)
    strides = (*x.stride(), *taps.stride(), *(window.stride() if window is not None else (0, 0, 0)),
               *(reset.stride() if reset is not None else (0, 0)))
    flags = dict(K=taps.shape[1], HAS_BIAS=bias is not None, HAS_WINDOW=window is not None,
                 HAS_RESET=reset is not None, ACC=tl.float64 if compute_dtype(x.dtype) == torch.float64 else tl.float32,
                 BLOCK_T=block_t, BLOCK_C=block_c, UNROLL=min(unroll, block_t),
                 num_warps=max(1, min(4, block_c // (32 * per_thread))), num_stages=1)
    return grid, args, strides, flags


def causal_conv1d_triton_fwd(x, taps, bias=None, window=None, reset=None, silu=False, block_t=32):
    """The Triton body of ``hf_densessm::causal_conv1d``, no checks (:func:`_causal_conv1d_fwd_kernel`): arguments
    and result as :func:`~.torch_path.causal_conv1d_torch` (``x`` any strides: channel stride 1 reads 16-byte
    vectors), plus ``block_t``, tokens per program, a power of 2."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        grid, args, strides, flags = _launch_args(x, taps, bias, window, reset, block_t, 16 // x.element_size(), 8)
        launch(_causal_conv1d_fwd_kernel)[grid](*args, out, *strides, *x.shape[1:], SILU=silu, **flags)
    return out


def causal_conv1d_triton_bwd(grad_out, x, taps, bias=None, window=None, reset=None, silu=False, block_t=32):
    """The Triton body of ``hf_densessm::causal_conv1d_backward``: :func:`_causal_conv1d_bwd_kernel`, then the sum
    of its per-block partial sums (deterministic: no atomics). ``grad_out`` ``(batch, seq_len, channels)``, any
    strides, the rest as :func:`causal_conv1d_triton_fwd`; returns as :func:`~.torch_path.causal_conv1d_backward_torch`.
    """
    batch, length, channels = x.shape
    cdt = compute_dtype(x.dtype)
    grad_x = torch.empty((batch, length, channels), dtype=x.dtype, device=x.device)
    grid, args, strides, flags = _launch_args(x, taps, bias, window, reset, block_t, min(4, 16 // x.element_size()), 4)
    dw = torch.empty((grid[0], channels, taps.shape[1]), dtype=cdt, device=x.device)
    db = None if bias is None else torch.empty((grid[0], channels), dtype=cdt, device=x.device)
    grad_window = x.new_empty((0,)) if window is None else x.new_zeros(window.shape, dtype=window.dtype)
    if grad_x.numel():
        launch(_causal_conv1d_bwd_kernel)[grid](*args, grad_out, grad_x, None if window is None else grad_window,
                                                dw, db, *strides, *grad_out.stride(), length, channels, SILU=silu,
                                                **flags)
    grad_bias = x.new_empty((0,)) if bias is None else db.sum(0).to(bias.dtype)
    return grad_x, dw.sum(0).to(taps.dtype), grad_bias, grad_window
