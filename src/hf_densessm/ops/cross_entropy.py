"""Cross-entropy of the language-model head, row by row: the compiled CPU kernel and its PyTorch reference.

``loss = sum_i w_i (logsumexp(x_i) - x_{i, t_i}) / divisor`` over rows ``i`` whose target ``t_i`` is not
``ignore_index`` (``w_i = 1``, else 0); the gradient is ``(softmax(x_i) - onehot(t_i)) w_i / divisor``. The
reference is ``torch.nn.functional.cross_entropy`` (reduction ``"sum"`` divided by ``divisor``), which is what
transformers' ``ForCausalLMLoss`` computes.

Why a kernel: at a 32000-word vocabulary the logits of a training step are the largest tensor of the model
((batch * length) x vocabulary: 262 MB for 2 x 1024 tokens), and PyTorch's log-softmax, NLL and their backward
make about six passes over it through main memory (with a zero-filled gradient). A row of logits (128 KB) fits in
the L2 cache, so the kernel reads each row from memory once in the forward pass (maximum, then the sum of
exponentials from the cache) and once in the backward pass, writing the gradient as it goes, into a buffer kept from
the last step when one is given (``workspace``: :mod:`hf_densessm.ops.workspace` says why and when it is safe).
Rows are split between the workers of :func:`hf_densessm.ops.cpu_build.run_job`. Accumulation is in the logits' dtype (float32, or
float64 for float64 models); :func:`cross_entropy` runs the reference for other devices and dtypes and where the
kernel cannot be built.
"""

from __future__ import annotations

from string import Template

import torch
import torch.nn.functional as F

from .cpu_build import load_library, run_job, vector_source
from .workspace import Workspace

__all__ = ["cross_entropy", "cross_entropy_reference"]

_BODY = Template(r"""
/* Rows [r0, r1): lse_i = logsumexp(x_i). */
void ce_fwd$sfx(int64_t r0, int64_t r1, int64_t V, const $real *x, int64_t ld, $real *lse) {
    for (int64_t i = r0; i < r1; i++) {
        const $real *row = x + i * ld;
        vec$sfx m = ZERO$sfx + row[0];
        int64_t j = 0;
        for (; j + $W <= V; j += $W) {
            const vec$sfx v = vld$sfx(row + j, $W);
            const ivec$sfx gt = v > m;
            m = (vec$sfx)((gt & (ivec$sfx)v) | (~gt & (ivec$sfx)m));
        }
        $real mx = m[0];
        for (int l = 1; l < $W; l++) mx = m[l] > mx ? m[l] : mx;
        for (; j < V; j++) mx = row[j] > mx ? row[j] : mx;
        vec$sfx s = ZERO$sfx;
        for (j = 0; j + $W <= V; j += $W) s += vexp$sfx(vld$sfx(row + j, $W) - mx);
        if (j < V) {
            const int64_t nl = V - j;
            const vec$sfx e = vexp$sfx(vld$sfx(row + j, nl) - mx);
            for (int64_t l = 0; l < nl; l++) s[l] += e[l];
        }
        lse[i] = mx + log(hsum$sfx(s));
    }
}

/* Rows [r0, r1): g_i = exp(x_i - lse_i) * scale_i, then g_{i, t_i} -= scale_i (rows with scale 0 are zeros). */
void ce_bwd$sfx(int64_t r0, int64_t r1, int64_t V, const $real *x, int64_t ld, const $real *lse,
                const int64_t *target, const $real *scale, $real *g) {
    for (int64_t i = r0; i < r1; i++) {
        const $real *row = x + i * ld;
        $real *out = g + i * V;
        const $real sc = scale[i];
        if (sc == ($real)0) { memset(out, 0, (size_t)V * sizeof($real)); continue; }
        for (int64_t j = 0; j < V; j += $W) {
            const int64_t nl = V - j < $W ? V - j : $W;
            vst$sfx(out + j, vexp$sfx(vld$sfx(row + j, nl) - lse[i]) * sc, nl);
        }
        out[target[i]] -= sc;
    }
}

/* Jobs of cpu_build.run_job over rows [r0, r1). fwd args: V, x, ld, lse. bwd args: V, x, ld, lse, target, scale, g. */
void ce_fwd_job$sfx(int64_t w, int64_t r0, int64_t r1, const int64_t *a) {
    (void)w;
    ce_fwd$sfx(r0, r1, a[0], (const $real *)(intptr_t)a[1], a[2], ($real *)(intptr_t)a[3]);
}
void ce_bwd_job$sfx(int64_t w, int64_t r0, int64_t r1, const int64_t *a) {
    (void)w;
    ce_bwd$sfx(r0, r1, a[0], (const $real *)(intptr_t)a[1], a[2], (const $real *)(intptr_t)a[3],
               (const int64_t *)(intptr_t)a[4], (const $real *)(intptr_t)a[5], ($real *)(intptr_t)a[6]);
}
""")

SOURCE = vector_source("", _BODY)


def _library():
    return load_library("cross_entropy", SOURCE)


def _suffix(dtype: torch.dtype) -> str:
    return "_f64" if dtype == torch.float64 else "_f32"


class CrossEntropyCPUFn(torch.autograd.Function):
    """``(logits (rows, vocab), target (rows,) int64, ignore_index, divisor, workspace) -> loss`` (0-dim, logits'
    dtype) with the compiled kernel; saves the logits (no copy), the row log-sum-exps and the targets. The backward
    pass writes the logits' gradient into ``workspace`` (a :class:`~hf_densessm.ops.workspace.Workspace`) when one
    is given, else into a new tensor."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, divisor, workspace):
        lib = _library()
        rows, vocab = logits.shape
        lse = torch.empty(rows, dtype=logits.dtype)
        run_job(lib, "ce_fwd_job" + _suffix(logits.dtype), [vocab, logits.data_ptr(), logits.stride(0), lse.data_ptr()],
                rows)
        valid = target != ignore_index
        safe = torch.where(valid, target, torch.zeros_like(target)).contiguous()
        picked = logits.gather(1, safe[:, None])[:, 0]
        ctx.save_for_backward(logits, lse, safe, valid)
        ctx.divisor = divisor
        ctx.workspace = workspace
        return torch.where(valid, lse - picked, torch.zeros_like(lse)).sum() / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, safe, valid = ctx.saved_tensors
        lib = _library()
        rows, vocab = logits.shape
        scale = (grad_loss / ctx.divisor * valid).to(logits.dtype).contiguous()
        if ctx.workspace is None:
            grad = torch.empty(rows, vocab, dtype=logits.dtype)
        else:
            grad = ctx.workspace.take("cross_entropy_grad", (rows, vocab), logits.dtype)
        pointers = [t.data_ptr() for t in (lse, safe, scale, grad)]
        job_args = [vocab, logits.data_ptr(), logits.stride(0), *pointers]
        run_job(lib, "ce_bwd_job" + _suffix(logits.dtype), job_args, rows)
        return grad, None, None, None, None


def cross_entropy_reference(logits, target, ignore_index: int = -100, divisor=None) -> torch.Tensor:
    """``F.cross_entropy(logits, target, ignore_index, reduction="sum") / divisor`` (``divisor=None``: the number
    of rows whose target is not ``ignore_index``, i.e. reduction ``"mean"``; 0 valid rows give NaN, as PyTorch)."""
    if divisor is None:
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="mean")
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum") / divisor


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, divisor=None, workspace=None
) -> torch.Tensor:
    """Summed cross-entropy of ``logits`` rows against ``target`` divided by ``divisor`` (module docstring).

    Args:
        logits: ``(rows, vocab)`` float32 or float64 (other dtypes and devices run the reference), any row stride
            with unit stride along the vocabulary (else one copy is made).
        target: ``(rows,)`` integer class indices in ``[0, vocab)``, or ``ignore_index``.
        ignore_index: target value of rows that do not count.
        divisor: a number or 0-dim tensor the sum is divided by (transformers' ``num_items_in_batch``); ``None``
            divides by the number of counted rows (reduction ``"mean"``).
        workspace: a :class:`~hf_densessm.ops.workspace.Workspace` whose buffer the backward pass writes the
            logits' gradient into when it is free (the causal-LM models pass their own), or ``None``: a new tensor
            each time. The kernel path only; the values are the same either way.

    Returns:
        The loss, a 0-dim tensor in ``logits``' dtype, differentiable in ``logits``. Equal to
        :func:`cross_entropy_reference` within the dtype's rounding (tested).

    Raises:
        ValueError: ``logits`` not 2-D, ``target`` not 1-D of ``rows`` entries, or a target outside
            ``[0, vocab)`` that is not ``ignore_index`` (on the reference path, PyTorch's own error).
        TypeError: ``target`` not an integer tensor, or ``workspace`` neither ``None`` nor a ``Workspace``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape (rows, vocab), got shape {tuple(logits.shape)}")
    if target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(f"target must have shape ({logits.shape[0]},), got shape {tuple(target.shape)}")
    if target.is_floating_point() or target.dtype == torch.bool or target.is_complex():
        raise TypeError(f"target must be an integer tensor, got {target.dtype}")
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(
            f"workspace must be None or an hf_densessm.ops.workspace.Workspace, got {type(workspace).__name__}"
        )
    target = target.to(torch.int64)
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64) or _library() is None:
        return cross_entropy_reference(logits, target, ignore_index, divisor)  # it checks the targets itself
    counted = target != ignore_index
    if bool(((target < 0) | (target >= logits.shape[1])).logical_and(counted).any()):
        raise ValueError(
            f"target values must be in [0, {logits.shape[1]}) or ignore_index={ignore_index}, got "
            f"min {int(target.min())}, max {int(target.max())}"
        )
    if divisor is None:
        divisor = counted.sum().to(logits.dtype)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return CrossEntropyCPUFn.apply(logits, target, ignore_index, divisor, workspace)
