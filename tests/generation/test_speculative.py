"""Speculative decoding with the recurrent cache: transformers' assisted generation and prompt lookup verify several
drafted tokens in one forward, then ``crop`` the cache back to the accepted ones (docs/design.md §5, "Speculative
decoding")."""

import contextlib
import math
from unittest import mock

import pytest
import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

from hf_densessm.modeling.cache import DenseSSMCache
from hf_densessm.modeling.cache_names import generate_keyword
from helpers import VOCAB, micro_model, output_cache, random_ids

TARGETS = [("densemamba", "input"), ("densemamba", "state"), ("denseretnet", None)]
IDS = [f"{family}-{target}" if target else family for family, target in TARGETS]


def model(family, target=None, seed=0, dtype=torch.float64, **overrides):
    """A micro model whose greedy tokens vary (a wide init), in ``dtype``."""
    if target:
        overrides["dense_target"] = target
    return micro_model(family, seed=seed, initializer_range=0.5, **overrides).to(dtype)


def perturbed(target_model, scale=0.01, seed=1):
    """A copy of ``target_model`` with noise on every weight: an assistant that agrees with it often, not always;
    drafts of 4 tokens."""
    torch.manual_seed(seed)
    copy = type(target_model)(target_model.config).to(target_model.dtype).eval()
    copy.load_state_dict(target_model.state_dict())
    copy.generation_config.num_assistant_tokens = 4
    copy.generation_config.num_assistant_tokens_schedule = "constant"
    copy.generation_config.assistant_confidence_threshold = 0.0  # drafts of 4 even where a micro model hesitates
    with torch.no_grad():
        for parameter in copy.parameters():
            parameter.add_(torch.randn_like(parameter) * scale)
    return copy


def llama(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


@contextlib.contextmanager
def watched_crops():
    """Every ``DenseSSMCache.crop`` call as ``(cache, tokens_to_remove, tokens recorded before it, its states'
    addresses after it)``."""
    calls, crop = [], DenseSSMCache.crop

    def watched(self, tokens_to_remove):
        calls.append((self, tokens_to_remove, sum(record[0] for record in self._records), addresses(self)))
        return crop(self, tokens_to_remove)

    with mock.patch.object(DenseSSMCache, "crop", watched):
        yield calls


def states(cache):
    """Every state tensor of ``cache`` with its counts, by name."""
    found = {"positions": cache.positions_seen, "real tokens": cache.real_tokens_seen}
    for i, layer in enumerate(cache.layers):
        if layer.is_recurrent_states_initialized[0]:
            found[f"state {i}"] = layer.recurrent_states[0]
        if layer.is_conv_states_initialized[0]:
            found[f"window {i}"] = layer.conv_states[0]
    return found


def assert_same_states(cache, expected, atol=1e-12):
    """Equal to float64 rounding: plain decoding's steps (the C++ step on the CPU) and a verification's scan round
    their exponentials differently (about 1e-14 relative over a few tokens)."""
    got, want = states(cache), states(expected)
    assert got.keys() == want.keys()
    for name in got:
        if want[name] is None:
            assert got[name] is None, name
        else:
            torch.testing.assert_close(got[name], want[name], atol=atol, rtol=1e-13, msg=name)


def addresses(cache):
    return {name: tensor.data_ptr() for name, tensor in states(cache).items() if tensor is not None}


# ---------------------------------------------------------------------------------------------------------------------
# The rollback itself
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["verify", "draft"])
@pytest.mark.parametrize("removed", [0, 1, 4, 6])
@pytest.mark.parametrize(("family", "target"), TARGETS, ids=IDS)
def test_crop_equals_feeding_only_the_accepted_tokens(family, target, removed, pattern):
    """After ``crop(-removed)``, every state, conv window and count is what feeding only the other tokens leaves, in
    place (same addresses), and the records are freed. ``verify``: one 6-token forward (the target's verification);
    ``draft``: a 3-token forward then 3 one-token steps (an assistant's continuation and drafts). Two rows, one
    left-padded."""
    m = model(family, target)
    ids = random_ids(2, 14)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        cache = DenseSSMCache(config=m.config)
        cache.activate_past_recording()
        m(ids[:, :8], attention_mask=mask[:, :8], cache=cache, use_cache=True)
        cache.crop(0)
        before = addresses(cache)
        chunks = [(8, 14)] if pattern == "verify" else [(8, 11), (11, 12), (12, 13), (13, 14)]
        for start, end in chunks:
            m(ids[:, start:end], attention_mask=mask[:, start:end], cache=cache, use_cache=True)
        cache.crop(-removed)
        kept = 14 - removed
        expected = output_cache(m(ids[:, :kept], attention_mask=mask[:, :kept], use_cache=True))
        assert_same_states(cache, expected)
        assert addresses(cache) == before
        assert cache._records == [] and cache._pending == {}
        # and it decodes on as the reference does
        step = ids[:, kept - 1 : kept] if removed else ids[:, 13:14]
        reference = m(step, cache=expected, use_cache=True).logits
        torch.testing.assert_close(m(step, cache=cache, use_cache=True).logits, reference, atol=1e-12, rtol=0)


def test_crop_refuses_what_it_cannot_take_back():
    m = model("denseretnet")
    cache = DenseSSMCache(config=m.config)
    with torch.no_grad():
        m(random_ids(1, 5), cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="activate_past_recording"):  # not recording
            cache.crop(-1)
        cache.activate_past_recording()
        m(random_ids(1, 3), cache=cache, use_cache=True)
        for bad in (-4, 1):  # more than fed since the last crop; a positive count
            with pytest.raises(RuntimeError, match="0 to 3 tokens"):
                cache.crop(bad)


# ---------------------------------------------------------------------------------------------------------------------
# generate(): the same tokens as plain greedy decoding
# ---------------------------------------------------------------------------------------------------------------------


def plain_and_speculative(m, ids, max_new_tokens=24, **speculative):
    plain = m.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
    with watched_crops() as crops:
        fast = m.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True, **speculative
        )
    return plain, fast, crops


@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant"])
@pytest.mark.parametrize(("family", "target"), TARGETS, ids=IDS)
def test_greedy_speculative_decoding_gives_the_plain_greedy_tokens(family, target, mode):
    """float64: the tokens exactly, and the returned cache equals plain decoding's; drafts were rejected (some crop
    took tokens back) and the assistant's accepted (fewer verifications than new tokens); a verification never keeps
    more records than its own tokens (memory bounded)."""
    m = model(family, target)
    prompt = random_ids(1, 10)
    if mode == "prompt_lookup":  # a prompt that repeats itself, for drafts to come from
        speculative = dict(prompt_lookup_num_tokens=4)
        ids = torch.cat([prompt, prompt, prompt[:, :5]], dim=1)
    else:
        speculative = dict(assistant_model=perturbed(m))
        ids = prompt
    plain, fast, crops = plain_and_speculative(m, ids, **speculative)
    assert torch.equal(fast.sequences, plain.sequences)
    assert_same_states(output_cache(fast), output_cache(plain))
    target_crops = [(removed, recorded) for cache, removed, recorded, _ in crops if cache is output_cache(fast)]
    assert any(removed < 0 for removed, _ in target_crops)
    if mode == "assistant":  # (a random micro model does not copy its prompt: prompt lookup's drafts are rejected)
        assert len(target_crops) < fast.sequences.shape[1] - ids.shape[1]
    assert all(recorded <= 5 for _, recorded in target_crops[1:])


def test_assistants_of_other_kinds():
    """A DenseRetNet assisting a DenseMamba, a Llama (a transformers model on the same vocabulary) assisting a
    DenseSSM model, and a DenseSSM model assisting a Llama: the plain greedy tokens, in float64."""
    mamba, retnet, other = model("densemamba", "state"), model("denseretnet"), llama()
    ids = random_ids(1, 10)
    for target, assistant in [(mamba, retnet), (retnet, other), (other, mamba), (other, retnet)]:
        plain, fast, crops = plain_and_speculative(target, ids, assistant_model=assistant)
        assert torch.equal(fast.sequences, plain.sequences), (type(target).__name__, type(assistant).__name__)
        assert any(removed < 0 for _, removed, *_ in crops)


@pytest.mark.parametrize("family", ["densemamba", "denseretnet"])
def test_early_exit_assistant(family):
    """transformers' early-exit drafts (``assistant_early_exit=2``: the model's first 2 blocks, its norm and head,
    with a cache of 2 layers): the plain greedy tokens, and the model has all its blocks again after."""
    m = model(family)
    ids = random_ids(1, 10)
    plain, fast, crops = plain_and_speculative(m, ids, assistant_early_exit=2)
    assert torch.equal(fast.sequences, plain.sequences)
    assert {len(cache.layers) for cache, *_ in crops} == {2, 4} and m.config.num_hidden_layers == 4


@pytest.mark.parametrize("family", ["densemamba", "denseretnet"])
def test_float32_gives_the_plain_greedy_tokens(family):
    m = model(family, dtype=torch.float32)
    prompt = random_ids(1, 12, seed=5)
    ids = torch.cat([prompt, prompt], dim=1)
    for speculative in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=perturbed(m))):
        plain, fast, _ = plain_and_speculative(m, ids, max_new_tokens=32, **speculative)
        assert torch.equal(fast.sequences, plain.sequences)


def test_batches_larger_than_one_are_refused_by_transformers():
    m = model("densemamba")
    ids = random_ids(2, 6)
    for speculative in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=perturbed(m))):
        with pytest.raises(ValueError, match="batch_size = 1"):
            m.generate(ids, max_new_tokens=4, do_sample=False, **speculative)


def test_plain_decoding_records_nothing():
    """A cache an assisted generate() returned, continued by a plain generate(): it stops recording (nothing kept),
    and the tokens are plain greedy's over the whole run."""
    m = model("denseretnet")
    ids = random_ids(1, 8)
    out = m.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=perturbed(m), return_dict_in_generate=True)
    cache = output_cache(out)
    assert cache.recording
    more = m.generate(
        out.sequences, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
        **{generate_keyword(m.old_cache_names): cache},
    )
    assert output_cache(more) is cache and not cache.recording and cache._records == []
    assert torch.equal(more.sequences, m.generate(ids, max_new_tokens=12, do_sample=False))


# ---------------------------------------------------------------------------------------------------------------------
# Outputs: streamer, return_dict_in_generate, sampling
# ---------------------------------------------------------------------------------------------------------------------


class Collect(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens += value.reshape(-1).tolist()

    def end(self):
        self.ended = True


@pytest.mark.parametrize("family", ["densemamba", "denseretnet"])
def test_streamer_and_returned_scores(family):
    """The streamer receives the prompt then every new token once; scores and logits: one per new token, plain
    greedy's."""
    m = model(family)
    prompt = random_ids(1, 9)
    ids = torch.cat([prompt, prompt], dim=1)
    outputs = {}
    for name, speculative in [("plain", {}), ("lookup", dict(prompt_lookup_num_tokens=3))]:
        streamer = Collect()
        outputs[name] = m.generate(
            ids, max_new_tokens=10, do_sample=False, streamer=streamer, return_dict_in_generate=True,
            output_scores=True, output_logits=True, **speculative,
        )
        assert streamer.ended and streamer.tokens == outputs[name].sequences[0].tolist()
    plain, fast = outputs["plain"], outputs["lookup"]
    assert torch.equal(fast.sequences, plain.sequences)
    for field in ("scores", "logits"):
        assert len(getattr(fast, field)) == 10
        torch.testing.assert_close(torch.stack(getattr(fast, field)), torch.stack(getattr(plain, field)))


def exact_joint(m, prompt, vocab):
    """``P(t1, t2 | prompt)`` of ``m`` as a ``(vocab, vocab)`` tensor."""
    with torch.no_grad():
        first = m(prompt).logits[0, -1].softmax(-1)
        follow = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        second = m(follow).logits[:, -1].softmax(-1)
    return first[:, None] * second


def chi_square(counts, probs, minimum=5.0):
    """Pearson's statistic and degrees of freedom, cells expected fewer than ``minimum`` times pooled."""
    expected = probs.flatten() * counts.sum()
    small = expected < minimum
    observed = torch.cat([counts.flatten()[~small], counts.flatten()[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return statistic, int(keep.sum()) - 1


def test_speculative_sampling_follows_the_target_distribution():
    """transformers' speculative sampling (accept a draft with probability min(1, p/q), else resample from
    (p - q)+) gives the target's distribution: 120 two-token samples on a 3-token vocabulary (no end token) against
    the exact joint of the target (chi-square below a p ~ 1e-4 threshold), and far from the assistant's own."""
    vocab, samples = 3, 120
    special = dict(vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target, assistant = model("denseretnet", **special), model("densemamba", seed=4, **special)
    prompt = torch.tensor([[0, 1, 2, 1, 0]])
    p, q = exact_joint(target, prompt, vocab), exact_joint(assistant, prompt, vocab)
    assert (p - q).abs().sum() / 2 > 0.3  # the two differ: a test that can fail
    torch.manual_seed(0)
    counts = torch.zeros(vocab, vocab)
    with watched_crops() as crops:
        for _ in range(samples):
            out = target.generate(prompt, max_new_tokens=2, do_sample=True, assistant_model=assistant, top_k=0)
            counts[out[0, -2], out[0, -1]] += 1
    assert any(removed < 0 for _, removed, *_ in crops)  # drafts were rejected
    threshold = lambda df: df + 5 * math.sqrt(2 * df)  # noqa: E731  (normal approximation, p ~ 1e-4 and below)
    statistic, df = chi_square(counts, p)
    assert statistic < threshold(df), (statistic, df)
    statistic, df = chi_square(counts, q)
    assert statistic > threshold(df), (statistic, df)


# ---------------------------------------------------------------------------------------------------------------------
# The compiled decoding path
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["densemamba", "denseretnet"])
def test_compiled_decoding_around_speculative_decoding(family):
    """With a compiled decoding step, speculative forwards run eagerly (a recording cache is not compileable, as
    transformers' own recording layers); every crop writes the states in place (same addresses); a plain generate()
    continuing the returned cache compiles its step once, and gives the eager tokens."""
    m = model(family, dtype=torch.float32)
    prompt = random_ids(1, 8)
    ids = torch.cat([prompt, prompt], dim=1)
    eager = m.generate(ids, max_new_tokens=12, do_sample=False)
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    config._compile_all_devices = True
    m.generation_config.compile_config = config
    with watched_crops() as crops:
        out = m.generate(
            ids, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=3, return_dict_in_generate=True
        )
    assert graphs == []
    cache = output_cache(out)
    assert len({tuple(found.items()) for *_, found in crops} | {tuple(addresses(cache).items())}) == 1
    more = m.generate(
        out.sequences, max_new_tokens=6, do_sample=False, **{generate_keyword(m.old_cache_names): cache}
    )
    assert len(graphs) == 1
    assert torch.equal(more, eager)
