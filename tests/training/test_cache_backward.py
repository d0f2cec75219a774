"""Backpropagating through a forward that continues a cache (chunked training, truncated backpropagation through time,
fine-tuning over a cached prefix; hf_densessm.modeling.cache, "Autograd").

The cache holds values, not autograd history: a forward that continues it starts from its states as constants. So the
continuation's logits are those of one forward over the whole sequence, its gradient with respect to its own inputs is
that of the one forward (the later inputs never reach the prefix), and its gradient with respect to the parameters is
the derivative of its loss with the prefix's states held fixed, which central differences of the continuation's loss
measure directly (float64, from copies of the prefix's cache).
"""

import copy

import pytest
import torch

from helpers import VOCAB, micro_model, random_ids
from hf_densessm.modeling.cache_names import output_cache

#: (family, overrides): DenseMamba with both dense targets, DenseRetNet.
MIXERS = [
    ("densemamba", {"dense_target": "input"}),
    ("densemamba", {"dense_target": "state"}),
    ("denseretnet", {}),
]
MIXER_IDS = ["densemamba-input", "densemamba-state", "denseretnet"]
PREFIX = 4


def _model(family, overrides, backend, dense_layers, **more):
    """A float64 micro model (train mode: dropout is 0 in the micro configs) on ``backend``."""
    model = micro_model(family, kernel_backend=backend, dense_layers=dense_layers, **overrides, **more)
    return model.double().train()


def _inputs(model, length, padded):
    """Embeddings ``(2, length, hidden)`` float64, the 0/1 mask (row 1 left-padded by 2 when ``padded``) and fixed
    random weights ``(2, length - PREFIX, vocab)`` that make the continuation's logits a scalar loss."""
    ids = random_ids(2, length)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :2] = 0
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    weights = torch.randn(2, length - PREFIX, VOCAB, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return embeds, mask, weights


def _prefix_cache(model, embeds, mask):
    """The cache after the prefix, computed without gradients."""
    with torch.no_grad():
        out = model(inputs_embeds=embeds[:, :PREFIX], attention_mask=mask[:, :PREFIX], use_cache=True)
    return output_cache(out)


def _continue(model, embeds, mask, weights, cache):
    """The continuation from ``cache`` with gradients: its logits, the gradient of ``sum(logits * weights)`` with
    respect to its embeddings and to every parameter, and the cache it leaves."""
    model.zero_grad()
    inputs = embeds[:, PREFIX:].clone().requires_grad_()
    out = model(inputs_embeds=inputs, attention_mask=mask, cache=cache, use_cache=True)
    (out.logits * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), inputs.grad, grads, output_cache(out)


def _states(cache):
    return [t for layer in cache.layers for store in (layer.conv_states, layer.recurrent_states)
            for t in store.values() if t is not None]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("length", [1, 3], ids=["one-token", "three-tokens"])
@pytest.mark.parametrize("dense_layers", [0, 2])
@pytest.mark.parametrize("family, overrides", MIXERS, ids=MIXER_IDS)
def test_continuing_a_cache_backpropagates_from_the_cached_states(family, overrides, dense_layers, length, padded):
    model = _model(family, overrides, "torch", dense_layers)
    embeds, mask, weights = _inputs(model, PREFIX + length, padded)

    # one forward over the whole sequence
    whole = embeds.clone().requires_grad_()
    full = model(inputs_embeds=whole, attention_mask=mask).logits[:, PREFIX:]
    (full * weights).sum().backward()
    full_grads = {name for name, p in model.named_parameters() if p.grad is not None}

    cache = _prefix_cache(model, embeds, mask)
    start = copy.deepcopy(cache)
    logits, input_grad, grads, after = _continue(model, embeds, mask, weights, cache)
    torch.testing.assert_close(logits, full.detach(), atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(input_grad, whole.grad[:, PREFIX:], atol=1e-10, rtol=1e-9)
    assert grads.keys() == full_grads
    assert all(torch.isfinite(g).all() for g in grads.values())

    # the cache it leaves: the states of the same continuation without gradients, and no autograd history
    with torch.no_grad():
        reference = copy.deepcopy(start)
        model(inputs_embeds=embeds[:, PREFIX:], attention_mask=mask, cache=reference, use_cache=True)
    for state, expected in zip(_states(after), _states(reference), strict=True):
        assert not state.requires_grad
        torch.testing.assert_close(state, expected, atol=1e-12, rtol=1e-12)

    # the parameters' gradient: central differences of the continuation's loss along a random direction, the prefix's
    # states held fixed (each evaluation continues its own copy of the prefix's cache)
    generator = torch.Generator().manual_seed(11)
    params = dict(model.named_parameters())
    direction = {name: torch.randn(p.shape, generator=generator, dtype=p.dtype) for name, p in params.items()}

    def loss_at(step):
        with torch.no_grad():
            for name, p in params.items():
                p.add_(direction[name], alpha=step)
            cache = copy.deepcopy(start)
            out = model(inputs_embeds=embeds[:, PREFIX:], attention_mask=mask, cache=cache, use_cache=True)
            for name, p in params.items():
                p.sub_(direction[name], alpha=step)
            return (out.logits * weights).sum().item()

    h = 1e-7  # central differences: error ~ h^2 (at most ~1e-10 relative here) plus float64 rounding / h
    numeric = (loss_at(h) - loss_at(-h)) / (2 * h)
    analytic = sum((grads[name] * direction[name]).sum().item() for name in grads)
    assert analytic == pytest.approx(numeric, rel=1e-8, abs=1e-9)


#: Backends and the sizes they run at: the Triton kernels (under the interpreter on the CPU, seconds per call) with
#: two blocks, a narrow state and two-token continuations only.
BACKEND_CASES = [
    pytest.param("triton", 2, dense_layers, {"num_hidden_layers": 2, "hidden_size": 16}, id=f"triton-{dense_layers}-2")
    for dense_layers in (0, 1)
]


@pytest.mark.parametrize("backend, length, dense_layers, sizes", BACKEND_CASES)
@pytest.mark.parametrize("family, overrides", MIXERS, ids=MIXER_IDS)
def test_backward_through_a_continued_cache_on_every_backend(family, overrides, backend, length, dense_layers, sizes):
    """The kernels' backward passes from a cached state give the PyTorch path's gradients (checked above). (The
    one-token step kernels are not differentiable: with gradients on, a one-token call takes the scan.)"""
    if family == "densemamba" and backend == "triton":
        sizes = dict(sizes, state_size=4)
    results = []
    for kernels in ("torch", backend):
        model = _model(family, overrides, kernels, dense_layers, **sizes)
        embeds, mask, weights = _inputs(model, PREFIX + length, padded=True)
        results.append(_continue(model, embeds, mask, weights, _prefix_cache(model, embeds, mask))[:3])
    (ref_logits, ref_input_grad, ref_grads), (logits, input_grad, grads) = results
    # the Triton kernels keep some partial sums in float32 (tests/models/test_kernel_paths.py)
    tol = dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, **tol)
    torch.testing.assert_close(input_grad, ref_input_grad, **tol)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **tol, msg=name)


@pytest.mark.parametrize("family, overrides", MIXERS, ids=MIXER_IDS)
@pytest.mark.parametrize("backend", ["torch"])
def test_chunked_training_carries_states_not_graphs(family, overrides, backend):
    """Training chunk by chunk, one backward per chunk, each chunk continuing the cache of the one before: every
    backward works, and a chunk's gradients are the same whether the chunk before it ran with gradients or not."""
    model = _model(family, overrides, backend, 2)
    ids = random_ids(2, 12)
    chunks = [ids[:, i : i + 4] for i in (0, 4, 8)]

    def train(no_grad_first):
        cache, grads = None, []
        for i, chunk in enumerate(chunks):
            model.zero_grad()
            with torch.set_grad_enabled(not (no_grad_first and i == 0)):
                out = model(chunk, labels=chunk, cache=cache, use_cache=True)
            if out.loss.requires_grad:
                out.loss.backward()
                grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
            cache = output_cache(out)
            assert not any(state.requires_grad for state in _states(cache))
        return grads

    with_grads, without = train(False), train(True)
    assert len(with_grads) == 3 and len(without) == 2
    for step, expected in zip(with_grads[1:], without, strict=True):
        assert step.keys() == expected.keys()
        for name in step:
            torch.testing.assert_close(step[name], expected[name], atol=1e-12, rtol=1e-10, msg=name)


@pytest.mark.parametrize("family, overrides", MIXERS, ids=MIXER_IDS)
def test_one_token_call_with_gradients_is_the_step(family, overrides):
    """With gradients on, a one-token call over a cache runs the scan / chunked retention instead of the step: the
    same logits and states, a padded row keeping its states."""
    model = _model(family, overrides, "torch", 2)
    ids = random_ids(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    results = []
    for grad in (False, True):
        with torch.no_grad():
            cache = output_cache(model(ids[:, :5], use_cache=True))
        with torch.set_grad_enabled(grad):
            out = model(ids[:, 5:], attention_mask=mask, cache=cache, use_cache=True)
        results.append((out.logits.detach(), _states(cache)))
    (step_logits, step_states), (logits, states) = results
    torch.testing.assert_close(logits, step_logits, atol=1e-12, rtol=1e-10)
    for state, expected in zip(states, step_states, strict=True):
        torch.testing.assert_close(state, expected, atol=1e-12, rtol=1e-10)
