"""Chunkwise multi-scale retention in Triton (DenseSSM paper Eq. 18, 19, 24; RetNet chunkwise form; the design of
flash-linear-attention's ``chunk_h.py`` / ``chunk_o.py``): the kernels of ``hf_densessm::chunk_retention`` /
``_backward`` (``backend="triton"``). Formulas, kernels, packed documents: docs/kernels.md, "How the kernels work".
"""

from dataclasses import dataclass, replace

import torch

from ..backend import GPUArch, compute_dtype, device_arch
from ..triton_utils import launch, tl, triton  # raises ImportError without triton
from .naive import retention_log2_gamma

__all__ = ["ChunkRetentionConfig", "StateTiles", "chunk_retention_bwd_triton", "chunk_retention_config",
           "chunk_retention_fwd_triton"]


@dataclass(frozen=True)
class StateTiles:
    """Launch choices of one kernel: a ``(block_k, block_v)`` tile of the state (powers of 2, at least 16: the
    smallest ``tl.dot`` operand), warps, pipeline stages."""

    block_k: int
    block_v: int
    num_warps: int
    num_stages: int = 1

    def fit(self, key_dim: int, value_dim: int) -> "StateTiles":
        """The tiles shrunk to the next power of 2 of ``key_dim`` / ``value_dim`` where those are smaller."""
        block_k = min(self.block_k, max(16, triton.next_power_of_2(key_dim)))
        block_v = min(self.block_v, max(16, triton.next_power_of_2(value_dim)))
        return replace(self, block_k=block_k, block_v=block_v)


@dataclass(frozen=True)
class ChunkRetentionConfig:
    """``block_t`` tokens per chunk (one for every kernel; a power of 2, at least 16) and the tiles of the kernels
    ``h`` (state walk), ``o`` (output), ``dh`` (backward walk), ``dqk``, ``dv``."""

    block_t: int
    h: StateTiles
    o: StateTiles
    dh: StateTiles
    dqk: StateTiles
    dv: StateTiles


def chunk_retention_config(arch: GPUArch, dtype: torch.dtype, key_dim: int, value_dim: int) -> ChunkRetentionConfig:
    """The :class:`ChunkRetentionConfig` of the GPU ``arch`` (:func:`~..backend.device_arch`), the dtype of ``q``,
    ``k``, ``v`` and the per-head sizes (tiles shrink to them, :meth:`StateTiles.fit`): choices that compile without
    spills (docs/kernels.md, "Tile, warp and stage choices")."""
    if dtype in (torch.float16, torch.bfloat16):  # tensor-core products, 64-token chunks
        stages = 2 if arch.shared_per_block >= 96 * 1024 else 1  # 2 stages: <= 48 KB (sm_8x), 65 KB (sm_90)
        # wide(d): the 64 or 128 tile of the axis an output kernel keeps with fewer multiply-adds (docs/kernels.md)
        wide = lambda dim: min((128, 64), key=lambda b: triton.cdiv(dim, b) * (64 + 2 * b))  # noqa: E731
        tile_v = wide(value_dim) if value_dim > 64 else 64
        walk, out = StateTiles(64, 64, 4, stages), StateTiles(64, tile_v, tile_v // 16, stages)  # 4 or 8 warps
        dqk = StateTiles(64 if arch.capability >= (9, 0) else wide(key_dim), 64, 8, stages)
        tiles = (walk, out, walk, dqk, out)
    else:  # float32 / float64: exact products on the FMA units, operands in registers
        walk, out = StateTiles(32, 64, 8), StateTiles(32, 32, 8)
        tiles = (walk, out, walk, out, out)
    return ChunkRetentionConfig(64, *(t.fit(key_dim, value_dim) for t in tiles))


# ------------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _dot(a, b, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` in the operands' dtype, accumulated in ``ACC``."""
    return tl.dot(a, b, out_dtype=ACC, input_precision=PRECISION)


@triton.jit
def _chunk_decays(log2_gamma, docs, i_b, start, L, HAS_RESET: tl.constexpr, TRANSPOSED: tl.constexpr,
                  BT: tl.constexpr, ACC: tl.constexpr):
    """Decays of the chunk starting at token ``start`` of row ``i_b``, document masks applied (``docs``: ``(batch,
    1 + L)`` int32 document indices, read where ``HAS_RESET``). Returns ``intra`` (BT, BT) ``D[i, j] = gamma^(i-j)``
    for ``j <= i`` in one document, else 0 (its transpose if ``TRANSPOSED``); ``q_decay`` (BT,) ``gamma^(i+1)``, the
    read of the carried state; ``k_decay`` (BT,) ``gamma^(n-1-j)``, the write into the next state (0 past the
    sequence); ``state_decay`` (scalar) ``gamma^n``. A kernel that uses only some of them compiles only those."""
    offs_t = tl.arange(0, BT)
    t = start + offs_t
    mask_t = t < L
    n = tl.minimum(L - start, BT)
    distance = ((offs_t[None, :] - offs_t[:, None]) if TRANSPOSED else (offs_t[:, None] - offs_t[None, :])).to(ACC)
    intra = tl.where(distance >= 0, tl.exp2(tl.maximum(distance, 0) * log2_gamma), 0.0)
    q_decay = tl.exp2((offs_t + 1).to(ACC) * log2_gamma)
    k_decay = tl.where(mask_t, tl.exp2((n - 1 - offs_t).to(ACC) * log2_gamma), 0.0)
    state_decay = tl.exp2(n.to(ACC) * log2_gamma)
    if HAS_RESET:  # nothing crosses a document boundary (the mask of ``intra`` is symmetric)
        doc_base = docs + i_b * (L + 1)
        seg = tl.load(doc_base + 1 + t, mask=mask_t, other=-1)
        before = tl.load(doc_base + start)  # the carried state's document
        last = tl.load(doc_base + start + n)  # the chunk's last token's
        intra = tl.where(seg[:, None] == seg[None, :], intra, 0.0)
        q_decay = tl.where(seg == before, q_decay, 0.0)
        k_decay = tl.where(seg == last, k_decay, 0.0)
        state_decay = tl.where(last == before, state_decay, 0.0)
    return intra, q_decay, k_decay, state_decay


@triton.jit
def _head(i_bh, log2_gamma_ptr, scale, L, H: tl.constexpr, BT: tl.constexpr, ACC: tl.constexpr):
    """Row (int64) and head of program ``i_bh``, the number of chunks, the head's ``log2(gamma)``, ``scale`` in ACC."""
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    return i_b, i_h, tl.cdiv(L, BT), tl.load(log2_gamma_ptr + i_h), tl.full((), scale, ACC)


@triton.jit
def _walk(a, b, states, first, last, docs, log2_gamma_ptr, scale, L, H: tl.constexpr, K: tl.constexpr,
          V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_FIRST: tl.constexpr,
          STORE_LAST: tl.constexpr, REVERSE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
          HAS_RESET: tl.constexpr):
    """The chunk walk of ``_retention_chunk_h_kernel`` (``a, b = k, v``, forward in time) and
    ``_retention_chunk_dh_kernel`` (``a, b = q, dO``, ``REVERSE``): stores the tile met at each chunk into
    ``states`` ``(batch * heads, NT, K, V)``, starting from ``first`` (zero without ``HAS_FIRST``), and the last one
    into ``last`` if ``STORE_LAST``."""
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, NT, log2_gamma, scale = _head(i_bh, log2_gamma_ptr, scale, L, H, BT, ACC)
    offs_t = tl.arange(0, BT)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    # (batch, length, heads, dim) layout, contiguous: token stride H * dim
    a_base = a + i_b * L * H * K + i_h * K
    b_base = b + i_b * L * H * V + i_h * V
    tile_offs = offs_k[:, None] * V + offs_v[None, :]
    states_base = states + i_bh.to(tl.int64) * NT * K * V
    state_offs = i_bh.to(tl.int64) * K * V + tile_offs
    state = tl.zeros([BK, BV], dtype=ACC)
    if HAS_FIRST:
        state += tl.load(first + state_offs, mask=mask_kv, other=0.0).to(ACC)
    for i in range(0, NT):
        i_t = NT - 1 - i if REVERSE else i
        start = i_t * BT
        tl.store(states_base + i_t * K * V + tile_offs, state.to(states.dtype.element_ty), mask=mask_kv)
        t = start + offs_t
        mask_t = t < L
        a_blk = tl.load(a_base + t[:, None] * (H * K) + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :],
                        other=0.0)
        b_blk = tl.load(b_base + t[:, None] * (H * V) + offs_v[None, :], mask=mask_t[:, None] & mask_v[None, :],
                        other=0.0)
        _, q_decay, k_decay, state_decay = _chunk_decays(log2_gamma, docs, i_b, start, L, HAS_RESET, False, BT, ACC)
        a_blk = (a_blk * (scale * q_decay if REVERSE else k_decay)[:, None]).to(b_blk.dtype)
        state = state * state_decay + _dot(tl.trans(a_blk), b_blk, ACC, PRECISION)
    if STORE_LAST:
        tl.store(last + state_offs, state.to(last.dtype.element_ty), mask=mask_kv)


@triton.jit
def _retention_chunk_h_kernel(
    k, v, h, initial_state, final_state, docs, log2_gamma_ptr, L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    HAS_RESET: tl.constexpr,
):
    """Grid (value tiles, key tiles, batch * heads): ``h[b, h, c] = S_c`` of every chunk, and the final state."""
    _walk(k, v, h, initial_state, final_state, docs, log2_gamma_ptr, 1.0, L, H, K, V, BT, BK, BV, HAS_INITIAL_STATE,
          STORE_FINAL_STATE, False, ACC, PRECISION, HAS_RESET)


@triton.jit
def _value_tile(a, b, c, states, out, docs, log2_gamma_ptr, scale, L, H: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
                PRECISION: tl.constexpr, HAS_RESET: tl.constexpr, REVERSE: tl.constexpr):
    """One chunk and value tile of ``_retention_chunk_o_kernel`` (``a, b, c = q, k, v``, ``states = h``) or, if
    ``REVERSE``, of ``_retention_chunk_dv_kernel`` (``a, b, c = k, q, dO``, ``states = dh``): ``out = ((a b^T) *
    D~) c + d (a S_c)``, ``D~`` the decays ``D`` (their transpose if ``REVERSE``) times ``scale``, ``d`` the decay of
    the read of the carried state (``scale gamma^(i+1)``; ``REVERSE``: ``gamma^(n-1-j)``); the key axis summed
    inside the program."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, NT, log2_gamma, scale = _head(i_bh, log2_gamma_ptr, scale, L, H, BT, ACC)
    start = i_t * BT
    t = start + tl.arange(0, BT)
    mask_t = t < L
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < V
    mask_tv = mask_t[:, None] & mask_v[None, :]
    a_base = a + i_b * L * H * K + i_h * K
    b_base = b + i_b * L * H * K + i_h * K
    states_base = states + (i_bh.to(tl.int64) * NT + i_t) * K * V
    dt = a.dtype.element_ty
    scores = tl.zeros([BT, BT], dtype=ACC)  # a b^T
    from_state = tl.zeros([BT, BV], dtype=ACC)  # a S_c
    for k_start in range(0, K, BK):
        offs_k = k_start + tl.arange(0, BK)
        mask_k = offs_k < K
        mask_tk = mask_t[:, None] & mask_k[None, :]
        a_blk = tl.load(a_base + t[:, None] * (H * K) + offs_k[None, :], mask=mask_tk, other=0.0)
        b_blk = tl.load(b_base + t[:, None] * (H * K) + offs_k[None, :], mask=mask_tk, other=0.0)
        s_blk = tl.load(states_base + offs_k[:, None] * V + offs_v[None, :], mask=mask_k[:, None] & mask_v[None, :],
                        other=0.0)
        scores += _dot(a_blk, tl.trans(b_blk), ACC, PRECISION)
        from_state += _dot(a_blk, s_blk, ACC, PRECISION)
    intra, q_decay, k_decay, _ = _chunk_decays(log2_gamma, docs, i_b, start, L, HAS_RESET, REVERSE, BT, ACC)
    scores = tl.where(intra > 0, scores * scale * intra, 0.0)  # selected: a later token's NaN or inf stays out
    c_blk = tl.load(c + i_b * L * H * V + i_h * V + t[:, None] * (H * V) + offs_v[None, :], mask=mask_tv, other=0.0)
    if REVERSE:
        result = _dot(scores.to(dt), c_blk, ACC, PRECISION) + from_state * k_decay[:, None]
    else:  # the finite part of v through the product, the rest by the running sum
        finite_c = tl.where(tl.abs(c_blk) < float("inf"), c_blk, 0.0)
        result = _dot(scores.to(dt), finite_c, ACC, PRECISION) + from_state * (scale * q_decay)[:, None]
        result += tl.cumsum((c_blk - finite_c).to(ACC), axis=0)
    tl.store(out + i_b * L * H * V + i_h * V + t[:, None] * (H * V) + offs_v[None, :], result.to(dt), mask=mask_tv)


@triton.jit
def _retention_chunk_o_kernel(
    q, k, v, h, o, docs, log2_gamma_ptr, scale, L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, HAS_RESET: tl.constexpr,
):
    """Grid (value tiles, chunks, batch * heads): ``o`` of one chunk and value tile."""
    _value_tile(q, k, v, h, o, docs, log2_gamma_ptr, scale, L, H, K, V, BT, BK, BV, ACC, PRECISION, HAS_RESET, False)


@triton.jit
def _retention_chunk_dh_kernel(
    q, do, dh, d_final_state, d_initial_state, docs, log2_gamma_ptr, scale, L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_D_FINAL_STATE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, HAS_RESET: tl.constexpr,
):
    """Grid (value tiles, key tiles, batch * heads): ``dh[b, h, c] = dH_c`` of every chunk, and ``d initial_state``."""
    _walk(q, do, dh, d_final_state, d_initial_state, docs, log2_gamma_ptr, scale, L, H, K, V, BT, BK, BV,
          HAS_D_FINAL_STATE, True, True, ACC, PRECISION, HAS_RESET)


@triton.jit
def _retention_chunk_dqk_kernel(
    q, k, v, do, h, dh, dq, dk, docs, log2_gamma_ptr, scale, L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, HAS_RESET: tl.constexpr,
):
    """Grid (key tiles, chunks, batch * heads): ``dq`` (of ``q``, not ``q~``) and ``dk`` of one chunk and key tile,
    the value axis summed inside the program."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, NT, log2_gamma, scale = _head(i_bh, log2_gamma_ptr, scale, L, H, BT, ACC)
    start = i_t * BT
    t = start + tl.arange(0, BT)
    mask_t = t < L
    offs_k = i_k * BK + tl.arange(0, BK)
    mask_k = offs_k < K
    mask_tk = mask_t[:, None] & mask_k[None, :]
    v_base = v + i_b * L * H * V + i_h * V
    do_base = do + i_b * L * H * V + i_h * V
    state_base = (i_bh.to(tl.int64) * NT + i_t) * K * V
    dt = v.dtype.element_ty
    d_scores = tl.zeros([BT, BT], dtype=ACC)  # dO v^T
    dq_state = tl.zeros([BT, BK], dtype=ACC)  # dO S_c^T
    dk_state = tl.zeros([BT, BK], dtype=ACC)  # v dH_c^T
    for v_start in range(0, V, BV):
        offs_v = v_start + tl.arange(0, BV)
        mask_v = offs_v < V
        mask_tv = mask_t[:, None] & mask_v[None, :]
        mask_kv = mask_k[:, None] & mask_v[None, :]
        v_blk = tl.load(v_base + t[:, None] * (H * V) + offs_v[None, :], mask=mask_tv, other=0.0)
        do_blk = tl.load(do_base + t[:, None] * (H * V) + offs_v[None, :], mask=mask_tv, other=0.0)
        state_offs = state_base + offs_k[:, None] * V + offs_v[None, :]
        h_blk = tl.load(h + state_offs, mask=mask_kv, other=0.0)
        dh_blk = tl.load(dh + state_offs, mask=mask_kv, other=0.0)
        d_scores += _dot(do_blk, tl.trans(v_blk), ACC, PRECISION)
        dq_state += _dot(do_blk, tl.trans(h_blk), ACC, PRECISION)
        dk_state += _dot(v_blk, tl.trans(dh_blk), ACC, PRECISION)
    intra, q_decay, k_decay, _ = _chunk_decays(log2_gamma, docs, i_b, start, L, HAS_RESET, False, BT, ACC)
    # scale here, not on the (BT, BK) results: that crashed LLVM's SLP vectorizer (float32, fp64 scale, sm_90)
    d_scores = tl.where(intra > 0, d_scores * scale * intra, 0.0).to(dt)
    tk_offs = t[:, None] * (H * K) + offs_k[None, :]
    q_blk = tl.load(q + i_b * L * H * K + i_h * K + tk_offs, mask=mask_tk, other=0.0)
    k_blk = tl.load(k + i_b * L * H * K + i_h * K + tk_offs, mask=mask_tk, other=0.0)
    dq_blk = _dot(d_scores, k_blk, ACC, PRECISION) + dq_state * (scale * q_decay)[:, None]
    dk_blk = _dot(tl.trans(d_scores), q_blk, ACC, PRECISION) + dk_state * k_decay[:, None]
    tl.store(dq + i_b * L * H * K + i_h * K + tk_offs, dq_blk.to(dq.dtype.element_ty), mask=mask_tk)
    tl.store(dk + i_b * L * H * K + i_h * K + tk_offs, dk_blk.to(dk.dtype.element_ty), mask=mask_tk)


@triton.jit
def _retention_chunk_dv_kernel(
    q, k, do, dh, dv, docs, log2_gamma_ptr, scale, L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, HAS_RESET: tl.constexpr,
):
    """Grid (value tiles, chunks, batch * heads): ``dv`` of one chunk and value tile."""
    _value_tile(k, q, do, dh, dv, docs, log2_gamma_ptr, scale, L, H, K, V, BT, BK, BV, ACC, PRECISION, HAS_RESET, True)


# ---------------------------------------------------------------------------------------------------------- host


def _launch(kernel, grid, block_t, tiles, key_dim, value_dim, *args, **meta):
    """Launch ``kernel`` over ``grid`` with its tiles (:func:`~..triton_utils.launch`)."""
    launch(kernel)[grid](*args, K=key_dim, V=value_dim, BT=block_t, BK=tiles.block_k, BV=tiles.block_v,
                         num_warps=tiles.num_warps, num_stages=tiles.num_stages, **meta)


def _prepare(q, k, v, initial_state, final_state, reset, config):
    """Run ``_retention_chunk_h_kernel``, the final state written to ``final_state`` unless it is None. Returns the
    states entering every chunk, ``h`` ``(batch, heads, NT, key_dim, value_dim)`` in the inputs' dtype, the launch
    choice (``config``, or the one for this GPU and shape), contiguous ``q``, ``k``, ``v``, the ``(batch, 1 +
    length)`` int32 document indices (0 then ``cumsum(reset)``; None without ``reset``), the per-head
    ``log2(gamma)``, and the constexprs every kernel takes besides the sizes."""
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    config = config or chunk_retention_config(device_arch(q.device), q.dtype, key_dim, value_dim)
    acc_torch, acc_tl = (torch.float64, tl.float64) if v.dtype == torch.float64 else (torch.float32, tl.float32)
    docs = None if reset is None else torch.nn.functional.pad(reset.cumsum(1, dtype=torch.int32), (1, 0))
    precision = "ieee" if v.dtype in (torch.float32, torch.float64) else "tf32"  # tl.dot exact for float32/64
    meta = dict(H=heads, ACC=acc_tl, PRECISION=precision, HAS_RESET=reset is not None)
    log2_gamma = retention_log2_gamma(heads, q.device, acc_torch)
    initial_state = None if initial_state is None else initial_state.contiguous()
    q, k, v, tiles = q.contiguous(), k.contiguous(), v.contiguous(), config.h
    h = k.new_empty(batch, heads, triton.cdiv(length, config.block_t), key_dim, value_dim)
    grid = (triton.cdiv(value_dim, tiles.block_v), triton.cdiv(key_dim, tiles.block_k), batch * heads)
    _launch(_retention_chunk_h_kernel, grid, config.block_t, tiles, key_dim, value_dim, k, v, h, initial_state,
            final_state, docs, log2_gamma, length, HAS_INITIAL_STATE=initial_state is not None,
            STORE_FINAL_STATE=final_state is not None, **meta)
    return h, config, q, k, v, docs, log2_gamma, meta


def chunk_retention_fwd_triton(q, k, v, scale, initial_state=None, reset=None, config=None):
    """The Triton branch of ``hf_densessm::chunk_retention``, no checks: arguments and ``(o, final_state)`` as
    :func:`hf_densessm.ops.retention.chunk_retention` (``scale`` a float), plus ``config`` (default
    :func:`chunk_retention_config` for ``q``'s device). Memory: docs/kernels.md."""
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    final_state = q.new_empty(batch, heads, key_dim, value_dim, dtype=compute_dtype(v.dtype))
    h, config, q, k, v, docs, log2_gamma, meta = _prepare(q, k, v, initial_state, final_state, reset, config)
    o = torch.empty_like(v)
    if h.shape[2]:
        grid = (triton.cdiv(value_dim, config.o.block_v), h.shape[2], batch * heads)
        _launch(_retention_chunk_o_kernel, grid, config.block_t, config.o, key_dim, value_dim, q, k, v, h, o, docs,
                log2_gamma, scale, length, **meta)
    return o, final_state


def chunk_retention_bwd_triton(d_o, d_final_state, q, k, v, scale, initial_state=None, reset=None, config=None):
    """The Triton branch of ``hf_densessm::chunk_retention_backward``: arguments and returns as
    :func:`~.chunked_torch.chunk_retention_torch_backward` (``config`` as :func:`chunk_retention_fwd_triton`'s); the
    per-chunk states are recomputed (docs/kernels.md)."""
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    h, config, q, k, v, docs, log2_gamma, meta = _prepare(q, k, v, initial_state, None, reset, config)
    d_o = d_o.to(v.dtype).contiguous()
    d_final_state = None if d_final_state is None else d_final_state.contiguous()
    num_chunks, dh = h.shape[2], torch.empty_like(h)
    d_initial_state = q.new_empty(batch, heads, key_dim, value_dim, dtype=compute_dtype(v.dtype))
    grid = (triton.cdiv(value_dim, config.dh.block_v), triton.cdiv(key_dim, config.dh.block_k), batch * heads)
    _launch(_retention_chunk_dh_kernel, grid, config.block_t, config.dh, key_dim, value_dim, q, d_o, dh, d_final_state,
            d_initial_state, docs, log2_gamma, scale, length, HAS_D_FINAL_STATE=d_final_state is not None, **meta)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if num_chunks:
        grid = (triton.cdiv(key_dim, config.dqk.block_k), num_chunks, batch * heads)
        _launch(_retention_chunk_dqk_kernel, grid, config.block_t, config.dqk, key_dim, value_dim, q, k, v, d_o, h, dh,
                dq, dk, docs, log2_gamma, scale, length, **meta)
        grid = (triton.cdiv(value_dim, config.dv.block_v), num_chunks, batch * heads)
        _launch(_retention_chunk_dv_kernel, grid, config.block_t, config.dv, key_dim, value_dim, q, k, d_o, dh, dv,
                docs, log2_gamma, scale, length, **meta)
    return dq, dk, dv, d_initial_state
