"""What DenseMamba and DenseRetNet share above the block: input checks, the backbone's forward body, the causal-LM
head, generation glue, ``save_pretrained`` / ``push_to_hub`` and the classification head (docs/design.md §1, §5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import CompileConfig
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.utils import logging

from .cache import CACHE_FIELDS, CACHE_RENAMED, check_cache, model_output, new_cache, output_cache, record_tokens, takes_cache
from .dense_connection import run_dense_layers


logger = logging.get_logger(__name__)

_ID_DTYPES = (torch.int64, torch.int32)


def check_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, hidden_size: int) -> None:
    """Check the model's token inputs at ``forward`` entry.

    Raises:
        ValueError: both or neither given; ``input_ids`` not ``(batch, seq_len)`` or ``inputs_embeds`` not
            ``(batch, seq_len, hidden_size)``, with ``batch, seq_len >= 1``.
        TypeError: ``input_ids`` not an int64 / int32 tensor, ``inputs_embeds`` not a floating-point tensor.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of `input_ids` or `inputs_embeds`.")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in _ID_DTYPES:
            got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise TypeError(f"`input_ids` must be an int64 or int32 tensor, got {got}.")
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(
                "`input_ids` must have shape (batch, sequence_length) with batch >= 1 and sequence_length >= 1, "
                f"got {tuple(input_ids.shape)}."
            )
    else:
        if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.dtype.is_floating_point:
            got = inputs_embeds.dtype if isinstance(inputs_embeds, torch.Tensor) else type(inputs_embeds).__name__
            raise TypeError(f"`inputs_embeds` must be a floating-point tensor, got {got}.")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size or 0 in inputs_embeds.shape[:2]:
            raise ValueError(
                f"`inputs_embeds` must have shape (batch, sequence_length, {hidden_size}) with batch >= 1 and "
                f"sequence_length >= 1, got {tuple(inputs_embeds.shape)}."
            )


def prepare_attention_mask(attention_mask: torch.Tensor | None, batch: int, seq_len: int) -> torch.Tensor | None:
    """The last ``seq_len`` columns of ``attention_mask`` (``(batch, past + seq_len)``, 0 for padding), or ``None``
    when nothing is padded.

    Raises:
        TypeError: not a tensor.
        ValueError: not 2-D, another batch, shorter than the input, or a value other than 0 and 1.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"`attention_mask` must be a tensor of 0 and 1, got {type(attention_mask).__name__}.")
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < seq_len:
        raise ValueError(
            f"`attention_mask` must have shape (batch, sequence_length) = ({batch}, >= {seq_len}) with 1 for tokens "
            f"and 0 for padding, got {tuple(attention_mask.shape)}."
        )
    attention_mask = attention_mask[:, -seq_len:]
    if torch.compiler.is_compiling():  # no data-dependent branch in a graph: the mask is applied (all ones = none)
        return attention_mask
    if bool((attention_mask == 1).all()):  # the common case (every decoding step): one check, nothing padded
        return None
    if attention_mask.dtype != torch.bool and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("`attention_mask` must hold only 0 (padding) and 1 (token); got other values.")
    return attention_mask


PACKING_KEYS = ("cu_seq_lens_q", "seq_idx", "position_ids")


def packed_document_starts(
    batch: int,
    seq_len: int,
    device: torch.device,
    cu_seq_lens_q: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The ``(batch, seq_len)`` bool ``reset`` of packed documents (True at each document's first token) from
    transformers' padding-free inputs, or ``None`` when each row holds one document. Inputs (integer tensors, checked,
    must agree; unchecked while compiling, docs/design.md §5): ``cu_seq_lens_q`` ``(num_docs + 1,)`` cumulative
    lengths (batch 1); ``seq_idx`` ``(batch, seq_len)`` non-decreasing; ``position_ids`` ``(batch, seq_len)`` or
    ``(seq_len,)``, restarting at 0 per document and rising by 1 inside one.

    Raises:
        TypeError: a non-integer tensor.
        ValueError: a bad shape, lengths not rising strictly from 0 to ``seq_len``, a decreasing ``seq_idx``,
            ``position_ids`` that neither restart at 0 nor rise by 1, or inputs that disagree.
    """
    starts = {}
    checked = not torch.compiler.is_compiling()
    if cu_seq_lens_q is not None:
        cu = _integer_tensor("cu_seq_lens_q", cu_seq_lens_q).to(device)
        if cu.dim() != 1 or batch != 1:
            raise ValueError(
                f"`cu_seq_lens_q` must be 1-D (num_docs + 1,) with batch size 1 (a flattened batch), got shape "
                f"{tuple(cu.shape)} with batch {batch}."
            )
        if checked and (cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != seq_len or bool((cu[1:] <= cu[:-1]).any())):
            raise ValueError(
                f"`cu_seq_lens_q` must rise strictly from 0 to the sequence length {seq_len} (no empty document), "
                f"got {cu.tolist()[:16]}."
            )
        reset = torch.zeros(1, seq_len, dtype=torch.bool, device=device)
        reset[0, cu[:-1].long()] = True
        starts["cu_seq_lens_q"] = reset
    if seq_idx is not None:
        ids = _integer_tensor("seq_idx", seq_idx).to(device)
        if tuple(ids.shape) != (batch, seq_len):
            raise ValueError(f"`seq_idx` must have shape (batch, sequence_length) = {(batch, seq_len)}, got {tuple(ids.shape)}.")
        step = ids[:, 1:] - ids[:, :-1]
        if checked and bool((step < 0).any()):
            raise ValueError("`seq_idx` must not decrease along a row (one index per packed document).")
        starts["seq_idx"] = F.pad(step != 0, (1, 0), value=True)
    if position_ids is not None:
        pos = _integer_tensor("position_ids", position_ids).to(device)
        if pos.dim() == 1:
            pos = pos[None].expand(batch, -1)
        if tuple(pos.shape) != (batch, seq_len):
            raise ValueError(
                f"`position_ids` must have shape (batch, sequence_length) = {(batch, seq_len)}, got {tuple(pos.shape)}."
            )
        restart = pos == 0
        if not checked:
            starts["position_ids"] = restart
        elif bool(restart[:, 1:].any()):  # packed: positions must restart at 0 or rise by 1
            if not bool(restart[:, 0].all()) or not bool((restart[:, 1:] | (pos[:, 1:] == pos[:, :-1] + 1)).all()):
                raise ValueError(
                    "`position_ids` of packed documents must start at 0 and, inside a document, rise by 1 "
                    "(they restart at 0 where a document starts)."
                )
            starts["position_ids"] = restart
    if not starts:
        return None
    (first, reset), *others = starts.items()
    if not checked:
        return reset
    for name, other in others:
        if not torch.equal(other, reset):
            raise ValueError(f"`{first}` and `{name}` describe different document boundaries.")
    return reset if bool(reset[:, 1:].any()) else None


def _integer_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"`{name}` must be an integer tensor, got {got}.")
    return value


def run_backbone(
    model,
    embeddings: nn.Embedding,
    final_norm: nn.Module,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    cache,
    use_cache: bool | None,
    output_hidden_states: bool | None,
    attention_mask: torch.Tensor | None,
    **packing,
):
    """The body of both families' backbone ``forward``: check the inputs, embed, set up the cache, run the dense
    blocks (``model.layers``), count the tokens, apply the final norm (docs/design.md §5). ``packing``: the inputs
    of :func:`packed_document_starts` (other keys ignored), refused with a cache or with padding.

    Returns:
        ``(last_hidden_state (batch, seq_len, hidden_size), cache or None, hidden_states or None)``; the
        ``hidden_states`` tuple has ``num_hidden_layers + 1`` entries (block inputs, then the normed output).

    Raises:
        ValueError, TypeError: bad inputs (:func:`check_inputs`, :func:`prepare_attention_mask`,
            :func:`packed_document_starts`, :func:`~hf_densessm.modeling.cache.check_cache`).
    """
    config = model.config
    output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
    check_inputs(input_ids, inputs_embeds, config.hidden_size)
    if inputs_embeds is None:
        inputs_embeds = embeddings(input_ids)
    else:
        inputs_embeds = inputs_embeds.to(embeddings.weight.dtype)
    batch, seq_len = inputs_embeds.shape[:2]
    if torch.compiler.is_compiling() and (cache is not None or use_cache):
        reset = None  # a call that keeps a cache continues one document per row (checked when not compiling)
    else:
        reset = packed_document_starts(
            batch, seq_len, inputs_embeds.device, **{key: packing.get(key) for key in PACKING_KEYS}
        )
    if reset is not None and (cache is not None or use_cache):
        raise ValueError(
            "Packed documents (`cu_seq_lens_q`, `seq_idx` or restarting `position_ids`) are for training and scoring, "
            "not for decoding: give no `cache` and leave `use_cache` unset or False."
        )
    if use_cache is None:
        use_cache = config.use_cache and not model.training and reset is None
    if model.gradient_checkpointing and model.training and torch.is_grad_enabled() and use_cache:
        logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing; setting `use_cache=False`.")
        use_cache = False
    if cache is not None and use_cache:
        check_cache(cache, config, batch)
    elif use_cache:
        cache = new_cache(config)
    if not use_cache:
        cache = None
    attention_mask = prepare_attention_mask(attention_mask, batch, seq_len)
    if reset is not None and attention_mask is not None:
        raise ValueError("Packed documents need no padding: give no `attention_mask` with zeros alongside them.")
    if attention_mask is not None:  # padding enters the blocks as zeros, whatever it held (docs/design.md §5)
        inputs_embeds = torch.where(attention_mask[..., None].bool(), inputs_embeds, 0)
    hidden_states, all_hidden_states = run_dense_layers(
        model.layers, inputs_embeds, config, output_hidden_states,
        cache=cache, attention_mask=attention_mask, reset=reset,
    )
    record_tokens(cache, inputs_embeds, attention_mask)
    hidden_states = final_norm(hidden_states)
    if output_hidden_states:
        all_hidden_states += (hidden_states,)
    return hidden_states, cache, all_hidden_states


def _output(model, output_class, return_dict, cache, **fields):
    """``model_output(output_class, cache, **fields)``, or its ``to_tuple()`` (the fields not ``None``, in order) when
    ``return_dict`` (default ``config.return_dict``) is False."""
    output = model_output(output_class, cache, **fields)
    return output if (return_dict if return_dict is not None else model.config.return_dict) else output.to_tuple()


def backbone_output(model, output_class, return_dict, hidden_states, cache, all_hidden_states):
    """``output_class(last_hidden_state, hidden_states, <cache field>)``, or its tuple (:func:`_output`)."""
    return _output(
        model, output_class, return_dict, cache, last_hidden_state=hidden_states, hidden_states=all_hidden_states
    )


def check_logits_to_keep(logits_to_keep, seq_len: int):
    """The index of the kept positions: an ``int >= 0`` keeps the last that many (0: all), a 1-D integer tensor those.

    Raises:
        TypeError: a ``bool``, a float, or a tensor that is not an integer tensor.
        ValueError: a negative int, a tensor that is not 1-D, or an index outside ``[-seq_len, seq_len)``.
    """
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dtype.is_floating_point or logits_to_keep.dtype == torch.bool:
            raise TypeError(f"`logits_to_keep` as a tensor must hold integer positions, got {logits_to_keep.dtype}.")
        if logits_to_keep.dim() != 1:
            raise ValueError(
                f"`logits_to_keep` as a tensor must be 1-D (positions to keep), got shape {tuple(logits_to_keep.shape)}."
            )
        if logits_to_keep.numel() and not bool(((logits_to_keep >= -seq_len) & (logits_to_keep < seq_len)).all()):
            raise ValueError(f"`logits_to_keep` holds positions outside [-{seq_len}, {seq_len}).")
        return logits_to_keep
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise TypeError(
            f"`logits_to_keep` must be an int >= 0 or a 1-D integer tensor, got {logits_to_keep!r} "
            f"({type(logits_to_keep).__name__})."
        )
    if logits_to_keep < 0:
        raise ValueError(f"`logits_to_keep` must be >= 0 (0 keeps every position), got {logits_to_keep}.")
    return slice(-logits_to_keep, None) if logits_to_keep else slice(None)


class DenseSSMSaveMixin:
    """``save_pretrained`` / ``push_to_hub`` (transformers' arguments and returns) through :mod:`hf_densessm.hub`,
    imported lazily inside ``try`` (falling back to transformers' methods): docs/design.md §8."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        try:
            from hf_densessm.hub import save_pretrained
        except ImportError:
            return super().save_pretrained(save_directory, *args, **kwargs)
        return save_pretrained(self, save_directory, *args, **kwargs)

    def push_to_hub(self, repo_id, *args, **kwargs):
        try:
            from hf_densessm.hub import push_to_hub
        except ImportError:
            return super().push_to_hub(repo_id, *args, **kwargs)
        return push_to_hub(self, repo_id, *args, **kwargs)


class DenseSSMCausalLMMixin:
    """The causal-LM head's forward logic and the generation glue of both families (a subclass has ``lm_head`` and
    ``config``); cache and compiled decoding: docs/design.md §5."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' hook: ``generate()`` gets a new, empty ``DenseSSMCache`` under the installed release's cache
        name before the prefill, unless one was passed in or ``use_cache=False``."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if generation_config.use_cache is False or any(model_kwargs.get(name) is not None for name in CACHE_FIELDS):
            return
        # the keyword generate() keeps the cache under (docs/design.md §5, "The cache's name")
        name = "cache" if CACHE_RENAMED else "cache_params" if "mamba" in type(self).__name__.lower() else "past_key_values"
        model_kwargs[name] = new_cache(self.config)

    def compile_decode_step(self, enable: bool = True):
        """Compile ``generate()``'s one-token decoding steps on every device: ``generation_config.compile_config``
        becomes ``CompileConfig(fullgraph=True)``, allowed on every device (docs/design.md §5, "Compiled decoding");
        ``enable=False`` goes back to transformers' default (``compile_config = None``). Returns the model.

        Raises:
            TypeError: ``enable`` is not a bool.
        """
        if not isinstance(enable, bool):
            raise TypeError(f"`enable` must be a bool, got {enable!r} ({type(enable).__name__}).")
        compile_config = None
        if enable:
            compile_config = CompileConfig(fullgraph=True)
            compile_config._compile_all_devices = True  # transformers' switch for devices other than CUDA
        self.generation_config.compile_config = compile_config
        return self

    def _causal_lm_output(self, outputs, labels, logits_to_keep, return_dict, output_class, **kwargs):
        """The head's return value from the backbone's ``outputs``: ``output_class(loss, logits, hidden_states, <cache
        field>)`` or its tuple (:func:`_output`); logits ``(batch, kept_positions, vocab_size)`` float32 (float64 for a
        float64 model) at ``logits_to_keep`` (:func:`check_logits_to_keep`), loss (given ``labels``) by
        ``self.loss_function``."""
        kept = check_logits_to_keep(logits_to_keep, outputs.last_hidden_state.shape[1])
        logits = self.lm_head(outputs.last_hidden_state[:, kept, :].to(self.lm_head.weight.dtype))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return _output(
            self, output_class, return_dict, output_cache(outputs),
            loss=loss, logits=logits, hidden_states=outputs.hidden_states,
        )

    @takes_cache("past_key_values", "cache_params")
    def prepare_inputs_for_generation(
        self,
        input_ids,
        attention_mask=None,
        inputs_embeds=None,
        cache=None,
        next_sequence_length=None,
        is_first_iteration=False,
        **kwargs,
    ):
        """As transformers' default, except: the 2-D padding mask is cut to the columns of the tokens fed (a
        ``(batch, 1)`` mask per decoding step); a ``cache`` holding ``p < input_ids.shape[1]`` positions is continued
        with ``input_ids[:, p:]``; the cache goes to ``forward`` as ``cache`` (docs/design.md §5)."""
        if is_first_iteration and next_sequence_length is None and cache is not None:
            seen = cache.get_seq_length()
            length = (inputs_embeds if inputs_embeds is not None else input_ids).shape[1]
            if 0 < seen < length:
                next_sequence_length = length - seen
        model_inputs = super().prepare_inputs_for_generation(
            input_ids,
            attention_mask=None,
            inputs_embeds=inputs_embeds,
            next_sequence_length=next_sequence_length,
            is_first_iteration=is_first_iteration,
            **kwargs,
        )
        if cache is not None:
            model_inputs["cache"] = cache
        fed = model_inputs["input_ids"] if model_inputs.get("input_ids") is not None else model_inputs["inputs_embeds"]
        model_inputs["attention_mask"] = None if attention_mask is None else attention_mask[:, -fed.shape[1] :]
        return model_inputs


class DenseSSMForSequenceClassificationMixin(GenericForSequenceClassification):
    """transformers' ``GenericForSequenceClassification`` over the family's backbone, built directly (docs/design.md
    §5, "Sequence classification"). A subclass sets ``base_model_prefix`` and ``backbone_class``."""

    backbone_class: type = None

    def __init__(self, config):
        super(GenericForSequenceClassification, self).__init__(config)
        self.num_labels = config.num_labels
        setattr(self, self.base_model_prefix, self.backbone_class(config))
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
