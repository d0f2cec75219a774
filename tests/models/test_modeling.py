"""Both model families: outputs, input checks, the recurrent cache (three computations agree), padding, and
DenseMamba's exact equivalence with transformers' Mamba at dense_layers=0."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, MambaConfig, MambaForCausalLM

from hf_densessm import DenseMambaForCausalLM
from helpers import FAMILIES, micro_config, micro_model, output_cache, random_ids

ATOL = 1e-4


def test_densemamba_m0_is_transformers_mamba():
    dense = micro_model("densemamba", dense_layers=0)
    cfg = dense.config
    mamba = MambaForCausalLM(
        MambaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            state_size=cfg.state_size,
            num_hidden_layers=cfg.num_hidden_layers,
            expand=cfg.expand,
            conv_kernel=cfg.conv_kernel,
        )
    ).eval()
    ours = {k: v.shape for k, v in dense.state_dict().items()}
    theirs = {k: v.shape for k, v in mamba.state_dict().items()}
    assert ours == theirs
    mamba.load_state_dict(dense.state_dict(), strict=True)
    ids = random_ids(2, 13)
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, mamba(ids).logits, atol=ATOL, rtol=1e-4)
    # and the other way: a transformers Mamba state dict loads strictly
    fresh = DenseMambaForCausalLM(cfg).eval()
    fresh.load_state_dict(mamba.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, mamba(ids).logits, atol=ATOL, rtol=1e-4)


def test_densemamba_dense_parameters_are_named_dense():
    base = set(micro_model("densemamba", dense_layers=0).state_dict())
    dense = set(micro_model("densemamba", dense_layers=2).state_dict())
    assert base < dense
    assert all("dense" in name for name in dense - base)


def test_densemamba_closed_gates_give_the_base_model():
    dense = micro_model("densemamba", dense_layers=2)
    base = micro_model("densemamba", dense_layers=0)
    base.load_state_dict({k: v for k, v in dense.state_dict().items() if k in base.state_dict()}, strict=True)
    for layer in dense.backbone.layers:
        for conn in (layer.mixer.dense_u, layer.mixer.dense_B):
            if conn is not None:
                conn.zero_gates()
    ids = random_ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, base(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_loss_hidden_states_and_logits_to_keep(family):
    model = micro_model(family)
    ids = random_ids(2, 11)
    with torch.no_grad():
        out = model(ids, labels=ids, output_hidden_states=True)
        expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), ids[:, 1:].reshape(-1))
        torch.testing.assert_close(out.loss, expected)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        assert out.logits.dtype == torch.float32 and out.logits.shape == (2, 11, model.config.vocab_size)
        last = model(ids, logits_to_keep=1).logits
        torch.testing.assert_close(last, out.logits[:, -1:])
        embeds = model.get_input_embeddings()(ids)
        torch.testing.assert_close(model(inputs_embeds=embeds).logits, out.logits)
        as_tuple = model(ids, labels=ids, return_dict=False)
        torch.testing.assert_close(as_tuple[0], out.loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_inputs_raise_at_entry(family):
    model = micro_model(family)
    ids = random_ids(2, 5)
    with pytest.raises(ValueError, match="exactly one of `input_ids` or `inputs_embeds`"):
        model(ids, inputs_embeds=model.get_input_embeddings()(ids))
    with pytest.raises(ValueError, match="exactly one"):
        model()
    with pytest.raises(TypeError, match="input_ids"):
        model(ids.float())
    with pytest.raises(ValueError, match="input_ids"):
        model(ids[0])
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(3, 5))
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(2, 5, 7))
    with pytest.raises(TypeError, match="`cache`"):
        model(ids, cache="not a cache", use_cache=True)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=-1)
    cache = output_cache(model(ids, use_cache=True))  # over a cache, the same errors (no AttributeError on `.shape`)
    with pytest.raises(ValueError, match="exactly one"):
        model(cache=cache)
    with pytest.raises(TypeError, match="input_ids"):
        model([[1]], cache=cache)


DENSE_SETTINGS = [
    {},
    {"dense_layers": 0},
    {"dense_layers": 4, "dense_shared_gate": False, "dense_projection": "linear", "dense_fusion": "concat"},
    {"dense_every": 2, "dense_selection": "linear"},
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", DENSE_SETTINGS)
def test_full_forward_prefill_decode_and_chunked_prefill_agree(family, settings):
    model = micro_model(family, **settings)
    ids = random_ids(2, 12)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        # prefill 5 tokens, then decode the rest one token at a time
        out = model(ids[:, :5], use_cache=True)
        steps, cache = [out.logits], output_cache(out)
        for t in range(5, 12):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = output_cache(out)
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=1e-4)
        # prefill in two chunks (7 + 5)
        first = model(ids[:, :7], use_cache=True)
        second = model(ids[:, 7:], cache=output_cache(first), use_cache=True)
        torch.testing.assert_close(torch.cat([first.logits, second.logits], dim=1), full, atol=ATOL, rtol=1e-4)


def _cache_numel(cache) -> int:
    total = 0
    for layer in cache.layers:
        for store in (layer.conv_states, layer.recurrent_states):
            total += sum(t.numel() for t in store.values() if t is not None)
    return total


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_size_does_not_grow_with_length(family):
    model = micro_model(family)
    with torch.no_grad():
        short = output_cache(model(random_ids(1, 4), use_cache=True))
        long = output_cache(model(random_ids(1, 64), use_cache=True))
    assert isinstance(long, DynamicCache)
    assert _cache_numel(short) == _cache_numel(long) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_gives_each_row_its_own_result(family):
    model = micro_model(family)
    ids = random_ids(2, 9)
    padded = ids.clone()
    padded[1, :4] = model.config.pad_token_id
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        batch = model(padded, attention_mask=mask, use_cache=True)
        alone = model(ids[1:, 4:], use_cache=True)
        torch.testing.assert_close(batch.logits[1:, 4:], alone.logits, atol=ATOL, rtol=1e-4)
        for layer_b, layer_a in zip(output_cache(batch).layers, output_cache(alone).layers):
            torch.testing.assert_close(layer_b.recurrent_states[0][1:], layer_a.recurrent_states[0], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_step_leaves_every_state_unchanged(family):
    model = micro_model(family)
    with torch.no_grad():
        cache = output_cache(model(random_ids(2, 6), use_cache=True))
        before = [
            [t.clone() for t in list(layer.recurrent_states.values()) + list(layer.conv_states.values()) if t is not None]
            for layer in cache.layers
        ]
        mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
        model(random_ids(2, 1, seed=5), attention_mask=mask, cache=cache, use_cache=True)
        for layer, old in zip(cache.layers, before):
            new = [t for t in list(layer.recurrent_states.values()) + list(layer.conv_states.values()) if t is not None]
            for a, b in zip(new, old):
                torch.testing.assert_close(a[1], b[1], atol=0, rtol=0)  # padded row: untouched
                assert not torch.equal(a[0], b[0])  # the other row moved on
