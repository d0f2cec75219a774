"""Eager and compiled runs accept and refuse the same inputs (docs/design.md §6, "Checks of values"): every check that
reads tensor values is a ``ValueError`` eagerly and, traced into the graph by ``torch.compile(fullgraph=True)``
(``capture_scalar_outputs`` off, so a host read would break the graph), a ``RuntimeError`` with the same message.
The compiled runs use Dynamo's ``eager`` backend: what is checked is what Dynamo traces, not Inductor's code."""

import pytest
import torch

from helpers import FAMILIES, micro_model, output_cache, random_ids


def _bad_inputs(family):
    ids = random_ids(2, 8)
    mask = torch.ones_like(ids)
    packed = torch.cat([torch.arange(3), torch.arange(5)])[None].expand(2, -1)
    out_of_vocab = ids.clone()
    out_of_vocab[0, 2] = 97
    return {
        "ids out of the vocabulary": (dict(input_ids=out_of_vocab), "vocab_size"),
        "mask value 2": (dict(input_ids=ids, attention_mask=mask * 2), "only 0"),
        "packed documents with a cache": (dict(input_ids=ids, position_ids=packed, use_cache=True), "not for decoding"),
        "decreasing seq_idx": (dict(input_ids=ids, seq_idx=torch.tensor([[0, 0, 1, 1, 0, 2, 2, 2]] * 2)), "decrease"),
        "cu_seq_lens_q short of the length": (dict(input_ids=ids[:1], cu_seq_lens_q=torch.tensor([0, 3, 6])), "rise"),
        "positions that skip": (dict(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 2, 3, 4, 5]] * 2)), "rise by 1"),
        "logits_to_keep out of range": (dict(input_ids=ids, logits_to_keep=torch.tensor([0, 8])), "outside"),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_and_compiled_runs_refuse_the_same_inputs(family):
    model = micro_model(family)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        for name, (inputs, message) in _bad_inputs(family).items():
            with pytest.raises(ValueError, match=message):
                model(**inputs)
            with pytest.raises(RuntimeError, match=message):
                compiled(**inputs)
        ids = random_ids(2, 8)  # and a good input runs in both, with the same logits
        torch.testing.assert_close(compiled(ids, attention_mask=torch.ones_like(ids)).logits, model(ids).logits)
    torch._dynamo.reset()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_decoding_step_traces_whole_with_its_checks(family):
    """The one-token step over a cache, with a padded row and an out-of-vocabulary id refused in the graph: no host
    read breaks it (fullgraph, ``capture_scalar_outputs`` off)."""
    model = micro_model(family)
    ids = random_ids(2, 6)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    torch._dynamo.reset()
    step = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=False):
        cache = output_cache(model(ids, attention_mask=mask[:, :6], use_cache=True))
        token = random_ids(2, 1, seed=5)
        step(token, attention_mask=mask, cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="vocab_size"):
            step(token + 97, attention_mask=mask, cache=cache, use_cache=True)
    torch._dynamo.reset()
