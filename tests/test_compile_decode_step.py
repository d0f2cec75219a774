"""``compile_decode_step()``: the one-token decoding step as one ``torch.compile``-d function (CPU).

Checked here: the compiled step computes the function of the full forward (logits of prefill + compiled one-token
steps against one full forward, within the dtype's rounding, both families, with and without the dense connection,
DenseMamba's ``dense_target="state"``), ``generate()`` gives the eager tokens, every decoding step takes it, every
other call (padding in the step, gradients, training mode, labels) runs the eager model, a compilation failure
falls back to the eager step with one warning, and bad arguments raise. Speed: ``benchmarks/bench_cpu.py``.

Each compiled model costs one compilation (several seconds on a 2-core CPU), so the models are few and small.
"""

import copy
import pickle

import pytest
import torch

from helpers import decode_step_by_step, micro_model, output_cache, random_ids
from hf_densessm.modeling import modeling_densessm

# (family, overrides, dtype): the compiled variants (one compilation each)
COMPILED = [
    ("densemamba", dict(dense_layers=0), torch.float32),
    ("densemamba", dict(dense_layers=2), torch.float32),
    ("densemamba", dict(dense_layers=2, dense_target="state"), torch.float32),
    ("denseretnet", dict(dense_layers=2), torch.float32),
    ("densemamba", dict(dense_layers=2), torch.bfloat16),
]
IDS = [f"{f}-{'-'.join(f'{k}={v}' for k, v in o.items())}-{str(d).split('.')[-1]}" for f, o, d in COMPILED]
# max |compiled - forward| / max |forward|: float32 rounding; bfloat16: the compiler keeps fused intermediates in
# float32 where the eager ops round each to bfloat16 (as the eager step's own tolerance in test_decode_speed_paths)
RELATIVE_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-2}


def _compiled(model):
    """Turn the ``torch.compile`` step on and count its calls (a wrapper around the compiled function). DenseMamba's
    C kernel, which ``"auto"`` takes for float32 DenseMamba, is tested in ``test_densemamba_step.py``."""
    model.compile_decode_step(implementation="torch_compile")
    compiled, calls = model._compiled_decode_fn(), []

    def counted(*args):
        calls.append(args[1].shape)
        return compiled(*args)

    modeling_densessm.COMPILED_DECODE_STEPS[model] = counted
    return calls


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family,overrides,dtype", COMPILED, ids=IDS)
def test_compiled_step_equals_full_forward_and_generates_eager_tokens(family, overrides, dtype):
    model = micro_model(family, **overrides).to(dtype)
    ids = random_ids(2, 12)
    with torch.no_grad():
        full = model(ids).logits
    prompt = ids[:, :5]
    eager_tokens = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    calls = _compiled(model)
    decoded = decode_step_by_step(model, ids, None, prefill=5)
    assert len(calls) == 7  # every one-token step ran compiled
    assert decoded.dtype == full.dtype == torch.float32
    scale = full.abs().max().item()
    diff = (decoded - full).abs().max().item()
    assert diff <= RELATIVE_TOL[dtype] * scale, f"max |compiled - forward| = {diff:.3g}, max |logit| {scale:.3g}"
    tokens = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert len(calls) == 7 + 5  # the prefill eager, the 5 later steps compiled
    if dtype == torch.float32:  # bfloat16 greedy tokens may flip on a near tie between two logits
        assert torch.equal(tokens, eager_tokens)


def test_other_calls_run_the_eager_model():
    model = micro_model("densemamba", dense_layers=2)
    calls = _compiled(model)
    ids = random_ids(2, 8)
    with torch.no_grad():
        out = model(ids[:, :6], use_cache=True)
        cache = output_cache(out)
        # padding in this step (row 1's token is padding): the eager masked path
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, -1] = 0
        model(ids[:, 6:7], attention_mask=mask, use_cache=True, cache=cache)
        model(ids[:, 6:7], labels=ids[:, 6:7], use_cache=True, cache=cache)  # labels
        model(ids[:, 6:7], output_hidden_states=True, use_cache=True, cache=cache)
        model(ids[:, 5:7], use_cache=True, cache=cache)  # two tokens
        model(ids[:, 6:7], use_cache=True)  # no cache given: a new one, not filled
        with pytest.raises(IndexError):  # a token id outside the vocabulary: the eager embedding's error
            model(torch.full((2, 1), 10_000), use_cache=True, cache=cache)
        with pytest.raises(TypeError, match="input_ids"):
            model(ids[:, 6:7].float(), use_cache=True, cache=cache)
    model(ids[:, 6:7], use_cache=True, cache=cache)  # gradients on
    model.train()
    with torch.no_grad():
        model(ids[:, 6:7], use_cache=True, cache=cache)
    assert calls == []


def test_compilation_failure_falls_back_to_eager_with_one_warning(monkeypatch):
    model = micro_model("denseretnet")
    ids = random_ids(1, 9)
    eager = decode_step_by_step(model, ids, None, prefill=4)

    def failing_compile(fn, **kwargs):
        def run(*args):  # what torch.compile raises when its backend cannot compile (e.g. no C++ compiler)
            raise torch._dynamo.exc.BackendCompilerFailed(fn, RuntimeError("no C++ compiler here\nsecond line"), None)

        return run

    monkeypatch.setattr(modeling_densessm.torch, "compile", failing_compile)
    model.compile_decode_step()
    with pytest.warns(RuntimeWarning, match="compile_decode_step could not compile.*no C\\+\\+ compiler here") as caught:
        fallback = decode_step_by_step(model, ids, None, prefill=4)
    assert caught[0].filename.endswith("helpers.py")  # names the caller's line, not PyTorch's module call
    torch.testing.assert_close(fallback, eager, rtol=0, atol=0)
    assert model.__dict__["_compile_decode_step"] is False  # later steps: eager, no further warnings


def test_errors_other_than_compilation_are_raised(monkeypatch):
    model = micro_model("densemamba", dense_layers=0)
    ids = random_ids(1, 7)

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise ValueError("raised while running")

        return run

    monkeypatch.setattr(modeling_densessm.torch, "compile", broken_compile)
    model.compile_decode_step(implementation="torch_compile")
    with pytest.raises(ValueError, match="raised while running"):
        decode_step_by_step(model, ids, None, prefill=5)
    assert model.__dict__["_compile_decode_step"] is True  # not switched off silently


def test_compile_decode_step_arguments():
    model = micro_model("densemamba")
    assert model.compile_decode_step() is model
    assert model.__dict__["_compile_decode_step"] is True
    assert model.compile_decode_step(False) is model
    assert model.__dict__["_compile_decode_step"] is False
    with pytest.raises(TypeError, match="`enable` must be a bool"):
        model.compile_decode_step("yes")
    with pytest.raises(ValueError, match="`implementation` must be one of .*'auto'.*got 'inductor'"):
        model.compile_decode_step(implementation="inductor")


def test_a_copy_compiles_its_own_step_and_the_model_pickles():
    model = micro_model("densemamba", dense_layers=0)
    _compiled(model)
    ids = random_ids(1, 7)
    decode_step_by_step(model, ids, None, prefill=5)  # the original compiles and runs its step
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.backbone.norm_f.weight.mul_(2.0)  # the copy's weights differ: a shared step would ignore that
        expected = clone(ids).logits
    assert clone.__dict__["_compile_decode_step"] is True and clone not in modeling_densessm.COMPILED_DECODE_STEPS
    calls = _compiled(clone)
    decoded = decode_step_by_step(clone, ids, None, prefill=5)
    assert len(calls) == 2
    torch.testing.assert_close(decoded, expected, rtol=1e-5, atol=1e-5)
    restored = pickle.loads(pickle.dumps(model))  # only the flag travels
    assert restored.__dict__["_compile_decode_step"] is True
