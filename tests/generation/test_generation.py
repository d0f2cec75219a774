"""generate() unchanged: greedy with and without the cache, seeded sampling, beam search, left-padded batches."""

import pytest
import torch

from helpers import FAMILIES, micro_model, random_ids

NEW = dict(max_new_tokens=8, min_new_tokens=8)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_cache_equals_without(family):
    model = micro_model(family)
    ids = random_ids(2, 6)
    with_cache = model.generate(ids, do_sample=False, use_cache=True, **NEW)
    without = model.generate(ids, do_sample=False, use_cache=False, **NEW)
    assert with_cache.shape == (2, 14)
    assert torch.equal(with_cache, without)


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_sampling_is_reproducible(family):
    model = micro_model(family)
    ids = random_ids(1, 4)
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        runs.append(model.generate(ids, do_sample=True, top_k=0, temperature=1.0, **NEW))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_with_cache_equals_without(family):
    model = micro_model(family)
    ids = random_ids(2, 5)
    beams = model.generate(ids, num_beams=3, do_sample=False, use_cache=True, **NEW)
    plain = model.generate(ids, num_beams=3, do_sample=False, use_cache=False, **NEW)
    assert beams.shape == (2, 13)
    assert torch.equal(beams, plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_matches_each_row_alone(family):
    model = micro_model(family)
    pad = model.config.pad_token_id
    long, short = random_ids(1, 7, seed=3)[0], random_ids(1, 4, seed=4)[0]
    batch = torch.stack([long, torch.cat([torch.full((3,), pad), short])])
    mask = torch.tensor([[1] * 7, [0, 0, 0] + [1] * 4])
    together = model.generate(batch, attention_mask=mask, do_sample=False, pad_token_id=pad, **NEW)
    alone_long = model.generate(long[None], do_sample=False, **NEW)
    alone_short = model.generate(short[None], do_sample=False, **NEW)
    assert torch.equal(together[0, 7:], alone_long[0, 7:])
    assert torch.equal(together[1, 7:], alone_short[0, 4:])
