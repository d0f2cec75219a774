"""Triton device functions shared by the kernels of every op (``__all__``), :func:`launch`, and ``triton`` / ``tl``
for the kernel files, whose import thus raises ``ImportError`` without triton (docs/kernels.md).
"""

import inspect

try:  # triton: needed only when a kernel of this file runs
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(f"{__name__} holds Triton kernels and needs the `triton` package") from error

import torch

from .dispatch import interpreting

__all__ = ["acc", "launch", "sigmoid", "softplus", "tl", "triton"]


def launch(kernel):
    """``torch.library.wrap_triton(kernel)``, to be indexed with the grid and called (traced by ``torch.compile``);
    ``kernel`` itself under the interpreter, whose functions ``wrap_triton`` refuses (outside it, a ``RuntimeError``
    from ``wrap_triton`` for a kernel that is not a Triton kernel)."""
    try:
        return torch.library.wrap_triton(kernel)
    except RuntimeError:
        if interpreting():
            return kernel
        raise


@triton.jit
def acc(x, USE_FP64: tl.constexpr):
    """Cast a tile of any float dtype to the accumulation dtype: float64 if ``USE_FP64`` else float32."""
    return x.to(tl.float64 if USE_FP64 else tl.float32)


@triton.jit
def softplus(x):
    """``log(1 + exp(x))`` elementwise (Mamba paper App. D). float32: ``max(x, 0) + v p(v)``, ``v = exp(-|x|)``,
    ``p`` a degree-8 fit of ``log1p(v) / v`` (relative error <= 2.3e-7; docs/kernels.md); float64: ``log(1 +
    exp(x))``, ``x`` above 20."""
    if x.dtype == tl.float64:
        return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    v = tl.exp2(-tl.abs(x) * 1.4426950408889634)
    p = tl.fma(v, 0.005186003632843494, -0.029210267588496208)
    p = tl.fma(p, v, 0.07754038274288177)
    p = tl.fma(p, v, -0.13583941757678986)
    p = tl.fma(p, v, 0.19055955111980438)
    p = tl.fma(p, v, -0.24825648963451385)
    p = tl.fma(p, v, 0.3331601023674011)
    p = tl.fma(p, v, -0.4999925494194031)
    p = tl.fma(p, v, 0.9999999403953552)
    return tl.fma(v, p, tl.maximum(x, 0.0))


APPROX_DIV = tl.constexpr("approx" in inspect.signature(tl.math.fdiv).parameters)  # triton 3.6 has no `approx`


@triton.jit
def sigmoid(x):
    """``1 / (1 + exp(-x))`` elementwise, in float32 by an approximate division (2 ulp, no range check) where this
    triton's ``fdiv`` has ``approx``, else by ``/``; the gate ``y * silu(z) = y z sigmoid(z)`` of the Mamba block."""
    denominator = 1.0 + tl.exp2(x * -1.4426950408889634)
    return tl.math.fdiv(1.0, denominator, approx=x.dtype == tl.float32) if APPROX_DIV else 1.0 / denominator
