"""torch.compile traces both families whole (docs/design.md §5), on the CPU here:

- a training forward and backward under ``torch.compile(model, fullgraph=True)`` gives the eager loss and gradients,
  with left padding and with packed documents;
- a one-token decoding step over a filled cache gives the eager logits, with no recompilation from one token to
  the next (``torch.compiler.set_stance("fail_on_recompile")`` after the first step);
- ``generate()`` takes transformers' own compile path: the decision (``_valid_auto_compile_criteria``) is True once
  compiling is allowed on this device (``compile_decode_step()``, i.e. ``CompileConfig._compile_all_devices``),
  because the cache exists when generate decides; the compiled steps give the eager tokens; ``disable_compile``
  is honoured; and the ``model.forward = torch.compile(model.forward, fullgraph=True)`` recipe works too.

Compiling takes tens of seconds per graph on a 2-core CPU, so the models are the micro ones.
"""

import copy

import pytest
import torch
from transformers import CompileConfig

from helpers import FAMILIES, micro_model, output_cache, random_ids

TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _loss_and_grads(model, ids, **inputs):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, **inputs).loss
    loss.backward()
    grads = {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("inputs", ["left_padding", "packed"])
def test_compiled_training_step_equals_eager(family, inputs):
    model = micro_model(family).train()
    for module in model.modules():  # the same function in both runs
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ids = random_ids(2, 37)
    if inputs == "left_padding":
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        kwargs = dict(attention_mask=mask)
    else:  # three documents in each row, restarting positions (transformers' DataCollatorWithFlattening)
        positions = torch.cat([torch.arange(12), torch.arange(20), torch.arange(5)])
        kwargs = dict(position_ids=positions[None].expand(2, -1))
    eager_loss, eager_grads = _loss_and_grads(model, ids, **kwargs)
    compiled = torch.compile(model, fullgraph=True)
    loss, grads = _loss_and_grads(compiled, ids, **kwargs)
    torch.testing.assert_close(loss, eager_loss, **TOL)
    assert grads.keys() == eager_grads.keys()
    for name in grads:  # Inductor reorders float32 sums: 1e-3 of each gradient's largest entry
        ref = eager_grads[name]
        atol = 1e-3 * ref.abs().max().item()
        torch.testing.assert_close(grads[name], ref, atol=atol, rtol=1e-3, msg=lambda m: f"{name}: {m}")


def test_compiled_training_over_a_dynamic_length_serves_chunk_multiples():
    """One training graph traced over a dynamic length (17 tokens) serves 64 and 128 tokens (multiples of the
    retention's 64-token chunk) with the eager loss and without recompiling (issue 33, item 8: the retention op's fake
    put ``length % 64`` in a divisor of the graph's guards, a ZeroDivisionError at 64). DenseRetNet, two layers;
    DenseMamba's scan and the prefill are covered by tests/ops (``dynamic_length``) and tests/models/test_export.py.
    Inductor's caches are off: a cached graph would bring back the guards it was compiled with."""
    model = micro_model("denseretnet", num_hidden_layers=2, dense_layers=1).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            for length in (17, 64, 128):
                ids = random_ids(2, length, seed=length)
                eager_loss, _ = _loss_and_grads(model, ids)
                loss, grads = _loss_and_grads(compiled, ids)
                torch.testing.assert_close(loss, eager_loss, **TOL)
                assert all(g.isfinite().all() for g in grads.values())
                torch.compiler.set_stance("fail_on_recompile")
    finally:
        torch.compiler.set_stance("default")


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decoding_step_equals_eager_without_recompiling(family):
    model = micro_model(family)
    ids = random_ids(2, 9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        eager_cache = output_cache(out)
        compiled_cache = copy.deepcopy(eager_cache)
        step = torch.compile(model, fullgraph=True)
        token = out.logits[:, -1:].argmax(-1)
        try:
            for i in range(4):  # the step's own mask column, as generate() passes it (prepare_inputs_for_generation)
                step_mask = torch.ones_like(token)
                eager = model(token, attention_mask=step_mask, cache=eager_cache, use_cache=True).logits
                compiled = step(token, attention_mask=step_mask, cache=compiled_cache, use_cache=True).logits
                torch.testing.assert_close(compiled, eager, **TOL)
                if i == 0:
                    torch.compiler.set_stance("fail_on_recompile")
                token = eager.argmax(-1)
        finally:
            torch.compiler.set_stance("default")
    assert compiled_cache.get_seq_length() == eager_cache.get_seq_length() == 13


def _criteria(model, generation_config):
    """generate()'s own decision, with the cache generate() prepares (as it does, before the prefill)."""
    model_kwargs = {"use_cache": True}
    model._prepare_cache_for_generation(generation_config, model_kwargs, None, 1, 20)
    return model._valid_auto_compile_criteria(model_kwargs, generation_config)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_compiles_its_decoding_steps(family):
    model = micro_model(family)
    ids = random_ids(2, 7)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert not _criteria(model, copy.deepcopy(model.generation_config))  # a CPU, no opt-in: eager, as transformers
    model.compile_decode_step()
    config = copy.deepcopy(model.generation_config)
    assert _criteria(model, config)  # the cache exists when generate decides
    config.disable_compile = True
    assert not _criteria(model, config)
    compiled = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert "_compiled_call" in model.__dict__  # transformers' get_compiled_call ran
    assert torch.equal(compiled, eager)
    model.compile_decode_step(False)
    assert model.generation_config.compile_config is None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padded", [False, True])
def test_generate_compiles_the_decoding_step_once(family, padded):
    """transformers' own compile test setting (fullgraph, static shapes) through ``generate()``: one compilation for
    every decoding step, padded or not (the step's mask is a fresh tensor, not a view of the growing mask whose
    strides change), and the eager tokens."""
    model = micro_model(family)
    ids = random_ids(2, 7)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    graphs = []

    def backend(graph, example_inputs):  # runs the graph as traced, counting compilations (a function: generate()
        graphs.append(graph)  # deep-copies its config, and a function is copied by reference)
        return graph.forward

    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    config._compile_all_devices = True
    model.generation_config.compile_config = config
    compiled = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert len(graphs) == 1
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_forward_recipe_generates_eager_tokens(family):
    model = micro_model(family)
    ids = random_ids(1, 6)
    eager = model.generate(ids, max_new_tokens=4, do_sample=False)
    model.forward = torch.compile(model.forward, fullgraph=True)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), eager)


def test_compile_decode_step_rejects_a_non_bool():
    with pytest.raises(TypeError, match="enable"):
        micro_model("denseretnet").compile_decode_step("yes")
