"""One decoding step of multi-scale retention in Triton (DenseSSM paper Eq. 18-19), the state updated in place: the
Triton branch of ``hf_densessm::retention_state_update`` (docs/kernels.md, "How the kernels work").
"""

import torch

from ..backend import GPUArch, device_arch
from ..triton_utils import launch, tl, triton  # raises ImportError without triton
from .chunk import StateTiles

__all__ = ["retention_state_update_config", "retention_state_update_triton"]


def retention_state_update_config(arch: GPUArch, key_dim: int, value_dim: int) -> StateTiles:
    """The decode step's tiles (``num_stages`` unused): 64 x 64 on 4 warps for every ``arch``, fit to the head."""
    return StateTiles(64, 64, 4).fit(key_dim, value_dim)


@triton.jit
def _retention_step_kernel(
    state, q, k, v, o, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
):
    """Grid (value tiles, batch * heads); q, k: (B, H, K), v, o: (B, H, V), state: (B, H, K, V), contiguous."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_h = i_bh % H
    scale = tl.full((), scale, ACC)  # fp32 from Triton's launcher, fp64 from Inductor's: cast to one dtype
    gamma = 1.0 - tl.exp2(-(i_h + 5).to(ACC))  # gamma_h = 1 - 2**(-5 - h), exact in float32 and float64
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < V
    v_row = tl.load(v + i_bh * V + offs_v, mask=mask_v, other=0.0).to(ACC)
    state_base = state + i_bh.to(tl.int64) * K * V
    o_acc = tl.zeros([BV], dtype=ACC)
    for k_start in range(0, K, BK):
        offs_k = k_start + tl.arange(0, BK)
        mask_k = offs_k < K
        mask_kv = mask_k[:, None] & mask_v[None, :]
        q_row = tl.load(q + i_bh * K + offs_k, mask=mask_k, other=0.0).to(ACC) * scale
        k_row = tl.load(k + i_bh * K + offs_k, mask=mask_k, other=0.0).to(ACC)
        ptrs = state_base + offs_k[:, None] * V + offs_v[None, :]
        s = tl.load(ptrs, mask=mask_kv, other=0.0).to(ACC)
        s = gamma * s + k_row[:, None] * v_row[None, :]  # Eq. 18
        tl.store(ptrs, s.to(state.dtype.element_ty), mask=mask_kv)
        o_acc += tl.sum(q_row[:, None] * s, axis=0)  # Eq. 19
    tl.store(o + i_bh * V + offs_v, o_acc.to(o.dtype.element_ty), mask=mask_v)


def retention_state_update_triton(state, q, k, v, scale, config=None):
    """No checks: arguments and ``o`` as :func:`hf_densessm.ops.retention.retention_state_update` (``scale`` a
    float), plus ``config`` (default :func:`retention_state_update_config`)."""
    batch, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    acc = tl.float64 if state.dtype == torch.float64 else tl.float32
    work = state if state.is_contiguous() else state.contiguous()
    o = torch.empty_like(v)
    tiles = config or retention_state_update_config(device_arch(q.device), key_dim, value_dim)
    launch(_retention_step_kernel)[(triton.cdiv(value_dim, tiles.block_v), batch * heads)](
        work, q.contiguous(), k.contiguous(), v.contiguous(), o, scale,
        H=heads, K=key_dim, V=value_dim, BK=tiles.block_k, BV=tiles.block_v, ACC=acc, num_warps=tiles.num_warps)
    if work is not state:
        state.copy_(work)
    return o
