"""Fused Triton decode step of the selective SSM (Mamba paper eq. 2a/2b, recurrent mode): the Triton body of
``hf_densessm::selective_state_update``."""

from __future__ import annotations

import torch

from ..backend import GPUArch, device_arch
from ..triton_utils import acc, launch, sigmoid, softplus, tl, triton  # raises ImportError without triton

__all__ = ["selective_state_update_config", "selective_state_update_triton"]


def selective_state_update_config(arch: GPUArch, nstate: int) -> tuple[int, int]:
    """``(block_d, num_warps)`` of the decode step, powers of 2: a 512-element state tile on 4 warps, for every
    ``arch`` (docs/kernels.md); ``nstate``: the state size ``N``."""
    del arch
    return max(4, min(32, 512 // triton.next_power_of_2(nstate))), 4


@triton.jit
def _selective_state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, y_ptr,
    s_h_b, s_h_d, s_h_n, s_x_b, s_x_d, s_dt_b, s_dt_d, s_A_d, s_A_n, s_B_b, s_B_n, s_C_b, s_C_n, s_z_b, s_z_d,
    dim, nstate,
    HAS_Z: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    USE_FP64: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < dim
    mask_n = offs_n < nstate
    mask_dn = mask_d[:, None] & mask_n[None, :]

    h_ptrs = state_ptr + pid_b * s_h_b + offs_d[:, None] * s_h_d + offs_n[None, :] * s_h_n
    h = acc(tl.load(h_ptrs, mask=mask_dn, other=0.0), USE_FP64)
    x = acc(tl.load(x_ptr + pid_b * s_x_b + offs_d * s_x_d, mask=mask_d, other=0.0), USE_FP64)
    dt = acc(tl.load(dt_ptr + pid_b * s_dt_b + offs_d * s_dt_d, mask=mask_d, other=0.0), USE_FP64)
    if HAS_BIAS:
        dt += acc(tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64)
    if SOFTPLUS:
        dt = softplus(dt)
    A = acc(tl.load(A_ptr + offs_d[:, None] * s_A_d + offs_n[None, :] * s_A_n, mask=mask_dn, other=0.0), USE_FP64)
    Bv = acc(tl.load(B_ptr + pid_b * s_B_b + offs_n * s_B_n, mask=mask_n, other=0.0), USE_FP64)
    Cv = acc(tl.load(C_ptr + pid_b * s_C_b + offs_n * s_C_n, mask=mask_n, other=0.0), USE_FP64)

    h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * Bv[None, :]  # eq. 2a, discretized as eq. 4
    tl.store(h_ptrs, h.to(state_ptr.dtype.element_ty), mask=mask_dn)
    y = tl.sum(h * Cv[None, :], axis=1)  # eq. 2b
    if HAS_D:
        y += acc(tl.load(D_ptr + offs_d, mask=mask_d, other=0.0), USE_FP64) * x
    if HAS_Z:
        z = acc(tl.load(z_ptr + pid_b * s_z_b + offs_d * s_z_d, mask=mask_d, other=0.0), USE_FP64)
        y = y * z * sigmoid(z)
    tl.store(y_ptr + pid_b * dim + offs_d, y.to(y_ptr.dtype.element_ty), mask=mask_d)


def selective_state_update_triton(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                                  config=None):
    """One decode step, ``state`` (batch, dim, state) updated in place, no checks: arguments and ``y`` as
    :func:`hf_densessm.ops.selective_state_update` (any strides), plus ``config`` ``(block_d, num_warps)`` (default
    :func:`selective_state_update_config`). Not differentiable."""
    batch, dim, nstate = state.shape
    block_d, num_warps = config or selective_state_update_config(device_arch(state.device), nstate)
    block_d = min(block_d, triton.next_power_of_2(dim))
    D, dt_bias = (None if t is None else t.contiguous() for t in (D, dt_bias))  # indexed as contiguous
    y = torch.empty(batch, dim, dtype=x.dtype, device=x.device)
    launch(_selective_state_update_kernel)[(batch, triton.cdiv(dim, block_d))](
        state, x, dt, A, B, C, D, z, dt_bias, y, *state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(),
        *C.stride(), *((0, 0) if z is None else z.stride()), dim, nstate, HAS_Z=z is not None, HAS_D=D is not None,
        HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), USE_FP64=state.dtype == torch.float64,
        BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(nstate), num_warps=num_warps)
    return y
