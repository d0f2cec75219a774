"""The cross-entropy kernel (``ops/cross_entropy.py``) against ``torch.nn.functional.cross_entropy``, and the models'
loss (``modeling/loss.py``) against transformers' ``ForCausalLMLoss``."""

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_densessm import DenseMambaConfig, DenseMambaForCausalLM
import importlib

ce_module = importlib.import_module("hf_densessm.ops.cross_entropy")  # the module (the package exports the function)
from hf_densessm.ops.cross_entropy import CrossEntropyCPUFn, cross_entropy, cross_entropy_reference

pytestmark = pytest.mark.skipif(ce_module._library() is None, reason="no C compiler: the kernel cannot be built")


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (7, 5), (33, 1001), (64, 32000)])
@pytest.mark.parametrize("divisor", [None, 17.0, "tensor"])
def test_kernel_matches_pytorch(dtype, tol, rows, vocab, divisor):
    g = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[1::3] = -100
    div = torch.tensor(11.0) if divisor == "tensor" else divisor
    calls = []
    real = CrossEntropyCPUFn.apply
    CrossEntropyCPUFn.apply = lambda *a: calls.append(1) or real(*a)
    try:
        loss = cross_entropy(logits, target, divisor=div)
    finally:
        CrossEntropyCPUFn.apply = real
    assert calls and loss.dtype == dtype
    ref = cross_entropy_reference(logits, target, divisor=div)
    assert rel(loss, ref) < tol
    (g1,) = torch.autograd.grad(loss * 1.3, logits)
    (g2,) = torch.autograd.grad(ref * 1.3, logits)
    assert rel(g1, g2) < tol


def test_strided_rows_and_all_ignored():
    base = torch.randn(6, 40, dtype=torch.float64)
    logits = base[:, :33]  # row stride 40
    target = torch.tensor([0, 5, -100, 32, 7, -100])
    assert rel(cross_entropy(logits, target), cross_entropy_reference(logits, target)) < 1e-12
    everything_ignored = torch.full((6,), -100)
    assert torch.isnan(cross_entropy(logits, everything_ignored))  # as PyTorch's mean over no element
    assert torch.isnan(cross_entropy_reference(logits, everything_ignored))


def test_bad_inputs():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="target values must be in \\[0, 10\\)"):
        cross_entropy(logits, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="target must have shape \\(4,\\)"):
        cross_entropy(logits, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="target must be an integer tensor"):
        cross_entropy(logits, torch.zeros(4))
    with pytest.raises(ValueError, match="logits must have shape \\(rows, vocab\\)"):
        cross_entropy(logits[None], torch.zeros(4, dtype=torch.long))


def _model():
    torch.manual_seed(0)
    config = DenseMambaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, state_size=4,
                              num_hidden_layers=2, time_step_rank=4, dense_layers=1)
    return DenseMambaForCausalLM(config)


def test_model_loss_equals_transformers_loss():
    model = _model()
    ids = torch.randint(3, 300, (3, 17))
    labels = ids.clone()
    labels[0, :5] = -100  # e.g. left padding
    out = model(ids, labels=labels)
    assert rel(out.loss, ForCausalLMLoss(out.logits, labels, 300)) < 2e-6
    out = model(ids, labels=labels, num_items_in_batch=torch.tensor(40))  # as Trainer passes it
    assert rel(out.loss, ForCausalLMLoss(out.logits, labels, 300, num_items_in_batch=torch.tensor(40))) < 2e-6
    grads = torch.autograd.grad(out.loss, [p for p in model.parameters()])
    ref = ForCausalLMLoss(model(ids).logits, labels, 300, num_items_in_batch=torch.tensor(40))
    ref_grads = torch.autograd.grad(ref, [p for p in model.parameters()])
    assert max(rel(a, b) for a, b in zip(grads, ref_grads)) < 1e-4


def test_a_loss_function_the_user_sets_is_used():
    model = _model()
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum() * 0 + 42.0
    ids = torch.randint(3, 300, (1, 5))
    assert model(ids, labels=ids).loss.item() == 42.0
