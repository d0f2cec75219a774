"""``torch.export`` of both families (issue 33, item 10; docs/design.md §5, "torch.export"): a prefill exported once
over a dynamic length (left padding included) gives the eager logits and cache at lengths from 2 to past two chunks,
chunk multiples included; a decoding step exported with the cache as input and output (``DenseSSMCache`` is a
registered pytree) gives the eager logits step after step, the cache it was given updated in place as eager
updates it and the one it returns holding the same states."""

import copy

import pytest
import torch
from torch.export import Dim

from helpers import FAMILIES, micro_model, output_cache, random_ids

# float32, two implementations: an exported program runs the traced PyTorch path, the eager model the C++ CPU
# entries where they apply (a retention of at most 16 tokens: another summation order, about 1e-6 apart)
TOL = dict(atol=1e-5, rtol=1e-5)


def _contents(cache):
    """Every filled state of ``cache``, then its counts."""
    states = [s for layer in cache.layers for slots in (layer.conv_states, layer.recurrent_states)
              for s in slots.values() if s is not None]
    return states + [c for c in (cache.positions_seen, cache.real_tokens_seen) if c is not None]


def _assert_same_cache(got, expected):
    assert type(got) is type(expected)
    got, expected = _contents(got), _contents(expected)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL)


def _left_padded(length, seed):
    ids = random_ids(2, length, seed=seed)
    mask = torch.ones_like(ids)
    mask[1, : length // 3] = 0
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_exports_over_a_dynamic_length(family):
    model = micro_model(family)
    ids, mask = _left_padded(17, seed=1)
    length = Dim("length", min=2, max=4096)
    with torch.no_grad():
        program = torch.export.export(
            model, (), {"input_ids": ids, "attention_mask": mask, "use_cache": True},
            dynamic_shapes={"input_ids": {1: length}, "attention_mask": {1: length}, "use_cache": None}, strict=False,
        )
    for n in (2, 3, 17, 64, 65, 128, 130):
        ids, mask = _left_padded(n, seed=n)
        with torch.no_grad():
            got = program.module()(input_ids=ids, attention_mask=mask, use_cache=True)
            expected = model(ids, attention_mask=mask, use_cache=True)
        torch.testing.assert_close(got.logits, expected.logits, **TOL, msg=lambda m: f"length {n}: {m}")
        _assert_same_cache(output_cache(got), output_cache(expected))


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_step_exports_with_the_cache_as_input_and_output(family):
    model = micro_model(family)
    ids, mask = _left_padded(9, seed=2)
    with torch.no_grad():
        prefill = model(ids, attention_mask=mask, use_cache=True)
    cache, token = output_cache(prefill), prefill.logits[:, -1:].argmax(-1)
    step_mask = torch.ones_like(token)  # the step's own mask column, as generate() passes it
    with torch.no_grad():
        program = torch.export.export(
            model, (), {"input_ids": token, "attention_mask": step_mask, "cache": copy.deepcopy(cache),
                        "use_cache": True}, strict=False,
        )
    eager_cache, exported_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    for _ in range(4):
        with torch.no_grad():
            expected = model(token, attention_mask=step_mask, cache=eager_cache, use_cache=True)
            got = program.module()(input_ids=token, attention_mask=step_mask, cache=exported_cache, use_cache=True)
        torch.testing.assert_close(got.logits, expected.logits, **TOL)
        _assert_same_cache(exported_cache, eager_cache)
        _assert_same_cache(output_cache(got), eager_cache)
        token = expected.logits[:, -1:].argmax(-1)
    assert exported_cache.get_seq_length() == eager_cache.get_seq_length() == 13
