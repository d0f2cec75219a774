"""The dense connection's gated fusion with the gate's activation fused in: ``feature + total * silu(gate)``
(DenseSSM paper Eq. 16-17 with a shared gate and the identity transition: ``sum_i silu(g) * f_i`` summed first), the
compiled CPU kernel and its PyTorch path.

Why a kernel: the fusion runs once per feature and layer on ``(batch, length, feature)`` tensors; in PyTorch it is a
SiLU and a multiply-add forward and three multiplies backward (five passes over memory each way, counting the
saved activation), in C one pass each way: forward reads ``feature, total, gate`` and writes the result; backward
reads ``grad, total, gate`` and writes ``d total = grad * silu(gate)`` and ``d gate = grad * total * silu'(gate)``
(``d feature`` is ``grad`` itself). Rows are split between the workers of
:func:`hf_densessm.ops.cpu_build.run_job`.
"""

from __future__ import annotations

from string import Template

import torch
import torch.nn.functional as F

from .backend import resolve_backend
from .cpu_build import load_library, run_job, vector_source

__all__ = ["gated_add", "gated_add_torch"]

#: Below this many elements ``backend="auto"`` runs PyTorch: a kernel call through ctypes costs about 25 us, PyTorch's
#: ``addcmul`` on one decoding step's row about 4 us (measured on the 2-core Xeon of docs/benchmarks.md).
MIN_KERNEL_ELEMENTS = 1 << 16

_BODY = Template(r"""
/* Rows [r0, r1) of width n; each tensor has its own row stride, unit stride along the row. */
void gated_add_fwd$sfx(int64_t r0, int64_t r1, int64_t n, const $real *f, int64_t sf, const $real *t, int64_t st,
                       const $real *a, int64_t sa, $real *out) {
    for (int64_t i = r0; i < r1; i++)
        for (int64_t j = 0; j < n; j += $W) {
            const int64_t nl = n - j < $W ? n - j : $W;
            const vec$sfx av = vld$sfx(a + i * sa + j, nl);
            vst$sfx(out + i * n + j, vld$sfx(f + i * sf + j, nl) + vld$sfx(t + i * st + j, nl) * av * vsigmoid$sfx(av), nl);
        }
}

void gated_add_bwd$sfx(int64_t r0, int64_t r1, int64_t n, const $real *g, int64_t sg, const $real *t, int64_t st,
                       const $real *a, int64_t sa, $real *dt, $real *da) {
    for (int64_t i = r0; i < r1; i++)
        for (int64_t j = 0; j < n; j += $W) {
            const int64_t nl = n - j < $W ? n - j : $W;
            const vec$sfx av = vld$sfx(a + i * sa + j, nl), gv = vld$sfx(g + i * sg + j, nl);
            const vec$sfx s = vsigmoid$sfx(av);
            vst$sfx(dt + i * n + j, gv * av * s, nl);
            vst$sfx(da + i * n + j, gv * vld$sfx(t + i * st + j, nl) * s * (($real)1 + av * (($real)1 - s)), nl);
        }
}

/* Jobs of cpu_build.run_job over rows [r0, r1). fwd args: n, f, sf, t, st, a, sa, out. bwd args: n, g, sg, t, st,
   a, sa, dt, da. */
void gated_add_fwd_job$sfx(int64_t w, int64_t r0, int64_t r1, const int64_t *p) {
    (void)w;
    gated_add_fwd$sfx(r0, r1, p[0], (const $real *)(intptr_t)p[1], p[2], (const $real *)(intptr_t)p[3], p[4],
                      (const $real *)(intptr_t)p[5], p[6], ($real *)(intptr_t)p[7]);
}
void gated_add_bwd_job$sfx(int64_t w, int64_t r0, int64_t r1, const int64_t *p) {
    (void)w;
    gated_add_bwd$sfx(r0, r1, p[0], (const $real *)(intptr_t)p[1], p[2], (const $real *)(intptr_t)p[3], p[4],
                      (const $real *)(intptr_t)p[5], p[6], ($real *)(intptr_t)p[7], ($real *)(intptr_t)p[8]);
}
""")

SOURCE = vector_source("", _BODY)


def _library():
    return load_library("gated_add", SOURCE)


def gated_add_torch(feature: torch.Tensor, total: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The PyTorch path of :func:`gated_add`: ``torch.addcmul(feature, total, F.silu(gate))``."""
    return torch.addcmul(feature, total, F.silu(gate))


def _rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``x`` as a ``(rows, n)`` tensor with unit stride along ``n`` (a view when the leading dimensions collapse into
    one row stride, else a copy), and that row stride."""
    x = x.to(dtype)
    n = x.shape[-1]
    try:
        rows = x.view(-1, n)
    except RuntimeError:
        rows = x.reshape(-1, n).contiguous()
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, rows.stride(0)


def _suffix(dtype: torch.dtype) -> str:
    return "_f64" if dtype == torch.float64 else "_f32"


class GatedAddCPUFn(torch.autograd.Function):
    """``(feature, total, gate) -> feature + total * silu(gate)`` with the compiled kernel; all three of one shape and
    of the compute dtype (float32/float64). Saves ``total`` and ``gate``."""

    @staticmethod
    def forward(ctx, feature, total, gate):
        shape, dtype = feature.shape, feature.dtype
        f, sf = _rows(feature, dtype)
        t, st = _rows(total, dtype)
        a, sa = _rows(gate, dtype)
        out = torch.empty(f.shape, dtype=dtype)
        job_args = [f.shape[1], f.data_ptr(), sf, t.data_ptr(), st, a.data_ptr(), sa, out.data_ptr()]
        run_job(_library(), "gated_add_fwd_job" + _suffix(dtype), job_args, f.shape[0])
        ctx.save_for_backward(total, gate)
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad):
        total, gate = ctx.saved_tensors
        dtype = total.dtype
        g, sg = _rows(grad, dtype)
        t, st = _rows(total, dtype)
        a, sa = _rows(gate, dtype)
        d_total, d_gate = torch.empty(g.shape, dtype=dtype), torch.empty(g.shape, dtype=dtype)
        job_args = [g.shape[1], g.data_ptr(), sg, t.data_ptr(), st, a.data_ptr(), sa, d_total.data_ptr(),
                    d_gate.data_ptr()]
        run_job(_library(), "gated_add_bwd_job" + _suffix(dtype), job_args, g.shape[0])
        return grad, d_total.view(total.shape), d_gate.view(gate.shape)


def gated_add(feature: torch.Tensor, total: torch.Tensor, gate: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``feature + total * silu(gate)`` (module docstring).

    Args:
        feature, total, gate: tensors of one shape ``(..., n)`` and one float dtype; ``gate`` is the gate's
            pre-activation (e.g. ``fc2`` of the MLP gate, DenseSSM Eq. 16).
        backend: ``"auto"`` (the compiled kernel for float32/float64 CPU tensors of at least
            ``MIN_KERNEL_ELEMENTS`` elements where it builds, PyTorch otherwise: a decoding step's row is cheaper
            in PyTorch), ``"cpu"`` (the kernel for any size), ``"torch"``, ``"triton"`` (no Triton kernel: PyTorch).

    Returns:
        A tensor of that shape and dtype (contiguous on the kernel path), differentiable in all three.

    Raises:
        ValueError: shapes or dtypes differ; a bad ``backend``.
        RuntimeError: ``backend="cpu"`` where the kernel cannot be built or on non-CPU tensors.
    """
    if not (feature.shape == total.shape == gate.shape):
        raise ValueError(f"feature, total and gate must have one shape, got {tuple(feature.shape)}, "
                         f"{tuple(total.shape)}, {tuple(gate.shape)}")
    if not (feature.dtype == total.dtype == gate.dtype):
        raise ValueError(f"feature, total and gate must have one dtype, got {feature.dtype}, {total.dtype}, {gate.dtype}")
    form = resolve_backend(backend, feature.device, lambda: _library() is not None)
    small = backend == "auto" and feature.numel() < MIN_KERNEL_ELEMENTS
    if form != "cpu" or small or feature.dtype not in (torch.float32, torch.float64) or feature.numel() == 0:
        return gated_add_torch(feature, total, gate)
    return GatedAddCPUFn.apply(feature, total, gate)
