"""The selective scan as a compiled CPU kernel (C, built on first use by :mod:`hf_densessm.ops.cpu_build`): what
the models run on the CPU when a C compiler is available (``backend="auto"`` or ``"cpu"``).

- :func:`selective_scan_cpu`: the whole sequence, forward and backward (:class:`SelectiveScanCPUFn`);
- :func:`selective_state_update_cpu`: one decoding step, the state updated in place.

Same recurrence and arguments as :func:`.chunked_torch.selective_scan_torch` (Mamba paper Algorithm 2, eq. 2a/2b
with eq. 4's discretization as the authors' code applies it) and the same ground truth,
:func:`.naive.selective_scan_naive`, in the tests::

    h_t = a_t * h_{t-1} + dt_t * B_t * u_t,   a_t = exp(dt_t * A) (0 at a packed document's first token)
    y_t = (sum_n C_{t,n} h_{t,n} + D * u_t) * silu(z_t)

**How the kernel is laid out.** Channels are taken ``W`` at a time (16 in float32, 8 in float64: one 64-byte
vector, written with GCC vector extensions so the compiler maps it to AVX-512, AVX2 or NEON registers); for each
group of ``W`` channels and each sequence the loop runs over the tokens with the ``N`` state vectors kept in
registers: per token one vector exponential per state index, two fused multiply-adds and the ``C`` readout. Every
input is read once and nothing of size ``(batch, length, dim, state)`` exists. Per-token tensors are read in the
model's ``(batch, length, dim)`` memory order (the ``(batch, dim, length)`` arguments are usually transposed views
of it; any other layout is copied once). The exponential is a Cody-Waite range reduction and a Taylor polynomial
(degree 7 in float32, relative error below 2e-7; degree 13 in float64, below 1e-15), because compilers only
vectorize ``exp`` under ``-ffast-math``, which this package never uses.

**Backward** (:class:`SelectiveScanCPUFn`): nothing but the inputs is saved. Per group of channels the states are
recomputed once to keep one state every ``segment`` tokens, then, segment by segment from the end, the segment's
states are recomputed and the adjoint recurrence ``g_{t-1} = a_t (g_t + C_t gy_t)`` runs backwards, reading every
gradient off ``g``, ``h_{t-1}`` and ``a_t`` (``d a_t / d dt_t = A a_t``). ``dB`` and ``dC`` are sums over channels:
each worker accumulates them per lane for all of its channel groups and reduces the lanes once per sequence.

Threads: the channel groups are split between ``torch.get_num_threads()`` workers
(:func:`hf_densessm.ops.cpu_build.run_job`: PyTorch's OpenMP threads, or a thread pool); the decode step runs on one
thread (it is a few microseconds).
Accumulation is in float32 for float32/bfloat16/float16 inputs and in float64 for float64 inputs.
"""

from __future__ import annotations

import ctypes
from string import Template

import torch
import torch.nn.functional as F

from ..cpu_build import load_error, load_library, per_worker, run_job, vector_source, worker_count
from .chunked_torch import _compute_dtype, discretize_delta

__all__ = ["SelectiveScanCPUFn", "cpu_kernel_available", "selective_scan_cpu", "selective_state_update_cpu"]

#: Largest ``state`` size the kernel takes (its per-state vectors live on the stack); larger runs the PyTorch path.
MAX_STATE = 256
#: Tokens per recomputed segment in the backward pass (the segment's states stay in the L2 cache).
SEGMENT = 32
#: Channel groups whose states a worker advances together, token by token (must match the C source's TILE). 16
#: rather than 8: a training step's scans (2 x 1024 tokens, 1024 channels, 16 states, forward + backward) ran 12-15%
#: faster on the 2-core AVX-512 Xeon of docs/benchmarks.md (more independent state chains per token; 32 was as fast).
TILE = 16

_HEADER = r"""
typedef struct {
    int64_t batch, dim, length, nstate, seg;
    const void *u, *dt, *A, *B, *C, *D, *z, *keep, *h0, *dy, *dhlast;
    int64_t u_sb, u_st, dt_sb, dt_st, B_sb, B_st, C_sb, C_st, z_sb, z_st, dy_sb, dy_st, y_sb, y_st;
    void *y, *hlast, *du, *ddt, *dz, *dA, *dD, *dh0, *ck;
} scan_args;
"""

# One copy per compute type (:func:`hf_densessm.ops.cpu_build.vector_source`: $real, $W lanes, $sfx suffix).
_BODY = Template(r"""
/* Loops: sequence, then tiles of TILE channel groups, then tokens, then the tile's groups: a tile's states stay in
   the L1 cache and the tile's inputs of one token are contiguous in memory (one page visit per token and tile). */
#ifndef TILE
#define TILE 16
#endif

/* A tile's parameters: A (lanes over channels, one vector per state index) and D; the state before the sequence
   (h0, or zeros) into h[i * hstride + n]. */
static inline __attribute__((always_inline)) void load_tile$sfx(const scan_args *a, int64_t b, int64_t gt, int64_t nt,
                                                               const int64_t N, vec$sfx Av[][N], vec$sfx *Dv,
                                                               vec$sfx *h, int64_t hstride) {
    const $real *A = a->A, *D = a->D, *h0 = a->h0;
    const int64_t dim = a->dim;
    for (int64_t i = 0; i < nt; i++) {
        const int64_t d0 = (gt + i) * $W, nl = dim - d0 < $W ? dim - d0 : $W;
        for (int64_t n = 0; n < N; n++) {
            Av[i][n] = vlds$sfx(A + d0 * N + n, N, nl);
            h[i * hstride + n] = h0 ? vlds$sfx(h0 + (b * dim + d0) * N + n, N, nl) : ZERO$sfx;
        }
        Dv[i] = D ? vld$sfx(D + d0, nl) : ZERO$sfx;
    }
}

/* Forward over channel groups [g0, g1): y, the last state, the checkpoints. */
static inline __attribute__((always_inline)) void fwd_groups$sfx(const scan_args *a, int64_t g0, int64_t g1,
                                                                const int64_t N) {
    const $real *u = a->u, *dt = a->dt, *A = a->A, *B = a->B, *C = a->C, *D = a->D, *z = a->z, *keep = a->keep,
                *h0 = a->h0;
    $real *y = a->y, *hlast = a->hlast;
    vec$sfx *ck = a->ck;  /* optional: the state before every seg-th token, for the backward pass */
    const int64_t L = a->length, dim = a->dim, seg = a->seg, nseg = (L + seg - 1) / seg;
    const int64_t ngroups = (dim + $W - 1) / $W;
    vec$sfx h[TILE][N], Av[TILE][N], Dv[TILE];
    for (int64_t b = 0; b < a->batch; b++)
        for (int64_t gt = g0; gt < g1; gt += TILE) {
            const int64_t nt = g1 - gt < TILE ? g1 - gt : TILE;
            load_tile$sfx(a, b, gt, nt, N, Av, Dv, &h[0][0], N);
            for (int64_t t = 0; t < L; t++) {
                const $real *Bt = B + b * a->B_sb + t * a->B_st, *Ct = C + b * a->C_sb + t * a->C_st;
                const $real k = keep ? keep[b * L + t] : ($real)1;
                for (int64_t i = 0; i < nt; i++) {
                    const int64_t d0 = (gt + i) * $W, nl = dim - d0 < $W ? dim - d0 : $W;
                    if (ck && t % seg == 0)
                        memcpy(ck + ((b * nseg + t / seg) * ngroups + gt + i) * N, h[i], (size_t)N * sizeof(vec$sfx));
                    const vec$sfx uv = vld$sfx(u + b * a->u_sb + t * a->u_st + d0, nl);
                    const vec$sfx dv = vld$sfx(dt + b * a->dt_sb + t * a->dt_st + d0, nl);
                    const vec$sfx dtu = dv * uv;
                    vec$sfx acc = Dv[i] * uv;
                    for (int64_t n = 0; n < N; n++) {
                        h[i][n] = vexp$sfx(dv * Av[i][n]) * k * h[i][n] + dtu * Bt[n];
                        acc += Ct[n] * h[i][n];
                    }
                    if (z) {
                        const vec$sfx zv = vld$sfx(z + b * a->z_sb + t * a->z_st + d0, nl);
                        acc = acc * zv * vsigmoid$sfx(zv);
                    }
                    vst$sfx(y + b * a->y_sb + t * a->y_st + d0, acc, nl);
                }
            }
            if (hlast)
                for (int64_t i = 0; i < nt; i++) {
                    const int64_t d0 = (gt + i) * $W, nl = dim - d0 < $W ? dim - d0 : $W;
                    for (int64_t n = 0; n < N; n++) vsts$sfx(hlast + (b * dim + d0) * N + n, N, h[i][n], nl);
                }
        }
}

void scan_fwd$sfx(const scan_args *a, int64_t g0, int64_t g1) {
    if (a->nstate == 16) fwd_groups$sfx(a, g0, g1, 16); else fwd_groups$sfx(a, g0, g1, a->nstate);
}

/* Backward over channel groups [g0, g1). du, ddt, dz: (batch, length, dim) contiguous, written; dA (dim, N) and
   dD (dim) accumulated (+=, zeroed by the caller); dh0 (batch, dim, N) written; dBp, dCp (batch, length, N): this
   worker's partial sums over its channels, written. work: TILE * (nseg + 2 * seg + 1) * N + 2 * length * N
   vectors. */
static inline __attribute__((always_inline)) void bwd_groups$sfx(const scan_args *a, int64_t g0, int64_t g1,
                                                                $real *dBp, $real *dCp, vec$sfx *work,
                                                                const int64_t N) {
    const $real *u = a->u, *dt = a->dt, *A = a->A, *B = a->B, *C = a->C, *D = a->D, *z = a->z, *keep = a->keep,
                *h0 = a->h0, *dy = a->dy, *dhlast = a->dhlast;
    $real *du = a->du, *ddt = a->ddt, *dz = a->dz, *dA = a->dA, *dD = a->dD, *dh0 = a->dh0;
    const int64_t L = a->length, dim = a->dim, seg = a->seg, nseg = (L + seg - 1) / seg;
    const int64_t ngroups = (dim + $W - 1) / $W;
    /* per tile member i: recomputed checkpoints ckw, the segment's states hs (seg + 1) and decays as (seg) */
    vec$sfx *ckw = work, *hs = ckw + TILE * nseg * N, *as = hs + TILE * (seg + 1) * N;
    vec$sfx *accB = as + TILE * seg * N, *accC = accB + L * N;
    vec$sfx g[TILE][N], Av[TILE][N], dAacc[TILE][N], Dv[TILE], dDacc[TILE];
    for (int64_t b = 0; b < a->batch; b++) {
        memset(accB, 0, (size_t)(2 * L * N) * sizeof(vec$sfx));
        for (int64_t gt = g0; gt < g1; gt += TILE) {
            const int64_t nt = g1 - gt < TILE ? g1 - gt : TILE;
            load_tile$sfx(a, b, gt, nt, N, Av, Dv, hs, (seg + 1) * N);
            for (int64_t i = 0; i < nt; i++) {
                const int64_t d0 = (gt + i) * $W, nl = dim - d0 < $W ? dim - d0 : $W;
                for (int64_t n = 0; n < N; n++) {
                    dAacc[i][n] = ZERO$sfx;
                    g[i][n] = dhlast ? vlds$sfx(dhlast + (b * dim + d0) * N + n, N, nl) : ZERO$sfx;
                }
                dDacc[i] = ZERO$sfx;
            }
            /* 1. states at the segment starts: saved by the forward pass, or recomputed here */
            if (!a->ck)
                for (int64_t t = 0; t < L; t++) {
                    const $real *Bt = B + b * a->B_sb + t * a->B_st;
                    const $real k = keep ? keep[b * L + t] : ($real)1;
                    for (int64_t i = 0; i < nt; i++) {
                        const int64_t d0 = (gt + i) * $W, nl = dim - d0 < $W ? dim - d0 : $W;
                        vec$sfx *hc = hs + i * (seg + 1) * N;
                        if (t % seg == 0) memcpy(ckw + (i * nseg + t / seg) * N, hc, (size_t)N * sizeof(vec$sfx));
                        const vec$sfx uv = vld$sfx(u + b * a->u_sb + t * a->u_st + d0, nl);
                        const vec$sfx dv = vld$sfx(dt + b * a->dt_sb + t * a->dt_st + d0, nl);
                        const vec$sfx dtu = dv * uv;
                        for (int64_t n = 0; n < N; n++) hc[n] = vexp$sfx(dv * Av[i][n]) * k * hc[n] + dtu * Bt[n];
                    }
                }
            /* 2. the adjoint, segment by segment from the end */
            for (int64_t s = nseg - 1; s >= 0; s--) {
                const int64_t t0 = s * seg, t1 = t0 + seg < L ? t0 + seg : L;
                for (int64_t i = 0; i < nt; i++) {
                    const vec$sfx *ck = a->ck ? (const vec$sfx *)a->ck + ((b * nseg + s) * ngroups + gt + i) * N
                                              : ckw + (i * nseg + s) * N;
                    memcpy(hs + i * (seg + 1) * N, ck, (size_t)N * sizeof(vec$sfx));
                }
                for (int64_t t = t0; t < t1; t++) {
                    const int64_t r = t - t0;
                    const $real *Bt = B + b * a->B_sb + t * a->B_st;
                    const $real k = keep ? keep[b * L + t] : ($real)1;
                    for (int64_t i = 0; i < nt; i++) {
                        const int64_t d0 = (gt + i) * $W, nl = dim - d0 < $W ? dim - d0 : $W;
                        vec$sfx *hh = hs + (i * (seg + 1) + r) * N, *aa = as + (i * seg + r) * N;
                        const vec$sfx uv = vld$sfx(u + b * a->u_sb + t * a->u_st + d0, nl);
                        const vec$sfx dv = vld$sfx(dt + b * a->dt_sb + t * a->dt_st + d0, nl);
                        const vec$sfx dtu = dv * uv;
                        for (int64_t n = 0; n < N; n++) {
                            const vec$sfx an = vexp$sfx(dv * Av[i][n]) * k;
                            aa[n] = an;
                            hh[N + n] = an * hh[n] + dtu * Bt[n];
                        }
                    }
                }
                for (int64_t t = t1 - 1; t >= t0; t--) {
                    const int64_t r = t - t0;
                    const $real *Bt = B + b * a->B_sb + t * a->B_st, *Ct = C + b * a->C_sb + t * a->C_st;
                    vec$sfx *aB = accB + t * N, *aC = accC + t * N;
                    for (int64_t i = 0; i < nt; i++) {
                        const int64_t d0 = (gt + i) * $W, nl = dim - d0 < $W ? dim - d0 : $W;
                        const vec$sfx *hprev = hs + (i * (seg + 1) + r) * N, *hcur = hprev + N, *at = as + (i * seg + r) * N;
                        const vec$sfx uv = vld$sfx(u + b * a->u_sb + t * a->u_st + d0, nl);
                        const vec$sfx dv = vld$sfx(dt + b * a->dt_sb + t * a->dt_st + d0, nl);
                        vec$sfx gy = dy ? vld$sfx(dy + b * a->dy_sb + t * a->dy_st + d0, nl) : ZERO$sfx;
                        if (z) {
                            const vec$sfx zv = vld$sfx(z + b * a->z_sb + t * a->z_st + d0, nl);
                            vec$sfx yv = Dv[i] * uv;
                            for (int64_t n = 0; n < N; n++) yv += Ct[n] * hcur[n];
                            const vec$sfx sg = vsigmoid$sfx(zv);
                            vst$sfx(dz + (b * L + t) * dim + d0, gy * yv * sg * (($real)1 + zv * (($real)1 - sg)), nl);
                            gy = gy * zv * sg;
                        }
                        dDacc[i] += gy * uv;
                        const vec$sfx dtu = dv * uv;
                        vec$sfx sB = ZERO$sfx, sA = ZERO$sfx;
                        for (int64_t n = 0; n < N; n++) {
                            const vec$sfx gn = g[i][n] + Ct[n] * gy;
                            aC[n] += gy * hcur[n];
                            aB[n] += gn * dtu;
                            sB += gn * Bt[n];
                            const vec$sfx gah = gn * at[n] * hprev[n];
                            sA += Av[i][n] * gah;
                            dAacc[i][n] += gah * dv;
                            g[i][n] = gn * at[n];
                        }
                        vst$sfx(du + (b * L + t) * dim + d0, Dv[i] * gy + dv * sB, nl);
                        vst$sfx(ddt + (b * L + t) * dim + d0, uv * sB + sA, nl);
                    }
                }
            }
            for (int64_t i = 0; i < nt; i++) {
                const int64_t d0 = (gt + i) * $W, nl = dim - d0 < $W ? dim - d0 : $W;
                for (int64_t n = 0; n < N; n++) {
                    vsts$sfx(dh0 + (b * dim + d0) * N + n, N, g[i][n], nl);
                    for (int64_t l = 0; l < nl; l++) dA[(d0 + l) * N + n] += dAacc[i][n][l];
                }
                if (dD) for (int64_t l = 0; l < nl; l++) dD[d0 + l] += dDacc[i][l];
            }
        }
        for (int64_t t = 0; t < L; t++)
            for (int64_t n = 0; n < N; n++) {
                dBp[(b * L + t) * N + n] = hsum$sfx(accB[t * N + n]);
                dCp[(b * L + t) * N + n] = hsum$sfx(accC[t * N + n]);
            }
    }
}

void scan_bwd$sfx(const scan_args *a, int64_t g0, int64_t g1, $real *dBp, $real *dCp, vec$sfx *work) {
    if (a->nstate == 16) bwd_groups$sfx(a, g0, g1, dBp, dCp, work, 16);
    else bwd_groups$sfx(a, g0, g1, dBp, dCp, work, a->nstate);
}

/* Jobs of cpu_build.run_job over channel groups [g0, g1). fwd args: the scan_args. bwd args: the scan_args, then
   the dB, dC and work buffers of worker 0 and their per-worker strides in bytes. */
void scan_fwd_job$sfx(int64_t w, int64_t g0, int64_t g1, const int64_t *args) {
    (void)w;
    scan_fwd$sfx((const scan_args *)(intptr_t)args[0], g0, g1);
}
void scan_bwd_job$sfx(int64_t w, int64_t g0, int64_t g1, const int64_t *args) {
    scan_bwd$sfx((const scan_args *)(intptr_t)args[0], g0, g1, ($real *)((char *)(intptr_t)args[1] + w * args[2]),
                 ($real *)((char *)(intptr_t)args[3] + w * args[4]),
                 (vec$sfx *)((char *)(intptr_t)args[5] + w * args[6]));
}

/* One decoding step: state (batch, dim, N), x/dt/z/y (batch, dim), B/C (batch, N), A (dim, N), all contiguous.
   W channels at a time: their dt (softplus), D x and SiLU(z) as vectors, each channel's N states as vectors. */
void state_update$sfx(int64_t batch, int64_t dim, int64_t N, $real *state, const $real *x, const $real *dt,
                      const $real *A, const $real *B, const $real *C, const $real *D, const $real *z,
                      const $real *dt_bias, int64_t softplus, $real *y) {
    for (int64_t b = 0; b < batch; b++)
        for (int64_t d0 = 0; d0 < dim; d0 += $W) {
            const int64_t cl = dim - d0 < $W ? dim - d0 : $W;
            vec$sfx dtv = vld$sfx(dt + b * dim + d0, cl);
            if (dt_bias) dtv += vld$sfx(dt_bias + d0, cl);
            if (softplus) dtv = vsoftplus$sfx(dtv);  /* torch's softplus, threshold 20 */
            const vec$sfx xv = vld$sfx(x + b * dim + d0, cl);
            vec$sfx yv = ZERO$sfx;
            for (int64_t l = 0; l < cl; l++) {
                const int64_t d = d0 + l;
                const $real dtl = dtv[l], xl = xv[l];
                $real *h = state + (b * dim + d) * N;
                vec$sfx acc = ZERO$sfx;
                for (int64_t n0 = 0; n0 < N; n0 += $W) {
                    const int64_t nl = N - n0 < $W ? N - n0 : $W;
                    const vec$sfx av = vexp$sfx(dtl * vld$sfx(A + d * N + n0, nl));
                    const vec$sfx hv = av * vld$sfx(h + n0, nl) + (dtl * xl) * vld$sfx(B + b * N + n0, nl);
                    vst$sfx(h + n0, hv, nl);
                    acc += vld$sfx(C + b * N + n0, nl) * hv;
                }
                yv[l] = hsum$sfx(acc);
            }
            if (D) yv += vld$sfx(D + d0, cl) * xv;
            if (z) { const vec$sfx zv = vld$sfx(z + b * dim + d0, cl); yv *= zv * vsigmoid$sfx(zv); }
            vst$sfx(y + b * dim + d0, yv, cl);
        }
}
""")


SOURCE = vector_source(_HEADER, _BODY)


class _ScanArgs(ctypes.Structure):
    _fields_ = (
        [(name, ctypes.c_int64) for name in ("batch", "dim", "length", "nstate", "seg")]
        + [(name, ctypes.c_void_p) for name in ("u", "dt", "A", "B", "C", "D", "z", "keep", "h0", "dy", "dhlast")]
        + [(name, ctypes.c_int64) for name in ("u_sb", "u_st", "dt_sb", "dt_st", "B_sb", "B_st", "C_sb", "C_st",
                                                "z_sb", "z_st", "dy_sb", "dy_st", "y_sb", "y_st")]
        + [(name, ctypes.c_void_p) for name in ("y", "hlast", "du", "ddt", "dz", "dA", "dD", "dh0", "ck")]
    )


def _library():
    return load_library("selective_scan", SOURCE)


def cpu_kernel_available() -> bool:
    """Whether the compiled kernel can run here (built, or buildable now: this call builds it once)."""
    return _library() is not None


def why_unavailable() -> str | None:
    """The reason the kernel could not be built in this process, or ``None``."""
    return load_error("selective_scan")


def _lanes(cdt: torch.dtype) -> int:
    return 8 if cdt == torch.float64 else 16


def _suffix(cdt: torch.dtype) -> str:
    return "_f64" if cdt == torch.float64 else "_f32"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _token_major(x: torch.Tensor | None, cdt: torch.dtype):
    """``x`` (batch, k, length) as a (batch, length, k) tensor with unit stride along ``k`` in ``cdt`` (a view when
    ``x`` already is a transposed view of such a tensor, else one copy), and its batch and token strides."""
    if x is None:
        return None, 0, 0
    xt = x.transpose(1, 2)
    if xt.dtype != cdt or xt.stride(2) != 1:
        xt = xt.to(cdt).contiguous()
    return xt, xt.stride(0), xt.stride(1)


def _contiguous(x: torch.Tensor | None, cdt: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(cdt).contiguous()


def _args(u, dt, A, B, C, D, z, keep, h0) -> tuple[_ScanArgs, list]:
    """The kernel's argument struct for the (batch, dim, length) inputs, and the tensors it points into (kept
    alive by the caller while the kernel runs)."""
    cdt = dt.dtype
    batch, dim, length = u.shape
    ut, u_sb, u_st = _token_major(u, cdt)
    dtt, dt_sb, dt_st = _token_major(dt, cdt)
    Bt, B_sb, B_st = _token_major(B, cdt)
    Ct, C_sb, C_st = _token_major(C, cdt)
    zt, z_sb, z_st = _token_major(z, cdt)
    A_, D_, h0_ = _contiguous(A, cdt), _contiguous(D, cdt), _contiguous(h0, cdt)
    keep_ = None if keep is None else keep.to(cdt).contiguous()
    args = _ScanArgs(
        batch=batch, dim=dim, length=length, nstate=A.shape[1], seg=SEGMENT,
        u=_ptr(ut), dt=_ptr(dtt), A=_ptr(A_), B=_ptr(Bt), C=_ptr(Ct), D=_ptr(D_), z=_ptr(zt), keep=_ptr(keep_),
        h0=_ptr(h0_), u_sb=u_sb, u_st=u_st, dt_sb=dt_sb, dt_st=dt_st, B_sb=B_sb, B_st=B_st, C_sb=C_sb, C_st=C_st,
        z_sb=z_sb, z_st=z_st,
    )
    return args, [ut, dtt, Bt, Ct, zt, A_, D_, h0_, keep_]


def _groups(dim: int, cdt: torch.dtype) -> int:
    return -(-dim // _lanes(cdt))


def _checkpoints(batch: int, dim: int, length: int, nstate: int, cdt: torch.dtype) -> torch.Tensor:
    """Buffer of the states before every ``SEGMENT``-th token, as the kernel lays them out: (batch, segments,
    channel groups, state, lanes); ``nstate / SEGMENT`` (one half) of a ``(batch, length, dim)`` tensor."""
    lanes = _lanes(cdt)
    return torch.empty(batch, -(-length // SEGMENT), -(-dim // lanes), nstate, lanes, dtype=cdt)


def _scan_forward(u, dt, A, B, C, D, z, initial_state, keep, want_last: bool, checkpoints=None):
    cdt = dt.dtype
    lib = _library()
    batch, dim, length = u.shape
    args, alive = _args(u, dt, A, B, C, D, z, keep, initial_state)
    y = torch.empty(batch, length, dim, dtype=cdt)
    last = torch.empty(batch, dim, A.shape[1], dtype=cdt) if want_last else None
    args.y, args.y_sb, args.y_st = y.data_ptr(), y.stride(0), y.stride(1)
    args.hlast, args.ck = _ptr(last), _ptr(checkpoints)
    run_job(lib, "scan_fwd_job" + _suffix(cdt), [ctypes.addressof(args)], _groups(dim, cdt))
    del alive
    return y.transpose(1, 2), last


class SelectiveScanCPUFn(torch.autograd.Function):
    """Autograd wrapper of the compiled scan: ``(u, dt, A, B, C, D, z, initial_state, keep) -> (y, last_state)``,
    the interface of :class:`.chunked_torch.SelectiveScanTorchFn` (``dt`` already discretized; it sets the compute
    dtype, float32 or float64; ``keep`` (batch, length) is 0 at a packed document's first token, or None).

    ``y`` (batch, dim, length) and ``last_state`` (batch, dim, state) come back in the compute dtype; gradients
    in each input's dtype. Saves the inputs and, when a gradient is needed, the state before every ``SEGMENT``-th
    token (:func:`_checkpoints`, half the size of one input), which spares the backward pass one sweep."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, D, z, initial_state, keep=None):
        batch, dim, length = u.shape
        checkpoints = _checkpoints(batch, dim, length, A.shape[1], dt.dtype) if any(ctx.needs_input_grad) else None
        y, last = _scan_forward(u, dt, A, B, C, D, z, initial_state, keep, want_last=True, checkpoints=checkpoints)
        ctx.save_for_backward(u, dt, A, B, C, D, z, initial_state, keep, checkpoints)
        return y, last

    @staticmethod
    def backward(ctx, gout, glast):
        u, dt, A, B, C, D, z, initial_state, keep, checkpoints = ctx.saved_tensors
        cdt = dt.dtype
        lib = _library()
        batch, dim, length = u.shape
        n = A.shape[1]
        args, alive = _args(u, dt, A, B, C, D, z, keep, initial_state)
        args.ck = _ptr(checkpoints)
        gy, dy_sb, dy_st = _token_major(gout, cdt)
        dhlast = _contiguous(glast, cdt)
        args.dy, args.dy_sb, args.dy_st, args.dhlast = _ptr(gy), dy_sb, dy_st, _ptr(dhlast)
        kw = dict(dtype=cdt)
        du, ddt = torch.empty(batch, length, dim, **kw), torch.empty(batch, length, dim, **kw)
        dz = None if z is None else torch.empty(batch, length, dim, **kw)
        dA, dD = torch.zeros(dim, n, **kw), None if D is None else torch.zeros(dim, **kw)
        dh0 = torch.empty(batch, dim, n, **kw)
        args.du, args.ddt, args.dz, args.dA, args.dD, args.dh0 = (_ptr(t) for t in (du, ddt, dz, dA, dD, dh0))
        groups = _groups(dim, cdt)
        size = worker_count(groups)
        dB_parts = torch.empty(size, batch, length, n, **kw)
        dC_parts = torch.empty(size, batch, length, n, **kw)
        lanes = _lanes(cdt)
        nseg = -(-length // SEGMENT)
        work_vectors = (TILE * (nseg + 2 * SEGMENT + 1) + 2 * length) * n
        work = torch.empty(size, work_vectors * lanes, **kw)
        job_args = [ctypes.addressof(args), *per_worker(dB_parts), *per_worker(dC_parts), *per_worker(work)]
        used = run_job(lib, "scan_bwd_job" + _suffix(cdt), job_args, groups, workers=size)
        dB = dB_parts[:used].sum(0) if used > 1 else dB_parts[0]
        dC = dC_parts[:used].sum(0) if used > 1 else dC_parts[0]
        del alive, gy, dhlast

        def cast(grad, like):
            return None if like is None or grad is None else grad.to(like.dtype)

        return (
            cast(du.transpose(1, 2), u), ddt.transpose(1, 2), cast(dA, A), cast(dB.transpose(1, 2), B),
            cast(dC.transpose(1, 2), C), cast(dD, D), cast(None if dz is None else dz.transpose(1, 2), z),
            cast(dh0, initial_state), None,
        )


def selective_scan_cpu(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       initial_state=None, return_last_state=False, reset=None):
    """Selective scan with the compiled CPU kernel (Mamba paper, Algorithm 2, eq. 2a/2b and 4).

    Args:
        u: (batch, dim, length) SSM input. delta: (batch, dim, length) time step before ``delta_bias``/softplus.
        A: (dim, state), entries <= 0, ``state <= MAX_STATE``. B, C: (batch, state, length).
        D: (dim,) skip, optional. z: (batch, dim, length) gate, optional: ``y *= silu(z)``.
        delta_bias: (dim,) optional. delta_softplus: apply softplus to ``delta + delta_bias`` (done in PyTorch).
        initial_state: (batch, dim, state) optional (zeros). return_last_state: also return the last state.
        reset: (batch, length) bool or None, True at each packed document's first token (``h_{t-1}`` taken as 0).

    Returns:
        ``y`` (batch, dim, length) in ``u``'s dtype; with ``return_last_state`` also ``last_state`` (batch, dim,
        state) in float32 (float64 for float64 inputs). Differentiable in every tensor argument.

    Raises:
        RuntimeError: the kernel could not be built here (:func:`why_unavailable`), or the tensors are not on the
            CPU. No other argument checks: :func:`hf_densessm.ops.selective_scan` does them.
    """
    if _library() is None:
        raise RuntimeError(f"the compiled CPU selective scan is not available here: {why_unavailable()}")
    if u.device.type != "cpu":
        raise RuntimeError(f"the compiled CPU selective scan takes CPU tensors, got {u.device.type} tensors")
    cdt = _compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    dt = discretize_delta(delta, delta_bias, delta_softplus, cdt)
    keep = None if reset is None else (~reset.bool()).to(cdt)
    y, last_state = SelectiveScanCPUFn.apply(u, dt, A, B, C, D, z, initial_state, keep)
    y = y.to(u.dtype)
    return (y, last_state) if return_last_state else y


def selective_state_update_cpu(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One decode step of the selective SSM with the compiled CPU kernel (Mamba paper eq. 2a/2b, recurrent mode).

    Args:
        state: (batch, dim, state) float32 (or float64) SSM state, contiguous, updated IN PLACE to ``h_t``.
        x: (batch, dim) this token's input. dt: (batch, dim) time step before ``dt_bias``/softplus.
        A: (dim, state), entries <= 0. B, C: (batch, state). D: (dim,) optional. z: (batch, dim) gate, optional.
        dt_bias: (dim,) optional. dt_softplus: apply softplus (PyTorch's, threshold 20) to ``dt + dt_bias``.

    Returns:
        ``y`` (batch, dim) in ``x``'s dtype: ``(sum_n C_n h_n + D x) * silu(z)``. Not differentiable (decoding).

    Raises:
        RuntimeError: the kernel is not available, or ``state`` is not a contiguous float32/float64 CPU tensor
            (the caller, :func:`hf_densessm.ops.selective_state_update`, sends other states to PyTorch).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the compiled CPU selective scan is not available here: {why_unavailable()}")
    if state.device.type != "cpu" or state.dtype not in (torch.float32, torch.float64) or not state.is_contiguous():
        raise RuntimeError("selective_state_update_cpu needs a contiguous float32 or float64 CPU state")
    cdt = state.dtype
    batch, dim, n = state.shape
    tensors = [_contiguous(t, cdt) for t in (x, dt, A, B, C, D, z, dt_bias)]
    y = torch.empty(batch, dim, dtype=cdt)
    getattr(lib, "state_update" + _suffix(cdt))(
        ctypes.c_int64(batch), ctypes.c_int64(dim), ctypes.c_int64(n), ctypes.c_void_p(state.data_ptr()),
        *(ctypes.c_void_p(_ptr(t)) for t in tensors), ctypes.c_int64(int(bool(dt_softplus))),
        ctypes.c_void_p(y.data_ptr()),
    )
    return y.to(x.dtype)
