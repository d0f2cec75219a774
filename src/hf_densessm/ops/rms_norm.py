"""RMSNorm, ``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension (in groups), the compiled CPU kernel and
its PyTorch path. The normalization of every DenseSSM block, of DenseRetNet's per-head output ("group norm", with
its retention normalization folded into ``eps``) and of its fused keys and values (docs/design.md §3, §4).

Why a kernel: in PyTorch the norm is five passes over the tensor forward (square, mean, rsqrt, two products) and
about ten backward, each with a new tensor; the kernel makes one pass forward (a row of at most a few KB stays in
L1 between its sum of squares and its output) and one backward, keeping only the per-row ``rstd``. Measured on
the 2-core Xeon of docs/benchmarks.md at 2 x 1024 tokens: a 768-wide norm's forward + backward 10.4 ms in PyTorch
(``torch.nn.functional.rms_norm``: 12.8 ms). Rows are split between the workers of
:func:`hf_densessm.ops.cpu_build.run_job`; accumulation in the tensor's dtype (float32, or float64), as PyTorch's
path, which computes the statistics in float32 for 16-bit inputs (the kernel takes float32 and float64 only).
"""

from __future__ import annotations

from string import Template

import torch

from .backend import resolve_backend
from .cpu_build import as_rows, load_library, per_worker, run_job, vector_source, worker_count

__all__ = ["rms_norm", "rms_norm_torch"]

#: Below this many elements ``backend="auto"`` runs PyTorch (a decoding step's rows: a ctypes call costs ~25 us).
MIN_KERNEL_ELEMENTS = 1 << 16

_BODY = Template(r"""
/* Rows [r0, r1) of width d (row stride sx); eps of row i: eps[i * se] (se = 0: one eps). y = w * x * rstd,
   rstd_i = 1 / sqrt(mean_j x_ij^2 + eps_i); y (rows, d) contiguous. */
void rms_fwd$sfx(int64_t r0, int64_t r1, int64_t d, const $real *x, int64_t sx, const $real *w, const $real *eps,
                 int64_t se, $real *y, $real *rstd) {
    for (int64_t i = r0; i < r1; i++) {
        const $real *xi = x + i * sx;
        vec$sfx s = ZERO$sfx;
        for (int64_t j = 0; j < d; j += $W) {
            const int64_t nl = d - j < $W ? d - j : $W;
            const vec$sfx v = vld$sfx(xi + j, nl);
            s += v * v;
        }
        const $real r = ($real)1 / sqrt(hsum$sfx(s) / ($real)d + eps[i * se]);
        rstd[i] = r;
        for (int64_t j = 0; j < d; j += $W) {
            const int64_t nl = d - j < $W ? d - j : $W;
            vst$sfx(y + i * d + j, vld$sfx(w + j, nl) * (vld$sfx(xi + j, nl) * r), nl);
        }
    }
}

/* dx_ij = rstd_i (w_j g_ij - xh_ij mean_j(w g xh)_i), xh = x rstd; dw_j += g_ij xh_ij into this worker's (d,) partial
   (zeroed by the caller). dx (rows, d) contiguous. */
void rms_bwd$sfx(int64_t r0, int64_t r1, int64_t d, const $real *x, int64_t sx, const $real *w, const $real *rstd,
                 const $real *g, int64_t sg, $real *dx, $real *dw) {
    for (int64_t i = r0; i < r1; i++) {
        const $real *xi = x + i * sx, *gi = g + i * sg;
        const $real r = rstd[i];
        vec$sfx s = ZERO$sfx;
        for (int64_t j = 0; j < d; j += $W) {
            const int64_t nl = d - j < $W ? d - j : $W;
            const vec$sfx xh = vld$sfx(xi + j, nl) * r, gv = vld$sfx(gi + j, nl);
            s += vld$sfx(w + j, nl) * gv * xh;
            vst$sfx(dw + j, vld$sfx(dw + j, nl) + gv * xh, nl);
        }
        const $real m = hsum$sfx(s) / ($real)d;
        for (int64_t j = 0; j < d; j += $W) {
            const int64_t nl = d - j < $W ? d - j : $W;
            const vec$sfx xh = vld$sfx(xi + j, nl) * r;
            vst$sfx(dx + i * d + j, (vld$sfx(w + j, nl) * vld$sfx(gi + j, nl) - xh * m) * r, nl);
        }
    }
}

/* Jobs of cpu_build.run_job over rows. fwd args: d, x, sx, w, eps, se, y, rstd. bwd args: d, x, sx, w, rstd, g, sg,
   dx, dw (worker 0's partial), the byte stride between workers' partials. */
void rms_fwd_job$sfx(int64_t w, int64_t r0, int64_t r1, const int64_t *p) {
    (void)w;
    rms_fwd$sfx(r0, r1, p[0], (const $real *)(intptr_t)p[1], p[2], (const $real *)(intptr_t)p[3],
                (const $real *)(intptr_t)p[4], p[5], ($real *)(intptr_t)p[6], ($real *)(intptr_t)p[7]);
}
void rms_bwd_job$sfx(int64_t w, int64_t r0, int64_t r1, const int64_t *p) {
    rms_bwd$sfx(r0, r1, p[0], (const $real *)(intptr_t)p[1], p[2], (const $real *)(intptr_t)p[3],
                (const $real *)(intptr_t)p[4], (const $real *)(intptr_t)p[5], p[6], ($real *)(intptr_t)p[7],
                ($real *)(intptr_t)(p[8] + w * p[9]));
}
""")

SOURCE = vector_source("", _BODY)


def _library():
    return load_library("rms_norm", SOURCE)


def _suffix(dtype: torch.dtype) -> str:
    return "_f64" if dtype == torch.float64 else "_f32"


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, num_groups: int = 1, eps_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The PyTorch path of :func:`rms_norm` (statistics in float32, or float64 for float64 inputs; output in ``x``'s
    dtype, then multiplied by ``weight``, as transformers' ``LlamaRMSNorm``)."""
    input_dtype = x.dtype
    h = x.to(torch.promote_types(input_dtype, torch.float32))
    if num_groups > 1:
        h = h.unflatten(-1, (num_groups, -1))
    eps = eps if eps_scale is None else eps * eps_scale
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(input_dtype)
    return h.flatten(-2) if num_groups > 1 else h


class RMSNormCPUFn(torch.autograd.Function):
    """``(rows (n, d) with unit stride along d, weight (d,), eps (n,) or (1,), eps stride) -> (n, d)`` with the
    compiled kernel; saves the rows (no copy), the weight and the per-row ``rstd``."""

    @staticmethod
    def forward(ctx, rows, weight, eps, eps_stride):
        n, d = rows.shape
        y = torch.empty(n, d, dtype=rows.dtype)
        rstd = torch.empty(n, dtype=rows.dtype)
        job_args = [d, rows.data_ptr(), rows.stride(0), weight.data_ptr(), eps.data_ptr(), eps_stride, y.data_ptr(),
                    rstd.data_ptr()]
        run_job(_library(), "rms_fwd_job" + _suffix(rows.dtype), job_args, n)
        ctx.save_for_backward(rows, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        rows, weight, rstd = ctx.saved_tensors
        n, d = rows.shape
        grad = grad.to(rows.dtype)
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        dx = torch.empty(n, d, dtype=rows.dtype)
        workers = worker_count(n)
        partial = torch.zeros(workers, d, dtype=rows.dtype)
        job_args = [d, rows.data_ptr(), rows.stride(0), weight.data_ptr(), rstd.data_ptr(), grad.data_ptr(),
                    grad.stride(0), dx.data_ptr(), *per_worker(partial)]
        run_job(_library(), "rms_bwd_job" + _suffix(rows.dtype), job_args, n, workers=workers)
        return dx, partial.sum(0), None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    num_groups: int = 1,
    eps_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, each of ``num_groups`` equal slices of it on its
    own (module docstring; RMSNorm, Zhang & Sennrich 2019, Eq. 4).

    Args:
        x: ``(..., hidden)``, ``hidden`` divisible by ``num_groups``.
        weight: ``(hidden // num_groups,)``, shared by the groups.
        eps: the added constant (> 0).
        num_groups: the number of slices normalized on their own.
        eps_scale: optional positive factor on ``eps`` per row and group, broadcastable to
            ``(..., num_groups, 1)`` (DenseRetNet's folded retention normalization, docs/design.md §3).
        backend: ``"auto"`` (the compiled kernel for float32/float64 CPU tensors of at least
            :data:`MIN_KERNEL_ELEMENTS` elements whose ``weight`` has their dtype and whose ``eps_scale`` needs
            no gradient, where the kernel builds; PyTorch otherwise), ``"cpu"`` (the kernel at any size where
            those hold), ``"torch"``, ``"triton"`` (PyTorch).

    Returns:
        A tensor of ``x``'s shape and dtype, differentiable in ``x`` and ``weight``.

    Raises:
        ValueError: ``hidden`` not divisible by ``num_groups``, a ``weight`` of the wrong size, a bad ``backend``.
        RuntimeError: ``backend="cpu"`` where the kernel cannot be built or on non-CPU tensors.
    """
    hidden = x.shape[-1]
    if num_groups < 1 or hidden % num_groups:
        raise ValueError(f"the last dimension ({hidden}) must be divisible by num_groups ({num_groups})")
    d = hidden // num_groups
    if weight.shape != (d,):
        raise ValueError(f"weight must have shape ({d},), got {tuple(weight.shape)}")
    form = resolve_backend(backend, x.device, lambda: _library() is not None)
    small = backend == "auto" and x.numel() < MIN_KERNEL_ELEMENTS
    usable = (
        x.dtype in (torch.float32, torch.float64) and weight.dtype == x.dtype and weight.device == x.device
        and x.numel() > 0 and (eps_scale is None or not eps_scale.requires_grad)
    )
    if form != "cpu" or small or not usable:
        return rms_norm_torch(x, weight, eps, num_groups, eps_scale)
    grouped = x.unflatten(-1, (num_groups, d))
    rows, _ = as_rows(grouped)
    if eps_scale is None:
        eps_rows, eps_stride = torch.full((1,), eps, dtype=x.dtype), 0
    else:
        eps_rows = (eps * eps_scale.to(x.dtype)).expand(*grouped.shape[:-1], 1).reshape(-1).contiguous()
        eps_stride = 1
    return RMSNormCPUFn.apply(rows, weight, eps_rows, eps_stride).view(x.shape)
