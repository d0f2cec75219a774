"""Mamba's causal depthwise convolution in token-major order (``ops/causal_conv1d.py``): the compiled CPU kernel
and the PyTorch path against ``F.conv1d`` (channels first, left zero padding; packed documents run one by one),
values and gradients in float64; cached windows; half precision; argument checks."""

import pytest
import torch
import torch.nn.functional as F

import importlib

conv_module = importlib.import_module("hf_densessm.ops.causal_conv1d")  # the module (the package exports the function)
from hf_densessm.ops.causal_conv1d import causal_conv1d

BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(conv_module._library() is None, reason="no C compiler"))]


def reference(x, weight, bias, window=None, reset=None, activation=None):
    """F.conv1d over (batch, channels, length), each packed document alone; the window's last kernel - 1 inputs
    stand before the sequence."""
    kernel = weight.shape[-1]
    rows = []
    for b in range(x.shape[0]):
        starts = [0] + ([] if reset is None else [t for t in range(1, x.shape[1]) if reset[b, t]]) + [x.shape[1]]
        pieces = []
        for s, e in zip(starts[:-1], starts[1:]):
            seq = x[b : b + 1, s:e].transpose(1, 2)
            left = window[b : b + 1, :, 1:] if window is not None and s == 0 else seq.new_zeros(1, seq.shape[1], kernel - 1)
            pieces.append(F.conv1d(torch.cat([left, seq], -1), weight, bias, groups=weight.shape[0]).transpose(1, 2))
        rows.append(torch.cat(pieces, 1))
    out = torch.cat(rows, 0)
    return F.silu(out) if activation == "silu" else out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 1, 1, 4), (2, 7, 5, 4), (3, 40, 37, 4), (2, 33, 20, 3), (1, 5, 16, 2)])
@pytest.mark.parametrize("mode", ["plain", "window", "packed"])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_matches_conv1d_float64(backend, shape, mode, activation):
    batch, length, dim, kernel = shape
    g = torch.Generator().manual_seed(length * dim)
    proj = torch.randn(batch, length, 2 * dim, generator=g, dtype=torch.float64)
    x = proj[..., :dim].detach().requires_grad_()  # a view with the in_proj's row stride, as in the model
    weight = torch.randn(dim, 1, kernel, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(dim, generator=g, dtype=torch.float64, requires_grad=True)
    window = torch.randn(batch, dim, kernel, generator=g, dtype=torch.float64) if mode == "window" else None
    reset = None
    if mode == "packed":
        reset = torch.rand(batch, length, generator=g) < 0.25
    out = causal_conv1d(x, weight, bias, window, reset, activation, backend=backend)
    ref = reference(x, weight, bias, window, reset, activation)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    go = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * go).sum(), (x, weight, bias))
    refs = torch.autograd.grad((ref * go).sum(), (x, weight, bias))
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_and_no_bias(backend):
    x = torch.randn(2, 9, 24).bfloat16()
    weight = torch.randn(24, 1, 4).bfloat16()
    out = causal_conv1d(x, weight, None, activation="silu", backend=backend)
    assert out.dtype == torch.bfloat16
    ref = reference(x.double(), weight.double(), None, activation="silu")
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_window_is_read_not_kept():
    """The window is a cache the caller updates in place right after: the backward pass must use the values of the
    call."""
    x = torch.randn(1, 6, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(16, 1, 4, dtype=torch.float64, requires_grad=True)
    window = torch.randn(1, 16, 4, dtype=torch.float64)
    out = causal_conv1d(x, weight, None, window)
    ref = reference(x, weight, None, window)
    (g_ref,) = torch.autograd.grad(ref.sum(), weight)
    window.zero_()
    (g,) = torch.autograd.grad(out.sum(), weight)
    torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(x=torch.randn(2, 3)), ValueError, "x must have shape \\(batch, seq_len, channels\\)"),
        (dict(x=torch.ones(1, 3, 4, dtype=torch.long)), TypeError, "x must be a floating-point tensor"),
        (dict(weight=torch.randn(5, 1, 4)), ValueError, "weight must have shape \\(4, 1, kernel\\)"),
        (dict(bias=torch.randn(3)), ValueError, "bias must have shape \\(4,\\)"),
        (dict(window=torch.randn(1, 4, 3)), ValueError, "window must have shape"),
        (dict(activation="gelu"), ValueError, "activation must be one of"),
        (dict(reset=torch.zeros(1, 3, dtype=torch.bool), window=torch.randn(1, 4, 4)), ValueError, "cannot be combined"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
    ],
)
def test_bad_inputs(kwargs, error, match):
    args = dict(x=torch.randn(1, 3, 4), weight=torch.randn(4, 1, 4), bias=None)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        causal_conv1d(**args)
