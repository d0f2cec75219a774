"""RMSNorm (``ops/rms_norm.py``): the CPU kernel against the formula in float64 (value, the gradients of the input
and the weight), with groups and a per-row ``eps`` scale as DenseRetNet's group norm uses them, strided rows, rows
across every worker; float32 at the models' scale; the PyTorch path where the kernel does not apply; argument
checks; and the models' norm module on the kernel and on ``kernel_backend="torch"`` alike."""

import importlib

import pytest
import torch

from hf_densessm.modeling.norm import DenseSSMRMSNorm
from hf_densessm.ops.rms_norm import RMSNormCPUFn, rms_norm, rms_norm_torch

module = importlib.import_module("hf_densessm.ops.rms_norm")
has_kernel = module._library() is not None
BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(not has_kernel, reason="no C compiler"))]


def formula(x, weight, eps, groups=1, eps_scale=None):
    """Written out independently: each group's mean square, eps (times its scale), 1 / sqrt, times the weight."""
    g = x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
    e = torch.full(g.shape[:-1] + (1,), eps, dtype=x.dtype) if eps_scale is None else eps * eps_scale.expand(
        *g.shape[:-1], 1)
    return (g / torch.sqrt((g * g).sum(-1, keepdim=True) / g.shape[-1] + e) * weight).reshape(x.shape)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,groups,scaled", [((1, 1, 1), 1, False), ((2, 7, 5), 1, False), ((3, 37, 40), 4, True),
                                                 ((2, 301, 768), 2, True), ((2, 130, 512), 1, False)])
def test_matches_the_formula_float64(backend, shape, groups, scaled):
    g = torch.Generator().manual_seed(shape[-1])
    wide = torch.randn(*shape[:-1], shape[-1] + 3, generator=g, dtype=torch.float64) * 3
    x = wide[..., 3:].detach().requires_grad_()  # strided rows
    weight = torch.randn(shape[-1] // groups, generator=g, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(1, shape[1], groups, 1, generator=g, dtype=torch.float64) * 50 + 0.5 if scaled else None
    eps = 0.3  # large enough that a wrong per-row eps shows
    out = rms_norm(x, weight, eps, groups, scale, backend=backend)
    ref = formula(x, weight, eps, groups, scale)
    torch.testing.assert_close(out, ref, atol=1e-13, rtol=1e-12)
    go = torch.randn(shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * go).sum(), (x, weight))
    for a, b in zip(grads, torch.autograd.grad((ref * go).sum(), (x, weight))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-11)


@pytest.mark.skipif(not has_kernel, reason="no C compiler")
def test_float32_at_model_scale_runs_the_kernel(monkeypatch):
    calls = []
    real = RMSNormCPUFn.apply
    monkeypatch.setattr(RMSNormCPUFn, "apply", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 1024, 384, generator=g) * 0.02).requires_grad_()  # embeddings' init scale
    weight = torch.ones(384, requires_grad=True)
    out = rms_norm(x, weight, 1e-6)
    assert calls
    ref = formula(x.double(), weight.double(), 1e-6)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
    go = torch.randn(out.shape, generator=g)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    refs = torch.autograd.grad((formula(x64, w64, 1e-6) * go.double()).sum(), (x64, w64))
    for a, b in zip(torch.autograd.grad((out * go).sum(), (x, weight)), refs):
        assert ((a.double() - b).abs().max() / b.abs().max()).item() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_pytorch_path_where_the_kernel_does_not_apply(backend, monkeypatch):
    def refuse(*a):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(RMSNormCPUFn, "apply", refuse)
    x = torch.randn(2, 300, 256)
    xb, wb = x.bfloat16(), torch.ones(256, dtype=torch.bfloat16)
    assert rms_norm(xb, wb, 1e-6, backend=backend).dtype == torch.bfloat16  # 16-bit: PyTorch, float32 statistics
    torch.testing.assert_close(rms_norm(xb, wb, 1e-6, backend=backend), rms_norm_torch(xb, wb, 1e-6))
    scale = torch.rand(1, 300, 2, 1, requires_grad=True) + 0.5  # an eps scale that needs its gradient
    out = rms_norm(x, torch.ones(128), 1e-6, 2, scale, backend=backend)
    (grad,) = torch.autograd.grad(out.sum(), scale)
    assert grad.shape == scale.shape


def test_bad_inputs():
    x = torch.randn(2, 6)
    with pytest.raises(ValueError, match="divisible by num_groups"):
        rms_norm(x, torch.ones(6), 1e-6, num_groups=4)
    with pytest.raises(ValueError, match="weight must have shape \\(3,\\)"):
        rms_norm(x, torch.ones(6), 1e-6, num_groups=2)


@pytest.mark.skipif(not has_kernel, reason="no C compiler")
def test_norm_module_kernel_and_torch_backends_agree():
    torch.manual_seed(0)
    norm = DenseSSMRMSNorm(768, eps=1e-6, num_groups=2).double()
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 200, 768, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(1, 200, 2, 1, dtype=torch.float64) + 0.5
    outs = []
    for backend in ("auto", "torch"):
        norm.config = type("C", (), {"kernel_backend": backend})()
        out = norm(x, eps_scale=scale)
        outs.append((out, *torch.autograd.grad(out.square().sum(), (x, norm.weight))))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
