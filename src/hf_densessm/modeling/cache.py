"""The recurrent-state cache of every family (:class:`DenseSSMCache`), its checks and helpers (docs/design.md §5)."""

from __future__ import annotations

from functools import partial

import torch
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin
from transformers.exporters.exporter_dynamo import register_pytree_node

from ..ops.dispatch import chosen_backend, use_backend


class DenseSSMCache(DynamicCache):
    """transformers' ``DynamicCache`` (a ``LinearAttentionLayer`` per block) plus in-place counts (docs/design.md §5).

    Attributes:
        model_type: the ``model_type`` of the config it was built for (``None`` without one).
        counts_row_tokens: the config's ``cache_counts_row_tokens``.
        positions_seen: positions processed, padding included, 0-dim int64 (``None`` before the first forward).
        real_tokens_seen: with ``counts_row_tokens``, each row's real tokens, ``(batch,)`` int64, else ``None``.
        recording: whether each forward keeps what :meth:`crop` needs (from :meth:`activate_past_recording`).
    """

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config, **kwargs)
        self.model_type = getattr(config, "model_type", None)
        self.counts_row_tokens = getattr(config, "cache_counts_row_tokens", False)
        self.positions_seen: torch.Tensor | None = None
        self.real_tokens_seen: torch.Tensor | None = None
        self.recording = False
        self._records: list = []  # per recorded forward: (tokens, attention mask or None, {layer: what it kept})
        self._pending: dict = {}  # the forward under way's layers

    @staticmethod
    def _new_count(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A zero int64 count of ``shape`` on ``device``, at a static address (docs/design.md §5)."""
        count = torch.zeros(shape, dtype=torch.long, device=device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(count)
        return count

    def record_tokens(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Count a forward's positions and (with :attr:`counts_row_tokens`) each row's real tokens; ``inputs``
        ``(batch, seq_len, ...)`` (shape and device only), ``attention_mask`` ``(batch, seq_len)`` 0/1 or ``None``."""
        batch, count = inputs.shape[:2]
        if self.positions_seen is None:
            self.positions_seen = self._new_count((), inputs.device)
        self.positions_seen.add_(count)
        if self.recording:
            self._records.append((count, attention_mask, self._pending))
            self._pending = {}
        if not self.counts_row_tokens:
            return
        if self.real_tokens_seen is None:
            self.real_tokens_seen = self._new_count((batch,), inputs.device)
        self.real_tokens_seen.add_(count if attention_mask is None else attention_mask.long().sum(-1))

    def activate_past_recording(self) -> None:
        """transformers' hook before speculative decoding: forwards keep what :meth:`crop` needs (until stopped)."""
        self.recording = True

    def stop_recording(self) -> None:
        """Back to plain decoding: forwards keep nothing, and what was kept is dropped."""
        self.recording, self._records, self._pending = False, [], {}

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can take tokens back: while :attr:`recording`."""
        return self.recording

    @property
    def is_compileable(self) -> bool:
        """As transformers' layers: not while recording (speculative forwards run eagerly, their lengths vary)."""
        return not self.recording and super().is_compileable

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' rollback after a speculative verification: take the last ``-tokens_to_remove`` tokens back
        (states, windows and counts, in place), then drop the records (docs/design.md §5, "Speculative decoding").
        ``RuntimeError`` if not :attr:`recording`, ``tokens_to_remove > 0``, or more than fed since the last crop."""
        remove = -tokens_to_remove
        recorded = sum(record[0] for record in self._records)
        if not self.recording or remove < 0 or remove > recorded:
            raise RuntimeError(f"`crop` takes back 0 to {recorded} tokens (the tokens fed since the last crop) as a "
                               f"negative int, after `activate_past_recording()` (recording: {self.recording}); got "
                               f"{tokens_to_remove}.")
        while remove:
            length, mask, layers = self._records.pop()
            keep = max(length - remove, 0)
            for layer_idx, kept in layers.items():
                layer = self.layers[layer_idx]
                if "state" in kept:
                    before, run, backend = kept["state"]
                    with use_backend(backend):  # the kernels of the forward
                        state = run(before, keep) if keep else before
                    if state is None:  # the forward filled an empty cache
                        layer.recurrent_states[0].zero_()
                    else:
                        layer.recurrent_states[0].copy_(state)
                if "window" in kept:  # the window before the forward, then its conv inputs
                    window = layer.conv_states[0]
                    window.copy_(kept["window"][..., keep : keep + window.shape[-1]])
            self.positions_seen.sub_(length - keep)
            if self.real_tokens_seen is not None:
                self.real_tokens_seen.sub_(length - keep if mask is None else mask[:, keep:].long().sum(-1))
            remove -= length - keep
        self._records, self._pending = [], {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of positions processed so far, an ``int`` (reading it waits for the device)."""
        return 0 if self.positions_seen is None else int(self.positions_seen)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """transformers' beam-search reordering of every state, and of :attr:`real_tokens_seen` (in place)."""
        super().reorder_cache(beam_idx)
        if (seen := self.real_tokens_seen) is not None:
            seen.copy_(seen.index_select(0, beam_idx.to(seen.device)))

    def reset(self) -> None:
        """transformers' reset (states zeroed in place), and both counts back to zero."""
        super().reset()
        self._records, self._pending = [], {}
        for count in (self.positions_seen, self.real_tokens_seen):
            if count is not None:
                count.zero_()


# torch.export takes and returns the cache as a pytree of its tensors (docs/design.md §5, "torch.export")
register_pytree_node(DenseSSMCache)


def record_states(cache: Cache | None, layer_idx: int, state: torch.Tensor | None, run, *inputs) -> None:
    """While a :class:`DenseSSMCache` is :attr:`~DenseSSMCache.recording`, keep for its ``crop`` the recurrent state of
    block ``layer_idx`` before the forward (``state``, copied; call before the block updates it) and ``run(*inputs,
    initial_state, n)``, the state after the forward's first ``n >= 1`` tokens (``inputs`` by reference)."""
    if isinstance(cache, DenseSSMCache) and cache.recording:
        before = None if state is None else state.clone()
        cache._pending.setdefault(layer_idx, {})["state"] = (before, partial(run, *inputs), chosen_backend(None))


def check_cache(cache, config, batch: int) -> None:
    """Check that ``cache`` fits a model of ``config`` given ``batch`` rows: one linear-attention layer per block,
    only ``config.cache_slots`` filled, with ``config.cache_shapes``. ``TypeError``: not a ``Cache``, not
    linear-attention layers, or not a :class:`DenseSSMCache` where the family counts each row's tokens; ``ValueError``:
    another layer count, family, batch size or width."""
    hint = ("leave `cache` unset (the model builds one), pass the cache a previous call returned, or build an empty "
            "one with `hf_densessm.modeling.cache.DenseSSMCache(config=model.config)`")
    family = config.model_type
    if not isinstance(cache, Cache):
        raise TypeError(f"`cache` must be a transformers `Cache`, got {type(cache).__name__}; {hint}.")
    if len(cache.layers) != (layers := config.num_hidden_layers):
        raise ValueError(f"`cache` has {len(cache.layers)} layers but the model has {layers}; {hint}.")
    if not all(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers):
        raise TypeError(f"`cache` must hold linear-attention (recurrent state) layers; {hint}.")
    slots, built_for = config.cache_slots, cache.model_type if isinstance(cache, DenseSSMCache) else None
    needed = max(slots["conv"] + slots["recurrent"]) + 1
    foreign = [f"layer {i} holds {kind} state slot {slot}, which a {family} model never fills"
               for i, layer in enumerate(cache.layers) for kind in ("conv", "recurrent")
               for slot, filled in getattr(layer, f"is_{kind}_states_initialized").items()
               if filled and slot not in slots[kind]]
    if built_for is not None and built_for != family:
        foreign.insert(0, f"a {built_for} model, not {family}")
    if any(layer.number_of_states != needed for layer in cache.layers):
        foreign.insert(0, f"{cache.layers[0].number_of_states} state slots per layer, a {family} model needs {needed}")
    if foreign:
        raise ValueError(f"`cache` was built for another model family ({foreign[0]}); {hint}.")
    if config.cache_counts_row_tokens and not isinstance(cache, DenseSSMCache):
        raise TypeError(f"`cache` must be a `DenseSSMCache` for a {family} model (it counts the real tokens of each "
                        f"row, which place the rotary angles), got {type(cache).__name__}; {hint}.")
    expected = config.cache_shapes(batch)
    for layer_idx in range(len(cache.layers)):
        for (kind, slot), shape in expected.items():
            if (state := cache_state(cache, layer_idx, kind, slot)) is not None and tuple(state.shape) != shape:
                raise ValueError(f"`cache` holds a {kind} state of shape {tuple(state.shape)} in layer {layer_idx}, "
                                 f"but this model with batch size {batch} needs {shape} (a cache serves one batch "
                                 f"size); {hint}.")
    counts = cache.real_tokens_seen if isinstance(cache, DenseSSMCache) else None
    if counts is not None and tuple(counts.shape) != (batch,):
        raise ValueError(f"`cache` counts the tokens of {counts.shape[0]} rows, but this call has batch size {batch} "
                         f"(a cache serves one batch size); {hint}.")


def store_recurrent_state(cache: Cache, layer_idx: int, state: torch.Tensor, slot: int = 0) -> None:
    """Store ``state`` (the slot's shape and dtype) in recurrent slot ``slot`` of block ``layer_idx``, detached: in
    place with gradients off, else the slot is rebound (docs/design.md §5, "Backpropagating through a cache")."""
    layer = cache.layers[layer_idx]
    if torch.is_grad_enabled() and layer.is_recurrent_states_initialized[slot]:
        layer.recurrent_states[slot] = state.detach()
    else:  # gradients off, or an empty slot (nothing saved it): transformers' in-place copy
        cache.update_recurrent_state(state.detach(), layer_idx, state_idx=slot)


def store_conv_inputs(cache: Cache, layer_idx: int, inputs: torch.Tensor, conv_kernel_size: int) -> None:
    """Append ``inputs`` ``(batch, channels, seq_len)`` (the window's dtype), detached, to the conv window of block
    ``layer_idx``, keeping the last ``conv_kernel_size`` (with gradients on, in a copy of the window); a recording
    :class:`DenseSSMCache` keeps the window before and ``inputs`` for ``crop`` (docs/design.md §5)."""
    layer, window, inputs = cache.layers[layer_idx], cache_state(cache, layer_idx, "conv"), inputs.detach()
    if window is not None and torch.is_grad_enabled():
        layer.conv_states[0] = window = window.clone()
    recording = isinstance(cache, DenseSSMCache) and cache.recording
    if recording or window is None or not layer.has_previous_state[0]:
        window = inputs.new_zeros(*inputs.shape[:-1], conv_kernel_size) if window is None else window
        inputs = torch.cat([window, inputs], dim=-1)
        if recording:  # what `crop` reads the window back from
            cache._pending.setdefault(layer_idx, {})["window"] = inputs
        inputs = inputs[..., -conv_kernel_size:]
    cache.update_conv_state(inputs, layer_idx, conv_kernel_size=conv_kernel_size)


def cache_state(cache: Cache | None, layer_idx: int, kind: str = "recurrent", slot: int = 0) -> torch.Tensor | None:
    """The ``kind`` state (``"recurrent"``, or ``"conv"``: the window ``(batch, channels, conv_kernel)``) in ``slot``
    of block ``layer_idx``, or ``None`` (no cache, or before the first update)."""
    if cache is None:
        return None
    layer = cache.layers[layer_idx]
    return getattr(layer, f"{kind}_states")[slot] if getattr(layer, f"is_{kind}_states_initialized")[slot] else None
