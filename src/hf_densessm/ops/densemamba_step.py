"""DenseMamba's whole one-token decoding step as one compiled CPU kernel (C, built on first use by
:mod:`hf_densessm.ops.cpu_build`): the embedding row, every block (RMSNorm, ``in_proj``, the convolution window,
``x_proj``, ``dt_proj``, the dense connection of the inputs ``u`` and ``B``, the SSM step, ``out_proj``, the
residual), the final norm and the LM head, in one OpenMP parallel region on PyTorch's threads, with the cache's
states updated in place. Used by ``compile_decode_step()``
(:meth:`~hf_densessm.modeling.modeling_densessm.DenseSSMCausalLMMixin.compile_decode_step`) for float32 and
float64 DenseMamba models whose configuration and modules it covers (:func:`unsupported_reason`).

Why: a batch-1 step reads every weight once (about 120 MB for DenseMamba-30M in float32), and its other work is
small; what the ``torch.compile`` graph adds around its matrix products (about 30 kernels, each a parallel region
with its own barriers, their buffers, PyTorch's guard check over some 150 tensors) cost about 1.2 ms per token on
the 2-core CPU of docs/benchmarks.md, where the products take 3 ms (run X). Here each block is seven phases
separated by barriers of one parallel region; the matrix-vector products read four weight rows at a time for all
batch rows, with a software prefetch of the next four, which reads faster than PyTorch's BLAS here; the per-channel
work runs on vectors of channels. Measured against the ``torch.compile`` step and transformers' Mamba in
``benchmarks/bench_cpu.py`` (docs/benchmarks.md, run Y).

The PyTorch reference is the model's own one-token path (``DenseMambaMixer._decode_step`` inside the model's
``forward``), which the tests compare with this kernel in float64 and float32, with and without the dense
connection, several rows, biases and ``dense_every``. The SSM step is the selective scan's own C
``state_update`` (:mod:`hf_densessm.ops.selective_scan.cpu`) and the norm is :mod:`hf_densessm.ops.rms_norm`'s C
``rms_fwd``, compiled into this library, not written again. The same formulas (paper: He et al. 2024, Eq. 10-17 for
the dense connection; Mamba paper Eq. 2a/2b and Algorithm 2 for the block)::

    x^l = RMSNorm(h^l);  [x, z] = in_proj(x^l);  u = SiLU(conv(window + x));  [dt_r, B, C] = x_proj(u)
    u' = u + SiLU(fc2_u SiLU(fc1_u x^l)) * sum_i u^{l-i};  B' = B + SiLU(fc2_B SiLU(fc1_B x^l)) * sum_i B^{l-i}
    dt = softplus(dt_proj(dt_r));  s = exp(dt A) s + dt B' u';  y = (C . s + D u') * SiLU(z)
    h^{l+1} = h^l + out_proj(y);  logits = lm_head(RMSNorm_f(h^L))
"""

from __future__ import annotations

import ctypes
import itertools
import operator
import struct
import threading
import weakref
from string import Template

import torch
from torch import nn
from torch.nn.modules import module as _module

from .cpu_build import load_error, load_library, openmp_ready, vector_source
from .rms_norm import _BODY as _RMS_BODY
from .selective_scan.cpu import _BODY as _SCAN_BODY
from .selective_scan.cpu import _HEADER as _SCAN_HEADER

__all__ = ["DenseMambaCPUStep", "MAX_PREDECESSORS", "registration_count", "unsupported_reason"]

#: Most predecessors (``dense_layers``) the kernel fuses; larger ``m`` runs the ``torch.compile`` step.
MAX_PREDECESSORS = 16

_HEADER = r"""
#ifdef _OPENMP
#include <omp.h>
#define DMS_BARRIER _Pragma("omp barrier")
#else
#define DMS_BARRIER
#endif
#define DMS_MAX_PRED @MAX_PREDECESSORS@
/* Every field a 64-bit integer (addresses as integers, eps as the bits of a double): no padding, filled from
   Python as one int64 array. */
typedef struct {
    int64_t norm_w, eps, in_w, in_b, conv_w, conv_b, xp_w, xp_b, dt_w, dt_b, A_log, Dskip, out_w, out_b,
            conv_state, ssm_state, npred, gu1, gu2, gb1, gb2, pred[DMS_MAX_PRED];
} dms_layer;
typedef struct {
    int64_t batch, hidden, inner, nstate, rank, kconv, gate, vocab, layers, threads;
    int64_t ids, embed, norm_w, eps, head_w, head_b, logits, work;
} dms_model;
/* [b, e) of this thread's share of n items, in blocks of align items. */
static inline void dms_range(int64_t n, int64_t align, int64_t t, int64_t nt, int64_t *b, int64_t *e) {
    const int64_t blocks = (n + align - 1) / align;
    int64_t lo = blocks * t / nt * align, hi = blocks * (t + 1) / nt * align;
    *b = lo < n ? lo : n;
    *e = hi < n ? hi : n;
}
static inline double dms_eps(int64_t bits) { double e; memcpy(&e, &bits, sizeof e); return e; }
#define DMS_P(T, v) ((T *)(intptr_t)(v))
"""

_BODY = Template(r"""
/* The lanes of v summed as a tree (half onto half): four dependent adds rather than the prelude's fifteen. */
static inline $real dms_hsum$sfx(vec$sfx v) {
    $real t[$W];
    memcpy(t, &v, sizeof v);
    for (int w = $W / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) t[l] += t[l + w];
    return t[0];
}

/* w . x over K elements (any K: the last vector partial), lanes summed as a tree. */
static inline $real dms_dot$sfx(const $real *w, const $real *x, int64_t K) {
    vec$sfx a = ZERO$sfx;
    for (int64_t k = 0; k < K; k += $W) {
        const int64_t nl = K - k < $W ? K - k : $W;
        a += vld$sfx(w + k, nl) * vld$sfx(x + k, nl);
    }
    return dms_hsum$sfx(a);
}

/* y[b sy + r] = act(W[r, :] . x[b sx + :] + bias[r]) (accumulate: added to y) for rows [r0, r1) and every batch
   row: four weight rows at a time, read once for all batch rows (they stay in L1 between rows). */
static void dms_gemv$sfx(const $real *W, const $real *bias, int64_t K, const $real *x, int64_t sx, int64_t batch,
                         $real *y, int64_t sy, int64_t r0, int64_t r1, int accumulate, int silu) {
    for (int64_t r = r0; r < r1; r += 4) {
        const int64_t nr = r1 - r < 4 ? r1 - r : 4;
        for (int64_t b = 0; b < batch; b++) {
            const $real *xb = x + b * sx;
            $real out[4];
            if (nr == 4 && K % $W == 0) {
                const $real *w0 = W + r * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
                vec$sfx a0 = ZERO$sfx, a1 = ZERO$sfx, a2 = ZERO$sfx, a3 = ZERO$sfx, xv, v0, v1, v2, v3;
                /* the next four rows (contiguous), requested one line per row per step: the hardware prefetcher
                   alone keeps too few lines in flight for short rows (measured: 1.3x the BLAS with it, 1.0x
                   without) */
                const char *next = (const char *)(W + (r + 4) * K), *stop = (const char *)(W + r1 * K);
                for (int64_t k = 0; k < K; k += $W) {
                    const char *p = next + 4 * k * sizeof($real);
                    if (b == 0 && p < stop)
                        for (int q = 0; q < 4 * (int)sizeof(vec$sfx); q += 64) __builtin_prefetch(p + q, 0, 3);
                    memcpy(&xv, xb + k, sizeof xv);
                    memcpy(&v0, w0 + k, sizeof v0); memcpy(&v1, w1 + k, sizeof v1);
                    memcpy(&v2, w2 + k, sizeof v2); memcpy(&v3, w3 + k, sizeof v3);
                    a0 += v0 * xv; a1 += v1 * xv; a2 += v2 * xv; a3 += v3 * xv;
                }
                out[0] = dms_hsum$sfx(a0); out[1] = dms_hsum$sfx(a1); out[2] = dms_hsum$sfx(a2);
                out[3] = dms_hsum$sfx(a3);
            } else {
                for (int64_t i = 0; i < nr; i++) out[i] = dms_dot$sfx(W + (r + i) * K, xb, K);
            }
            for (int64_t i = 0; i < nr; i++) {
                $real v = out[i] + (bias ? bias[r + i] : ($real)0);
                if (silu) v = v / (($real)1 + exp(-v));
                $real *o = y + b * sy + r + i;
                *o = accumulate ? *o + v : v;
            }
        }
    }
}

/* The gated sum of the dense connection for feature j of batch row b: SiLU(g . gate) with gate = SiLU(fc1 x^l)
   (already applied), times the predecessors' sum, nearest first (as ops/gated_add.py). */
static inline $real dms_dense$sfx(const $real *fc2_row, const $real *gate, int64_t G, const $real *feat,
                                  const dms_layer *L, int64_t stride, int64_t j) {
    const $real a = dms_dot$sfx(fc2_row, gate, G);
    $real total = 0;
    for (int64_t q = 0; q < L->npred; q++) total += feat[L->pred[q] * stride + j];
    return total * (a / (($real)1 + exp(-a)));
}

/* One decoding step of the whole model (module docstring). work: the scratch of dms_work_size. */
void dms_step$sfx(const dms_model *M, const dms_layer *Ls) {
    const int64_t Bt = M->batch, H = M->hidden, D = M->inner, N = M->nstate, R = M->rank, K = M->kconv;
    const int64_t G = M->gate, XD = R + 2 * N;
    $real *w = DMS_P($real, M->work);
    $real *h = w; w += Bt * H;
    $real *xn = w; w += Bt * H;
    $real *xz = w; w += Bt * 2 * D;
    $real *xdbl = w; w += Bt * XD;
    $real *g1u = w; w += Bt * G;
    $real *g1b = w; w += Bt * G;
    $real *uf = w; w += Bt * D;
    $real *Bf = w; w += Bt * N;
    $real *dt = w; w += Bt * D;
    $real *A = w; w += D * N;
    $real *y = w; w += Bt * D;
    $real *rstd = w; w += Bt;
    $real *ufeat = w; w += M->layers * Bt * D;   /* every layer's pre-fusion u, (layers, batch, D) */
    $real *bfeat = w;                            /* and B, (layers, batch, N) */
    const int64_t *ids = DMS_P(const int64_t, M->ids);
    #pragma omp parallel num_threads((int)M->threads)
    {
        int64_t t = 0, nt = 1, r0, r1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        dms_range(Bt, 1, t, nt, &r0, &r1);
        for (int64_t b = r0; b < r1; b++)
            memcpy(h + b * H, DMS_P(const $real, M->embed) + ids[b] * H, H * sizeof($real));
        DMS_BARRIER
        for (int64_t l = 0; l < M->layers; l++) {
            const dms_layer *L = Ls + l;
            const $real eps = ($real)dms_eps(L->eps);
            $real *u = ufeat + l * Bt * D, *Bpre = bfeat + l * Bt * N;
            /* 1. x^l = RMSNorm(h) */
            dms_range(Bt, 1, t, nt, &r0, &r1);
            rms_fwd$sfx(r0, r1, H, h, H, DMS_P(const $real, L->norm_w), &eps, 0, xn, rstd);
            DMS_BARRIER
            /* 2. [x, z] = in_proj(x^l); the dense gates' hidden layers SiLU(fc1 x^l) */
            dms_range(2 * D, 4, t, nt, &r0, &r1);
            dms_gemv$sfx(DMS_P(const $real, L->in_w), DMS_P(const $real, L->in_b), H, xn, H, Bt, xz, 2 * D, r0, r1,
                         0, 0);
            if (L->npred) {
                dms_range(G, 4, t, nt, &r0, &r1);
                dms_gemv$sfx(DMS_P(const $real, L->gu1), NULL, H, xn, H, Bt, g1u, G, r0, r1, 0, 1);
                dms_gemv$sfx(DMS_P(const $real, L->gb1), NULL, H, xn, H, Bt, g1b, G, r0, r1, 0, 1);
            }
            DMS_BARRIER
            /* 3. the convolution window rolled by one (this token last), u = SiLU(taps . window + bias) */
            dms_range(D, $W, t, nt, &r0, &r1);
            for (int64_t b = 0; b < Bt; b++)
                for (int64_t d0 = r0; d0 < r1; d0 += $W) {
                    const int64_t nl = r1 - d0 < $W ? r1 - d0 : $W;
                    vec$sfx sv = ZERO$sfx;
                    for (int64_t l = 0; l < nl; l++) {
                        const int64_t d = d0 + l;
                        $real *win = DMS_P($real, L->conv_state) + (b * D + d) * K;
                        const $real *taps = DMS_P(const $real, L->conv_w) + d * K;
                        for (int64_t k = 0; k + 1 < K; k++) win[k] = win[k + 1];
                        win[K - 1] = xz[b * 2 * D + d];
                        $real s = 0;
                        for (int64_t k = 0; k < K; k++) s += win[k] * taps[k];
                        sv[l] = s + (L->conv_b ? DMS_P(const $real, L->conv_b)[d] : ($real)0);
                    }
                    vst$sfx(u + b * D + d0, sv * vsigmoid$sfx(sv), nl);
                }
            DMS_BARRIER
            /* 4. [dt_r, B, C] = x_proj(u) */
            dms_range(XD, 4, t, nt, &r0, &r1);
            dms_gemv$sfx(DMS_P(const $real, L->xp_w), DMS_P(const $real, L->xp_b), D, u, D, Bt, xdbl, XD, r0, r1, 0, 0);
            DMS_BARRIER
            /* 5. per channel: dt before its softplus, A = -exp(A_log), the fused u'; thread 0: B and the fused B' */
            dms_range(D, $W, t, nt, &r0, &r1);
            dms_gemv$sfx(DMS_P(const $real, L->dt_w), DMS_P(const $real, L->dt_b), R, xdbl, XD, Bt, dt, D, r0, r1,
                         0, 0);
            for (int64_t i = r0 * N; i < r1 * N; i += $W) {
                const int64_t nl = r1 * N - i < $W ? r1 * N - i : $W;
                vst$sfx(A + i, -vexp$sfx(vld$sfx(DMS_P(const $real, L->A_log) + i, nl)), nl);
            }
            for (int64_t b = 0; b < Bt; b++)
                for (int64_t d0 = r0; d0 < r1; d0 += $W) {
                    const int64_t nl = r1 - d0 < $W ? r1 - d0 : $W;
                    vec$sfx out = vld$sfx(u + b * D + d0, nl);
                    if (L->npred) {  /* W channels' gate pre-activations and predecessor sums, then their SiLU */
                        vec$sfx av = ZERO$sfx, tv = ZERO$sfx;
                        const $real *fc2 = DMS_P(const $real, L->gu2), *gate = g1u + b * G;
                        for (int64_t i = 0; i < nl; i++) av[i] = dms_dot$sfx(fc2 + (d0 + i) * G, gate, G);
                        for (int64_t q = 0; q < L->npred; q++)  /* nearest first, as ops/gated_add.py */
                            tv += vld$sfx(ufeat + L->pred[q] * Bt * D + b * D + d0, nl);
                        out += tv * (av * vsigmoid$sfx(av));
                    }
                    vst$sfx(uf + b * D + d0, out, nl);
                }
            if (t == 0)
                for (int64_t b = 0; b < Bt; b++)
                    for (int64_t n = 0; n < N; n++) {
                        Bpre[b * N + n] = xdbl[b * XD + R + n];
                        Bf[b * N + n] = Bpre[b * N + n] + (L->npred ? dms_dense$sfx(DMS_P(const $real, L->gb2) + n * G,
                                                                                    g1b + b * G, G, bfeat, L,
                                                                                    Bt * N, b * N + n) : ($real)0);
                    }
            DMS_BARRIER
            /* 6. the SSM step on this thread's channels (the selective scan's own state_update) */
            if (r0 < r1)
                for (int64_t b = 0; b < Bt; b++)
                    state_update$sfx(1, r1 - r0, N, DMS_P($real, L->ssm_state) + (b * D + r0) * N, uf + b * D + r0,
                                     dt + b * D + r0, A + r0 * N, Bf + b * N, xdbl + b * XD + R + N,
                                     DMS_P(const $real, L->Dskip) + r0, xz + b * 2 * D + D + r0, NULL, 1,
                                     y + b * D + r0);
            DMS_BARRIER
            /* 7. h += out_proj(y) */
            dms_range(H, 4, t, nt, &r0, &r1);
            dms_gemv$sfx(DMS_P(const $real, L->out_w), DMS_P(const $real, L->out_b), D, y, D, Bt, h, H, r0, r1, 1, 0);
            DMS_BARRIER
        }
        {
            const $real eps = ($real)dms_eps(M->eps);
            dms_range(Bt, 1, t, nt, &r0, &r1);
            rms_fwd$sfx(r0, r1, H, h, H, DMS_P(const $real, M->norm_w), &eps, 0, xn, rstd);
        }
        DMS_BARRIER
        dms_range(M->vocab, 4, t, nt, &r0, &r1);
        dms_gemv$sfx(DMS_P(const $real, M->head_w), DMS_P(const $real, M->head_b), H, xn, H, Bt,
                     DMS_P($real, M->logits), M->vocab, r0, r1, 0, 0);
    }
}
""")


def _source() -> str:
    # fused multiply-adds in this library's loops (the BLAS uses them too; -std=c11 turns contraction off)
    header = ('#pragma GCC optimize ("fp-contract=fast")\n' + _SCAN_HEADER
              + _HEADER.replace("@MAX_PREDECESSORS@", str(MAX_PREDECESSORS)))
    body = Template(_RMS_BODY.template + _SCAN_BODY.template + _BODY.template)
    return vector_source(header, body)


def _library():
    return load_library("densemamba_step", _source())


_SUFFIX = {torch.float32: "_f32", torch.float64: "_f64"}
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_MODEL_FIELDS = 18
_LAYER_FIELDS = 21 + MAX_PREDECESSORS
#: Bumped by PyTorch's global module, parameter and buffer registration hooks (any assignment of a submodule,
#: parameter or buffer anywhere): every bound step re-reads its model after one.
_GENERATION = [0]
_HOOKS: list = []


def _bump(*_args):
    _GENERATION[0] += 1


def _install_hooks() -> None:
    if not _HOOKS:
        _HOOKS.extend([
            _module.register_module_module_registration_hook(_bump),
            _module.register_module_parameter_registration_hook(_bump),
            _module.register_module_buffer_registration_hook(_bump),
        ])


def _bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _plain(module, cls) -> bool:
    """``module`` is exactly ``cls``, with no hooks of its own and no replaced ``forward``."""
    return (
        type(module) is cls
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and "forward" not in module.__dict__
    )


def unsupported_reason(model) -> str | None:
    """Why :class:`DenseMambaCPUStep` cannot run ``model`` as it is now, or ``None`` when it can.

    Covered: a DenseMamba causal LM on the CPU, every parameter float32 (or every one float64), ``hidden_act="silu"``,
    ``dense_target="input"`` with the defaults of the dense connection (``dense_selection="mlp"``, one shared gate,
    ``dense_projection="identity"``, ``dense_fusion="add"``; ``dense_layers`` up to :data:`MAX_PREDECESSORS`, any
    ``dense_every``), any ``use_bias`` / ``use_conv_bias``, tied or untied LM head, and modules that are exactly the
    model's own classes with no hooks, adapters or replaced ``forward`` (a LoRA layer or a hook makes the step run
    elsewhere, so that it takes effect). A C compiler and PyTorch's OpenMP threads (:func:`cpu_build.openmp_ready`).
    """
    return _bind(model)[1]


def _bind(model):
    """``(binding, None)`` where the kernel can run ``model`` now, else ``(None, reason)``
    (:func:`unsupported_reason`): the checks and the binding are one pass."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "densemamba":
        return None, "not a DenseMamba model"
    for key, value in (("hidden_act", "silu"), ("dense_target", "input"), ("dense_selection", "mlp"),
                       ("dense_shared_gate", True), ("dense_projection", "identity"), ("dense_fusion", "add")):
        if getattr(config, key) != value:
            return None, f"config.{key}={getattr(config, key)!r} (the kernel covers {value!r})"
    if config.dense_layers > MAX_PREDECESSORS:
        return None, f"config.dense_layers={config.dense_layers} > {MAX_PREDECESSORS}"
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _SUFFIX:
        return None, (f"parameter dtypes {sorted(str(d) for d in dtypes)} (the kernel takes all float32 or all "
                      "float64)")
    if any(p.device.type != "cpu" for p in model.parameters()):
        return None, "parameters not on the CPU"
    library = _library()
    if library is None:
        return None, f"the kernel could not be built: {load_error('densemamba_step')}"
    if not openmp_ready(library):
        return None, ("PyTorch's OpenMP threads are not available to the kernel here (a forked process, or another "
                      "runtime)")
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return None, "global module forward hooks are registered"
    try:
        return _Binding(model), None
    except _Unsupported as error:
        return None, str(error)


class _Unsupported(Exception):
    pass


class _Binding:
    """The modules and weights of ``model`` the kernel reads, checked once; :meth:`current` re-checks what can
    change without a registration (hooks, a replaced ``forward``, a class swapped, a parameter's storage, dtype or
    shape, a norm's ``eps``)."""

    def __init__(self, model):
        config = model.config
        backbone = model.backbone
        self.generation = _GENERATION[0]
        self.dtype = model.lm_head.weight.dtype
        from ..modeling.dense_connection import DenseGate, DenseHiddenConnection
        from ..modeling.modeling_densemamba import (
            DenseMambaBlock,
            DenseMambaForCausalLM,
            DenseMambaMixer,
            DenseMambaModel,
        )
        from ..modeling.norm import DenseSSMRMSNorm

        # the head's class exactly: a subclass may compute its logits otherwise
        checked: list[tuple[nn.Module, type]] = [(model, DenseMambaForCausalLM), (backbone, DenseMambaModel),
                                                 (backbone.embeddings, nn.Embedding),
                                                 (backbone.norm_f, DenseSSMRMSNorm), (model.lm_head, nn.Linear)]
        params: list[torch.Tensor] = []
        norms: list[DenseSSMRMSNorm] = [backbone.norm_f]
        layer_parts = []
        layers = backbone.layers
        if type(layers) is not nn.ModuleList or len(layers) != config.num_hidden_layers:
            raise _Unsupported("backbone.layers is not the model's own list of blocks")

        def linear(module, out_features, in_features, bias_allowed=True):
            checked.append((module, nn.Linear))
            w, b = module.weight, module.bias
            if tuple(w.shape) != (out_features, in_features) or (b is not None and not bias_allowed):
                raise _Unsupported(f"a linear layer of shape {tuple(w.shape)}, bias {b is not None}")
            params.extend([w] if b is None else [w, b])
            return w, b

        D, H, N, R = config.intermediate_size, config.hidden_size, config.state_size, config.time_step_rank
        G, K = config.dense_gate_hidden_size, config.conv_kernel
        for idx, block in enumerate(layers):
            mixer = block.mixer
            checked += [(block, DenseMambaBlock), (mixer, DenseMambaMixer), (block.norm, DenseSSMRMSNorm),
                        (mixer.conv1d, nn.Conv1d)]
            norms.append(block.norm)
            in_w, in_b = linear(mixer.in_proj, 2 * D, H)
            xp_w, xp_b = linear(mixer.x_proj, R + 2 * N, D)
            dt_w, dt_b = linear(mixer.dt_proj, D, R)
            out_w, out_b = linear(mixer.out_proj, H, D)
            conv = mixer.conv1d
            if tuple(conv.weight.shape) != (D, 1, K):
                raise _Unsupported(f"conv1d weight of shape {tuple(conv.weight.shape)}")
            shapes = [(block.norm.weight, (H,)), (mixer.A_log, (D, N)), (mixer.D, (D,))]
            shapes += [] if conv.bias is None else [(conv.bias, (D,))]
            for tensor, shape in shapes:
                if tuple(tensor.shape) != shape or block.norm.num_groups != 1:
                    raise _Unsupported(f"a block parameter of shape {tuple(tensor.shape)} where {shape} is expected")
                params.append(tensor)
            params.append(conv.weight)
            gates = []
            for name in ("dense_u", "dense_B"):
                connection = getattr(mixer, name)
                if connection is None:
                    gates.append(None)
                    continue
                gate = connection.gate
                checked += [(connection, DenseHiddenConnection), (gate, DenseGate)]
                width = D if name == "dense_u" else N
                gates.append((linear(gate.fc1, G, H, False)[0], linear(gate.fc2, width, G, False)[0],
                              connection.num_predecessors))
            if gates[0] is None or gates[1] is None:
                if gates[0] is not None or gates[1] is not None:
                    raise _Unsupported("only one of dense_u / dense_B present")
                npred = 0
            else:
                npred = gates[0][2]
            layer_parts.append(dict(
                norm=block.norm, in_w=in_w, in_b=in_b, conv_w=conv.weight, conv_b=conv.bias, xp_w=xp_w, xp_b=xp_b,
                dt_w=dt_w, dt_b=dt_b, A_log=mixer.A_log, Dskip=mixer.D, out_w=out_w, out_b=out_b, npred=npred,
                gates=gates, pred=[idx - j for j in range(1, npred + 1)],
            ))
        head_w, head_b = linear(model.lm_head, config.vocab_size, H)
        embed = backbone.embeddings.weight
        if tuple(embed.shape) != (config.vocab_size, H) or backbone.embeddings.max_norm is not None:
            raise _Unsupported(f"embedding of shape {tuple(embed.shape)}, max_norm {backbone.embeddings.max_norm}")
        if tuple(backbone.norm_f.weight.shape) != (H,) or backbone.norm_f.num_groups != 1:
            raise _Unsupported("a final norm of another shape")
        params += [embed, backbone.norm_f.weight]
        for p in params:
            if p.dtype != self.dtype or p.device.type != "cpu" or not p.is_contiguous():
                raise _Unsupported("a parameter of another dtype or device, or not contiguous")
        for module, cls in checked:
            if not _plain(module, cls):
                raise _Unsupported(f"{type(module).__name__} is not a plain {cls.__name__} (hooks, an adapter, or a "
                                   "replaced forward)")
        self.modules = [m for m, _ in checked]
        self.classes = [c for _, c in checked]
        self.hook_dicts = [m._forward_hooks for m in self.modules] + [m._forward_pre_hooks for m in self.modules]
        self.module_dicts = [m.__dict__ for m in self.modules]
        self.params = params
        self.norms = norms
        self.key = self._key()
        self.sizes = (H, D, N, R, K, G, config.vocab_size)
        # the fixed part of the argument arrays: every weight's address
        fixed = [0] * _MODEL_FIELDS
        fixed[1:10] = [H, D, N, R, K, G, config.vocab_size, len(layer_parts), 0]
        fixed[11:16] = [embed.data_ptr(), backbone.norm_f.weight.data_ptr(), _bits(backbone.norm_f.variance_epsilon),
                        head_w.data_ptr(), 0 if head_b is None else head_b.data_ptr()]
        self.model_args = fixed
        self.layer_args = []
        for layer in layer_parts:
            row = [0] * _LAYER_FIELDS
            ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
            gu = layer["gates"][0] or (None, None, 0)
            gb = layer["gates"][1] or (None, None, 0)
            row[0:21] = [ptr(layer["norm"].weight), _bits(layer["norm"].variance_epsilon), ptr(layer["in_w"]),
                         ptr(layer["in_b"]), ptr(layer["conv_w"]), ptr(layer["conv_b"]), ptr(layer["xp_w"]),
                         ptr(layer["xp_b"]), ptr(layer["dt_w"]), ptr(layer["dt_b"]), ptr(layer["A_log"]),
                         ptr(layer["Dskip"]), ptr(layer["out_w"]), ptr(layer["out_b"]), 0, 0, layer["npred"],
                         ptr(gu[0]), ptr(gu[1]), ptr(gb[0]), ptr(gb[1])]
            row[21:21 + layer["npred"]] = layer["pred"]
            self.layer_args.append(row)
        self.library = _library()
        self.step_fn = getattr(self.library, "dms_step" + _SUFFIX[self.dtype])
        self.arrays = self.new_arrays()

    def new_arrays(self):
        """The C arguments (the model's fields, every layer's row), with this binding's weight addresses."""
        flat = [value for row in self.layer_args for value in row]
        return (ctypes.c_int64 * _MODEL_FIELDS)(*self.model_args), (ctypes.c_int64 * len(flat))(*flat)

    def _key(self):
        params = self.params
        return (
            list(map(torch.Tensor.data_ptr, params)),
            list(map(_DTYPE, params)),
            list(map(_SHAPE, params)),
            [n.variance_epsilon for n in self.norms],
        )

    def current(self) -> bool:
        """Whether the bound modules and weights are still the model's, unchanged in what the kernel assumes (about
        35 us for DenseMamba-30M: the checks run over lists kept at binding, in C loops)."""
        return (
            self.generation == _GENERATION[0]
            and not _module._global_forward_hooks
            and not _module._global_forward_pre_hooks
            and not any(self.hook_dicts)  # PyTorch's register_forward_(pre_)hook fill these dicts in place
            and list(map(type, self.modules)) == self.classes
            and not any(map(operator.contains, self.module_dicts, itertools.repeat("forward")))
            and self._key() == self.key
        )


class DenseMambaCPUStep:
    """The compiled one-token decoding step of one DenseMamba model (module docstring), bound to its modules.

    ``step(input_ids, cache)`` returns the logits ``(batch, 1, vocab_size)`` (float32, or float64 for a float64
    model) of ``input_ids`` ``(batch, 1)`` int64 (ids in ``[0, vocab_size)``, checked by the caller) after the
    positions in ``cache`` (a filled DenseMamba cache of ``batch`` rows), and advances the cache's convolution
    windows and SSM states in place (the position count is the caller's). It returns ``None`` (nothing done) when
    the model changed in a way the kernel does not cover since it was bound (:func:`unsupported_reason`), or the
    cache's states are not contiguous tensors of the model's dtype: the caller then runs another step.

    Built with :meth:`for_model`, which returns ``None`` where :func:`unsupported_reason` gives a reason.
    """

    def __init__(self, model, binding: _Binding):
        self._model = weakref.ref(model)
        self._binding = binding
        self._work: torch.Tensor | None = None
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model) -> DenseMambaCPUStep | None:
        """The step of ``model``, or ``None`` where the kernel cannot run it (:func:`unsupported_reason`)."""
        binding, _ = _bind(model)
        if binding is None:
            return None
        _install_hooks()
        return cls(model, binding)

    def _rebind(self, model) -> bool:
        binding, _ = _bind(model)
        if binding is not None:
            self._binding = binding
        return binding is not None

    def __call__(self, input_ids: torch.Tensor, cache) -> torch.Tensor | None:
        model = self._model()
        if model is None:
            return None
        binding = self._binding
        if not openmp_ready(binding.library):  # e.g. a forked child: libgomp's threads did not survive the fork
            return None
        if not binding.current() and not self._rebind(model):
            return None
        binding = self._binding
        dtype = binding.dtype
        if input_ids.dtype != torch.int64 or input_ids.device.type != "cpu":
            return None
        batch = input_ids.shape[0]
        H, D, N, R, K, G, V = binding.sizes
        states = []
        for layer in cache.layers:
            conv, ssm = layer.conv_states[0], layer.recurrent_states[0]
            if not (conv.dtype == dtype == ssm.dtype and conv.is_contiguous() and ssm.is_contiguous()
                    and conv.is_cpu and ssm.is_cpu):
                return None
            states += (conv.data_ptr(), ssm.data_ptr())
        layers = len(binding.layer_args)
        size = batch * (2 * H + 2 * D + (R + 2 * N) + 2 * G + D + N + D + D + 1 + layers * (D + N)) + D * N
        ids = input_ids if input_ids.is_contiguous() else input_ids.contiguous()
        logits = torch.empty(batch, 1, V, dtype=dtype)
        # the scratch and the argument arrays are kept between steps; a call that overlaps another (two threads on
        # one model) takes its own
        owned = self._lock.acquire(blocking=False)
        try:
            work, arrays = (self._work, binding.arrays) if owned else (None, binding.new_arrays())
            if work is None or work.numel() < size or work.dtype != dtype:
                work = torch.empty(size, dtype=dtype)
                if owned:
                    self._work = work
            margs, largs = arrays
            margs[0], margs[9], margs[10], margs[16], margs[17] = (
                batch, torch.get_num_threads(), ids.data_ptr(), logits.data_ptr(), work.data_ptr())
            for i in range(layers):  # the state slots (14, 15) of each layer's row
                largs[i * _LAYER_FIELDS + 14] = states[2 * i]
                largs[i * _LAYER_FIELDS + 15] = states[2 * i + 1]
            binding.step_fn(margs, largs)
        finally:
            if owned:
                self._lock.release()
        return logits


def registration_count() -> int:
    """How many module, parameter and buffer registrations PyTorch's global hooks have counted since the first step
    was bound (0 before): a model that changed by one is read again."""
    return _GENERATION[0]
