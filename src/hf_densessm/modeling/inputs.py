"""The checks of a model's inputs at ``forward`` entry (docs/errors.md), values through
:func:`~hf_densessm.ops.backend.require` (docs/design.md §6): token ids or embeddings, padding, packing, logits kept."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.backend import require, tracing


def check_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, hidden_size: int, vocab_size: int,
                 cached: bool = False) -> None:
    """Check the model's token inputs (``cached``: over a cache; a one-token step's id check makes no host sync).
    ``ValueError``: both or neither given; ``input_ids`` not ``(batch, seq_len)`` or ``inputs_embeds`` not ``(batch,
    seq_len, hidden_size)``, with ``batch, seq_len >= 1``; an id outside ``[0, vocab_size)``. ``TypeError``:
    ``input_ids`` not an int64 / int32 tensor, ``inputs_embeds`` not a floating-point tensor."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of `input_ids` or `inputs_embeds`.")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise TypeError(f"`input_ids` must be an int64 or int32 tensor, got {got}.")
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError("`input_ids` must have shape (batch, sequence_length) with batch >= 1 and sequence_length "
                             f">= 1, got {tuple(input_ids.shape)}.")
        require(
            ((input_ids >= 0) & (input_ids < vocab_size)).all(),
            f"`input_ids` must hold token ids in [0, vocab_size) = [0, {vocab_size}): was the text tokenized with this "
            "model's tokenizer?", host_read=not (cached and input_ids.shape[1] == 1),
        )
    elif not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.dtype.is_floating_point:
        got = inputs_embeds.dtype if isinstance(inputs_embeds, torch.Tensor) else type(inputs_embeds).__name__
        raise TypeError(f"`inputs_embeds` must be a floating-point tensor, got {got}.")
    elif inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size or 0 in inputs_embeds.shape[:2]:
        raise ValueError(f"`inputs_embeds` must have shape (batch, sequence_length, {hidden_size}) with batch >= 1 and "
                         f"sequence_length >= 1, got {tuple(inputs_embeds.shape)}.")


def prepare_attention_mask(attention_mask: torch.Tensor | None, batch: int, seq_len: int,
                           decoding: bool = False) -> torch.Tensor | None:
    """The last ``seq_len`` columns of ``attention_mask`` (``(batch, past + seq_len)``, 0 for padding); ``None`` when
    nothing is padded and that can be read without a host sync (not while tracing, nor ``decoding`` off the CPU).
    ``TypeError``: not a tensor; ``ValueError``: not 2-D, another batch, shorter than the input, values not 0 and 1."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"`attention_mask` must be a tensor of 0 and 1, got {type(attention_mask).__name__}.")
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < seq_len:
        raise ValueError(f"`attention_mask` must have shape (batch, sequence_length) = ({batch}, >= {seq_len}) with 1 "
                         f"for tokens and 0 for padding, got {tuple(attention_mask.shape)}.")
    attention_mask = attention_mask[:, -seq_len:]
    if attention_mask.dtype != torch.bool:
        require(((attention_mask == 0) | (attention_mask == 1)).all(),
                "`attention_mask` must hold only 0 (padding) and 1 (token).", host_read=not decoding)
    device = attention_mask.device
    kept = tracing(device) or (decoding and device.type != "cpu") or not bool(attention_mask.all())
    return attention_mask if kept else None


def packed_document_starts(batch: int, seq_len: int, device: torch.device, keeps_cache: bool = False,
                           cu_seq_lens_q: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
                           position_ids: torch.Tensor | None = None, **others) -> torch.Tensor | None:
    """The ``(batch, seq_len)`` bool ``reset`` of packed documents (True at each document's first token), or ``None``
    for one document per row (while tracing: none given), from transformers' padding-free inputs (integer tensors):
    ``cu_seq_lens_q`` ``(num_docs + 1,)`` (batch 1), ``seq_idx`` ``(batch, seq_len)``, ``position_ids``
    ``(batch, seq_len)`` or ``(seq_len,)``. A call that ``keeps_cache`` must hold one document per row.
    ``TypeError``: a non-integer tensor; ``ValueError``: a bad shape, lengths not rising strictly from 0 to ``seq_len``,
    a decreasing ``seq_idx``, ``position_ids`` that neither restart at 0 nor rise by 1, inputs that disagree, or
    several documents in a row that ``keeps_cache``."""
    starts = {}
    if cu_seq_lens_q is not None:
        cu = _integer_tensor("cu_seq_lens_q", cu_seq_lens_q).to(device)
        if cu.dim() != 1 or batch != 1 or cu.numel() < 2:
            raise ValueError(f"`cu_seq_lens_q` must be 1-D (num_docs + 1,) with batch size 1 (a flattened batch), got "
                             f"shape {tuple(cu.shape)} with batch {batch}.")
        require((cu[0] == 0) & (cu[-1] == seq_len) & (cu[1:] > cu[:-1]).all(), "`cu_seq_lens_q` must rise strictly "
                f"from 0 to the sequence length {seq_len} (no empty document).")
        reset = torch.zeros(1, seq_len, dtype=torch.bool, device=device)
        reset[0, cu[:-1].long().clamp(0, seq_len - 1)] = True
        starts["cu_seq_lens_q"] = reset
    if seq_idx is not None:
        ids = _integer_tensor("seq_idx", seq_idx).to(device)
        if tuple(ids.shape) != (batch, seq_len):
            raise ValueError(f"`seq_idx` must have shape (batch, sequence_length) = {(batch, seq_len)}, got "
                             f"{tuple(ids.shape)}.")
        step = ids[:, 1:] - ids[:, :-1]
        require((step >= 0).all(), "`seq_idx` must not decrease along a row (one index per packed document).")
        starts["seq_idx"] = F.pad(step != 0, (1, 0), value=True)
    if position_ids is not None:
        pos = _integer_tensor("position_ids", position_ids).to(device)
        if pos.dim() == 1:
            pos = pos[None].expand(batch, -1)
        if tuple(pos.shape) != (batch, seq_len):
            raise ValueError(f"`position_ids` must have shape (batch, sequence_length) = {(batch, seq_len)}, got "
                             f"{tuple(pos.shape)}.")
        restart = pos == 0
        rises = restart[:, 1:] | (pos[:, 1:] == pos[:, :-1] + 1)
        require(~restart[:, 1:].any() | (restart[:, 0].all() & rises.all()), "`position_ids` of packed documents "
                "must start at 0 and, inside a document, rise by 1 (they restart at 0 where a document starts).")
        starts["position_ids"] = restart
    if not starts:
        return None
    (first, reset), *others_given = starts.items()
    for name, other in others_given:
        require((other == reset).all(), f"`{first}` and `{name}` describe different document boundaries.")
    if keeps_cache:  # one document per row: the cache continues it
        require(~reset[:, 1:].any(), "Packed documents (`cu_seq_lens_q`, `seq_idx` or restarting `position_ids`) are "
                "for training and scoring, not for decoding: give no `cache` and leave `use_cache` unset or False.")
        return None
    return reset if tracing(device) or bool(reset[:, 1:].any()) else None


def _integer_tensor(name: str, value) -> torch.Tensor:
    """``value`` if it is an integer tensor, else a ``TypeError`` naming ``name``."""
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"`{name}` must be an integer tensor, got {got}.")
    return value


def check_logits_to_keep(logits_to_keep, seq_len: int):
    """The index of the kept positions: an ``int >= 0`` keeps the last that many (0: all), a 1-D integer tensor those.
    ``TypeError``: a ``bool``, a float, or a non-integer tensor; ``ValueError``: a negative int, a tensor that is not
    1-D, or an index outside ``[-seq_len, seq_len)``."""
    if isinstance(logits_to_keep, torch.Tensor):
        if _integer_tensor("logits_to_keep", logits_to_keep).dim() != 1:
            shape = tuple(logits_to_keep.shape)
            raise ValueError(f"`logits_to_keep` as a tensor must be 1-D (positions to keep), got shape {shape}.")
        require(((logits_to_keep >= -seq_len) & (logits_to_keep < seq_len)).all(),
                f"`logits_to_keep` holds positions outside [-{seq_len}, {seq_len}).")
        return logits_to_keep
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise TypeError(f"`logits_to_keep` must be an int >= 0 or a 1-D integer tensor, got {logits_to_keep!r} "
                        f"({type(logits_to_keep).__name__}).")
    if logits_to_keep < 0:
        raise ValueError(f"`logits_to_keep` must be >= 0 (0 keeps every position), got {logits_to_keep}.")
    return slice(-logits_to_keep, None) if logits_to_keep else slice(None)
