"""The dense connection's fused gate (``ops/gated_add.py``): the CPU kernel against the PyTorch path in float64
(values and the three gradients), strided inputs as the models pass them, half precision, argument checks; and the
default dense connection equal to the unfused sum of gated predecessors."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from hf_densessm.modeling.dense_connection import DenseHiddenConnection
from hf_densessm.ops.gated_add import gated_add, gated_add_torch

module = importlib.import_module("hf_densessm.ops.gated_add")
BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(module._library() is None, reason="no C compiler"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 7, 5), (3, 11, 37), (2, 9, 1024)])
def test_matches_the_formula_float64(backend, shape):
    g = torch.Generator().manual_seed(shape[-1])
    wide = torch.randn(*shape[:-1], 3 * shape[-1], generator=g, dtype=torch.float64)
    feature = wide[..., : shape[-1]].detach().requires_grad_()  # strided rows, as a split projection
    total = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    gate = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).requires_grad_()
    out = gated_add(feature, total, gate, backend=backend)
    ref = feature + total * gate * torch.sigmoid(gate)
    torch.testing.assert_close(out, ref, atol=1e-13, rtol=1e-13)
    go = torch.randn(shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * go).sum(), (feature, total, gate))
    refs = torch.autograd.grad((ref * go).sum(), (feature, total, gate))
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, atol=1e-13, rtol=1e-13)


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_float32_and_bfloat16(backend):
    x = [torch.randn(2, 5, 48) for _ in range(3)]
    torch.testing.assert_close(gated_add(*x, backend=backend), gated_add_torch(*x), atol=1e-6, rtol=1e-6)
    xb = [t.bfloat16() for t in x]
    assert gated_add(*xb, backend=backend).dtype == torch.bfloat16


def test_bad_inputs():
    a = torch.randn(2, 3)
    with pytest.raises(ValueError, match="one shape"):
        gated_add(a, a, torch.randn(2, 4))
    with pytest.raises(ValueError, match="one dtype"):
        gated_add(a, a, a.double())


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_default_connection_equals_the_unfused_sum(backend):
    torch.manual_seed(0)
    conn = DenseHiddenConnection(16, 24, 3, "identity", "mlp", True, "add", 4).double()
    conn.config = type("C", (), {"kernel_backend": backend})()
    x, feature = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 5, 24, dtype=torch.float64)
    preds = [torch.randn(2, 5, 24, dtype=torch.float64) for _ in range(3)]
    gate = conn.gate(x)
    expected = feature + sum(f * gate for f in preds)
    torch.testing.assert_close(conn(x, feature, preds), expected, atol=1e-13, rtol=1e-13)
    assert torch.equal(conn.gate(x), F.silu(conn.gate.pre_activation(x)))
