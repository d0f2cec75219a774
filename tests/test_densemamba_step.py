"""DenseMamba's whole one-token decoding step as one C kernel (``hf_densessm.ops.densemamba_step``), the step
``compile_decode_step()`` takes for float32 / float64 DenseMamba models.

Checked here: its logits and its cache states against the eager step (the model's own PyTorch path, the kernel's
reference) in float64 to 1e-12 and in float32 to its rounding, at the micro sizes (every vector tail: hidden 32,
state 8, rank 2) and at the 30M preset's widths (hidden 512, inner 1024, state 16, rank 32) against a float64
eager model, with and without the dense connection, ``dense_every``, biases, several rows; ``generate()`` gives the
eager tokens through it; what it does not cover (another dtype or configuration, a hook, an adapter, a replaced
module, a changed weight) is either run elsewhere or read again, never run stale; and ``implementation`` is checked.
Speed: ``benchmarks/bench_cpu.py`` (docs/benchmarks.md, run Y).
"""

import pytest
import torch
from torch import nn

from helpers import decode_step_by_step, micro_model, output_cache, random_ids
from hf_densessm import DenseMambaConfig, DenseMambaForCausalLM
from hf_densessm.modeling import modeling_densessm
from hf_densessm.ops import cpu_build, densemamba_step

pytestmark = pytest.mark.skipif(
    densemamba_step.unsupported_reason(micro_model("densemamba")) is not None,
    reason=f"the kernel cannot run here: {densemamba_step.unsupported_reason(micro_model('densemamba'))}",
)


def _counted(model):
    """``compile_decode_step()`` on, and the kernel's calls that returned logits counted."""
    model.compile_decode_step()
    calls = []
    original = densemamba_step.DenseMambaCPUStep.__call__

    def counting(self, input_ids, cache):
        out = original(self, input_ids, cache)
        if out is not None and self._model() is model:
            calls.append(input_ids.shape)
        return out

    return calls, counting


@pytest.fixture
def count_calls(monkeypatch):
    def make(model):
        calls, counting = _counted(model)
        monkeypatch.setattr(densemamba_step.DenseMambaCPUStep, "__call__", counting)
        return calls

    return make


def _states(cache):
    return [t.clone() for layer in cache.layers for t in (layer.conv_states[0], layer.recurrent_states[0])]


def _decode_with_cache(model, ids, prefill):
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        logits, cache = [out.logits], output_cache(out)
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1), _states(cache)


def _perturb(model):
    """Weights the init leaves at 0 or 1 (conv and linear biases, norm weights) made random, and the dense gates
    made 10x stronger, so that every term of the step shows in its output."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            if ".gate.fc2." in name:
                p.mul_(10.0)
    return model


MICRO = [
    dict(dense_layers=0),
    dict(dense_layers=2),
    dict(dense_layers=3, dense_every=2),
    dict(dense_layers=2, use_bias=True, use_conv_bias=False),
]


@pytest.mark.parametrize("overrides", MICRO, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)], ids=["float64", "float32"])
def test_kernel_step_equals_eager_step_and_its_states(overrides, dtype, tol, count_calls):
    model = _perturb(micro_model("densemamba", **overrides)).to(dtype)
    ids = random_ids(3, 11)  # 3 rows, 6 one-token steps after a 5-token prefill
    eager_logits, eager_states = _decode_with_cache(model, ids, 5)
    calls = count_calls(model)
    logits, states = _decode_with_cache(model, ids, 5)
    assert len(calls) == 6 and calls[0] == (3, 1)
    scale = eager_logits.abs().max().item()
    assert (logits - eager_logits).abs().max().item() <= tol * scale
    for got, want in zip(states, eager_states):
        assert (got - want).abs().max().item() <= tol * max(want.abs().max().item(), 1.0)


def test_kernel_at_the_30m_widths_against_a_float64_reference(count_calls):
    """The preset's widths (every fast path of the kernel: 4-row blocks, full vectors), float32 at the model's init
    scale, against the eager step of the same weights in float64."""
    config = DenseMambaConfig.from_preset("densemamba-30m", vocab_size=512, num_hidden_layers=5)
    torch.manual_seed(0)
    model = DenseMambaForCausalLM(config).eval()
    reference = DenseMambaForCausalLM(config).eval().to(torch.float64)
    reference.load_state_dict(model.state_dict())
    ids = random_ids(2, 40, low=3) % 512
    want, _ = _decode_with_cache(reference, ids, 24)
    calls = count_calls(model)
    got, _ = _decode_with_cache(model, ids, 24)
    assert len(calls) == 16
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert err <= 2e-5, f"max |float32 kernel - float64 eager| / max |logit| = {err:.3g}"


def test_generate_gives_the_eager_tokens_through_the_kernel(count_calls):
    model = micro_model("densemamba", dense_layers=2)
    prompt = random_ids(2, 6)
    eager = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    calls = count_calls(model)
    tokens = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, eager)
    assert len(calls) == 7  # every step after the prefill


def test_changed_weights_and_dtype_are_read_again(count_calls):
    model = micro_model("densemamba", dense_layers=2)
    calls = count_calls(model)
    ids = random_ids(1, 9)
    decode_step_by_step(model, ids, None, prefill=5)
    with torch.no_grad():
        model.backbone.layers[1].mixer.in_proj.weight.mul_(1.5)  # in place: same storage, new values
        model.backbone.layers[2].mixer.dense_u.gate.fc2.weight.normal_()
        expected = model(ids).logits
    torch.testing.assert_close(decode_step_by_step(model, ids, None, prefill=5), expected, rtol=2e-5, atol=2e-5)
    model.to(torch.float64)  # new storage for every weight: the kernel is bound again, in float64
    with torch.no_grad():
        expected = model(ids).logits
    before = len(calls)
    torch.testing.assert_close(decode_step_by_step(model, ids, None, prefill=5), expected, rtol=1e-12, atol=1e-12)
    assert len(calls) == before + 4
    model.backbone.layers[0].mixer.out_proj = nn.Linear(64, 32, bias=False).double()  # a replaced module
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(decode_step_by_step(model, ids, None, prefill=5), expected, rtol=1e-12, atol=1e-12)
    assert len(calls) == before + 8


def test_hooks_and_adapters_take_effect_elsewhere(count_calls):
    """A hook or a wrapped layer is not what the kernel computes: those steps run the eager or compiled model."""
    model = micro_model("densemamba", dense_layers=2)
    calls = count_calls(model)
    ids = random_ids(1, 8)
    seen = []
    handle = model.backbone.layers[1].mixer.x_proj.register_forward_hook(lambda m, i, o: seen.append(1))
    # the fallback, kept cheap here: the eager function in place of the torch.compile one (no Inductor build)
    modeling_densessm.COMPILED_DECODE_STEPS[model] = lambda m, i, c: m._decode_logits(i, c)
    decode_step_by_step(model, ids, None, prefill=5)
    assert calls == [] and len(seen) == 1 + 3  # the prefill, then every step: the hook ran each time
    handle.remove()
    assert densemamba_step.unsupported_reason(model) is None


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (dict(dense_target="state"), "dense_target"),
        (dict(dense_shared_gate=False), "dense_shared_gate"),
        (dict(dense_projection="linear"), "dense_projection"),
        (dict(dense_selection="linear"), "dense_selection"),
        (dict(dense_layers=densemamba_step.MAX_PREDECESSORS + 1, num_hidden_layers=18), "dense_layers=17 > 16"),
    ],
)
def test_configurations_it_does_not_cover_are_named(overrides, reason):
    assert reason in densemamba_step.unsupported_reason(micro_model("densemamba", **overrides))


def test_other_dtypes_and_families_are_named():
    assert "float32" in densemamba_step.unsupported_reason(micro_model("densemamba").to(torch.bfloat16))
    assert densemamba_step.unsupported_reason(micro_model("denseretnet")) == "not a DenseMamba model"
    model = micro_model("densemamba")
    model.backbone.layers[0].mixer.in_proj.register_forward_pre_hook(lambda m, i: None)
    assert "hooks" in densemamba_step.unsupported_reason(model)


def test_a_forked_process_runs_another_step(count_calls, monkeypatch):
    """libgomp's threads do not survive a fork: there the kernel steps aside (as cpu_build.run_job does)."""
    model = micro_model("densemamba", dense_layers=2)
    calls = count_calls(model)
    ids = random_ids(1, 8)
    with torch.no_grad():
        expected = model(ids).logits
    decode_step_by_step(model, ids, None, prefill=5)
    assert len(calls) == 3
    monkeypatch.setattr(cpu_build, "_FORKED", True)
    modeling_densessm.COMPILED_DECODE_STEPS[model] = lambda m, i, c: m._decode_logits(i, c)  # eager, no Inductor
    torch.testing.assert_close(decode_step_by_step(model, ids, None, prefill=5), expected, rtol=2e-5, atol=2e-5)
    assert len(calls) == 3
