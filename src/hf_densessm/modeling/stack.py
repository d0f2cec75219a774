"""What DenseMamba and DenseRetNet share above the block: input checks, the densely connected layer stack,
the causal-LM head and the generation glue. Written once, used by both families.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import check_cache, new_cache, record_tokens
from .dense import dense_predecessor_count


def check_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, hidden_size: int) -> None:
    """Check the model's token inputs at ``forward`` entry.

    Raises:
        ValueError: both or neither of ``input_ids`` and ``inputs_embeds`` are given, ``input_ids`` is not
            ``(batch, sequence_length)`` or is empty, or ``inputs_embeds`` is not ``(batch, sequence_length, hidden_size)``.
        TypeError: ``input_ids`` is not an integer tensor.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of `input_ids` or `inputs_embeds`.")
    if input_ids is not None:
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise TypeError(f"`input_ids` must be an integer tensor, got dtype {input_ids.dtype}.")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"`input_ids` must have shape (batch, sequence_length) with sequence_length >= 1, got {tuple(input_ids.shape)}."
            )
    elif inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size or inputs_embeds.shape[1] == 0:
        raise ValueError(
            f"`inputs_embeds` must have shape (batch, sequence_length, {hidden_size}), got {tuple(inputs_embeds.shape)}."
        )


def prepare_attention_mask(attention_mask: torch.Tensor | None, batch: int, seq_len: int) -> torch.Tensor | None:
    """Return the ``(batch, seq_len)`` 0/1 mask of the current tokens, or ``None`` when nothing is padded.

    ``attention_mask`` may also cover earlier (cached) tokens, as ``generate()`` passes it: ``(batch, past + seq_len)``;
    only its last ``seq_len`` columns are used. 0 marks padding, which never enters a recurrent state.

    Raises:
        ValueError: ``attention_mask`` is not 2-D, its batch differs, or it is shorter than the input.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < seq_len:
        raise ValueError(
            f"`attention_mask` must have shape (batch, sequence_length) = ({batch}, >= {seq_len}) with 1 for tokens "
            f"and 0 for padding, got {tuple(attention_mask.shape)}."
        )
    attention_mask = attention_mask[:, -seq_len:]
    if bool(attention_mask.all()):
        return None
    return attention_mask


def run_dense_stack(
    layers: nn.ModuleList,
    hidden_states: torch.Tensor,
    config,
    output_hidden_states: bool,
    **layer_kwargs,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Run the blocks with the dense connection (paper Eq. 10-11): block ``l`` receives the pre-fusion features
    of its ``min(l, m)`` predecessors (nearest first), flattened into positional tensors so that gradient
    checkpointing (reentrant or not) carries their gradients. Only the last ``m`` layers' features are kept.

    Each block is called ``block(hidden_states, *dense_inputs, **layer_kwargs)`` and returns the flat tuple
    ``(hidden_states, *features)`` (flat, so that a reentrant checkpoint tracks every tensor it returns).

    Returns the last block's output ``(batch, seq_len, hidden_size)`` and, if ``output_hidden_states``, the input
    of every block (the embeddings first), without the final norm (the caller appends the normed output).
    """
    m = config.dense_layers
    history: list[tuple[torch.Tensor, ...]] = []
    all_hidden_states = () if output_hidden_states else None
    for layer_idx, block in enumerate(layers):
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        n = dense_predecessor_count(layer_idx, m, config.dense_every)
        dense_inputs = [t for j in range(1, n + 1) for t in history[-j]]
        hidden_states, *features = block(hidden_states, *dense_inputs, **layer_kwargs)
        if m:
            history.append(tuple(features))
            if len(history) > m:
                history.pop(0)
    return hidden_states, all_hidden_states


def run_backbone(
    model,
    embeddings: nn.Embedding,
    final_norm: nn.Module,
    cache_arg_name: str,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    cache,
    use_cache: bool | None,
    output_hidden_states: bool | None,
    attention_mask: torch.Tensor | None,
):
    """The body of a DenseSSM backbone's ``forward``, shared by both families: check the inputs, embed, set up
    the cache (a new :class:`~hf_densessm.modeling.cache.DenseSSMCache` when ``use_cache`` and none is given),
    run the densely connected blocks (``model.layers``), count the tokens on the cache, apply the final norm.

    The blocks take the cache under ``cache_arg_name`` (``"cache_params"`` or ``"past_key_values"``).

    Returns:
        ``(last_hidden_state (batch, seq_len, hidden_size), cache or None, hidden_states or None)``; the
        ``hidden_states`` tuple has ``num_hidden_layers + 1`` entries (block inputs, then the normed output).

    Raises:
        ValueError, TypeError: bad inputs (see :func:`check_inputs`, :func:`prepare_attention_mask`,
            :func:`~hf_densessm.modeling.cache.check_cache`).
    """
    config = model.config
    if output_hidden_states is None:
        output_hidden_states = config.output_hidden_states
    if use_cache is None:
        use_cache = config.use_cache and not model.training
    check_inputs(input_ids, inputs_embeds, config.hidden_size)
    if inputs_embeds is None:
        inputs_embeds = embeddings(input_ids)
    if model.gradient_checkpointing and model.training:
        use_cache = False
    if cache is not None:
        check_cache(cache, config, cache_arg_name)
    elif use_cache:
        cache = new_cache(config)
    if not use_cache:
        cache = None
    batch, seq_len = inputs_embeds.shape[:2]
    attention_mask = prepare_attention_mask(attention_mask, batch, seq_len)
    hidden_states, all_hidden_states = run_dense_stack(
        model.layers,
        inputs_embeds,
        config,
        output_hidden_states,
        **{cache_arg_name: cache, "attention_mask": attention_mask},
    )
    record_tokens(cache, seq_len)
    hidden_states = final_norm(hidden_states)
    if output_hidden_states:
        all_hidden_states += (hidden_states,)
    return hidden_states, cache, all_hidden_states


def group_dense_inputs(dense_inputs: tuple[torch.Tensor, ...], per_layer: int) -> list[tuple[torch.Tensor, ...]]:
    """Undo :func:`run_dense_stack`'s flattening: ``per_layer`` tensors per predecessor, nearest first."""
    return [tuple(dense_inputs[i : i + per_layer]) for i in range(0, len(dense_inputs), per_layer)]


class DenseSSMCausalLMMixin:
    """The causal-LM head's forward logic and generation glue shared by both families.

    A subclass has ``self.lm_head`` and ``self.config``, and sets ``_cache_arg_name`` to the keyword under which
    ``generate()`` passes the cache (``"cache_params"`` for Mamba-named classes, ``"past_key_values"`` otherwise).
    """

    _cache_arg_name = "past_key_values"

    def _logits_and_loss(
        self,
        hidden_states: torch.Tensor,
        labels: torch.Tensor | None,
        logits_to_keep: int | torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Logits ``(batch, kept_positions, vocab_size)`` in float32 and the next-token loss (labels are shifted
        inside; -100 is ignored). ``logits_to_keep``: an int keeps the last that many positions (0 keeps all), a
        1-D tensor keeps those positions."""
        if isinstance(logits_to_keep, int):
            if logits_to_keep < 0:
                raise ValueError(f"`logits_to_keep` must be >= 0 (0 keeps every position), got {logits_to_keep}.")
            kept = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        else:
            kept = logits_to_keep
        logits = self.lm_head(hidden_states[:, kept, :].to(self.lm_head.weight.dtype)).float()
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return loss, logits

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """As transformers' default, but the 2-D padding mask is passed through as is: the recurrent blocks read
        it directly (its last ``sequence_length`` columns), and never need a 4-D attention mask."""
        cache = kwargs.pop("past_key_values", None)  # keeps transformers from building 4-D masks for it
        model_inputs = super().prepare_inputs_for_generation(input_ids, attention_mask=None, **kwargs)
        if cache is not None:
            model_inputs["past_key_values"] = cache
        model_inputs["attention_mask"] = attention_mask
        return model_inputs
