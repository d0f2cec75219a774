"""The classes every DenseSSM family subclasses (docs/design.md §1, §5; docs/contributing.md, "Adding a family"): the
pre-trained base, the backbone, the causal-LM head with its generation glue, the classification head, the RMSNorm."""

from __future__ import annotations

import torch
from torch import nn
from transformers import CompileConfig, GenerationMixin, PreTrainedModel
from transformers.generation import GenerationMode
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import can_return_tuple, logging

from ..ops.dispatch import use_backend
from .cache import DenseSSMCache, check_cache
from .cache_names import CACHE_FIELDS, CACHE_RENAMED, generate_keyword, model_output, output_cache, takes_cache
from .dense_connection import run_dense_layers
from .inputs import check_inputs, check_logits_to_keep, packed_document_starts, prepare_attention_mask
from .save_check import load_one_save

try:  # the publishing code, not shipped with remote code (docs/design.md §8)
    from .. import hub
except ImportError:
    hub = None


logger = logging.get_logger(__name__)


class DenseSSMRMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, Eq. 4), as ``LlamaRMSNorm``: ``weight * x / sqrt(mean(x^2)
    + eps)`` over the last dimension in float32 (float64 for float64 inputs), ``(..., hidden_size)`` in and out;
    ``num_groups > 1`` normalizes each equal slice alone with one shared ``weight`` ``(hidden_size // num_groups,)``
    (DenseRetNet's group norm, §3). Raises ``ValueError`` if ``num_groups`` does not divide ``hidden_size``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, num_groups: int = 1):
        super().__init__()
        if num_groups < 1 or hidden_size % num_groups:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_groups ({num_groups}).")
        self.weight = nn.Parameter(torch.ones(hidden_size // num_groups))
        self.variance_epsilon = eps
        self.num_groups = num_groups

    def forward(self, hidden_states: torch.Tensor, eps_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``eps_scale``: optional positive factor on ``eps`` per group, broadcastable to ``(..., num_groups, 1)``
        (DenseRetNet's retention normalization, docs/design.md §3)."""
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.promote_types(input_dtype, torch.float32)).unflatten(-1, (self.num_groups, -1))
        eps = self.variance_epsilon if eps_scale is None else self.variance_epsilon * eps_scale
        return (self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(input_dtype)).flatten(-2)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0] * self.num_groups}, eps={self.variance_epsilon}, num_groups={self.num_groups}"


class DenseSSMPreTrainedModel(PreTrainedModel):
    """Base of every DenseSSM model: transformers' flags, the cache's ``old_cache_names`` (``generate()``'s keyword
    before 5.24 is the first), ``save_pretrained`` / ``push_to_hub`` through :mod:`hf_densessm.hub` (transformers' own
    in remote code; docs/design.md §8), ``from_pretrained`` of one whole save (:func:`~.save_check.load_one_save`)."""

    supports_gradient_checkpointing = True
    _is_stateful = True
    old_cache_names: tuple[str, ...] = ("past_key_values",)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' ``from_pretrained``; ``MixedSaveError`` (an ``OSError``) for a folder mixing two saves."""
        load, path = super().from_pretrained, pretrained_model_name_or_path
        return load_one_save(lambda: load(path, *args, **kwargs), path, kwargs)

    def save_pretrained(self, *args, **kwargs):
        return super().save_pretrained(*args, **kwargs) if hub is None else hub.save_pretrained(self, *args, **kwargs)

    def push_to_hub(self, *args, **kwargs):
        return super().push_to_hub(*args, **kwargs) if hub is None else hub.push_to_hub(self, *args, **kwargs)


class DenseSSMModel(DenseSSMPreTrainedModel):
    """A family's backbone: input embeddings (``get_input_embeddings``), ``layers``, the final norm (attribute
    :attr:`final_norm_name`); returns :attr:`output_class`."""

    output_class: type = BaseModelOutputWithPast
    final_norm_name: str = "norm"

    def layer_inputs(self, embeds, cache, attention_mask, reset) -> dict:
        """The family's hook: extra keyword arguments, the same for every block of one forward (none here)."""
        return {}

    @takes_cache
    @can_return_tuple
    def forward(
        self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None, cache=None, use_cache: bool | None = None,
        output_hidden_states: bool | None = None, **kwargs,
    ):
        r"""
        Args:
            input_ids: ``(batch, seq_len)`` token ids; or ``inputs_embeds`` ``(batch, seq_len, hidden_size)``.
            attention_mask: ``(batch, seq_len)`` or ``(batch, cached + seq_len)``, 0 for padding (pad on the left).
            cache: a cache from a previous call, continued by the tokens given; also taken as ``past_key_values`` or
                ``cache_params`` (docs/design.md §5).
            use_cache: return the cache (default ``config.use_cache``, off in training).
            output_hidden_states: also return the ``num_hidden_layers + 1`` block inputs and the normed output.
            kwargs: transformers' packed-document inputs (``cu_seq_lens_q``, ``seq_idx``, ``position_ids``).

        Returns:
            :attr:`output_class` (``last_hidden_state`` ``(batch, seq_len, hidden_size)``, ``hidden_states``, the cache
            under the installed release's name), or its tuple.

        Raises:
            ValueError, TypeError: bad inputs (docs/errors.md; :mod:`.inputs`, :func:`~.cache.check_cache`).
        """
        config = self.config
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        check_inputs(input_ids, inputs_embeds, config.hidden_size, config.vocab_size, cached=cache is not None)
        embeds = self.get_input_embeddings()(input_ids) if inputs_embeds is None else inputs_embeds.to(self.dtype)
        batch, seq_len = embeds.shape[:2]
        decoding = cache is not None and seq_len == 1
        reset = packed_document_starts(batch, seq_len, embeds.device, cache is not None or bool(use_cache), **kwargs)
        if use_cache is None:
            use_cache = config.use_cache and not self.training and reset is None
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and use_cache:
            logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing; setting "
                                "`use_cache=False`.")
            use_cache = False
        if not use_cache:
            cache = None
        elif cache is None:
            cache = DenseSSMCache(config=config)
        else:
            check_cache(cache, config, batch)
        attention_mask = prepare_attention_mask(attention_mask, batch, seq_len, decoding=decoding)
        if reset is not None and attention_mask is not None:
            raise ValueError("Packed documents need no padding: give no `attention_mask` with zeros alongside them.")
        if attention_mask is not None:  # padding enters the blocks as zeros, whatever it held (docs/design.md §5)
            embeds = torch.where(attention_mask[..., None].bool(), embeds, 0)
        with use_backend(config.kernel_backend):  # the one place the ops' backend is read (docs/kernels.md)
            hidden_states, all_hidden_states = run_dense_layers(  # fewer layers in early-exit assistant drafts
                self.layers[: config.num_hidden_layers], embeds, config, output_hidden_states, cache=cache,
                attention_mask=attention_mask, reset=reset, **self.layer_inputs(embeds, cache, attention_mask, reset),
            )
        if isinstance(cache, DenseSSMCache):
            cache.record_tokens(embeds, attention_mask)
        hidden_states = getattr(self, self.final_norm_name)(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return model_output(self.output_class, cache, last_hidden_state=hidden_states, hidden_states=all_hidden_states)


class DenseSSMForCausalLM(DenseSSMPreTrainedModel, GenerationMixin):
    """A family's backbone (:attr:`backbone_class`, at ``base_model_prefix``) with ``lm_head``; returns
    :attr:`output_class` (``generate()``'s cache and compiled decoding: docs/design.md §5)."""

    backbone_class: type = None
    output_class: type = CausalLMOutputWithPast
    _is_stateful = False  # transformers' flag that refuses speculative decoding: the cache's `crop` rolls back

    def __init__(self, config):
        super().__init__(config)
        setattr(self, self.base_model_prefix, self.backbone_class(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @takes_cache
    @can_return_tuple
    def forward(
        self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None, cache=None, labels: torch.LongTensor | None = None,
        use_cache: bool | None = None, output_hidden_states: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        r"""
        Args:
            labels: ``(batch, seq_len)``, shifted inside, -100 ignored (transformers' ``self.loss_function``).
            logits_to_keep: an int ``n >= 0`` keeps the last ``n`` positions (0: all), a 1-D integer tensor those.
            others: as the backbone's ``forward``.

        Returns:
            :attr:`output_class`: ``loss`` (given ``labels``), ``logits`` ``(batch, kept_positions, vocab_size)``
            float32 (float64 for a float64 model), ``hidden_states``, the cache; or its tuple.

        Raises:
            ValueError, TypeError: bad inputs (docs/errors.md).
        """
        outputs = self.base_model(input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, cache=cache,
                                  use_cache=use_cache, output_hidden_states=output_hidden_states, return_dict=True,
                                  **kwargs)
        kept = check_logits_to_keep(logits_to_keep, outputs.last_hidden_state.shape[1])
        logits = self.lm_head(outputs.last_hidden_state[:, kept, :].to(self.lm_head.weight.dtype))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=self.config.vocab_size, **kwargs)
        return model_output(self.output_class, output_cache(outputs), loss=loss, logits=logits,
                            hidden_states=outputs.hidden_states)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        """transformers' hook: a new ``DenseSSMCache`` under the release's cache name unless one was passed or
        ``use_cache=False``; it records for ``crop`` only in an assistant's ``generate()`` (docs/design.md §5)."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)
        if generation_config.use_cache is False:
            return
        cache = next((model_kwargs[name] for name in CACHE_FIELDS if model_kwargs.get(name) is not None), None)
        if cache is None:
            cache = model_kwargs[generate_keyword(self.old_cache_names)] = DenseSSMCache(config=self.config)
        if generation_mode == GenerationMode.ASSISTED_GENERATION and not CACHE_RENAMED:  # 5.17-5.23 know only this
            for name in CACHE_FIELDS:
                model_kwargs.pop(name, None)
            model_kwargs["past_key_values"] = cache
        if isinstance(cache, DenseSSMCache):  # recording only as an assistant
            (cache.activate_past_recording if generation_config.is_assistant else cache.stop_recording)()

    def compile_decode_step(self, enable: bool = True):
        """Compile ``generate()``'s decoding steps on every device (``generation_config.compile_config =
        CompileConfig(fullgraph=True)``; ``enable=False``: ``None``); returns the model. ``TypeError``: not a bool."""
        if not isinstance(enable, bool):
            raise TypeError(f"`enable` must be a bool, got {enable!r} ({type(enable).__name__}).")
        self.generation_config.compile_config = CompileConfig(fullgraph=True) if enable else None
        if enable:  # transformers' switch for devices other than CUDA
            self.generation_config.compile_config._compile_all_devices = True
        return self

    @takes_cache
    def prepare_inputs_for_generation(
        self, input_ids, attention_mask=None, inputs_embeds=None, cache=None, next_sequence_length=None,
        is_first_iteration=False, **kwargs,
    ):
        """As transformers' default, except: the padding mask is cut to the fed tokens' columns (a fresh tensor); a
        ``cache`` of ``p`` positions continues with ``input_ids[:, p:]`` when no ``next_sequence_length`` is given;
        the cache goes to ``forward`` as ``cache`` (docs/design.md §5, "Continuing a cache"). ``ValueError`` at the
        first step for a ``cache`` holding as many positions as the prompt or more."""
        if cache is not None and (is_first_iteration or next_sequence_length is None):
            seen = cache.get_seq_length()
            length = (inputs_embeds if inputs_embeds is not None else input_ids).shape[1]
            if is_first_iteration and seen and seen >= length:
                raise ValueError(f"The `cache` passed to generate() holds {seen} positions, but the prompt has "
                                 f"{length}: a cache continues the prompt its positions came from, so give that "
                                 "prompt plus at least one new token (e.g. the `sequences` returned with the cache), "
                                 "or leave the cache out.")
            if next_sequence_length is None and seen > 0:
                next_sequence_length = length - seen
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, attention_mask=None, inputs_embeds=inputs_embeds, next_sequence_length=next_sequence_length,
            is_first_iteration=is_first_iteration, **kwargs,
        )
        if cache is not None:
            model_inputs["cache"] = cache
        fed = model_inputs["input_ids"] if model_inputs.get("input_ids") is not None else model_inputs["inputs_embeds"]
        if attention_mask is not None:  # a fresh tensor: a view's strides change per step and recompile
            attention_mask = attention_mask[:, -fed.shape[1] :].clone(memory_format=torch.contiguous_format)
        model_inputs["attention_mask"] = attention_mask
        return model_inputs


class DenseSSMForSequenceClassification(DenseSSMPreTrainedModel):
    """A family's backbone (:attr:`backbone_class`) with a bias-free ``score: hidden_size -> num_labels`` at the last
    non-padding token (transformers' ``GenericForSequenceClassification.forward``): ``(batch, num_labels)`` logits."""

    backbone_class: type = None
    forward = GenericForSequenceClassification.forward

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        setattr(self, self.base_model_prefix, self.backbone_class(config))
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
