"""The cache is named as the installed transformers names it (``hf_densessm.modeling.cache``, "Names"), checked
against transformers' own models on the same release: its Mamba for DenseMamba, its Llama for DenseRetNet (a
decoder whose cache was ``past_key_values`` before 5.24). Runs on every release CI installs (the newest admitted one
and the floor)."""

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM

from helpers import FAMILIES, VOCAB, micro_model, random_ids
from hf_densessm.modeling.cache_names import CACHE_RENAMED, cache_field, output_cache

#: The name each family's cache had before transformers 5.24 (its reference model's name).
OLD_NAME = {"densemamba": "cache_params", "denseretnet": "past_key_values"}


def transformers_reference(family):
    """A tiny model of transformers' own of the same kind as ``family``, in eval mode."""
    torch.manual_seed(0)
    if family == "densemamba":
        return MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, state_size=4)).eval()
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def deprecations(call):
    """Run ``call()``; return its result and the messages of the ``FutureWarning``s it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_hold_the_cache_under_transformers_name(family):
    model, reference = micro_model(family), transformers_reference(family)
    ids = random_ids(2, 5)
    with torch.no_grad():
        ours, theirs = model(ids, use_cache=True), reference(ids, use_cache=True)
        assert list(ours.keys()) == list(theirs.keys())
        assert list(model.base_model(ids, use_cache=True).keys()) == list(reference.base_model(ids, use_cache=True).keys())
    assert cache_field(type(ours)) == ("cache" if CACHE_RENAMED else OLD_NAME[family])
    assert output_cache(ours) is ours[cache_field(type(ours))]
    assert output_cache(ours).get_seq_length() == 5


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_takes_cache_and_the_old_name_as_transformers_does(family):
    model, reference = micro_model(family), transformers_reference(family)
    ids = random_ids(2, 9)
    old = OLD_NAME[family]
    with torch.no_grad():
        expected = model(ids).logits[:, 5:]
        new_name, warned = deprecations(lambda: model(ids[:, 5:], cache=output_cache(model(ids[:, :5], use_cache=True))))
        assert warned == []
        torch.testing.assert_close(new_name.logits, expected, atol=1e-5, rtol=1e-5)
        old_name, warned = deprecations(lambda: model(ids[:, 5:], **{old: output_cache(model(ids[:, :5], use_cache=True))}))
        torch.testing.assert_close(old_name.logits, expected, atol=1e-5, rtol=1e-5)
        _, theirs = deprecations(
            lambda: reference(ids[:, 5:], **{old: output_cache(reference(ids[:, :5], use_cache=True))})
        )
    # transformers' own deprecation on 5.24 and later (one FutureWarning naming the old keyword), none before
    assert len(warned) == len(theirs) == (1 if CACHE_RENAMED else 0)
    if CACHE_RENAMED:
        assert f"`{old}` is deprecated" in warned[0] and "Use `cache` instead" in warned[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_different_caches(family):
    model = micro_model(family)
    ids = random_ids(2, 6)
    with torch.no_grad():
        first, other = (output_cache(model(ids[:, :5], use_cache=True)) for _ in range(2))
        expected = model(ids[:, 5:], cache=output_cache(model(ids[:, :5], use_cache=True))).logits
        call = lambda: model(ids[:, 5:], cache=first, **{OLD_NAME[family]: other})  # noqa: E731
        if CACHE_RENAMED:  # transformers' rule: `cache` is used, with a warning that names both
            out, warned = deprecations(call)
            assert len(warned) == 1 and "Both" in warned[0]
            torch.testing.assert_close(out.logits, expected)
            assert first.get_seq_length() == 6 and other.get_seq_length() == 5
        else:
            with pytest.raises(ValueError, match="Give the cache once"):
                call()


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_continues_a_cache_given_under_the_releases_name(family):
    model = micro_model(family)
    ids = random_ids(2, 5)
    full = model.generate(ids, do_sample=False, max_new_tokens=6, min_new_tokens=6)
    first = model.generate(ids, do_sample=False, max_new_tokens=3, min_new_tokens=3, return_dict_in_generate=True)
    name = "cache" if CACHE_RENAMED else OLD_NAME[family]
    second, warned = deprecations(
        lambda: model.generate(first.sequences, do_sample=False, max_new_tokens=3, min_new_tokens=3,
                               **{name: output_cache(first)})
    )
    assert warned == []
    assert torch.equal(second, full)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cut", [0, 6])
def test_generate_refuses_a_cache_longer_than_the_prompt(family, cut):
    """A cache of 11 positions with a prompt of 11 - ``cut`` tokens: the prompt would be fed on top of a state that
    already holds it (or more), a silent wrong continuation."""
    model = micro_model(family)
    ids = random_ids(1, 11)
    cache = output_cache(model(ids, use_cache=True))
    name = "cache" if CACHE_RENAMED else OLD_NAME[family]
    with pytest.raises(ValueError, match="holds 11 positions, but the prompt has"):
        model.generate(ids[:, : 11 - cut], do_sample=False, max_new_tokens=2, **{name: cache})
