"""Chunkwise multi-scale retention in Triton: the forward and backward kernels of ``hf_densessm::chunk_retention``
and ``hf_densessm::chunk_retention_backward`` (``backend="triton"``), launched through ``torch.library.wrap_triton``.

Maths (DenseSSM paper Eq. 18, 19, 24; RetNet chunkwise form), per head with decay ``gamma`` and chunks of
``BT`` tokens, ``q~ = scale q``, ``D[i, j] = gamma^(i-j)`` for ``j <= i`` (0 above the diagonal), ``n`` the
number of tokens in the chunk (``BT``, or fewer in the last one):

    forward   o     = ((q~ k^T) * D) v + gamma^(i+1) q~ S                   (S: state before the chunk)
              S    <- gamma^n S + sum_j gamma^(n-1-j) k_j^T v_j
    backward  dq~   = ((dO v^T) * D) k + gamma^(i+1) dO S^T                 (forward in time, S recomputed)
              dk    = ((dO v^T) * D)^T q~ + gamma^(n-1-j) v dH^T           (backward in time)
              dv    = ((q~ k^T) * D)^T dO + gamma^(n-1-j) k dH
              dH   <- gamma^n dH + sum_i gamma^(i+1) q~_i^T dO_i            (dH: gradient of the state after
                                                                            the chunk; starts at d final_state,
                                                                            ends as d initial_state)

Each program owns one ``(BK, BV)`` tile of the state (or of ``dH``) in registers and walks the chunks of one
``(batch, head)``: the grid is ``(value tiles, key tiles, batch * heads)``, so no ``(length, K, V)`` state ever
reaches memory (states are recomputed in the backward pass). Every output that sums over the other axis
(``o`` and ``dq`` over value tiles or key tiles, ``dk`` over value tiles, ``dv`` over key tiles) is written
as float32 partial sums, one per tile, and added on the host. Key and value sizes that are not powers of two
(key 320 of the 1.3B preset) are masked. Products run through ``tl.dot`` in the input dtype (tensor cores for
float16 / bfloat16; exact, not TF32, for float32) with float32 accumulation (float64 for float64 inputs).

**Packed sequences** (``reset``, issue 11; constexpr ``HAS_RESET``): the host turns the ``(batch, length)`` reset
flags into ``(batch, 1 + length)`` int32 document indices, 0 for the initial state's document and then
``cumsum(reset)``, and every kernel masks per chunk, as ``chunked_torch.py`` does: ``D[i, j]`` where ``i`` and
``j`` lie in one document; ``gamma^(i+1)`` (the read of the carried state, and the matching term of ``dH``) where
token ``i`` is in the document of the token before the chunk; ``gamma^(n-1-j)`` (the write into the next state,
and the ``dH`` terms of ``dk``, ``dv``) where token ``j`` is in the chunk's last document; ``gamma^n`` (the carried
state, or ``dH``) where the chunk's last token is still in the carried state's document. So nothing crosses a
boundary, inside a chunk or at its edges, and ``d initial_state`` is 0 when the row starts a document at token 0.

Tiles, warps and stages of each kernel come from :func:`chunk_retention_config`, per GPU (compute capability,
shared memory per block) and dtype; ``tests/ops/test_compile.py`` compiles every choice it can make.
"""

from dataclasses import dataclass

import torch

try:  # triton: needed only when a kernel of this file runs
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(f"{__name__} holds Triton kernels and needs the `triton` package") from error

from ..backend import GPUArch, device_arch
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
    """Tiles, warps and stages of the chunkwise kernels for one GPU, input dtype and head size.

    Each program keeps a ``(block_k, block_v)`` state tile, ``(block_t, block_t)`` scores and decay mask and the
    ``(block_t, block_k | block_v)`` input tiles in registers. The choices below are the largest the compile test
    (``tests/ops/test_compile.py``) found to run without register spills at the presets' head sizes:

    - float32 (float64): every kernel on 32-token chunks with 32 x 32 (forward) or 32 x 64 (backward) state tiles
      and 8 warps, at most 29 KB of shared memory and about 200 registers. float32 ``tl.dot`` with exact ("ieee")
      products runs on the FMA units and holds its operands in registers: the first version's 64-token, 64 x 64
      tiles at 4 warps and 3 stages spilled 8-10 KB per thread in every kernel on sm_80, and its backward
      ``dk/dv`` kernel asked for 176 KB of shared memory, over an A100's 163 KB (the launch failed there);
    - float16 / bfloat16 on sm_90 (H100), measured there (``benchmarks/sweep_triton_tiles.py``, 24 candidates per
      kernel at DenseRetNet-350M's heads, 8 x 2048 tokens, ``benchmarks/results/sweep_triton_tiles.json``):
      the forward and ``dq`` kernels keep the first choice, 64-token chunks and 64 x 64 (key x value) state
      tiles at 8 warps; the faster candidates compiled here (forward 1.25-1.60 ms against 2.38 ms, ``dq`` 9.5 ms
      against 10.7 ms of forward + backward) spill registers in the compile test. ``dk/dv``: 32-token chunks, 64 x 64
      tiles at 4 warps, where the first choice had 32 x 64 tiles at 8 warps: forward + backward 8.0 ms against
      10.7 ms (three faster ones on 64-token chunks, 6.7-7.6 ms, spill; 32-token chunks with 128-wide tiles,
      7.2-7.3 ms, were not tried). On sm_8x the float32 choice (the 64-wide tiles spill there).

    Stages: for float16 / bfloat16, 2 (loads of the next chunk pipelined through shared memory) where a block may
    use at least 160 KB of shared memory (A100, H100), 1 elsewhere (99 KB: RTX 3090 / 4090, A10, L4, L40); for
    float32 always 1 (2 stages made the backward kernels spill on sm_80 and sm_90). Every choice needs at most
    a few tens of KB of shared memory, under every limit in :data:`~hf_densessm.ops.backend.ARCHS`.

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
        # heads smaller than one 32 x 64 tile: 4 warps for dk/dv (8 warps on its 16 x 32 tile made ptxas spill the
        # float32 kernel with packed-sequence resets on sm_90, at 128 registers)
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
    """Packed documents (``docs``: ``(batch, 1 + L)`` int32; ``doc_base``: this sequence's row). Reads the
    document index of each token ``t`` of the chunk (``doc_base[1 + t]``), of the token before the chunk
    (``doc_base[start]``; 0 before the first token: the initial state's document) and of the chunk's last token.
    Returns ``same`` (BT, BT): tokens i, j in one document; ``reads`` (BT,): token in the document of the carried
    state; ``writes`` (BT,): token in the document of the chunk's last token (the state after the chunk);
    ``carries`` (scalar): the carried state's document goes on to the chunk's end."""
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
    """Accumulator dtype (torch, triton) and ``tl.dot`` input precision for inputs of ``dtype``: float32 inputs
    get exact float32 products ("ieee"), not TF32; float16 / bfloat16 products run on tensor cores."""
    if dtype == torch.float64:
        return torch.float64, tl.float64, "ieee"
    return torch.float32, tl.float32, "ieee" if dtype == torch.float32 else "tf32"


def _document_indices(reset):
    """``(batch, 1 + length)`` int32 document index of the token before the first one (0, the initial state's
    document) and of every token (``cumsum(reset)``), contiguous; None without ``reset``."""
    if reset is None:
        return None
    return torch.nn.functional.pad(torch.cumsum(reset.to(torch.int32), dim=1, dtype=torch.int32), (1, 0))


def _launch(kernel, tiles, key_dim, value_dim, batch_heads, *args, **meta):
    """Launch one chunkwise kernel over ``(value tiles, key tiles, batch * heads)`` with its tiles, through
    ``torch.library.wrap_triton`` (so that ``torch.compile`` sees the kernel)."""
    grid = (triton.cdiv(value_dim, tiles.block_v), triton.cdiv(key_dim, tiles.block_k), batch_heads)
    launch(kernel)[grid](
        *args, K=key_dim, V=value_dim, BT=tiles.block_t, BK=tiles.block_k, BV=tiles.block_v,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **meta,
    )


def _state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _prepare(q, k, v, initial_state, config):
    """What both passes start from: the launch choice (``config``, or the one for this GPU and shape), contiguous
    ``q``, ``k``, ``v`` and initial state, the accumulation dtypes and the per-head ``log2(gamma)``."""
    if config is None:
        config = chunk_retention_config(device_arch(q.device), q.dtype, q.shape[-1], v.shape[-1])
    acc_torch, acc_tl, precision = _kernel_dtypes(v.dtype)
    log2_gamma = retention_log2_gamma(q.shape[2], q.device, acc_torch)
    initial_state = None if initial_state is None else initial_state.contiguous()
    return config, q.contiguous(), k.contiguous(), v.contiguous(), initial_state, acc_torch, acc_tl, precision, log2_gamma


def chunk_retention_fwd_triton(q, k, v, scale, initial_state=None, reset=None, config=None):
    """Forward pass of chunkwise retention with the Triton kernel: the Triton branch of
    ``hf_densessm::chunk_retention`` (arguments checked by :func:`hf_densessm.ops.retention.chunk_retention`).

    Args:
        q, k (Tensor): ``(batch, length, heads, key_dim)``; v (Tensor): ``(batch, length, heads, value_dim)``;
            float16, bfloat16, float32 (float64 where the device allows it).
        scale (float): positive factor on ``q``.
        initial_state (Tensor, optional): ``(batch, heads, key_dim, value_dim)`` float32 (float64 with float64
            inputs).
        reset (Tensor, optional): ``(batch, length)`` bool, True at the first token of each packed document.
        config (ChunkRetentionConfig, optional): the kernels' tiles; by default :func:`chunk_retention_config`
            for ``q``'s device.

    Returns:
        o ``(batch, length, heads, value_dim)`` in ``v``'s dtype and the final state ``(batch, heads, key_dim,
        value_dim)`` float32 (float64 for float64 inputs).
    """
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    config, q, k, v, initial_state, acc_torch, acc_tl, precision, log2_gamma = _prepare(q, k, v, initial_state, config)
    num_k = triton.cdiv(key_dim, config.fwd.block_k)
    o_partial = q.new_empty(num_k, batch, length, heads, value_dim, dtype=acc_torch)
    final_state = q.new_empty(batch, heads, key_dim, value_dim, dtype=_state_dtype(v.dtype))
    docs = _document_indices(reset)
    _launch(
        _retention_fwd_kernel, config.fwd, key_dim, value_dim, batch * heads,
        q, k, v, o_partial, initial_state, final_state, docs, log2_gamma, scale, length, H=heads,
        HAS_INITIAL_STATE=initial_state is not None, ACC=acc_tl, PRECISION=precision, HAS_RESET=docs is not None,
    )
    return o_partial.sum(0).to(v.dtype), final_state


def chunk_retention_bwd_triton(d_o, d_final_state, q, k, v, scale, initial_state=None, reset=None, config=None):
    """Backward pass of chunkwise retention with the Triton kernels (states recomputed, never stored): the Triton
    branch of ``hf_densessm::chunk_retention_backward``.

    Args:
        d_o (Tensor): ``(batch, length, heads, value_dim)``, the gradient of ``o``.
        d_final_state (Tensor, optional): ``(batch, heads, key_dim, value_dim)``, the gradient of the final state
            (None: zero).
        q, k, v, scale, initial_state, reset, config: as :func:`chunk_retention_fwd_triton`.

    Returns:
        dq, dk, dv in the dtypes of q, k, v, and the gradient of the initial state ``(batch, heads, key_dim,
        value_dim)`` (of a zero one without ``initial_state``) float32 (float64 for float64 inputs).
    """
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
    d_initial_state = q.new_empty(batch, heads, key_dim, value_dim, dtype=_state_dtype(v.dtype))
    _launch(
        _retention_bwd_dkv_kernel, config.dkv, key_dim, value_dim, batch * heads,
        q, k, v, d_o, dk_partial, dv_partial, d_final_state, d_initial_state, docs, log2_gamma, scale, length,
        HAS_D_FINAL_STATE=d_final_state is not None, **meta,
    )
    dq = dq_partial.sum(0).to(q.dtype)
    dk = dk_partial.sum(0).to(k.dtype)
    dv = dv_partial.sum(0).to(v.dtype)
    return dq, dk, dv, d_initial_state
