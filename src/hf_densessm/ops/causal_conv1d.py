"""Mamba's causal depthwise convolution (Mamba paper §3.4, Fig. 3: the short convolution before the SSM), with the
optional SiLU, in token-major memory order: the compiled CPU kernel and its PyTorch path.

``out_t = act(bias + sum_k weight[:, k] * x_{t - (kernel - 1) + k})``: ``nn.Conv1d(groups=channels)`` with
``kernel - 1`` zeros (or a cached window) on the left, as ``F.conv1d``. Packed documents (``reset``): tap ``k`` of
token ``t`` reads ``x_{t - (kernel - 1 - k)}`` only when that token lies in ``t``'s document.

Why token-major and why a kernel: the block's projections produce ``(batch, seq_len, channels)`` tensors, and
``F.conv1d`` wants channels first; on the CPU the two transposes and a backward in mixed layouts cost several times
the convolution. The PyTorch path (:func:`causal_conv1d_torch`) is ``kernel`` multiply-adds of shifted views of one
padded copy; its backward (autograd) still makes about 15 passes over ``(batch, seq_len, channels)`` tensors. The
kernel (C, :mod:`.cpu_build`, ``W`` channels per vector) makes one pass forward and two backward (the activation's
gradient, then the taps), with the taps' and bias' gradients summed per channel group by the worker that owns it.
"""

from __future__ import annotations

import ctypes
from string import Template

import torch
import torch.nn.functional as F

from .backend import resolve_backend
from .cpu_build import load_library, per_worker, run_job, vector_source, worker_count
from .packing import check_reset, document_positions

__all__ = ["causal_conv1d", "causal_conv1d_torch"]

_ACTIVATIONS = (None, "silu")

_HEADER = r"""
typedef struct {
    int64_t batch, length, dim, kernel, silu;
    const void *x, *w, *bias, *window, *pos, *gout;
    int64_t x_sb, x_st, g_sb, g_st;
    void *out, *dx, *dw, *dbias;
} conv_args;
"""

_BODY = Template(r"""
/* Pre-activation of token t for the channel group at d0: bias + sum_k w_k x_{t-(K-1)+k}, the window's inputs
   before the sequence, taps outside t's document (pos) skipped. */
static inline vec$sfx conv_pre$sfx(const conv_args *a, const vec$sfx *wv, vec$sfx bv, int64_t b, int64_t t,
                                   int64_t d0, int64_t nl) {
    const $real *x = a->x, *window = a->window;
    const int64_t *pos = a->pos;
    const int64_t K = a->kernel, dim = a->dim;
    vec$sfx acc = bv;
    for (int64_t k = 0; k < K; k++) {
        const int64_t back = K - 1 - k, p = t - back;
        if (pos && pos[b * a->length + t] < back) continue;
        if (p >= 0) acc += wv[k] * vld$sfx(x + b * a->x_sb + p * a->x_st + d0, nl);
        else if (window) acc += wv[k] * vlds$sfx(window + (b * dim + d0) * K + K + p, K, nl);
    }
    return acc;
}

/* Loops: token outer, channel groups inner (a worker's groups of one token are contiguous in memory: one page
   visit per token instead of one per group and token). */
void conv_fwd$sfx(const conv_args *a, int64_t g0, int64_t g1) {
    const int64_t K = a->kernel, dim = a->dim, L = a->length, ng = g1 - g0;
    const $real *w = a->w, *bias = a->bias;
    $real *out = a->out;
    vec$sfx wv[ng][K], bv[ng];
    for (int64_t g = g0; g < g1; g++) {
        const int64_t d0 = g * $W, nl = dim - d0 < $W ? dim - d0 : $W;
        for (int64_t k = 0; k < K; k++) wv[g - g0][k] = vlds$sfx(w + d0 * K + k, K, nl);
        bv[g - g0] = bias ? vld$sfx(bias + d0, nl) : ZERO$sfx;
    }
    for (int64_t b = 0; b < a->batch; b++)
        for (int64_t t = 0; t < L; t++)
            for (int64_t g = g0; g < g1; g++) {
                const int64_t d0 = g * $W, nl = dim - d0 < $W ? dim - d0 : $W;
                vec$sfx v = conv_pre$sfx(a, wv[g - g0], bv[g - g0], b, t, d0, nl);
                if (a->silu) v = v * vsigmoid$sfx(v);
                vst$sfx(out + (b * L + t) * dim + d0, v, nl);
            }
}

/* dx (batch, L, dim) written; dw (dim, K) and dbias (dim) written for the groups [g0, g1). One pass over the
   tokens: the pre-activation's gradient of token t goes into a ring of K per group, and dx of token t - (K - 1),
   whose later readers are then all known, is written. work: (g1 - g0) * K vectors. */
void conv_bwd$sfx(const conv_args *a, int64_t g0, int64_t g1, vec$sfx *work) {
    const int64_t K = a->kernel, dim = a->dim, L = a->length, ng = g1 - g0;
    const $real *w = a->w, *bias = a->bias, *x = a->x, *window = a->window, *gout = a->gout;
    const int64_t *pos = a->pos;
    $real *dx = a->dx, *dw = a->dw, *dbias = a->dbias;
    vec$sfx wv[ng][K], dwv[ng][K], bv[ng], dbv[ng];
    for (int64_t g = g0; g < g1; g++) {
        const int64_t d0 = g * $W, nl = dim - d0 < $W ? dim - d0 : $W;
        for (int64_t k = 0; k < K; k++) { wv[g - g0][k] = vlds$sfx(w + d0 * K + k, K, nl); dwv[g - g0][k] = ZERO$sfx; }
        bv[g - g0] = bias ? vld$sfx(bias + d0, nl) : ZERO$sfx;
        dbv[g - g0] = ZERO$sfx;
    }
    for (int64_t b = 0; b < a->batch; b++)
        for (int64_t t = 0; t < L + K - 1; t++)
            for (int64_t g = g0; g < g1; g++) {
                const int64_t i = g - g0, d0 = g * $W, nl = dim - d0 < $W ? dim - d0 : $W;
                vec$sfx *ring = work + i * K;
                if (t < L) {  /* gradient of token t's pre-activation; the taps' and the bias' gradients */
                    vec$sfx gp = vld$sfx(gout + b * a->g_sb + t * a->g_st + d0, nl);
                    if (a->silu) {
                        const vec$sfx v = conv_pre$sfx(a, wv[i], bv[i], b, t, d0, nl), s = vsigmoid$sfx(v);
                        gp = gp * s * (($real)1 + v * (($real)1 - s));
                    }
                    ring[t % K] = gp;
                    dbv[i] += gp;
                    for (int64_t k = 0; k < K; k++) {
                        const int64_t back = K - 1 - k, p = t - back;
                        if (pos && pos[b * L + t] < back) continue;
                        if (p >= 0) dwv[i][k] += gp * vld$sfx(x + b * a->x_sb + p * a->x_st + d0, nl);
                        else if (window) dwv[i][k] += gp * vlds$sfx(window + (b * dim + d0) * K + K + p, K, nl);
                    }
                }
                const int64_t p = t - (K - 1);  /* dx_p = sum_k w_k gpre_{p + K-1-k}, readers inside p's document */
                if (p >= 0) {
                    vec$sfx acc = ZERO$sfx;
                    for (int64_t k = 0; k < K; k++) {
                        const int64_t back = K - 1 - k, r = p + back;
                        if (r >= L || (pos && pos[b * L + r] < back)) continue;
                        acc += wv[i][k] * ring[r % K];
                    }
                    vst$sfx(dx + (b * L + p) * dim + d0, acc, nl);
                }
            }
    for (int64_t g = g0; g < g1; g++) {
        const int64_t d0 = g * $W, nl = dim - d0 < $W ? dim - d0 : $W;
        for (int64_t k = 0; k < K; k++) vsts$sfx(dw + d0 * K + k, K, dwv[g - g0][k], nl);
        if (dbias) vst$sfx(dbias + d0, dbv[g - g0], nl);
    }
}

/* Jobs of cpu_build.run_job over channel groups [g0, g1). fwd args: the conv_args. bwd args: the conv_args, then
   worker 0's work buffer and the per-worker stride in bytes. */
void conv_fwd_job$sfx(int64_t w, int64_t g0, int64_t g1, const int64_t *args) {
    (void)w;
    conv_fwd$sfx((const conv_args *)(intptr_t)args[0], g0, g1);
}
void conv_bwd_job$sfx(int64_t w, int64_t g0, int64_t g1, const int64_t *args) {
    conv_bwd$sfx((const conv_args *)(intptr_t)args[0], g0, g1, (vec$sfx *)((char *)(intptr_t)args[1] + w * args[2]));
}
""")

SOURCE = vector_source(_HEADER, _BODY)


class _ConvArgs(ctypes.Structure):
    _fields_ = (
        [(n, ctypes.c_int64) for n in ("batch", "length", "dim", "kernel", "silu")]
        + [(n, ctypes.c_void_p) for n in ("x", "w", "bias", "window", "pos", "gout")]
        + [(n, ctypes.c_int64) for n in ("x_sb", "x_st", "g_sb", "g_st")]
        + [(n, ctypes.c_void_p) for n in ("out", "dx", "dw", "dbias")]
    )


def _library():
    return load_library("causal_conv1d", SOURCE)


def causal_conv1d_torch(x, weight, bias=None, window=None, reset=None, activation=None) -> torch.Tensor:
    """The PyTorch path of :func:`causal_conv1d` (same arguments, no checks): ``kernel`` multiply-adds of shifted
    views of one padded copy of ``x``, in ``x``'s order; with ``reset``, each tap masked to its document."""
    kernel, length = weight.shape[-1], x.shape[1]
    taps = weight.reshape(weight.shape[0], kernel).to(x.dtype)
    if window is not None:
        context = window[..., 1:].transpose(1, 2).to(x.dtype)
    else:
        context = x.new_zeros(x.shape[0], kernel - 1, x.shape[2])
    padded = torch.cat([context, x], dim=1)  # (batch, kernel - 1 + seq_len, channels)
    position = None if reset is None else document_positions(reset)
    out = padded[:, kernel - 1 :] * taps[:, kernel - 1]
    if bias is not None:
        out = out + bias.to(x.dtype)
    for k in range(kernel - 1):
        tap = padded[:, k : k + length] * taps[:, k]
        if position is not None:  # tap k reads the token kernel - 1 - k back: only inside the document
            tap = tap * (position >= kernel - 1 - k).to(x.dtype)[..., None]
        out = out + tap
    return F.silu(out) if activation == "silu" else out


def _token_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype and x.stride(2) == 1 else x.to(dtype).contiguous()


def _kernel_args(x, taps, bias, window, position, activation) -> tuple[_ConvArgs, list]:
    batch, length, dim = x.shape
    alive = [x, taps, bias, window, position]
    args = _ConvArgs(
        batch=batch, length=length, dim=dim, kernel=taps.shape[1], silu=int(activation == "silu"),
        x=x.data_ptr(), w=taps.data_ptr(), bias=None if bias is None else bias.data_ptr(),
        window=None if window is None else window.data_ptr(), pos=None if position is None else position.data_ptr(),
        x_sb=x.stride(0), x_st=x.stride(1),
    )
    return args, alive


def _groups(dim: int, dtype: torch.dtype) -> int:
    return -(-dim // (8 if dtype == torch.float64 else 16))


def _suffix(dtype: torch.dtype) -> str:
    return "_f64" if dtype == torch.float64 else "_f32"


class CausalConv1dCPUFn(torch.autograd.Function):
    """``(x (batch, seq_len, channels), taps (channels, kernel), bias or None, window or None, position or None,
    activation) -> out (batch, seq_len, channels)`` with the compiled kernel; inputs already in the compute dtype
    (float32/float64) with unit channel stride. Differentiable in ``x``, ``taps`` and ``bias`` (not the cached
    window, which is a cache). Saves the inputs; recomputes the pre-activation in the backward pass."""

    @staticmethod
    def forward(ctx, x, taps, bias, window, position, activation):
        args, alive = _kernel_args(x, taps, bias, window, position, activation)
        out = torch.empty(x.shape, dtype=x.dtype)
        args.out = out.data_ptr()
        run_job(_library(), "conv_fwd_job" + _suffix(x.dtype), [ctypes.addressof(args)], _groups(x.shape[2], x.dtype))
        del alive
        ctx.save_for_backward(x, taps, bias, window, position)
        ctx.activation = activation
        return out

    @staticmethod
    def backward(ctx, gout):
        x, taps, bias, window, position = ctx.saved_tensors
        args, alive = _kernel_args(x, taps, bias, window, position, ctx.activation)
        gout = _token_major(gout, x.dtype)
        dx = torch.empty(x.shape, dtype=x.dtype)
        dtaps = torch.empty_like(taps)
        dbias = None if bias is None else torch.empty_like(bias)
        args.gout, args.g_sb, args.g_st = gout.data_ptr(), gout.stride(0), gout.stride(1)
        args.dx, args.dw, args.dbias = dx.data_ptr(), dtaps.data_ptr(), None if dbias is None else dbias.data_ptr()
        groups, lanes = _groups(x.shape[2], x.dtype), 8 if x.dtype == torch.float64 else 16
        size = worker_count(groups)
        work = torch.empty(size, -(-groups // size) * taps.shape[1] * lanes, dtype=x.dtype)
        job_args = [ctypes.addressof(args), *per_worker(work)]
        run_job(_library(), "conv_bwd_job" + _suffix(x.dtype), job_args, groups, workers=size)
        del alive
        return dx, dtaps, dbias, None, None, None


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    window: torch.Tensor | None = None,
    reset: torch.Tensor | None = None,
    activation: str | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal depthwise convolution over tokens, then ``activation`` (module docstring).

    Args:
        x: ``(batch, seq_len, channels)`` float tensor, any strides (token-major: the layout of ``nn.Linear``'s
            output; a channel stride other than 1 costs one copy on the kernel path).
        weight: ``(channels, 1, kernel)`` (``nn.Conv1d``'s) or ``(channels, kernel)``.
        bias: ``(channels,)`` or ``None``.
        window: ``(batch, channels, kernel)`` cached inputs before this call (transformers' Mamba conv state, the
            newest last; its last ``kernel - 1`` columns are used), or ``None`` (zeros: the sequence's start). Not
            differentiated.
        reset: ``(batch, seq_len)`` bool, True at each packed document's first token, or ``None``; not with a
            ``window``.
        activation: ``None`` or ``"silu"``.
        backend: ``"auto"`` (the compiled kernel on CPU tensors where it builds, PyTorch otherwise), ``"cpu"``,
            ``"torch"``, or ``"triton"`` (no Triton kernel: runs PyTorch).

    Returns:
        ``(batch, seq_len, channels)`` contiguous in ``x``'s dtype (computed in float32 for 16-bit inputs on the
        kernel path, float64 for float64), differentiable in ``x``, ``weight`` and ``bias``.

    Raises:
        ValueError: a shape that does not match, ``activation`` not ``None``/``"silu"``, ``reset`` with a ``window``,
            a bad ``backend``.
        TypeError: a non-tensor or non-float ``x``.
        RuntimeError: ``backend="cpu"`` where the kernel cannot be built or on non-CPU tensors.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor (batch, seq_len, channels), got {x!r:.60}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape (batch, seq_len, channels), got shape {tuple(x.shape)}")
    batch, length, channels = x.shape
    if weight.dim() not in (2, 3) or weight.shape[0] != channels or (weight.dim() == 3 and weight.shape[1] != 1):
        raise ValueError(f"weight must have shape ({channels}, 1, kernel) or ({channels}, kernel), got {tuple(weight.shape)}")
    kernel = weight.shape[-1]
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias must have shape ({channels},), got {tuple(bias.shape)}")
    if window is not None and tuple(window.shape) != (batch, channels, kernel):
        raise ValueError(f"window must have shape (batch, channels, kernel) = ({batch}, {channels}, {kernel}), "
                         f"got {tuple(window.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    reset = check_reset(reset, batch, length, x.device)
    if reset is not None and window is not None:
        raise ValueError("reset (packed documents) cannot be combined with a cached window")
    form = resolve_backend(backend, x.device, lambda: _library() is not None)
    if form != "cpu":
        return causal_conv1d_torch(x, weight, bias, window, reset, activation)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    taps = weight.reshape(channels, kernel).to(cdt).contiguous()
    bias_ = None if bias is None else bias.to(cdt).contiguous()
    window_ = None if window is None else window.detach().to(cdt, copy=True).contiguous()  # a cache: may change
    position = None if reset is None else document_positions(reset).contiguous()
    out = CausalConv1dCPUFn.apply(_token_major(x, cdt), taps, bias_, window_, position, activation)
    return out.to(x.dtype)
