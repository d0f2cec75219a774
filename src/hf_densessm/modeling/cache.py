"""Glue between DenseSSM blocks and transformers' own recurrent-state cache.

The models use ``transformers.DynamicCache(config=model.config)``: the configs declare every block as a
``"linear_attention"`` layer, so the cache holds one ``LinearAttentionLayer`` per block, whose conv and recurrent
state slots have a fixed size (independent of the sequence length). DenseMamba uses conv slot 0 (the last
``conv_kernel`` inputs of the causal convolution) and recurrent slot 0 (the SSM state ``(batch, intermediate_size,
state_size)``, float32). DenseRetNet uses recurrent slot 0 (the retention state ``(batch, heads, key_dim, value_dim)``,
float32) and recurrent slot 1 (the number of tokens seen per row, int64, which places later tokens' rotary angles).
``generate()`` builds this cache itself; beam search reorders it with the layers' own ``reorder_cache``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin


class DenseSSMCache(DynamicCache):
    """transformers' ``DynamicCache`` (one ``LinearAttentionLayer`` per block), plus a count of the tokens seen.

    The count is the one addition: ``generate()`` asks a cache passed as ``past_key_values`` for
    ``get_seq_length()`` (to slice the prompt), and transformers' linear-attention layers keep no sequence length,
    so a plain ``DynamicCache`` refuses. Every state, its reordering for beam search and its reset stay
    transformers' own. The models update the count (``record_tokens``); it includes padding positions.
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


def check_cache(cache, config, arg_name: str) -> None:
    """Check that ``cache`` is a transformers ``Cache`` with one linear-attention layer per block of ``config``.

    Raises:
        TypeError: ``cache`` is not a ``Cache``, or its layers are not linear-attention layers.
        ValueError: it has the wrong number of layers. Messages name ``arg_name`` and how to build a right one.
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


def recurrent_state(cache: Cache | None, layer_idx: int, slot: int = 0) -> torch.Tensor | None:
    """The recurrent state in ``slot`` of block ``layer_idx``, or ``None`` before the first update."""
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
