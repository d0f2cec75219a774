"""DenseRetNet: RetNet-GAU with DenseSSM's dense KV connection (He et al. 2024, §3.3 "Extension to RetNet", §4.2).

Inside a block (``d`` hidden, ``d_qk`` query/key, ``d_v = v_factor * d``, ``H`` heads):
``q = SiLU(W_q x)``, ``k = SiLU(W_k x) * (d_qk/H)^-0.5``, ``[v, g] = split(SiLU(W_h x))``; in layers with
predecessors ``k' = RMSNorm(k + sum_i SiLU(G_k(x)) * k^{l-i})``, ``v' = RMSNorm(v + sum_i SiLU(G_v(x)) * v^{l-i})``
(Eq. 20-23); theta shift on ``q`` and ``k'``; retention ``o_t = q_t S_t``, ``S_t = gamma_h S_{t-1} + k'_t^T v'_t``
with ``gamma_h = 1 - 2^(-5-h)`` (Eq. 18, 19, 24); each head's output at position ``t`` divided by ``sqrt(s_t)``,
``s_t = sum_{j<=t} gamma_h^(t-j)`` (the published models' normalization, :func:`retention_row_sums`); per-head
RMSNorm with one weight shared by the heads; ``out = W_o(norm(o) * g)``; dropout.

The retention ops (``hf_densessm.ops.chunk_retention`` / ``retention_state_update``) keep fla's plain semantics; the
normalization is folded exactly into the per-head RMSNorm (``eps * s_t``), in every path (training, prefill, continued prefill, decode,
left padding: ``t`` counts real tokens, as the rotary angles do). It matters: the per-head RMSNorm is not
scale-invariant when activations are small against its eps (1e-6), as at the published init scale. The published
parallel form also divides each row of ``(q k^T) * decay`` by ``max(1, |row sum|)``; its recurrent form does not, and
neither does this implementation (docs/design.md §3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..configuration.configuration_denseretnet import DenseRetNetConfig
from ..ops.packing import document_positions
from ..ops.retention import chunk_retention, retention_state_update
from .cache import recurrent_state, store_recurrent_state, takes_cache
from .dense_connection import build_dense_connection, init_dense_linear, split_dense_inputs
from .norm import DenseSSMRMSNorm
from .modeling_densessm import (
    DenseSSMCausalLMMixin,
    DenseSSMForSequenceClassificationMixin,
    DenseSSMSaveMixin,
    backbone_output,
    run_backbone,
)


class DenseRetNetThetaShift(nn.Module):
    """RetNet's rotary "theta shift": rotate every channel pair ``(2j, 2j+1)`` of each head by ``n * theta_j``,
    ``theta_j = rope_theta^-linspace(0, 1, head_dim/2)_j``, at absolute position ``n``.

    ``forward(x, positions)``: ``x`` ``(batch, seq_len, heads, head_dim)``, ``positions`` ``(batch, seq_len)`` int64;
    returns ``x`` rotated, same shape and dtype. Only position differences matter for ``q_n . k_m``.
    """

    def __init__(self, head_dim: int, rope_theta: float):
        super().__init__()
        self.head_dim, self.rope_theta = head_dim, rope_theta
        self.register_buffer("theta", self.compute_theta(), persistent=False)

    def compute_theta(self, device=None) -> torch.Tensor:
        """The angles ``(head_dim / 2,)`` float32 (a non-persistent buffer, rebuilt by ``_init_weights`` on load)."""
        exponents = torch.linspace(0, 1, self.head_dim // 2, dtype=torch.float64, device=device)
        return (self.rope_theta**-exponents).float()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for a float64 model
        theta = self.theta.to(device=positions.device, dtype=compute)
        angles = positions.to(compute)[..., None] * theta  # (batch, seq_len, head_dim / 2)
        cos = angles.cos().repeat_interleave(2, dim=-1)[:, :, None, :]
        sin = angles.sin().repeat_interleave(2, dim=-1)[:, :, None, :]
        xf = x.to(compute)
        rotated = torch.stack((-xf[..., 1::2], xf[..., ::2]), dim=-1).flatten(-2)
        return (xf * cos + rotated * sin).to(x.dtype)


def retention_row_sums(positions: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``s_t = sum_{j<=t} gamma_h^(t-j) = (1 - gamma_h^(t+1)) / (1 - gamma_h)``, ``gamma_h = 1 - 2^(-5-h)``: the
    published retention divides each head's output at position ``t`` by ``sqrt(s_t)`` (its parallel form normalizes
    the rows of the decay mask, its recurrent form carries ``s_t = s_{t-1} gamma + 1``; docs/design.md §3).

    Args:
        positions: ``(batch, seq_len)`` int64, ``t``, the 0-based count of real tokens in the document (padding
            positions may be -1; they are treated as ``t = 0``, their output is never used).
        num_heads: ``H``. dtype: of the result (computed in float64).

    Returns:
        ``(batch, seq_len, H, 1)`` sums in ``[1, 2^(5+h))``.
    """
    heads = torch.arange(num_heads, device=positions.device, dtype=torch.float64)
    log_gamma = torch.log1p(-torch.exp2(-5.0 - heads))  # log(gamma_h), (H,)
    count = positions.clamp(min=0).to(torch.float64)[..., None] + 1  # t + 1
    return (torch.expm1(count * log_gamma) / torch.expm1(log_gamma)).to(dtype)[..., None]


class DenseRetNetRetention(nn.Module):
    """One GAU-style multi-scale retention unit with the dense KV connection (see the module docstring).

    Parameters: ``q_proj``, ``k_proj`` (``d -> d_qk``), ``hidden_proj`` (``W_h: d -> 2 d_v``), ``o_proj``
    (``W_o: d_v -> d``), ``group_norm`` (per-head RMSNorm, one ``d_v / H`` weight shared by the heads), and in layers with predecessors ``dense_k``,
    ``dense_v`` (the gates ``G_k: d -> d/32 -> d_qk``, ``G_v: d -> d/32 -> d_v``) and ``k_norm``, ``v_norm``.
    """

    def __init__(self, config: DenseRetNetConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.key_dim = config.query_key_dim
        self.value_dim = config.value_dim
        self.head_dim = self.key_dim // self.num_heads
        self.key_scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.key_dim, bias=False)
        self.hidden_proj = nn.Linear(config.hidden_size, 2 * self.value_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)
        self.group_norm = DenseSSMRMSNorm(
            self.value_dim, eps=config.rms_norm_eps, num_groups=self.num_heads
        )
        self.theta_shift = DenseRetNetThetaShift(self.head_dim, config.rope_theta)
        self.dense_k = build_dense_connection(config, layer_idx, self.key_dim)
        self.dense_v = build_dense_connection(config, layer_idx, self.value_dim)
        if self.dense_k is not None:
            self.k_norm = DenseSSMRMSNorm(self.key_dim, eps=config.rms_norm_eps)
            self.v_norm = DenseSSMRMSNorm(self.value_dim, eps=config.rms_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        dense_inputs: tuple[torch.Tensor, ...],
        cache=None,
        attention_mask: torch.Tensor | None = None,
        reset: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One token over a filled cache without gradients is a decoding step (:func:`retention_state_update`, the
        state updated in place); every other call runs the chunked retention. With gradients on, every call (one
        token included) runs the chunked retention, differentiable on every backend; a call that continues a cache
        starts from its state as a constant (truncated backpropagation, :mod:`hf_densessm.modeling.cache`,
        "Autograd").

        Args:
            hidden_states: ``(batch, seq_len, hidden_size)``, the block's normalized input ``x^l``.
            dense_inputs: the predecessors' pre-fusion ``k`` tensors then their ``v`` tensors, nearest first (see
                :mod:`hf_densessm.modeling.dense_connection`): ``(batch, seq_len, d_qk)``,
                ``(batch, seq_len, d_v)``.
            cache: a transformers ``Cache`` (see :mod:`hf_densessm.modeling.cache`) or ``None``.
            attention_mask: ``(batch, seq_len)`` 0/1 or ``None``. Padded positions get ``k = v = 0``, so they add
                nothing to the state; in a one-token step a padded row's state is left as it was.
            reset: ``(batch, seq_len)`` bool or ``None``: True at the first token of each packed document; the
                retention state, the rotary position and the normalization restart there.

        Returns:
            ``(output (batch, seq_len, hidden_size), (k, v))`` with this layer's pre-fusion ``k`` and ``v``.
        """
        batch, seq_len, _ = hidden_states.shape
        backend = self.config.kernel_backend
        q = F.silu(self.q_proj(hidden_states))
        k = F.silu(self.k_proj(hidden_states)) * self.key_scale
        v, g = F.silu(self.hidden_proj(hidden_states)).chunk(2, dim=-1)
        if attention_mask is not None:
            keep = attention_mask[..., None].to(k.dtype)
            k, v = k * keep, v * keep
        features = (k, v)
        if self.dense_k is not None:  # dense KV connection, Eq. 20-23
            dense_k, dense_v = split_dense_inputs(dense_inputs, 2)
            # under autocast the norms' float32 weights promote their outputs (q stays in the autocast dtype):
            # the retention op takes one dtype, q's
            k = self.k_norm(self.dense_k(hidden_states, k, dense_k)).to(q.dtype)
            v = self.v_norm(self.dense_v(hidden_states, v, dense_v)).to(q.dtype)

        state = recurrent_state(cache, self.layer_idx)
        seen = getattr(cache, "real_tokens_seen", None)  # real tokens per row before this call; counted after it
        offset = seen if seen is not None else torch.zeros(batch, dtype=torch.long, device=q.device)
        if reset is not None:  # packed documents (no cache, no padding): positions restart at each document
            positions = document_positions(reset)
        elif attention_mask is None:
            positions = offset[:, None] + torch.arange(seq_len, device=q.device)
        else:  # count real tokens only, so padding never moves a row's position
            positions = offset[:, None] + attention_mask.long().cumsum(-1) - 1
        q = self.theta_shift(q.view(batch, seq_len, self.num_heads, self.head_dim), positions)
        k = self.theta_shift(k.view(batch, seq_len, self.num_heads, self.head_dim), positions)
        v = v.reshape(batch, seq_len, self.num_heads, -1)

        if state is not None and seq_len == 1 and not torch.is_grad_enabled():
            # decode: S = gamma S + k^T v; o = q S (Eq. 18, 19), the state updated in place
            previous = state.clone() if attention_mask is not None else None
            o = retention_state_update(state, q[:, 0], k[:, 0], v[:, 0], scale=1.0, backend=backend)[:, None]
            if previous is not None:  # a padded row keeps its state
                state.copy_(torch.where(attention_mask[:, 0, None, None, None].bool(), state, previous))
        else:  # training / prefill, and any call with gradients on (differentiable on every backend, the cached
            # state left as it was): chunkwise form of Eq. 24, continuing from the cached state
            o, final_state = chunk_retention(
                q, k, v, scale=1.0, initial_state=state,
                output_final_state=cache is not None, backend=backend, reset=reset,
            )
            if cache is not None:
                if state is not None and seq_len == 1 and attention_mask is not None:  # as in the step above, a
                    # padded row keeps its state
                    final_state = torch.where(attention_mask[:, 0, None, None, None].bool(), final_state, state)
                store_recurrent_state(cache, self.layer_idx, final_state)

        # The published o_t / sqrt(s_t), folded exactly into the per-head RMSNorm that follows:
        # RMSNorm(o / sqrt(s)) = o / sqrt(mean(o^2) + eps * s), so no pass over o is added.
        row_sums = retention_row_sums(positions, self.num_heads, torch.promote_types(o.dtype, torch.float32))
        o = self.group_norm(o.reshape(batch, seq_len, self.value_dim), eps_scale=row_sums)
        return self.dropout(self.o_proj(o * g)), features


class DenseRetNetBlock(GradientCheckpointingLayer):
    """Pre-norm residual block ``x + self_attn(input_layernorm(x))`` (GAU-style: no separate FFN).

    ``forward(hidden_states, *dense_inputs, cache=None, attention_mask=None)``: ``dense_inputs`` are the
    predecessors' ``k`` then ``v`` tensors, nearest first. Returns the flat ``(hidden_states, k, v)``.
    """

    def __init__(self, config: DenseRetNetConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = DenseSSMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DenseRetNetRetention(config, layer_idx)

    def forward(self, hidden_states, *dense_inputs, cache=None, attention_mask=None, reset=None):
        out, features = self.self_attn(
            self.input_layernorm(hidden_states),
            dense_inputs,
            cache=cache,
            attention_mask=attention_mask,
            reset=reset,
        )
        return (hidden_states + out, *features)


class DenseRetNetPreTrainedModel(DenseSSMSaveMixin, PreTrainedModel):
    """Weight init and flags shared by the DenseRetNet models."""

    config_class = DenseRetNetConfig
    config: DenseRetNetConfig
    base_model_prefix = "model"
    _no_split_modules = ["DenseRetNetBlock"]
    supports_gradient_checkpointing = True
    _is_stateful = True

    @torch.no_grad()
    def _init_weights(self, module):
        """The init the published DenseRetNet models were trained from (docs/design.md §3): their ``post_init()``
        draws every ``Linear`` (gates and ``lm_head`` included) and the embeddings from normal(0,
        ``initializer_range`` = 0.02); norms at 1; the rotary angles; the ``"linear"`` projections and ``"concat"``
        reduction of the dense ablations as :func:`~hf_densessm.modeling.dense_connection.init_dense_linear`.
        Leaf modules only, so every parameter missing from a checkpoint is initialized; loaded ones are kept."""
        std = self.config.initializer_range
        if init_dense_linear(module, init, gate_std=std):
            return
        if isinstance(module, DenseSSMRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DenseRetNetThetaShift):
            init.copy_(module.theta, module.compute_theta(module.theta.device))
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)


class DenseRetNetModel(DenseRetNetPreTrainedModel):
    """The DenseRetNet backbone: ``embed_tokens``, ``num_hidden_layers`` :class:`DenseRetNetBlock` with the dense
    KV connection, final RMSNorm ``norm``."""


    def __init__(self, config: DenseRetNetConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DenseRetNetBlock(config, layer_idx=i) for i in range(config.num_hidden_layers))
        self.norm = DenseSSMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, new_embeddings):
        self.embed_tokens = new_embeddings

    @takes_cache("past_key_values")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> tuple | BaseModelOutputWithPast:
        r"""
        Args:
            input_ids: ``(batch, seq_len)`` token ids; or ``inputs_embeds`` ``(batch, seq_len, hidden_size)`` (exactly one).
            cache: a cache from a previous call (or an empty
                ``hf_densessm.modeling.cache.DenseSSMCache(config=model.config)``; a plain ``DynamicCache`` has nowhere
                to count each row's tokens and is refused); the tokens given continue the cached sequence, whatever
                their number (prefill in chunks works). Also taken as ``past_key_values`` (its name before
                transformers 5.24; :func:`~hf_densessm.modeling.cache.takes_cache`).
            use_cache: return the cache (default ``config.use_cache``, off in training).
            attention_mask: ``(batch, seq_len)`` or ``(batch, cached + seq_len)``, 1 for tokens and 0 for padding
                (pad on the left for batched generation).

        Returns:
            ``BaseModelOutputWithPast`` (its cache field ``cache`` from transformers 5.24, ``past_key_values``
            before) with ``hidden_states`` of ``num_hidden_layers + 1`` entries when asked.

        Raises:
            ValueError, TypeError: bad inputs (see :func:`hf_densessm.modeling.modeling_densessm.run_backbone`).
        """
        hidden_states, cache, all_hidden_states = run_backbone(
            self, self.embed_tokens, self.norm, input_ids, inputs_embeds, cache, use_cache, output_hidden_states,
            attention_mask, **kwargs,
        )
        return backbone_output(self, BaseModelOutputWithPast, return_dict, hidden_states, cache, all_hidden_states)


class DenseRetNetForCausalLM(DenseSSMCausalLMMixin, DenseRetNetPreTrainedModel, GenerationMixin):
    """DenseRetNet with an (untied by default) language-modeling head ``lm_head``."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DenseRetNetConfig):
        super().__init__(config)
        self.model = DenseRetNetModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, new_embeddings):
        return self.model.set_input_embeddings(new_embeddings)

    @takes_cache("past_key_values")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> tuple | CausalLMOutputWithPast:
        r"""
        Args:
            labels: ``(batch, seq_len)``; shifted inside (``labels = input_ids`` works), -100 is ignored.
            logits_to_keep: an int keeps the last that many positions' logits (0 keeps all); a 1-D tensor keeps
                those positions.
            others: see :meth:`DenseRetNetModel.forward`.
        """
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        return self._causal_lm_output(outputs, labels, logits_to_keep, return_dict, CausalLMOutputWithPast, **kwargs)


class DenseRetNetForSequenceClassification(DenseSSMForSequenceClassificationMixin, DenseRetNetPreTrainedModel):
    """DenseRetNet with a sequence-classification head ``score`` read at the last non-padding token (transformers'
    ``GenericForSequenceClassification`` conventions; see
    :class:`~hf_densessm.modeling.modeling_densessm.DenseSSMForSequenceClassificationMixin`). ``forward`` returns a
    ``SequenceClassifierOutputWithPast`` with ``logits`` ``(batch, num_labels)``.
    """

    base_model_prefix = "model"
    backbone_class = DenseRetNetModel


__all__ = ["DenseRetNetForCausalLM", "DenseRetNetForSequenceClassification", "DenseRetNetModel", "DenseRetNetPreTrainedModel"]
