"""What a cache holds, read as transformers' generic generation tests read one (after greedy search and beam search):
one linear-attention layer per block, every filled slot a state of the family's shape with the batch first and what
its name says (the family config's ``cache_slots`` / ``cache_shapes``), and the bookkeeping on the cache itself: the positions seen and
DenseRetNet's count of each row's real tokens, which beam search reorders and reset() zeroes."""

import copy

import pytest
import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin

from helpers import FAMILIES, micro_model, random_ids
from hf_densessm.modeling.cache import DenseSSMCache
from hf_densessm.modeling.cache_names import output_cache


def _expected_states(config, rows):
    """The shape of every slot a model of ``config`` fills, for ``rows`` rows."""
    if config.model_type == "densemamba":
        return {
            ("conv", 0): (rows, config.intermediate_size, config.conv_kernel),
            ("recurrent", 0): (rows, config.intermediate_size, config.state_size),
        }
    heads = config.num_attention_heads
    return {("recurrent", 0): (rows, heads, config.query_key_dim // heads, config.value_dim // heads)}


def _padded_prompt(model):
    """Three rows, left-padded by 0, 2 and 1: ``(ids, mask, real tokens per row)``."""
    ids = random_ids(3, 6)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 2, 1)):
        ids[row, :pad] = model.config.pad_token_id
        mask[row, :pad] = 0
    return ids, mask, mask.sum(-1)


@pytest.mark.parametrize("num_beams", [1, 2], ids=["greedy", "beam-search"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cache_returned_by_generate_holds_states_of_the_family(family, num_beams):
    model = micro_model(family)
    config = model.config
    ids, mask, real = _padded_prompt(model)
    out = model.generate(
        ids, attention_mask=mask, do_sample=False, num_beams=num_beams, max_new_tokens=3, min_new_tokens=3,
        return_dict_in_generate=True, use_cache=True, pad_token_id=config.pad_token_id,
    )
    cache = output_cache(out)
    rows = ids.shape[0] * num_beams
    assert isinstance(cache, Cache) and isinstance(cache, DenseSSMCache)
    assert len(cache.layers) == config.num_hidden_layers
    expected = _expected_states(config, rows)
    assert config.cache_shapes(rows) == expected  # what the family declares, against the expectation above
    slots = config.cache_slots
    assert {(kind, slot) for kind in ("conv", "recurrent") for slot in slots[kind]} == set(expected)
    for layer in cache.layers:
        assert isinstance(layer, LinearAttentionCacheLayerMixin)
        assert layer.number_of_states == 1
        for kind, states, filled in (
            ("conv", layer.conv_states, layer.is_conv_states_initialized),
            ("recurrent", layer.recurrent_states, layer.is_recurrent_states_initialized),
        ):
            for slot, state in states.items():
                assert filled[slot] == ((kind, slot) in expected)
                if filled[slot]:
                    assert state.is_floating_point() and tuple(state.shape) == expected[kind, slot]
                else:
                    assert state is None
    # every position fed (the last generated token is not), padding included
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    if config.cache_counts_row_tokens:  # each row's real tokens, the beams of a prompt alike
        assert cache.real_tokens_seen.dtype == torch.int64
        assert torch.equal(cache.real_tokens_seen, (real + 2).repeat_interleave(num_beams))
    else:
        assert cache.real_tokens_seen is None


def _step(model, token, cache, mask=None):
    with torch.no_grad():
        return model(token, attention_mask=mask, cache=cache, use_cache=True).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_reordering_moves_each_rows_count_with_its_states(family):
    """After ``reorder_cache`` each row continues as the row it was taken from: its states and its token count (which
    places DenseRetNet's rotary angles) move together."""
    model = micro_model(family)
    ids, mask, real = _padded_prompt(model)
    with torch.no_grad():
        cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
    if model.config.cache_counts_row_tokens:
        assert torch.equal(cache.real_tokens_seen, real)
    token = random_ids(3, 1, seed=9)
    order = torch.tensor([2, 0, 1])
    untouched = _step(model, token, copy.deepcopy(cache))
    cache.reorder_cache(order)
    if model.config.cache_counts_row_tokens:
        assert torch.equal(cache.real_tokens_seen, real[order])
    moved = _step(model, token[order], cache)
    torch.testing.assert_close(moved, untouched[order], atol=1e-5, rtol=1e-4)  # rows in another order: rounding


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_step_counts_real_tokens_only(family):
    model = micro_model(family)
    ids, mask, real = _padded_prompt(model)
    with torch.no_grad():
        cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
    step_mask = torch.cat([mask, torch.tensor([[1], [0], [1]])], dim=1)
    _step(model, random_ids(3, 1, seed=9), cache, step_mask)
    assert cache.get_seq_length() == 7
    if model.config.cache_counts_row_tokens:
        assert torch.equal(cache.real_tokens_seen, real + torch.tensor([1, 0, 1]))


@pytest.mark.parametrize("family", FAMILIES)
def test_reset_cache_computes_as_a_new_one(family):
    model = micro_model(family)
    ids, mask, _ = _padded_prompt(model)
    with torch.no_grad():
        cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
        count = cache.real_tokens_seen
        cache.reset()
        assert cache.get_seq_length() == 0
        if model.config.cache_counts_row_tokens:  # zeroed in place, as transformers resets the states
            assert cache.real_tokens_seen is count and not count.any()
        again = model(ids, attention_mask=mask, cache=cache, use_cache=True)
        fresh = model(ids, attention_mask=mask, use_cache=True)
    torch.testing.assert_close(again.logits, fresh.logits, atol=0, rtol=0)
    for layer, new in zip(cache.layers, output_cache(fresh).layers, strict=True):
        for slot, state in layer.recurrent_states.items():
            if state is not None:
                torch.testing.assert_close(state, new.recurrent_states[slot], atol=0, rtol=0)
