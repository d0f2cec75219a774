"""Small configs and model builders shared by the tests."""

import torch

from hf_densessm import DenseMambaConfig, DenseMambaForCausalLM, DenseRetNetConfig, DenseRetNetForCausalLM
from hf_densessm.modeling.cache_names import output_cache

FAMILIES = ("densemamba", "denseretnet")
VOCAB = 97


def micro_config(family: str, **overrides):
    """A few-thousand-parameter config of ``family`` with the dense connection on (m = 2 unless overridden)."""
    if family == "densemamba":
        kwargs = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, state_size=8, dense_layers=2)
        kwargs.update(overrides)
        return DenseMambaConfig(**kwargs)
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, query_key_dim=16, dense_layers=2
    )
    kwargs.update(overrides)
    return DenseRetNetConfig(**kwargs)


def micro_model(family: str, seed: int = 0, **overrides):
    """A float32 causal LM of ``family`` in eval mode, with deterministic weights."""
    torch.manual_seed(seed)
    config = micro_config(family, **overrides)
    cls = DenseMambaForCausalLM if family == "densemamba" else DenseRetNetForCausalLM
    return cls(config).eval()


def enable_checkpointing(model, use_reentrant: bool | None = None):
    """Turn gradient checkpointing on under the installed release's name (``activation_checkpointing_enable`` from
    transformers 5.24, which deprecates ``gradient_checkpointing_enable``; the floor, 5.17, has only the latter)."""
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def same_model(loaded, model) -> bool:
    """Whether ``loaded`` is ``model`` exactly: its dense knobs and every tensor, bit for bit."""
    state, expected = loaded.state_dict(), model.state_dict()
    return (
        loaded.config.dense_layers == model.config.dense_layers
        and state.keys() == expected.keys()
        and all(torch.equal(state[key], expected[key]) for key in state)
    )


def random_ids(batch: int, length: int, seed: int = 1, low: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (batch, length), generator=g)


def decode_step_by_step(model, ids, mask, prefill):
    """Logits ``(batch, length, vocab)`` of ``ids[:, :prefill]`` in one call, then of every later token one by one,
    continuing the cache (``mask``: the 2-D padding mask or ``None``)."""
    with torch.no_grad():
        out = model(ids[:, :prefill], attention_mask=None if mask is None else mask[:, :prefill], use_cache=True)
        logits, cache = [out.logits], output_cache(out)
        for t in range(prefill, ids.shape[1]):
            out = model(
                ids[:, t : t + 1], attention_mask=None if mask is None else mask[:, : t + 1],
                use_cache=True, cache=cache,
            )
            logits.append(out.logits)
    return torch.cat(logits, dim=1)
