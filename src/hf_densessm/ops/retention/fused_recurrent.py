"""One decoding step of multi-scale retention in Triton, the state updated in place: the Triton branch of
``hf_densessm::retention_state_update``, launched through ``torch.library.wrap_triton``.

DenseSSM paper Eq. 18-19 for a single token, per head with decay ``gamma``:
``S <- gamma S + k^T v``, then ``o = (scale q) S``. Each program owns a ``BV``-wide column strip of one
``(batch, head)`` state and walks its key rows in ``BK`` tiles: it reads and writes every state element once
(the step is bound by memory traffic, O(1) in the context length) and sums ``o`` in registers, so no partial
outputs reach memory. Key and value sizes that are not powers of two are masked.

The per-head decay ``gamma_h = 1 - 2**(-5 - h)`` is computed in the kernel from the head index (no decay tensor
to build or copy per step), and every scalar the kernel receives is cast to the accumulator dtype first: under
``torch.compile`` on CUDA, Inductor's launcher passes a Python float such as ``scale`` as fp64, which made the
float32 loop-carried ``o_acc`` an fp64 value ("Loop-carried variable o_acc fp32 re-assigned to fp64").
"""

import torch

try:  # triton: needed only when a kernel of this file runs
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(f"{__name__} holds Triton kernels and needs the `triton` package") from error

from ..backend import GPUArch, device_arch
from ..triton_utils import launch

__all__ = ["retention_state_update_config", "retention_state_update_triton"]


def retention_state_update_config(arch: GPUArch, key_dim: int, value_dim: int) -> tuple[int, int, int]:
    """Key rows per tile, value columns per program and warps of the decode step: ``(block_k, block_v, warps)``.

    A program streams ``(block_k, block_v)`` float32 tiles of the state (32 values per thread at 64 x 64 and 4
    warps) and uses no shared memory for them, so one choice serves every architecture of
    :data:`~hf_densessm.ops.backend.ARCHS` (``tests/ops/test_compile.py`` checks it on each); tiles shrink to the
    next power of 2 of a smaller head (at least 16).

    Args:
        arch: the GPU's limits (:func:`hf_densessm.ops.backend.device_arch`).
        key_dim, value_dim: per-head sizes.

    Returns:
        ``(block_k, block_v, num_warps)``.
    """
    del arch
    block_k = min(64, max(16, triton.next_power_of_2(key_dim)))
    block_v = min(64, max(16, triton.next_power_of_2(value_dim)))
    return block_k, block_v, 4


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
    """One retention decoding step with the Triton kernel: the Triton branch of ``hf_densessm::retention_state_update``
    (arguments checked by :func:`hf_densessm.ops.retention.retention_state_update`).

    Args:
        state (Tensor): ``(batch, heads, key_dim, value_dim)`` float32 (float64 with float64 inputs), updated in place.
        q, k (Tensor): ``(batch, heads, key_dim)``; v (Tensor): ``(batch, heads, value_dim)``.
        scale (float): positive factor on ``q``.
        config (tuple, optional): ``(block_k, block_v, num_warps)``; by default
            :func:`retention_state_update_config` for the state's device.

    Returns:
        o (Tensor): ``(batch, heads, value_dim)`` in ``v``'s dtype.
    """
    batch, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    acc = tl.float64 if state.dtype == torch.float64 else tl.float32
    work = state if state.is_contiguous() else state.contiguous()
    o = torch.empty_like(v)
    block_k, block_v, num_warps = config or retention_state_update_config(device_arch(q.device), key_dim, value_dim)
    launch(_retention_step_kernel)[(triton.cdiv(value_dim, block_v), batch * heads)](
        work, q.contiguous(), k.contiguous(), v.contiguous(), o, scale,
        H=heads, K=key_dim, V=value_dim, BK=block_k, BV=block_v, ACC=acc, num_warps=num_warps,
    )
    if work is not state:
        state.copy_(work)
    return o
