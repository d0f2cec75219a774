"""The training step's kept scratch buffer (``ops/workspace.py``): reused only when nothing else holds it, the loss
gradient written into it equal to a fresh one's, and the models' own workspace."""

import copy
import importlib
import pickle
import threading

import pytest
import torch

from hf_densessm.ops.cross_entropy import cross_entropy, cross_entropy_reference
from hf_densessm.ops.workspace import Workspace, linear_into
from tests.helpers import FAMILIES, micro_model, random_ids

ws_module = importlib.import_module("hf_densessm.ops.workspace")
ce_module = importlib.import_module("hf_densessm.ops.cross_entropy")

needs_count = pytest.mark.skipif(ws_module._SOLE is None, reason="this PyTorch cannot report a storage's use count")
needs_kernel = pytest.mark.skipif(ce_module._library() is None, reason="no C compiler: the kernel cannot be built")


@needs_count
def test_reuses_only_free_memory():
    ws = Workspace()
    a = ws.take("g", (4, 5), torch.float32)
    assert a.shape == (4, 5) and a.dtype == torch.float32 and a.is_contiguous()
    pointer = a.data_ptr()
    b = ws.take("g", (4, 5), torch.float32)  # `a` is still alive: new memory
    assert b.data_ptr() != pointer
    del a
    pointer = b.data_ptr()
    c = ws.take("g", (2, 3), torch.float32)  # `b` alive, and it is the kept one now
    assert c.data_ptr() != pointer
    del b, c
    d = ws.take("g", (2, 3), torch.float32)  # free again: a view of the kept buffer, which is large enough
    pointer = d.data_ptr()
    del d
    assert ws.take("g", (3, 2), torch.float32).data_ptr() == pointer
    assert ws.take("g", (3, 2), torch.float64).dtype == torch.float64  # another dtype: a new buffer
    assert ws.take("g", (100,), torch.float64).numel() == 100  # larger: a new buffer
    assert ws.take("h", (0,), torch.float32).numel() == 0
    assert ws.nbytes() == 100 * 8 + 0


@needs_count
def test_a_kept_part_or_grad_blocks_reuse():
    ws = Workspace()
    a = ws.take("g", (10,), torch.float32)
    part = a[3:5]  # any tensor on the storage, however small
    del a
    assert ws.take("g", (10,), torch.float32).data_ptr() != part.data_ptr() - 3 * 4
    x = torch.zeros(10, requires_grad=True)
    x.grad = ws.take("g", (10,), torch.float32)
    assert ws.take("g", (10,), torch.float32).data_ptr() != x.grad.data_ptr()


def test_bad_shape_copy_pickle_clear():
    ws = Workspace()
    with pytest.raises(ValueError, match="shape must have entries >= 0"):
        ws.take("g", (2, -1), torch.float32)
    ws.take("g", (8,), torch.float32)
    assert copy.deepcopy(ws).nbytes() == 0 and pickle.loads(pickle.dumps(ws)).nbytes() == 0
    assert ws.nbytes() == 32
    ws.clear()
    assert ws.nbytes() == 0


@needs_count
def test_threads_never_share_memory():
    ws = Workspace()
    taken, barrier = [], threading.Barrier(4)

    def work():
        barrier.wait()
        for _ in range(200):
            taken.append(ws.take("g", (64,), torch.float32))  # all kept alive: every one must be distinct

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({t.data_ptr() for t in taken}) == len(taken) == 800


@needs_kernel
@needs_count
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_cross_entropy_gradient_in_workspace(dtype, tol):
    """Three backward passes through one workspace, rows crossing the workers' slices, ignored rows: each gradient
    equals PyTorch's; a gradient a hook kept is not overwritten by the next pass; a freed one's memory is reused."""
    ws = Workspace()
    g = torch.Generator().manual_seed(0)
    kept, pointers = [], []
    for step in range(3):
        logits = (torch.randn(37, 1001, generator=g, dtype=torch.float64) * 3).to(dtype).requires_grad_()
        target = torch.randint(0, 1001, (37,), generator=g)
        target[step::4] = -100
        if step == 0:
            logits.register_hook(lambda grad: kept.append((grad, grad.clone())))
        (grad,) = torch.autograd.grad(cross_entropy(logits, target, workspace=ws), logits)
        (ref,) = torch.autograd.grad(cross_entropy_reference(logits, target), logits)
        assert ((grad - ref).abs().max() / ref.abs().max()).item() < tol
        pointers.append(grad.data_ptr())
        del grad
    held, copy_at_step0 = kept[0]
    assert torch.equal(held, copy_at_step0)  # steps 1 and 2 wrote elsewhere
    assert pointers[1] != pointers[0] and pointers[2] == pointers[1]


def test_cross_entropy_workspace_type():
    with pytest.raises(TypeError, match="workspace must be None or an hf_densessm.ops.workspace.Workspace"):
        cross_entropy(torch.randn(3, 4), torch.tensor([0, 1, 2]), workspace={})


@needs_kernel
@needs_count
@pytest.mark.parametrize("family", FAMILIES)
def test_model_training_steps_reuse_and_eval_frees(family):
    """Training steps of a model with its workspace give the same parameter gradients as with PyTorch's own loss;
    the workspace holds the gradient between steps, also through ``eval()``; logits whose gradient the user
    retained stay intact; ``clear()`` frees it; a deep copy starts empty."""
    model = micro_model(family, vocab_size=300).train()
    reference = copy.deepcopy(model)
    reference.loss_function = lambda logits, labels, vocab_size, **kw: cross_entropy_reference(
        logits[:, :-1].reshape(-1, vocab_size), labels[:, 1:].reshape(-1))
    assert model.loss_workspace().nbytes() == 0
    retained = None
    for step in range(3):
        ids = random_ids(2, 19, seed=step) * 3  # ids up to 288
        for m in (model, reference):
            m.train().zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        if step == 1:
            out.logits.retain_grad()
        out.loss.backward()
        reference(ids, labels=ids).loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
        if step == 1:
            retained, retained_copy = out.logits.grad, out.logits.grad.clone()
        del out
        assert model.loss_workspace().nbytes() == 2 * (2 * 19 * 300 * 4)  # the logits and their gradient
        model.eval()  # an evaluation between steps keeps it
    assert torch.equal(retained, retained_copy)
    assert model.loss_workspace().nbytes() == 2 * (2 * 19 * 300 * 4)
    assert copy.deepcopy(model).loss_workspace().nbytes() == 0
    model.loss_workspace().clear()
    assert model.loss_workspace().nbytes() == 0


@needs_count
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_in_the_workspace_only_when_free(family):
    """The training forward's logits reuse the kept buffer once the last step's outputs are gone, never while the
    user holds them (they keep their values); the values and gradients equal the LM head's own call; a hook on the
    LM head is honoured (the module is called)."""
    model = micro_model(family, vocab_size=300).train()
    ids = random_ids(2, 19) * 3
    held = model(ids, labels=ids)
    held_logits = held.logits.detach().clone()
    second = model(ids.flip(1), labels=ids.flip(1))  # `held` is alive: new memory
    assert second.logits.data_ptr() != held.logits.data_ptr()
    assert torch.equal(held.logits.detach(), held_logits)
    pointer = second.logits.data_ptr()
    del held, second
    third = model(ids, labels=ids)
    assert third.logits.data_ptr() == pointer  # free again: reused
    (g1,) = torch.autograd.grad(third.loss, model.lm_head.weight)
    handle = model.lm_head.register_forward_hook(lambda mod, args, out: out * 1.0)
    try:
        fourth = model(ids, labels=ids)  # the module call (a hook): a fresh tensor, the same values
    finally:
        handle.remove()
    assert fourth.logits.data_ptr() != pointer
    torch.testing.assert_close(fourth.logits, third.logits, rtol=0, atol=0)
    (g2,) = torch.autograd.grad(fourth.loss, model.lm_head.weight)
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-8)
    with torch.no_grad():  # inference: the module call, nothing kept for it
        assert model(ids).logits.data_ptr() != pointer


def test_linear_into_bad_inputs():
    ws = Workspace()
    with pytest.raises(ValueError, match="weight must have shape \\(out, 4\\)"):
        linear_into(torch.randn(2, 4), torch.randn(3, 5), ws, "y")
    with pytest.raises(ValueError, match="float32 or float64"):
        linear_into(torch.randn(2, 4).bfloat16(), torch.randn(3, 4).bfloat16(), ws, "y")
