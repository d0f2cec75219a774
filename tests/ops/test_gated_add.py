"""The dense connection's fused gate (``ops/gated_add.py``): the CPU kernel against the formula in float64 (values
and every gradient: feature, each predecessor, the gate's input and its weight), strided inputs as the models pass
them, rows across the kernel's row blocks and workers, half precision, argument checks; and the default dense
connection equal to the unfused sum of gated predecessors, with a hook on the gate's output layer honoured."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from hf_densessm.modeling.dense_connection import DenseHiddenConnection
from hf_densessm.ops.gated_add import gated_add, gated_add_torch, uses_kernel

module = importlib.import_module("hf_densessm.ops.gated_add")
has_kernel = module._library() is not None
BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(not has_kernel, reason="no C compiler"))]


def formula(feature, predecessors, gate_input, gate_weight):
    """Written out independently of the op: a = h W^T, out = f + sum(p) * a * sigmoid(a)."""
    a = torch.einsum("...k,nk->...n", gate_input, gate_weight)
    return feature + torch.stack(predecessors).sum(0) * a * torch.sigmoid(a)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,k,count", [((1, 1, 1), 1, 1), ((2, 7, 5), 3, 2), ((3, 11, 37), 16, 4),
                                           ((2, 9, 1024), 16, 3), ((1, 2, 16), 5, 1)])
def test_matches_the_formula_float64(backend, shape, k, count):
    g = torch.Generator().manual_seed(shape[-1] + k)
    wide = torch.randn(*shape[:-1], 3 * shape[-1], generator=g, dtype=torch.float64)
    feature = wide[..., : shape[-1]].detach().requires_grad_()  # strided rows, as a split projection
    preds = [torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(count)]
    h_wide = torch.randn(*shape[:-1], k + 2, generator=g, dtype=torch.float64)
    gate_input = h_wide[..., 1 : k + 1].detach().requires_grad_()  # strided too
    weight = (torch.randn(shape[-1], k, generator=g, dtype=torch.float64) * 2 / k**0.5).requires_grad_()
    inputs = (feature, gate_input, weight, *preds)
    out = gated_add(feature, preds, gate_input, weight, backend=backend)
    ref = formula(feature, preds, gate_input, weight)
    torch.testing.assert_close(out, ref, atol=1e-13, rtol=1e-13)
    go = torch.randn(shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * go).sum(), inputs)
    refs = torch.autograd.grad((ref * go).sum(), inputs)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.skipif(not has_kernel, reason="no C compiler")
def test_many_rows_float32_at_model_scale():
    """2 x 300 rows (every worker gets several blocks of 8 rows, the last one ragged), 1024 features, k = 16, gate
    weights at the model's init scale (Xavier, gain 2^-2.5): the kernel against the float64 formula."""
    g = torch.Generator().manual_seed(0)
    f, *preds = (torch.randn(2, 301, 1024, generator=g) for _ in range(5))
    h = F.silu(torch.randn(2, 301, 16, generator=g))
    w = torch.nn.init.xavier_uniform_(torch.empty(1024, 16), gain=2**-2.5, generator=g)
    leaves = [t.requires_grad_() for t in (f, h, w, *preds)]
    out = gated_add(f, preds, h, w, backend="cpu")
    ref = formula(*(t.double() for t in (f,)), [p.double() for p in preds], h.double(), w.double())
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
    go = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * go).sum(), leaves)
    d64 = [t.detach().double().requires_grad_() for t in leaves]
    refs = torch.autograd.grad((formula(d64[0], d64[3:], d64[1], d64[2]) * go.double()).sum(), d64)
    for a, b in zip(grads, refs):
        assert ((a.double() - b).abs().max() / b.abs().max()).item() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_float32_and_bfloat16(backend):
    f, p1, p2 = (torch.randn(2, 5, 48) for _ in range(3))
    h, w = torch.randn(2, 5, 8), torch.randn(48, 8) / 3
    torch.testing.assert_close(gated_add(f, [p1, p2], h, w, backend=backend), gated_add_torch(f, [p1, p2], h, w),
                               atol=1e-5, rtol=1e-5)
    as_bf16 = [t.bfloat16() for t in (f, p1, h, w)]
    assert not uses_kernel(as_bf16[0], 8, backend)
    if backend != "torch" and has_kernel:  # a gate wider than the kernel takes runs PyTorch, with the same result
        wide_h, wide_w = torch.randn(2, 5, module.MAX_GATE_INPUTS + 1), torch.randn(48, module.MAX_GATE_INPUTS + 1)
        assert uses_kernel(f, module.MAX_GATE_INPUTS, "cpu") and not uses_kernel(f, module.MAX_GATE_INPUTS + 1, "cpu")
        torch.testing.assert_close(gated_add(f, [p1], wide_h, wide_w, backend=backend),
                                   gated_add_torch(f, [p1], wide_h, wide_w), atol=1e-5, rtol=1e-5)
    assert gated_add(as_bf16[0], [as_bf16[1]], as_bf16[2], as_bf16[3], backend=backend).dtype == torch.bfloat16


def test_bad_inputs():
    f, h, w = torch.randn(2, 3), torch.randn(2, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match="at least one tensor"):
        gated_add(f, [], h, w)
    with pytest.raises(ValueError, match="every predecessor must have feature's shape"):
        gated_add(f, [f, torch.randn(2, 4)], h, w)
    with pytest.raises(ValueError, match="gate_weight must have shape \\(3, k\\)"):
        gated_add(f, [f], h, torch.randn(4, 4))
    with pytest.raises(ValueError, match="gate_input must have shape"):
        gated_add(f, [f], torch.randn(3, 4), w)
    with pytest.raises(ValueError, match="one dtype"):
        gated_add(f, [f.double()], h, w)


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
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
    # a hook on the gate's output layer (as an adapter or offloading would add) is honoured: the layer is called
    handle = conn.gate.fc2.register_forward_hook(lambda mod, args, out: torch.zeros_like(out))
    try:
        torch.testing.assert_close(conn(x, feature, preds), feature, atol=0, rtol=0)
    finally:
        handle.remove()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,count", [((1, 1, 1), 1), ((2, 7, 5), 2), ((3, 11, 37), 4), ((2, 9, 1024), 3)])
def test_gate_given_directly_float64(backend, shape, count):
    """No weight: ``gate_input`` is the gate's pre-activation (``dense_selection="linear"``, or a hooked output
    layer), strided as a split projection's output."""
    g = torch.Generator().manual_seed(shape[-1])
    feature = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    preds = [torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(count)]
    wide = torch.randn(*shape[:-1], 2 * shape[-1], generator=g, dtype=torch.float64) * 3
    gate = wide[..., shape[-1]:].detach().requires_grad_()
    out = gated_add(feature, preds, gate, None, backend=backend)
    ref = feature + torch.stack(preds).sum(0) * gate * torch.sigmoid(gate)
    torch.testing.assert_close(out, ref, atol=1e-13, rtol=1e-13)
    go = torch.randn(shape, generator=g, dtype=torch.float64)
    inputs = (feature, gate, *preds)
    for a, b in zip(torch.autograd.grad((out * go).sum(), inputs), torch.autograd.grad((ref * go).sum(), inputs)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="gate_input must have shape"):
        gated_add(feature, preds, gate[..., :-1], None, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_linear_gate_connection_equals_the_unfused_sum(backend):
    torch.manual_seed(0)
    conn = DenseHiddenConnection(16, 24, 2, "identity", "linear", True, "add", 4).double()
    torch.nn.init.normal_(conn.gate.fc.weight)
    conn.config = type("C", (), {"kernel_backend": backend})()
    x, feature = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 5, 24, dtype=torch.float64)
    preds = [torch.randn(2, 5, 24, dtype=torch.float64) for _ in range(2)]
    gate = F.silu(x @ conn.gate.fc.weight.t())
    torch.testing.assert_close(conn(x, feature, preds), feature + sum(f * gate for f in preds), atol=1e-13, rtol=1e-13)
