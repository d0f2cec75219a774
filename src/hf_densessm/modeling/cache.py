"""The recurrent-state cache of both DenseSSM families: how it is built, which slot holds what, how tokens are counted.

**Built.** The cache is transformers' own ``DynamicCache(config=model.config)``: the configs declare every block a
``"linear_attention"`` layer (``config.layer_types``), so the cache holds one ``LinearAttentionLayer`` per block whose
conv and recurrent state slots have a fixed size, independent of the sequence length. The one addition is
:class:`DenseSSMCache`, a ``DynamicCache`` that also counts the tokens processed (:attr:`DenseSSMCache.positions_seen`,
because ``generate()`` asks a cache for ``get_seq_length()`` and linear-attention layers keep none; and, for
DenseRetNet, :attr:`DenseSSMCache.real_tokens_seen`, see "Tokens"). Both families build it the same way
(:func:`new_cache`): ``generate()`` gets one before its prefill, through transformers' hook
``_prepare_cache_for_generation``, so that it holds a compileable cache when it decides whether to compile the
decoding steps; a forward with ``use_cache`` and no cache creates one; a cache returned by one ``generate()`` call
continues in the next (:mod:`.modeling_densessm`).

**Slots** (:data:`CACHE_SLOTS`), one of each kind per block, each holding what its name says, one block state with the
batch first (as transformers' generic cache checks and tools read every filled slot):

=============  ===========================  ===================================================================
family         slot                         content
=============  ===========================  ===================================================================
densemamba     ``conv_states[0]``           the last ``conv_kernel`` inputs of the causal convolution,
                                            ``(batch, intermediate_size, conv_kernel)``, the model's dtype
densemamba     ``recurrent_states[0]``      the SSM state ``h``, ``(batch, intermediate_size, state_size)`` float32
denseretnet    ``recurrent_states[0]``      the retention state ``S``, ``(batch, heads, key_dim / heads,
                                            value_dim / heads)`` float32
=============  ===========================  ===================================================================

DenseRetNet has no convolution: its ``conv_states[0]`` stays empty.

**Autograd.** The cache holds values, never autograd history: a forward that continues a cache starts from its
states as constants, so its gradients reach back to the first of its own tokens (truncated backpropagation through
time: training chunk by chunk over a long text, or fine-tuning over a cached prefix, each chunk with its own
``backward()``), and a cache never keeps a graph alive. The forwards store their new states with
:func:`store_recurrent_state` and :func:`store_conv_inputs`: with gradients off (generation, decoding, scoring) in
place, as transformers' own ``update_recurrent_state`` / ``update_conv_state`` do, so that every slot keeps its address
(CUDA graphs, ``torch.compile``); with gradients on, into a new tensor that the slot is rebound to, because the states
a forward started from are saved for its backward pass (the selective scan and the chunked retention keep their
``initial_state``), and writing into them would break that backward.

**Tokens.** :attr:`DenseSSMCache.positions_seen` counts every position given to the model (padding included), which is
what ``generate()`` compares with the length of ``input_ids``. For the families in :data:`COUNTS_ROW_TOKENS`
(DenseRetNet), :attr:`DenseSSMCache.real_tokens_seen` also counts the real (non-padding) tokens of each row,
``(batch,)`` int64: they place the rotary angles and the retention normalization of later tokens, so a left-padded row
continues from its own position. These families need a :class:`DenseSSMCache` (:func:`check_cache`). The backbone
counts once per forward, after its blocks (:func:`record_tokens`; the count is advanced in place, so that it keeps its
address as the slots do). Beam search reorders the slots (transformers' ``reorder_cache``) and the per-row count
(:meth:`DenseSSMCache.reorder_cache`); ``reset()`` zeroes both counts.

**Names.** Inside this package the cache is always ``cache``. Outside, the installed transformers names it
(:func:`takes_cache`, :func:`cache_field`): from 5.24 on, ``cache`` everywhere (``forward`` keywords, model outputs,
``generate()``), the old names accepted through transformers' own ``deprecate_kwarg``; before 5.24, DenseMamba's
outputs hold it as ``cache_params`` (as ``transformers.MambaOutput``) and DenseRetNet's as ``past_key_values`` (as
``CausalLMOutputWithPast``), the names these releases use.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg

#: The names transformers has given the field of a model output that holds the cache: ``cache`` from 5.24 on; before,
#: ``past_key_values``, and ``cache_params`` in Mamba's outputs (transformers 5.17-5.23's ``ALL_CACHE_NAMES``).
CACHE_FIELDS = ("cache", "past_key_values", "cache_params")

#: Whether the installed transformers calls the cache ``cache`` (5.24 and later), read off its own output class.
CACHE_RENAMED = "cache" in CausalLMOutputWithPast.__dataclass_fields__

#: The release in which transformers drops the old keywords (what its own models pass to ``deprecate_kwarg``).
OLD_CACHE_NAMES_REMOVED_IN = "5.40.0"


def takes_cache(*old_names: str):
    """Decorate a ``forward`` (or ``prepare_inputs_for_generation``) written with a ``cache`` keyword so that it also
    takes the cache under ``old_names`` (``"past_key_values"``, ``"cache_params"``), as the installed transformers
    does:

    - transformers 5.24 and later: its own ``deprecate_kwarg(old, "5.40.0", new_name="cache")``, one per old name,
      as its Mamba and Llama models do (a ``FutureWarning`` for an old name; ``cache`` wins when both are given);
    - earlier releases, where the old names are the current ones: each is passed on as ``cache``, silently, and the
      signature lists them (``generate()`` checks its keywords against the signatures of ``forward`` and
      ``prepare_inputs_for_generation``).

    Raises:
        ValueError: (when decorating) a name in ``old_names`` that is not one of transformers' old names; (when
            called, releases before 5.24) two different objects given under two of the names, where 5.24 and later
            warn and use ``cache``, as transformers does.
    """
    for name in old_names:
        if name not in CACHE_FIELDS[1:]:
            raise ValueError(f"`old_names` must be among {CACHE_FIELDS[1:]}, got {name!r}.")

    def decorate(function):
        if CACHE_RENAMED:
            for name in old_names:
                function = deprecate_kwarg(name, OLD_CACHE_NAMES_REMOVED_IN, new_name="cache")(function)
            return function

        @functools.wraps(function)
        def with_old_names(*args, **kwargs):
            for name in old_names:
                if name not in kwargs:
                    continue
                value, current = kwargs.pop(name), kwargs.get("cache")
                if current is None:
                    kwargs["cache"] = value
                elif value is not None and value is not current:
                    raise ValueError(f"Give the cache once: `cache` and `{name}` are different objects.")
            return function(*args, **kwargs)

        signature = inspect.signature(function)
        parameters = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        parameters += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in old_names]
        parameters += [p for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        with_old_names.__signature__ = signature.replace(parameters=parameters)
        return with_old_names

    return decorate


def cache_field(output_class: type) -> str:
    """The field of ``output_class`` (a transformers ``ModelOutput`` dataclass) that holds the cache, as the installed
    transformers names it: one of :data:`CACHE_FIELDS`.

    Raises:
        TypeError: ``output_class`` declares none of them.
    """
    declared = getattr(output_class, "__dataclass_fields__", {})
    for name in CACHE_FIELDS:
        if name in declared:
            return name
    raise TypeError(f"{output_class.__name__} has no cache field (one of {CACHE_FIELDS}).")


def model_output(output_class: type, cache: Cache | None, **fields):
    """``output_class(**fields)`` with ``cache`` in its cache field (:func:`cache_field`)."""
    return output_class(**fields, **{cache_field(output_class): cache})


def output_cache(outputs) -> Cache | None:
    """The cache a model output holds (a transformers ``ModelOutput`` with a cache field, :func:`cache_field`)."""
    return getattr(outputs, cache_field(type(outputs)))


#: Which state slots each family uses, and what they hold (see the module docstring).
CACHE_SLOTS = {
    "densemamba": {"conv": (0,), "recurrent": (0,)},
    "denseretnet": {"conv": (), "recurrent": (0,)},
}

#: The families whose blocks read the real tokens each row has seen, kept on the cache
#: (:attr:`DenseSSMCache.real_tokens_seen`; module docstring, "Tokens").
COUNTS_ROW_TOKENS = frozenset({"denseretnet"})


class DenseSSMCache(DynamicCache):
    """transformers' ``DynamicCache`` (one ``LinearAttentionLayer`` per block), plus counts of the tokens seen.

    Attributes:
        model_type: the ``model_type`` of the config it was built for (``None`` without one); a model of another
            family refuses it (:func:`check_cache`).
        positions_seen: positions processed so far, padding included, a 0-dim int64 tensor on the model's device
            (``None`` before the first forward): ``generate()`` asks a cache for ``get_seq_length()`` (to slice a
            prompt that continues a cache), and transformers' linear-attention layers keep no sequence length.
        real_tokens_seen: for a family in :data:`COUNTS_ROW_TOKENS`, the real (non-padding) tokens each row has seen,
            ``(batch,)`` int64 on the model's device, ``None`` before the first forward (and for other families).

    The counts are tensors, made by the first forward and then advanced in place, so that a compiled decoding step
    neither guards on their values (no recompilation from one token to the next) nor moves them (CUDA graphs; they
    are marked as static addresses, as transformers marks the states). Every state, its reordering for beam search
    and its reset stay transformers' own; :meth:`reorder_cache` and :meth:`reset` also reorder and zero the counts.
    The models update the counts (:func:`record_tokens`).
    """

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config, **kwargs)
        self.model_type = getattr(config, "model_type", None)
        self.positions_seen: torch.Tensor | None = None
        self.real_tokens_seen: torch.Tensor | None = None

    @staticmethod
    def _new_count(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        count = torch.zeros(shape, dtype=torch.long, device=device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(count)
        return count

    def record_tokens(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Count a forward's tokens: its ``seq_len`` positions (padding included) in :attr:`positions_seen` and, for a
        family in :data:`COUNTS_ROW_TOKENS`, each row's real tokens in :attr:`real_tokens_seen` (made on the first
        call; then advanced in place).

        Args:
            inputs: the forward's ``input_ids`` ``(batch, seq_len)`` or ``inputs_embeds`` ``(batch, seq_len, hidden)``
                (only their shape and device are read).
            attention_mask: ``(batch, seq_len)`` 0/1 over these positions, or ``None`` when none is padding.
        """
        batch, count = inputs.shape[:2]
        if self.positions_seen is None:
            self.positions_seen = self._new_count((), inputs.device)
        self.positions_seen.add_(count)
        if self.model_type not in COUNTS_ROW_TOKENS:
            return
        if self.real_tokens_seen is None:
            self.real_tokens_seen = self._new_count((batch,), inputs.device)
        self.real_tokens_seen.add_(count if attention_mask is None else attention_mask.long().sum(-1))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of positions processed so far (the recurrent states do not grow with it), an ``int`` (reading it
        waits for the device)."""
        return 0 if self.positions_seen is None else int(self.positions_seen)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """transformers' reordering of every state for beam search (row ``i`` becomes row ``beam_idx[i]``), and of
        :attr:`real_tokens_seen` (in place)."""
        super().reorder_cache(beam_idx)
        if self.real_tokens_seen is not None:
            self.real_tokens_seen.copy_(self.real_tokens_seen.index_select(0, beam_idx.to(self.real_tokens_seen.device)))

    def reset(self) -> None:
        """transformers' reset (every state zeroed in place, the objects kept), and both counts back to zero."""
        super().reset()
        for count in (self.positions_seen, self.real_tokens_seen):
            if count is not None:
                count.zero_()


def new_cache(config) -> DenseSSMCache:
    """An empty cache for a DenseSSM ``config`` (states are allocated on first use)."""
    return DenseSSMCache(config=config)


def record_tokens(cache: Cache | None, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
    """Count a forward's tokens on ``cache`` if it keeps counts (a :class:`DenseSSMCache`:
    :meth:`DenseSSMCache.record_tokens`, same arguments)."""
    if isinstance(cache, DenseSSMCache):
        cache.record_tokens(inputs, attention_mask)


def _expected_shapes(config, batch: int) -> dict[tuple[str, int], tuple[int, ...]]:
    """The shape of every slot of :data:`CACHE_SLOTS` for ``config`` and ``batch`` rows."""
    if config.model_type == "densemamba":
        return {
            ("conv", 0): (batch, config.intermediate_size, config.conv_kernel),
            ("recurrent", 0): (batch, config.intermediate_size, config.state_size),
        }
    heads = config.num_attention_heads
    return {("recurrent", 0): (batch, heads, config.query_key_dim // heads, config.value_dim // heads)}


def check_cache(cache, config, batch: int) -> None:
    """Check that ``cache`` (a model's ``cache`` argument) fits a model of ``config`` given ``batch`` rows.

    It must be a transformers ``Cache`` with one linear-attention layer per block, with the state slots of the
    config's family (:data:`CACHE_SLOTS`), no other slot filled, and states (where already filled) of the shapes this
    model and batch need. A :class:`DenseSSMCache` must have been built for the config's family; a family that counts
    each row's tokens (:data:`COUNTS_ROW_TOKENS`) needs a :class:`DenseSSMCache`, whose count (once made) has one entry
    per row.

    Raises:
        TypeError: ``cache`` is not a ``Cache``, its layers are not linear-attention layers, or it is not a
            :class:`DenseSSMCache` where the family needs one (e.g. a plain ``DynamicCache`` given to DenseRetNet).
        ValueError: wrong number of layers; slots or a :attr:`DenseSSMCache.model_type` of another family (e.g. a
            DenseMamba cache given to DenseRetNet); states or counts of another batch size or width. Messages name
            ``cache`` and what was expected.
    """
    hint = (
        "leave `cache` unset (the model builds one), pass the cache a previous call returned, or build an empty one "
        "with `hf_densessm.modeling.cache.DenseSSMCache(config=model.config)`"
    )
    family = config.model_type
    if not isinstance(cache, Cache):
        raise TypeError(f"`cache` must be a transformers `Cache`, got {type(cache).__name__}; {hint}.")
    if len(cache.layers) != config.num_hidden_layers:
        raise ValueError(
            f"`cache` has {len(cache.layers)} layers but the model has {config.num_hidden_layers}; {hint}."
        )
    if not all(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers):
        raise TypeError(f"`cache` must hold linear-attention (recurrent state) layers; {hint}.")
    slots = CACHE_SLOTS[family]
    needed = max(slots["conv"] + slots["recurrent"]) + 1
    if any(layer.number_of_states != needed for layer in cache.layers):
        raise ValueError(
            f"`cache` was built for another model family ({cache.layers[0].number_of_states} state slots per "
            f"layer, a {family} model needs {needed}); {hint}."
        )
    built_for = cache.model_type if isinstance(cache, DenseSSMCache) else None
    if built_for is not None and built_for != family:
        raise ValueError(f"`cache` was built for another model family (a {built_for} model, not {family}); {hint}.")
    for layer_idx, layer in enumerate(cache.layers):
        for kind in ("conv", "recurrent"):
            filled = layer.is_conv_states_initialized if kind == "conv" else layer.is_recurrent_states_initialized
            stray = [slot for slot, is_filled in filled.items() if is_filled and slot not in slots[kind]]
            if stray:
                raise ValueError(
                    f"`cache` was built for another model family (layer {layer_idx} holds {kind} state slot "
                    f"{stray[0]}, which a {family} model never fills); {hint}."
                )
    if family in COUNTS_ROW_TOKENS and not isinstance(cache, DenseSSMCache):
        raise TypeError(
            f"`cache` must be a `DenseSSMCache` for a {family} model (it counts the real tokens of each row, which "
            f"place the rotary angles), got {type(cache).__name__}; {hint}."
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
                    f"`cache` holds a {kind} state of shape {tuple(state.shape)} in layer {layer_idx}, but this "
                    f"model with batch size {batch} needs {shape} (a cache serves one batch size); {hint}."
                )
    counts = cache.real_tokens_seen if isinstance(cache, DenseSSMCache) else None
    if counts is not None and tuple(counts.shape) != (batch,):
        raise ValueError(
            f"`cache` counts the tokens of {counts.shape[0]} rows, but this call has batch size {batch} (a cache "
            f"serves one batch size); {hint}."
        )


def is_filled(cache: Cache, model_type: str) -> bool:
    """Whether every state slot of :data:`CACHE_SLOTS` is filled in every layer of ``cache`` (a cache that passed
    :func:`check_cache`), and, for a family in :data:`COUNTS_ROW_TOKENS`, the per-row count made: what a one-token
    step that updates the cache in place needs."""
    slots = CACHE_SLOTS[model_type]
    if model_type in COUNTS_ROW_TOKENS and getattr(cache, "real_tokens_seen", None) is None:
        return False
    return all(
        all(layer.is_conv_states_initialized[i] for i in slots["conv"])
        and all(layer.is_recurrent_states_initialized[i] for i in slots["recurrent"])
        for layer in cache.layers
    )


def store_recurrent_state(cache: Cache, layer_idx: int, state: torch.Tensor, slot: int = 0) -> None:
    """Store ``state``, a block's recurrent state after a forward, in recurrent slot ``slot`` of block ``layer_idx``
    (see :data:`CACHE_SLOTS`), without its autograd history (module docstring, "Autograd").

    With gradients off it is copied into the slot (transformers' ``update_recurrent_state``: the slot is allocated on
    first use and keeps its address). With gradients on, a filled slot is rebound to ``state`` detached: the state
    the forward started from may be saved for its backward pass and is left untouched.

    Args:
        cache: a transformers ``Cache`` of linear-attention layers.
        layer_idx: the block. slot: the recurrent slot.
        state: the slot's new content, of the slot's shape and dtype (e.g. ``(batch, intermediate_size, state_size)``
            float32 for DenseMamba).
    """
    layer = cache.layers[layer_idx]
    if torch.is_grad_enabled() and layer.is_recurrent_states_initialized[slot]:
        layer.recurrent_states[slot] = state.detach()
    else:  # gradients off, or an empty slot (nothing saved it): transformers' in-place copy
        cache.update_recurrent_state(state.detach(), layer_idx, state_idx=slot)


def store_conv_inputs(cache: Cache, layer_idx: int, inputs: torch.Tensor, conv_kernel_size: int) -> None:
    """Append a forward's convolution inputs to the window of block ``layer_idx`` (conv slot 0), without their autograd
    history (module docstring, "Autograd"): transformers' ``update_conv_state``, which keeps the last
    ``conv_kernel_size`` inputs (padding with zeros on the left after a shorter first call).

    With gradients off the window is updated in place (it keeps its address). With gradients on, the slot is first
    rebound to a copy of the window, which the update then writes: the window the forward read is left untouched,
    should its backward pass need it (this package's convolutions copy it, but a kernel need not).

    Args:
        cache: a transformers ``Cache`` of linear-attention layers.
        layer_idx: the block.
        inputs: ``(batch, channels, seq_len)``, this call's inputs of the convolution, in the window's dtype.
        conv_kernel_size: the window's length.
    """
    layer = cache.layers[layer_idx]
    if torch.is_grad_enabled() and layer.is_conv_states_initialized[0]:
        layer.conv_states[0] = layer.conv_states[0].clone()
    cache.update_conv_state(inputs.detach(), layer_idx, conv_kernel_size=conv_kernel_size)


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
