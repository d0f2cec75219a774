"""Chunkwise multi-scale retention in Triton (DenseSSM paper Eq. 18, 19, 24; RetNet chunkwise form): the forward
and backward kernels of ``hf_densessm::chunk_retention`` / ``_backward`` (``backend="triton"``), launched through
``torch.library.wrap_triton``. Formulas, tiling, packed documents: docs/kernels.md, "How the kernels work".
"""

from dataclasses import dataclass

import torch

try:  # triton: needed only when a kernel of this file runs
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(f"{__name__} holds Triton kernels and needs the `triton` package") from error

from ..backend import GPUArch, compute_dtype, device_arch
from ..triton_utils import launch
from .naive import retention_log2_gamma

__all__ = [
    "ChunkRetentionConfig", "RetentionTiles", "chunk_retention_bwd_triton", "chunk_retention_config",
    "chunk_retention_fwd_triton",
]


@dataclass(frozen=True)
class RetentionTiles:
    """Launch choices of one chunkwise kernel: ``block_t`` tokens per chunk, a ``(block_k, block_v)`` tile of the
    state per program (all powers of 2, at least 16: the smallest ``tl.dot`` operand), warps, pipeline stages."""

    block_t: int
    block_k: int
    block_v: int
    num_warps: int
    num_stages: int = 1

    def fit(self, key_dim: int, value_dim: int) -> "RetentionTiles":
        """The tiles shrunk to the next power of 2 of ``key_dim`` / ``value_dim`` where those are smaller."""
        block_k = min(self.block_k, max(16, triton.next_power_of_2(key_dim)))
        block_v = min(self.block_v, max(16, triton.next_power_of_2(value_dim)))
        return RetentionTiles(self.block_t, block_k, block_v, self.num_warps, self.num_stages)


@dataclass(frozen=True)
class ChunkRetentionConfig:
    """Tiles of the three chunkwise kernels: forward, backward ``dq``, backward ``dk``/``dv``."""

    fwd: RetentionTiles
    dq: RetentionTiles
    dkv: RetentionTiles


def chunk_retention_config(arch: GPUArch, dtype: torch.dtype, key_dim: int, value_dim: int) -> ChunkRetentionConfig:
    """Tiles, warps and stages of the chunkwise kernels for one GPU, input dtype and head size: the largest that
    compile without spills (docs/kernels.md, "Tile, warp and stage choices", with the measurements behind them).

    Args:
        arch: the GPU's limits (:func:`hf_densessm.ops.backend.device_arch`).
        dtype: the dtype of ``q``, ``k``, ``v``.
        key_dim, value_dim: per-head sizes; tiles shrink to them where they are smaller.

    Returns:
        A :class:`ChunkRetentionConfig`.
    """
    half = dtype in (torch.float16, torch.bfloat16)
    stages = 2 if half and arch.shared_per_block >= 160 * 1024 else 1
    if half and arch.capability >= (9, 0):
        fwd = dq = RetentionTiles(64, 64, 64, 8, stages)
        dkv = RetentionTiles(32, 64, 64, 4, stages)
    else:
        fwd, dq = RetentionTiles(32, 32, 32, 8, stages), RetentionTiles(32, 32, 64, 8, stages)
        # heads smaller than one 32 x 64 tile: 4 warps for dk/dv (8 spilled with resets on sm_90; docs/kernels.md)
        dkv = RetentionTiles(32, 32, 64, 8 if key_dim * value_dim >= 32 * 64 else 4, stages)
    return ChunkRetentionConfig(*(tiles.fit(key_dim, value_dim) for tiles in (fwd, dq, dkv)))


@triton.jit
def _decay_masks(log2_gamma, BT: tl.constexpr, ACC: tl.constexpr):
    """``D[i, j] = gamma^(i-j)`` for ``j <= i`` else 0, and ``gamma^(i+1)``, both in the accumulator dtype."""
    offs_t = tl.arange(0, BT)
    distance = (offs_t[:, None] - offs_t[None, :]).to(ACC)
    decay = tl.where(distance >= 0, tl.exp2(tl.maximum(distance, 0) * log2_gamma), 0.0)
    q_decay = tl.exp2((offs_t + 1).to(ACC) * log2_gamma)
    return decay, q_decay


@triton.jit
def _document_masks(doc_base, start, t, mask_t, n):
    """From this row's document indices ``doc_base`` (``(1 + L)``): ``same`` (tokens i, j in one document),
    ``reads`` (token in the carried state's document), ``writes`` (in the chunk's last token's), ``carries`` (the
    carried state's document reaches the chunk's end)."""
    seg = tl.load(doc_base + 1 + t, mask=mask_t, other=-1)
    before = tl.load(doc_base + start)
    last = tl.load(doc_base + start + n)
    same = seg[:, None] == seg[None, :]
    return same, seg == before, seg == last, last == before


@triton.jit
def _dot(a, b, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` in the operands' dtype, accumulated in ``ACC``."""
    return tl.dot(a, b, out_dtype=ACC, input_precision=PRECISION)


@triton.jit
def _retention_fwd_kernel(
    q, k, v, o_partial, initial_state, final_state, docs, log2_gamma_ptr, scale, L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, HAS_RESET: tl.constexpr,
):
    """Grid (value tiles, key tiles, batch * heads): o partial sums over key tiles, and the final state."""
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BH = tl.num_programs(2)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    log2_gamma = tl.load(log2_gamma_ptr + i_h)
    scale = tl.full((), scale, ACC)  # fp32 from Triton's launcher, fp64 from Inductor's: cast to one dtype
    offs_t = tl.arange(0, BT)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    # (batch, length, heads, dim) layout, contiguous: token stride H * dim; o_partial: (key tiles, B, L, H, V).
    q_base = q + i_b * L * H * K + i_h * K
    k_base = k + i_b * L * H * K + i_h * K
    v_base = v + i_b * L * H * V + i_h * V
    o_base = o_partial + (i_k * BH).to(tl.int64) * L * V + i_b * L * H * V + i_h * V
    state_offs = (i_bh * K + offs_k[:, None]).to(tl.int64) * V + offs_v[None, :]
    mask_kv = mask_k[:, None] & mask_v[None, :]

    decay, q_decay = _decay_masks(log2_gamma, BT, ACC)
    state = tl.zeros([BK, BV], dtype=ACC)
    if HAS_INITIAL_STATE:
        state += tl.load(initial_state + state_offs, mask=mask_kv, other=0.0).to(ACC)
    for start in range(0, L, BT):
        t = start + offs_t
        mask_t = t < L
        n = tl.minimum(L - start, BT)
        mask_tk = mask_t[:, None] & mask_k[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        q_blk = tl.load(q_base + t[:, None] * (H * K) + offs_k[None, :], mask=mask_tk, other=0.0)
        k_blk = tl.load(k_base + t[:, None] * (H * K) + offs_k[None, :], mask=mask_tk, other=0.0)
        v_blk = tl.load(v_base + t[:, None] * (H * V) + offs_v[None, :], mask=mask_tv, other=0.0)
        dt = v_blk.dtype
        q_blk = q_blk * scale
        decay_c, q_decay_c = decay, q_decay
        k_decay = tl.where(mask_t, tl.exp2((n - 1 - offs_t).to(ACC) * log2_gamma), 0.0)
        state_decay = tl.exp2(n.to(ACC) * log2_gamma)
        if HAS_RESET:  # nothing crosses a document boundary
            same, reads, writes, carries = _document_masks(docs + i_b * (L + 1), start, t, mask_t, n)
            decay_c = tl.where(same, decay, 0.0)
            q_decay_c = tl.where(reads, q_decay, 0.0)
            k_decay = tl.where(writes, k_decay, 0.0)
            state_decay = tl.where(carries, state_decay, 0.0)
        # Intra-chunk ((q~ k^T) * D) v, plus the earlier chunks through the state: gamma^(i+1) q~ S.
        scores = _dot(q_blk.to(dt), tl.trans(k_blk), ACC, PRECISION) * decay_c
        o = _dot(scores.to(dt), v_blk, ACC, PRECISION)
        o += _dot((q_blk * q_decay_c[:, None]).to(dt), state.to(dt), ACC, PRECISION)
        tl.store(o_base + t[:, None] * (H * V) + offs_v[None, :], o, mask=mask_tv)
        # S <- gamma^n S + sum_j gamma^(n-1-j) k_j^T v_j.
        k_blk = (k_blk * k_decay[:, None]).to(dt)
        state = state * state_decay + _dot(tl.trans(k_blk), v_blk, ACC, PRECISION)
    tl.store(final_state + state_offs, state.to(final_state.dtype.element_ty), mask=mask_kv)


@triton.jit
def _retention_bwd_dq_kernel(
    k, v, do, dq_partial, initial_state, docs, log2_gamma_ptr, scale, L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, HAS_RESET: tl.constexpr,
):
    """Grid (value tiles, key tiles, batch * heads), forward in time: dq partial sums over value tiles."""
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BH = tl.num_programs(2)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    log2_gamma = tl.load(log2_gamma_ptr + i_h)
    scale = tl.full((), scale, ACC)  # fp32 from Triton's launcher, fp64 from Inductor's: cast to one dtype
    offs_t = tl.arange(0, BT)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    k_base = k + i_b * L * H * K + i_h * K
    v_base = v + i_b * L * H * V + i_h * V
    do_base = do + i_b * L * H * V + i_h * V
    dq_base = dq_partial + (i_v * BH).to(tl.int64) * L * K + i_b * L * H * K + i_h * K
    mask_kv = mask_k[:, None] & mask_v[None, :]

    decay, q_decay = _decay_masks(log2_gamma, BT, ACC)
    state = tl.zeros([BK, BV], dtype=ACC)
    if HAS_INITIAL_STATE:
        state_offs = (i_bh * K + offs_k[:, None]).to(tl.int64) * V + offs_v[None, :]
        state += tl.load(initial_state + state_offs, mask=mask_kv, other=0.0).to(ACC)
    for start in range(0, L, BT):
        t = start + offs_t
        mask_t = t < L
        n = tl.minimum(L - start, BT)
        mask_tk = mask_t[:, None] & mask_k[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        k_blk = tl.load(k_base + t[:, None] * (H * K) + offs_k[None, :], mask=mask_tk, other=0.0)
        v_blk = tl.load(v_base + t[:, None] * (H * V) + offs_v[None, :], mask=mask_tv, other=0.0)
        do_blk = tl.load(do_base + t[:, None] * (H * V) + offs_v[None, :], mask=mask_tv, other=0.0)
        dt = v_blk.dtype
        decay_c, q_decay_c = decay, q_decay
        k_decay = tl.where(mask_t, tl.exp2((n - 1 - offs_t).to(ACC) * log2_gamma), 0.0)
        state_decay = tl.exp2(n.to(ACC) * log2_gamma)
        if HAS_RESET:  # the forward pass's document masks
            same, reads, writes, carries = _document_masks(docs + i_b * (L + 1), start, t, mask_t, n)
            decay_c = tl.where(same, decay, 0.0)
            q_decay_c = tl.where(reads, q_decay, 0.0)
            k_decay = tl.where(writes, k_decay, 0.0)
            state_decay = tl.where(carries, state_decay, 0.0)
        # dq~ = ((dO v^T) * D) k + gamma^(i+1) dO S^T; dq = scale dq~.
        scores = _dot(do_blk, tl.trans(v_blk), ACC, PRECISION) * decay_c
        dq = _dot(scores.to(dt), k_blk, ACC, PRECISION)
        dq += _dot((do_blk * q_decay_c[:, None]).to(dt), tl.trans(state.to(dt)), ACC, PRECISION)
        tl.store(dq_base + t[:, None] * (H * K) + offs_k[None, :], dq * scale, mask=mask_tk)
        # The forward state update, recomputed.
        k_blk = (k_blk * k_decay[:, None]).to(dt)
        state = state * state_decay + _dot(tl.trans(k_blk), v_blk, ACC, PRECISION)


@triton.jit
def _retention_bwd_dkv_kernel(
    q, k, v, do, dk_partial, dv_partial, d_final_state, d_initial_state, docs, log2_gamma_ptr, scale, L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_D_FINAL_STATE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, HAS_RESET: tl.constexpr,
):
    """Grid (value tiles, key tiles, batch * heads), backward in time: dk partial sums over value tiles,
    dv partial sums over key tiles, and the gradient of the initial state."""
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BH = tl.num_programs(2)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    log2_gamma = tl.load(log2_gamma_ptr + i_h)
    scale = tl.full((), scale, ACC)  # fp32 from Triton's launcher, fp64 from Inductor's: cast to one dtype
    offs_t = tl.arange(0, BT)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    q_base = q + i_b * L * H * K + i_h * K
    k_base = k + i_b * L * H * K + i_h * K
    v_base = v + i_b * L * H * V + i_h * V
    do_base = do + i_b * L * H * V + i_h * V
    dk_base = dk_partial + (i_v * BH).to(tl.int64) * L * K + i_b * L * H * K + i_h * K
    dv_base = dv_partial + (i_k * BH).to(tl.int64) * L * V + i_b * L * H * V + i_h * V
    state_offs = (i_bh * K + offs_k[:, None]).to(tl.int64) * V + offs_v[None, :]
    mask_kv = mask_k[:, None] & mask_v[None, :]

    decay, q_decay = _decay_masks(log2_gamma, BT, ACC)
    d_state = tl.zeros([BK, BV], dtype=ACC)  # dH: gradient of the state after the current chunk
    if HAS_D_FINAL_STATE:
        d_state += tl.load(d_final_state + state_offs, mask=mask_kv, other=0.0).to(ACC)
    num_chunks = tl.cdiv(L, BT)
    for i in range(0, num_chunks):
        start = (num_chunks - 1 - i) * BT
        t = start + offs_t
        mask_t = t < L
        n = tl.minimum(L - start, BT)
        mask_tk = mask_t[:, None] & mask_k[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        q_blk = tl.load(q_base + t[:, None] * (H * K) + offs_k[None, :], mask=mask_tk, other=0.0)
        k_blk = tl.load(k_base + t[:, None] * (H * K) + offs_k[None, :], mask=mask_tk, other=0.0)
        v_blk = tl.load(v_base + t[:, None] * (H * V) + offs_v[None, :], mask=mask_tv, other=0.0)
        do_blk = tl.load(do_base + t[:, None] * (H * V) + offs_v[None, :], mask=mask_tv, other=0.0)
        dt = v_blk.dtype
        q_blk = q_blk * scale
        decay_c, q_decay_c = decay, q_decay
        k_decay = tl.where(mask_t, tl.exp2((n - 1 - offs_t).to(ACC) * log2_gamma), 0.0)
        state_decay = tl.exp2(n.to(ACC) * log2_gamma)
        if HAS_RESET:  # the forward pass's document masks
            same, reads, writes, carries = _document_masks(docs + i_b * (L + 1), start, t, mask_t, n)
            decay_c = tl.where(same, decay, 0.0)
            q_decay_c = tl.where(reads, q_decay, 0.0)
            k_decay = tl.where(writes, k_decay, 0.0)
            state_decay = tl.where(carries, state_decay, 0.0)
        d_state_dt = d_state.to(dt)
        # dk = ((dO v^T) * D)^T q~ + gamma^(n-1-j) v dH^T
        scores = _dot(do_blk, tl.trans(v_blk), ACC, PRECISION) * decay_c
        dk = _dot(tl.trans(scores.to(dt)), q_blk.to(dt), ACC, PRECISION)
        dk += _dot((v_blk * k_decay[:, None]).to(dt), tl.trans(d_state_dt), ACC, PRECISION)
        tl.store(dk_base + t[:, None] * (H * K) + offs_k[None, :], dk, mask=mask_tk)
        # dv = ((q~ k^T) * D)^T dO + gamma^(n-1-j) k dH
        scores = _dot(q_blk.to(dt), tl.trans(k_blk), ACC, PRECISION) * decay_c
        dv = _dot(tl.trans(scores.to(dt)), do_blk, ACC, PRECISION)
        dv += _dot((k_blk * k_decay[:, None]).to(dt), d_state_dt, ACC, PRECISION)
        tl.store(dv_base + t[:, None] * (H * V) + offs_v[None, :], dv, mask=mask_tv)
        # dH <- gamma^n dH + sum_i gamma^(i+1) q~_i^T dO_i
        q_blk = (q_blk * q_decay_c[:, None]).to(dt)
        d_state = d_state * state_decay + _dot(tl.trans(q_blk), do_blk, ACC, PRECISION)
    tl.store(d_initial_state + state_offs, d_state.to(d_initial_state.dtype.element_ty), mask=mask_kv)


def _kernel_dtypes(dtype):
    """Accumulator dtype (torch, triton) and ``tl.dot`` input precision: exact ("ieee") for float32 and float64."""
    if dtype == torch.float64:
        return torch.float64, tl.float64, "ieee"
    return torch.float32, tl.float32, "ieee" if dtype == torch.float32 else "tf32"


def _document_indices(reset):
    """``(batch, 1 + length)`` int32 document indices, 0 then ``cumsum(reset)``; None without ``reset``."""
    if reset is None:
        return None
    return torch.nn.functional.pad(torch.cumsum(reset.to(torch.int32), dim=1, dtype=torch.int32), (1, 0))


def _launch(kernel, tiles, key_dim, value_dim, batch_heads, *args, **meta):
    """Launch one chunkwise kernel over ``(value tiles, key tiles, batch * heads)`` through ``wrap_triton``."""
    grid = (triton.cdiv(value_dim, tiles.block_v), triton.cdiv(key_dim, tiles.block_k), batch_heads)
    launch(kernel)[grid](
        *args, K=key_dim, V=value_dim, BT=tiles.block_t, BK=tiles.block_k, BV=tiles.block_v,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **meta,
    )


def _prepare(q, k, v, initial_state, config):
    """Config, contiguous ``q, k, v, initial_state``, accumulation dtypes and per-head ``log2(gamma)``."""
    if config is None:
        config = chunk_retention_config(device_arch(q.device), q.dtype, q.shape[-1], v.shape[-1])
    acc_torch, acc_tl, precision = _kernel_dtypes(v.dtype)
    log2_gamma = retention_log2_gamma(q.shape[2], q.device, acc_torch)
    initial_state = None if initial_state is None else initial_state.contiguous()
    return config, q.contiguous(), k.contiguous(), v.contiguous(), initial_state, acc_torch, acc_tl, precision, log2_gamma


def chunk_retention_fwd_triton(q, k, v, scale, initial_state=None, reset=None, config=None):
    """The Triton branch of ``hf_densessm::chunk_retention``, no checks: arguments and ``(o, final_state)`` as
    :func:`hf_densessm.ops.retention.chunk_retention` (``scale`` a float), plus ``config`` (a
    :class:`ChunkRetentionConfig`; default :func:`chunk_retention_config` for ``q``'s device)."""
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    config, q, k, v, initial_state, acc_torch, acc_tl, precision, log2_gamma = _prepare(q, k, v, initial_state, config)
    num_k = triton.cdiv(key_dim, config.fwd.block_k)
    o_partial = q.new_empty(num_k, batch, length, heads, value_dim, dtype=acc_torch)
    final_state = q.new_empty(batch, heads, key_dim, value_dim, dtype=compute_dtype(v.dtype))
    docs = _document_indices(reset)
    _launch(
        _retention_fwd_kernel, config.fwd, key_dim, value_dim, batch * heads,
        q, k, v, o_partial, initial_state, final_state, docs, log2_gamma, scale, length, H=heads,
        HAS_INITIAL_STATE=initial_state is not None, ACC=acc_tl, PRECISION=precision, HAS_RESET=docs is not None,
    )
    return o_partial.sum(0).to(v.dtype), final_state


def chunk_retention_bwd_triton(d_o, d_final_state, q, k, v, scale, initial_state=None, reset=None, config=None):
    """The Triton branch of ``hf_densessm::chunk_retention_backward`` (states recomputed): given ``d_o`` and
    ``d_final_state`` (None: zero) and the forward's arguments, ``dq, dk, dv`` in the dtypes of q, k, v and the
    gradient of the initial state (of a zero one without it) in the state dtype."""
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    config, q, k, v, initial_state, acc_torch, acc_tl, precision, log2_gamma = _prepare(q, k, v, initial_state, config)
    d_o = d_o.to(v.dtype).contiguous()
    if d_final_state is not None:
        d_final_state = d_final_state.contiguous()
    docs = _document_indices(reset)
    meta = dict(H=heads, ACC=acc_tl, PRECISION=precision, HAS_RESET=docs is not None)
    dq_partial = q.new_empty(triton.cdiv(value_dim, config.dq.block_v), batch, length, heads, key_dim,
                             dtype=acc_torch)
    _launch(
        _retention_bwd_dq_kernel, config.dq, key_dim, value_dim, batch * heads,
        k, v, d_o, dq_partial, initial_state, docs, log2_gamma, scale, length,
        HAS_INITIAL_STATE=initial_state is not None, **meta,
    )
    dk_partial = q.new_empty(triton.cdiv(value_dim, config.dkv.block_v), batch, length, heads, key_dim,
                             dtype=acc_torch)
    dv_partial = q.new_empty(triton.cdiv(key_dim, config.dkv.block_k), batch, length, heads, value_dim,
                             dtype=acc_torch)
    d_initial_state = q.new_empty(batch, heads, key_dim, value_dim, dtype=compute_dtype(v.dtype))
    _launch(
        _retention_bwd_dkv_kernel, config.dkv, key_dim, value_dim, batch * heads,
        q, k, v, d_o, dk_partial, dv_partial, d_final_state, d_initial_state, docs, log2_gamma, scale, length,
        HAS_D_FINAL_STATE=d_final_state is not None, **meta,
    )
    dq = dq_partial.sum(0).to(q.dtype)
    dk = dk_partial.sum(0).to(k.dtype)
    dv = dv_partial.sum(0).to(v.dtype)
    return dq, dk, dv, d_initial_state
