"""The recurrent-state cache of both DenseSSM families: how it is built, which slot holds what, how tokens are counted.

**Built.** The cache is transformers' own ``DynamicCache(config=model.config)``: the configs declare every block a
``"linear_attention"`` layer (``config.layer_types``), so the cache holds one ``LinearAttentionLayer`` per block whose
conv and recurrent state slots have a fixed size, independent of the sequence length. The one addition is
:class:`DenseSSMCache`, a ``DynamicCache`` that also counts the positions processed, because ``generate()`` asks a
cache for ``get_seq_length()`` and linear-attention layers keep none. Both families build it the same way: the first
forward with ``use_cache`` and no cache creates one (:func:`new_cache`); ``generate()`` leaves the creation to that
forward (``_supports_default_dynamic_cache()`` is ``False``, as for transformers' own stateful models), and a cache
returned by one ``generate()`` call continues in the next (:mod:`.modeling_densessm`).

**Slots** (:data:`CACHE_SLOTS`), per block:

=============  ===========================  ===================================================================
family         slot                         content
=============  ===========================  ===================================================================
densemamba     ``conv_states[0]``           the last ``conv_kernel`` inputs of the causal convolution,
                                            ``(batch, intermediate_size, conv_kernel)``, the model's dtype
densemamba     ``recurrent_states[0]``      the SSM state ``h``, ``(batch, intermediate_size, state_size)`` float32
denseretnet    ``recurrent_states[0]``      the retention state ``S``, ``(batch, heads, key_dim / heads,
                                            value_dim / heads)`` float32
denseretnet    ``recurrent_states[1]``      real (non-padding) tokens seen per row, ``(batch,)`` int64: places the
                                            rotary angles and the retention normalization of later tokens
=============  ===========================  ===================================================================

**Tokens.** :attr:`DenseSSMCache.tokens_seen` counts every position given to the model (padding included), which is
what ``generate()`` compares with the length of ``input_ids``; DenseRetNet's per-row slot counts real tokens only.
Beam search reorders every slot with transformers' ``reorder_cache``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin

#: Which state slots each family uses, and what they hold (see the module docstring).
CACHE_SLOTS = {
    "densemamba": {"conv": (0,), "recurrent": (0,)},
    "denseretnet": {"conv": (), "recurrent": (0, 1)},
}


class DenseSSMCache(DynamicCache):
    """transformers' ``DynamicCache`` (one ``LinearAttentionLayer`` per block), plus a count of the positions seen.

    The count is the one addition: ``generate()`` asks a cache for ``get_seq_length()`` (to slice a prompt that
    continues a cache), and transformers' linear-attention layers keep no sequence length. Every state, its
    reordering for beam search and its reset stay transformers' own. The models update the count.
    """

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config, **kwargs)
        self.tokens_seen = 0

    def record_tokens(self, count: int) -> None:
        """Add ``count`` processed positions (padding included) to the sequence length."""
        self.tokens_seen += count

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of positions processed so far (the recurrent states do not grow with it)."""
        return self.tokens_seen

    def reset(self) -> None:
        super().reset()
        self.tokens_seen = 0


def new_cache(config) -> DenseSSMCache:
    """An empty cache for a DenseSSM ``config`` (states are allocated on first use)."""
    return DenseSSMCache(config=config)


def record_tokens(cache: Cache | None, count: int) -> None:
    """Count ``count`` processed positions on ``cache`` if it keeps a count (a :class:`DenseSSMCache`)."""
    if isinstance(cache, DenseSSMCache):
        cache.record_tokens(count)


def _expected_shapes(config, batch: int) -> dict[tuple[str, int], tuple[int, ...]]:
    """The shape of every slot of :data:`CACHE_SLOTS` for ``config`` and ``batch`` rows."""
    if config.model_type == "densemamba":
        return {
            ("conv", 0): (batch, config.intermediate_size, config.conv_kernel),
            ("recurrent", 0): (batch, config.intermediate_size, config.state_size),
        }
    heads = config.num_attention_heads
    return {
        ("recurrent", 0): (batch, heads, config.query_key_dim // heads, config.value_dim // heads),
        ("recurrent", 1): (batch,),
    }


def check_cache(cache, config, arg_name: str, batch: int) -> None:
    """Check that ``cache`` fits a model of ``config`` given ``batch`` rows.

    It must be a transformers ``Cache`` with one linear-attention layer per block, with the state slots of the
    config's family (:data:`CACHE_SLOTS`), and states (where already filled) of the shapes this model and batch need.

    Raises:
        TypeError: ``cache`` is not a ``Cache``, or its layers are not linear-attention layers.
        ValueError: wrong number of layers, slots of another family (e.g. a DenseMamba cache given to DenseRetNet),
            or states of another batch size or width. Messages name ``arg_name`` and what was expected.
    """
    hint = f"build one with `transformers.DynamicCache(config=model.config)` or leave `{arg_name}` unset"
    if not isinstance(cache, Cache):
        raise TypeError(f"`{arg_name}` must be a transformers `Cache`, got {type(cache).__name__}; {hint}.")
    if len(cache.layers) != config.num_hidden_layers:
        raise ValueError(
            f"`{arg_name}` has {len(cache.layers)} layers but the model has {config.num_hidden_layers}; {hint}."
        )
    if not all(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers):
        raise TypeError(f"`{arg_name}` must hold linear-attention (recurrent state) layers; {hint}.")
    slots = CACHE_SLOTS[config.model_type]
    needed = max(slots["conv"] + slots["recurrent"]) + 1
    if any(layer.number_of_states != needed for layer in cache.layers):
        raise ValueError(
            f"`{arg_name}` was built for another model family ({cache.layers[0].number_of_states} state slots per "
            f"layer, a {config.model_type} model needs {needed}); {hint}."
        )
    expected = _expected_shapes(config, batch)
    for layer_idx, layer in enumerate(cache.layers):
        for (kind, slot), shape in expected.items():
            filled = layer.is_conv_states_initialized if kind == "conv" else layer.is_recurrent_states_initialized
            if not filled[slot]:
                continue
            state = (layer.conv_states if kind == "conv" else layer.recurrent_states)[slot]
            if tuple(state.shape) != shape:
                raise ValueError(
                    f"`{arg_name}` holds a {kind} state of shape {tuple(state.shape)} in layer {layer_idx}, but this "
                    f"model with batch size {batch} needs {shape} (a cache serves one batch size); {hint}."
                )


def recurrent_state(cache: Cache | None, layer_idx: int, slot: int = 0) -> torch.Tensor | None:
    """The recurrent state in ``slot`` of block ``layer_idx`` (see :data:`CACHE_SLOTS`), or ``None`` before the
    first update."""
    if cache is None:
        return None
    layer = cache.layers[layer_idx]
    return layer.recurrent_states[slot] if layer.is_recurrent_states_initialized[slot] else None


def conv_state(cache: Cache | None, layer_idx: int) -> torch.Tensor | None:
    """The convolution state ``(batch, channels, conv_kernel)`` of block ``layer_idx``, or ``None`` before the
    first update."""
    if cache is None:
        return None
    layer = cache.layers[layer_idx]
    return layer.conv_states[0] if layer.is_conv_states_initialized[0] else None
