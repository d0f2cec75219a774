"""The dense connection's gated fusion with its gate's output layer and the sum of the predecessors fused in:
``feature + (p_1 + ... + p_n) * silu(h @ W^T)`` (DenseSSM paper Eq. 16-17 with a shared MLP gate and the identity
transition: ``sum_i silu(g) * p_i``, summed first; ``h`` is the gate's hidden activation ``SiLU(fc1(x))``, ``W`` the
weight of its output layer ``fc2``), the compiled CPU kernel and its PyTorch path.

Why a kernel: the fusion runs once per feature and layer on ``(batch, length, feature)`` tensors. In PyTorch the sum,
the gate's output layer (a product with only ``k = dense_gate_hidden_size`` = 16 terms, whose output is as large
as the feature), the SiLU and the multiply-add are separate passes over memory, each with a new tensor: for
DenseMamba-30M at 2 x 1024 tokens and m = 4, 37 ms of a training step's forward pass. The kernel reads the feature,
the predecessors and ``h`` once and writes the result and, for the backward pass, the sum (forward); it recomputes the
gate's ``k``-term products instead of storing them, and accumulates the gradients of ``h`` and ``W`` as it goes
(backward: reads ``grad, sum, h``, writes ``d sum = grad * silu(a)``, ``d h`` and per-worker partial ``d W``; ``d
feature`` is ``grad`` itself, and every predecessor's gradient is ``d sum``). Rows are split between the workers of
:func:`hf_densessm.ops.cpu_build.run_job`; accumulation in the tensors' dtype (float32, or float64 for float64
models). Without a weight the kernel takes the gate's pre-activation itself (``dense_selection="linear"``, or an
MLP gate whose output layer has a hook, an adapter or a bias: the layer is called, its output fused in). The
dense connection's other settings (a gate per predecessor, a projection, ``"concat"``) run PyTorch
(:class:`hf_densessm.modeling.dense_connection.DenseHiddenConnection`).
"""

from __future__ import annotations

from collections.abc import Sequence
from string import Template

import torch
import torch.nn.functional as F

from .backend import resolve_backend
from .cpu_build import as_rows, load_library, per_worker, run_job, vector_source, worker_count

__all__ = ["gated_add", "gated_add_torch", "uses_kernel"]

#: Below this many elements ``backend="auto"`` runs PyTorch: a kernel call through ctypes costs about 25 us, PyTorch's
#: ``addcmul`` on one decoding step's row about 4 us (measured on the 2-core Xeon of docs/benchmarks.md).
MIN_KERNEL_ELEMENTS = 1 << 16

#: The widest gate input (``k``, ``dense_gate_hidden_size``) the kernel takes: it recomputes the gate's ``k``-term
#: products in both passes and keeps ``8 k`` vectors on its stack, so a wider gate runs PyTorch (the defaults are
#: ``hidden_size // 32``: 16 at the 30M presets, 32 at the 350M ones).
MAX_GATE_INPUTS = 64

_BODY = Template(r"""
/* Rows [r0, r1), n features, k gate inputs (k = 0: h is the gate's pre-activation, (rows, n)), np predecessors.
   pp: np pairs (address, row stride) of the predecessors; wt: the gate's output weight transposed, (k, n)
   contiguous; out, total: (rows, n) contiguous (total NULL when np == 1: the sum is the one predecessor).
   a = h_i . wt[:, j], out = f + total * a * sigmoid(a). */
void gated_add_fwd$sfx(int64_t r0, int64_t r1, int64_t n, int64_t k, int64_t np, const $real *f, int64_t sf,
                       const int64_t *pp, const $real *h, int64_t sh, const $real *wt, $real *out, $real *total) {
    for (int64_t i = r0; i < r1; i++) {
        const $real *hi = h + i * sh;
        for (int64_t j = 0; j < n; j += $W) {
            const int64_t nl = n - j < $W ? n - j : $W;
            vec$sfx a = k ? ZERO$sfx : vld$sfx(hi + j, nl);  /* k = 0: h is the gate itself */
            for (int64_t c = 0; c < k; c++) a += hi[c] * vld$sfx(wt + c * n + j, nl);
            vec$sfx t = vld$sfx((const $real *)(intptr_t)pp[0] + i * pp[1] + j, nl);
            for (int64_t q = 1; q < np; q++)
                t += vld$sfx((const $real *)(intptr_t)pp[2 * q] + i * pp[2 * q + 1] + j, nl);
            if (total) vst$sfx(total + i * n + j, t, nl);
            vst$sfx(out + i * n + j, vld$sfx(f + i * sf + j, nl) + t * a * vsigmoid$sfx(a), nl);
        }
    }
}

/* Rows [r0, r1), in blocks of GA_ROWS rows (the weight gradient is updated once per block and column chunk).
   dtot = g * silu(a); da = g * t * silu'(a); dh_i = sum_j da_ij wt[:, j] (rows, k); dwt += h^T da into this worker's
   (k, n) partial, zeroed by the caller. */
#define GA_ROWS 8
void gated_add_bwd$sfx(int64_t r0, int64_t r1, int64_t n, int64_t k, const $real *t, int64_t st, const $real *g,
                       int64_t sg, const $real *h, int64_t sh, const $real *wt, $real *dtot, $real *dh, $real *dwt) {
    if (k == 0) {  /* the gate given directly: dh = da, (rows, n) contiguous; no weight */
        for (int64_t i = r0; i < r1; i++)
            for (int64_t j = 0; j < n; j += $W) {
                const int64_t nl = n - j < $W ? n - j : $W;
                const vec$sfx a = vld$sfx(h + i * sh + j, nl), s = vsigmoid$sfx(a), gv = vld$sfx(g + i * sg + j, nl);
                vst$sfx(dtot + i * n + j, gv * a * s, nl);
                vst$sfx(dh + i * n + j, gv * vld$sfx(t + i * st + j, nl) * s * (($real)1 + a * (($real)1 - s)), nl);
            }
        return;
    }
    vec$sfx acc[GA_ROWS * k];
    for (int64_t i0 = r0; i0 < r1; i0 += GA_ROWS) {
        const int64_t nr = r1 - i0 < GA_ROWS ? r1 - i0 : GA_ROWS;
        for (int64_t l = 0; l < nr * k; l++) acc[l] = ZERO$sfx;
        for (int64_t j = 0; j < n; j += $W) {
            const int64_t nl = n - j < $W ? n - j : $W;
            vec$sfx da[GA_ROWS];
            for (int64_t r = 0; r < nr; r++) {
                const int64_t i = i0 + r;
                const $real *hi = h + i * sh;
                vec$sfx a = ZERO$sfx;
                for (int64_t c = 0; c < k; c++) a += hi[c] * vld$sfx(wt + c * n + j, nl);
                const vec$sfx s = vsigmoid$sfx(a), gv = vld$sfx(g + i * sg + j, nl);
                vst$sfx(dtot + i * n + j, gv * a * s, nl);
                da[r] = gv * vld$sfx(t + i * st + j, nl) * s * (($real)1 + a * (($real)1 - s));
            }
            for (int64_t c = 0; c < k; c++) {
                const vec$sfx wc = vld$sfx(wt + c * n + j, nl);
                vec$sfx d = vld$sfx(dwt + c * n + j, nl);
                for (int64_t r = 0; r < nr; r++) {
                    acc[r * k + c] += da[r] * wc;
                    d += da[r] * h[(i0 + r) * sh + c];
                }
                vst$sfx(dwt + c * n + j, d, nl);
            }
        }
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < k; c++) dh[(i0 + r) * k + c] = hsum$sfx(acc[r * k + c]);
    }
}

/* Jobs of cpu_build.run_job over rows [r0, r1). fwd args: n, k, np, f, sf, pp, h, sh, wt, out, total. bwd args: n,
   k, t, st, g, sg, h, sh, wt, dtot, dh, dwt (worker 0's partial), the byte stride between workers' partials. */
void gated_add_fwd_job$sfx(int64_t w, int64_t r0, int64_t r1, const int64_t *p) {
    (void)w;
    gated_add_fwd$sfx(r0, r1, p[0], p[1], p[2], (const $real *)(intptr_t)p[3], p[4], (const int64_t *)(intptr_t)p[5],
                      (const $real *)(intptr_t)p[6], p[7], (const $real *)(intptr_t)p[8], ($real *)(intptr_t)p[9],
                      ($real *)(intptr_t)p[10]);
}
void gated_add_bwd_job$sfx(int64_t w, int64_t r0, int64_t r1, const int64_t *p) {
    gated_add_bwd$sfx(r0, r1, p[0], p[1], (const $real *)(intptr_t)p[2], p[3], (const $real *)(intptr_t)p[4], p[5],
                      (const $real *)(intptr_t)p[6], p[7], (const $real *)(intptr_t)p[8], ($real *)(intptr_t)p[9],
                      ($real *)(intptr_t)p[10], ($real *)(intptr_t)(p[11] + w * p[12]));
}
""")

SOURCE = vector_source("", _BODY)


def _library():
    return load_library("gated_add", SOURCE)


def gated_add_torch(
    feature: torch.Tensor,
    predecessors: Sequence[torch.Tensor],
    gate_input: torch.Tensor,
    gate_weight: torch.Tensor | None,
) -> torch.Tensor:
    """The PyTorch path of :func:`gated_add`: the predecessors summed in order, then
    ``torch.addcmul(feature, total, F.silu(gate))`` with ``gate = F.linear(gate_input, gate_weight)``, or
    ``gate_input`` itself when ``gate_weight`` is ``None``."""
    total = predecessors[0]
    for p in predecessors[1:]:
        total = total + p
    gate = gate_input if gate_weight is None else F.linear(gate_input, gate_weight)
    return torch.addcmul(feature, total, F.silu(gate))


def _suffix(dtype: torch.dtype) -> str:
    return "_f64" if dtype == torch.float64 else "_f32"


class GatedAddCPUFn(torch.autograd.Function):
    """``(feature, gate_input, gate_weight, *predecessors) -> feature + sum(predecessors) * silu(gate_input @
    gate_weight^T)`` with the compiled kernel; every tensor of the compute dtype (float32/float64). Saves the sum of
    the predecessors (the predecessor itself when there is one), ``gate_input`` and the transposed weight."""

    @staticmethod
    def forward(ctx, feature, gate_input, gate_weight, *predecessors):
        shape, dtype = feature.shape, feature.dtype
        f, sf = as_rows(feature)
        h, sh = as_rows(gate_input)
        preds = [as_rows(p) for p in predecessors]
        # (k, n): the kernel reads it along n; no weight (k = 0): gate_input is the gate's pre-activation
        wt = torch.empty(0, dtype=dtype) if gate_weight is None else gate_weight.t().contiguous()
        rows, n = f.shape
        out = torch.empty(rows, n, dtype=dtype)
        total = torch.empty(rows, n, dtype=dtype) if len(preds) > 1 else None
        pairs = torch.tensor([v for p, s in preds for v in (p.data_ptr(), s)], dtype=torch.int64)
        k = 0 if gate_weight is None else h.shape[1]
        job_args = [n, k, len(preds), f.data_ptr(), sf, pairs.data_ptr(), h.data_ptr(), sh, wt.data_ptr(),
                    out.data_ptr(), 0 if total is None else total.data_ptr()]
        run_job(_library(), "gated_add_fwd_job" + _suffix(dtype), job_args, rows)
        saved_total = preds[0][0] if total is None else total
        ctx.save_for_backward(saved_total, h, wt)
        ctx.shapes = (gate_input.shape, len(predecessors), k)
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad):
        total, h, wt = ctx.saved_tensors
        gate_input_shape, count, k = ctx.shapes
        dtype = total.dtype
        g, sg = as_rows(grad.to(dtype))
        rows, n = g.shape
        d_total = torch.empty(rows, n, dtype=dtype)
        d_h = torch.empty(rows, h.shape[1], dtype=dtype)
        workers = worker_count(rows)
        partial = torch.zeros(workers, k, n, dtype=dtype)
        job_args = [n, k, total.data_ptr(), total.stride(0), g.data_ptr(), sg, h.data_ptr(), h.stride(0),
                    wt.data_ptr(), d_total.data_ptr(), d_h.data_ptr(), *per_worker(partial)]
        run_job(_library(), "gated_add_bwd_job" + _suffix(dtype), job_args, rows, workers=workers)
        d_weight = partial.sum(0).t() if k else None
        d_total = d_total.view(grad.shape)
        return (grad, d_h.view(gate_input_shape), d_weight, *(d_total for _ in range(count)))


def uses_kernel(feature: torch.Tensor, gate_inputs: int, backend: str = "auto") -> bool:
    """Whether :func:`gated_add` runs the compiled kernel for a ``feature`` like this one and a gate input of
    ``gate_inputs`` (``k``) features (the caller can then pass an MLP gate's output layer as a weight instead of
    calling it): a float32/float64 CPU tensor with at least :data:`MIN_KERNEL_ELEMENTS` elements (any size for
    ``backend="cpu"``), ``0 <= k <=`` :data:`MAX_GATE_INPUTS` (0: the gate given directly, no weight), where the
    kernel builds, outside ``torch.compile``.
    Raises as :func:`hf_densessm.ops.backend.resolve_backend` for a bad ``backend``."""
    form = resolve_backend(backend, feature.device, lambda: _library() is not None)
    small = backend == "auto" and feature.numel() < MIN_KERNEL_ELEMENTS
    supported = feature.dtype in (torch.float32, torch.float64) and feature.numel() > 0
    return form == "cpu" and not small and supported and 0 <= gate_inputs <= MAX_GATE_INPUTS


def gated_add(
    feature: torch.Tensor,
    predecessors: Sequence[torch.Tensor],
    gate_input: torch.Tensor,
    gate_weight: torch.Tensor | None,
    backend: str = "auto",
) -> torch.Tensor:
    """``feature + (predecessors[0] + ... + predecessors[-1]) * silu(gate)`` with ``gate = gate_input @
    gate_weight^T``, or ``gate = gate_input`` when ``gate_weight`` is ``None`` (module docstring; DenseSSM paper
    Eq. 16-17).

    Args:
        feature: ``(..., n)``, this layer's own feature ``f^l``.
        predecessors: one or more tensors shaped like ``feature``, the lower layers' features (summed in order).
        gate_input: ``(..., k)`` with ``feature``'s leading dimensions: the gate's hidden activation; or, with no
            ``gate_weight``, the gate's pre-activation itself, shaped like ``feature``.
        gate_weight: ``(n, k)``, the weight of the gate's bias-free output layer (``nn.Linear(k, n).weight``), or
            ``None``.
        backend: ``"auto"`` (the compiled kernel where :func:`uses_kernel`, PyTorch otherwise: a decoding step's
            row is cheaper in PyTorch), ``"cpu"`` (the kernel for any size, PyTorch for a gate wider than
            :data:`MAX_GATE_INPUTS`), ``"torch"``, ``"triton"`` (no Triton kernel: PyTorch).

    Returns:
        A tensor shaped like ``feature`` in its dtype (contiguous on the kernel path), differentiable in every input.

    Raises:
        ValueError: no predecessor; a predecessor or ``gate_input``/``gate_weight`` of the wrong shape; tensors of
            different dtypes; a bad ``backend``.
        RuntimeError: ``backend="cpu"`` where the kernel cannot be built or on non-CPU tensors.
    """
    predecessors = list(predecessors)
    if not predecessors:
        raise ValueError("predecessors must hold at least one tensor")
    for p in predecessors:
        if p.shape != feature.shape:
            raise ValueError(
                f"every predecessor must have feature's shape {tuple(feature.shape)}, got {tuple(p.shape)}"
            )
    n = feature.shape[-1]
    if gate_weight is not None and (gate_weight.dim() != 2 or gate_weight.shape[0] != n):
        raise ValueError(f"gate_weight must have shape ({n}, k), got {tuple(gate_weight.shape)}")
    k = 0 if gate_weight is None else gate_weight.shape[1]
    expected = tuple(feature.shape) if gate_weight is None else (*feature.shape[:-1], k)
    if tuple(gate_input.shape) != expected:
        raise ValueError(f"gate_input must have shape {expected}, got {tuple(gate_input.shape)}")
    weights = () if gate_weight is None else (gate_weight,)
    dtypes = {t.dtype for t in (feature, gate_input, *weights, *predecessors)}
    if len(dtypes) != 1:
        raise ValueError(
            f"feature, predecessors, gate_input and gate_weight must have one dtype, got {sorted(map(str, dtypes))}"
        )
    if not uses_kernel(feature, k, backend):
        return gated_add_torch(feature, predecessors, gate_input, gate_weight)
    return GatedAddCPUFn.apply(feature, gate_input, gate_weight, *predecessors)
