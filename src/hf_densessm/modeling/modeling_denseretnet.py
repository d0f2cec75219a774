"""DenseRetNet: RetNet-GAU with DenseSSM's dense KV connection (He et al. 2024, §3.3 "Extension to RetNet", Eq. 18-24,
§4.2); the equations, the published retention normalization, padding and init: docs/design.md §3."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer

from ..configuration.configuration_denseretnet import DenseRetNetConfig
from ..ops.packing import document_positions
from ..ops.retention import chunk_retention, retention_state_update
from .cache import cache_state, record_states, store_recurrent_state
from .dense_connection import build_dense_connection, init_dense_linear, split_dense_inputs
from .modeling_densessm import (
    DenseSSMForCausalLM, DenseSSMForSequenceClassification, DenseSSMModel, DenseSSMPreTrainedModel, DenseSSMRMSNorm,
)


def rotary_angles(head_dim: int, rope_theta: float, device=None) -> torch.Tensor:
    """RetNet's rotary "theta shift" angles ``theta_j = rope_theta^-linspace(0, 1, head_dim/2)_j``, ``(head_dim / 2,)``
    float32 (computed in float64): channel pair ``(2j, 2j+1)`` of each head is rotated by ``n theta_j`` at position
    ``n`` (:func:`theta_shift`)."""
    return (rope_theta ** -torch.linspace(0, 1, head_dim // 2, dtype=torch.float64, device=device)).float()


def theta_shift(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(..., batch, seq_len, heads, head_dim)`` rotated by ``(cos, sin)`` of ``layer_inputs``:
    ``x * cos + swap(x) * sin``, ``swap`` exchanging the channels of each pair (the sign is in ``sin``), computed in
    their dtype; returns ``x``'s shape and dtype."""
    xf = x.to(cos.dtype)
    return (xf * cos + xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin).to(x.dtype)


def retention_row_sums(positions: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """The published per-row normalization ``s_t`` of head ``h`` (docs/design.md §3), ``(batch, seq_len, num_heads,
    1)`` ``dtype`` (computed in float64), from ``positions`` ``(batch, seq_len)`` int64 ``t`` (-1 at padding: 0)."""
    heads = torch.arange(num_heads, device=positions.device, dtype=torch.float64)
    log_gamma = torch.log1p(-torch.exp2(-5.0 - heads))  # log(gamma_h), (H,)
    count = positions.clamp(min=0).to(torch.float64)[..., None] + 1  # t + 1
    return (torch.expm1(count * log_gamma) / torch.expm1(log_gamma)).to(dtype)[..., None]


def _state_after(k, v, initial_state, n):
    """The retention state after the first ``n`` of a forward's tokens (``k``, ``v`` as the op takes them), for
    ``crop`` (:func:`~.cache.record_states`): the op's final state over them, ``k`` standing in for ``q`` (unread)."""
    return chunk_retention(k[:, :n], k[:, :n], v[:, :n], 1.0, initial_state, output_final_state=True)[1]


class DenseRetNetRetention(nn.Module):
    """One GAU-style multi-scale retention unit with the dense KV connection (docs/design.md §3): ``q_proj``,
    ``k_proj``, ``hidden_proj`` (``W_h``), ``o_proj`` (``W_o``), ``group_norm``, and in layers with predecessors
    ``dense_k``, ``dense_v``, ``k_norm``, ``v_norm``."""

    def __init__(self, config: DenseRetNetConfig, layer_idx: int):
        super().__init__()
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
        self.group_norm = DenseSSMRMSNorm(self.value_dim, eps=config.rms_norm_eps, num_groups=self.num_heads)
        self.dense_k = build_dense_connection(config, layer_idx, self.key_dim)
        self.dense_v = build_dense_connection(config, layer_idx, self.value_dim)
        if self.dense_k is not None:
            self.k_norm = DenseSSMRMSNorm(self.key_dim, eps=config.rms_norm_eps)
            self.v_norm = DenseSSMRMSNorm(self.value_dim, eps=config.rms_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self, hidden_states: torch.Tensor, dense_inputs: tuple[torch.Tensor, ...], cache=None,
        attention_mask: torch.Tensor | None = None, reset: torch.Tensor | None = None,
        *, rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """As :meth:`DenseMambaMixer.forward <hf_densessm.modeling.modeling_densemamba.DenseMambaMixer.forward>`, with
        retention (the features ``(k, v)``, pre-fusion; ``(batch, seq_len, d_qk)``, ``(batch, seq_len, d_v)``);
        ``rotary``: the forward's ``(cos, sin, row_sums)`` (:meth:`DenseRetNetModel.layer_inputs`)."""
        batch, seq_len, _ = hidden_states.shape
        q = F.silu(self.q_proj(hidden_states))
        k = F.silu(self.k_proj(hidden_states)) * self.key_scale
        v, g = F.silu(self.hidden_proj(hidden_states)).chunk(2, dim=-1)
        if attention_mask is not None:  # selected, not multiplied: 0 * NaN is NaN
            keep = attention_mask[..., None].bool()
            k, v = torch.where(keep, k, 0), torch.where(keep, v, 0)
        features = (k, v)
        if self.dense_k is not None:  # dense KV connection, Eq. 20-23
            dense_k, dense_v = split_dense_inputs(dense_inputs, 2)
            # under autocast the norms' float32 weights promote k, v; the retention op takes q's dtype
            k = self.k_norm(self.dense_k(hidden_states, k, dense_k)).to(q.dtype)
            v = self.v_norm(self.dense_v(hidden_states, v, dense_v)).to(q.dtype)

        q, k = (theta_shift(t.view(batch, seq_len, self.num_heads, self.head_dim), *rotary[:2]) for t in (q, k))
        v = v.reshape(batch, seq_len, self.num_heads, -1)
        state = cache_state(cache, self.layer_idx)
        record_states(cache, self.layer_idx, state, _state_after, k, v)

        if state is not None and seq_len == 1 and not torch.is_grad_enabled():
            # decode: S = gamma S + k^T v; o = q S (Eq. 18, 19), the state updated in place
            previous = state.clone() if attention_mask is not None else None
            o = retention_state_update(state, q[:, 0], k[:, 0], v[:, 0], scale=1.0)[:, None]
            if previous is not None:  # a padded row keeps its state
                state.copy_(torch.where(attention_mask[:, 0, None, None, None].bool(), state, previous))
        else:  # chunkwise form of Eq. 24 from the cached state (any call with gradients on: differentiable)
            o, final_state = chunk_retention(q, k, v, scale=1.0, initial_state=state,
                                             output_final_state=cache is not None, reset=reset)
            if cache is not None:
                if state is not None and seq_len == 1 and attention_mask is not None:  # a padded row keeps it
                    final_state = torch.where(attention_mask[:, 0, None, None, None].bool(), final_state, state)
                store_recurrent_state(cache, self.layer_idx, final_state)

        # the published o_t / sqrt(s_t), folded into the group norm: RMSNorm(o / sqrt(s)) = o / sqrt(mean(o^2) + eps s)
        o = self.group_norm(o.reshape(batch, seq_len, self.value_dim), eps_scale=rotary[2])
        return self.dropout(self.o_proj(o * g)), features


class DenseRetNetBlock(GradientCheckpointingLayer):
    """Pre-norm residual block ``x + self_attn(input_layernorm(x))`` (GAU-style: no separate FFN); ``forward`` as
    :class:`~hf_densessm.modeling.modeling_densemamba.DenseMambaBlock`'s, plus ``rotary`` (the retention's)."""

    def __init__(self, config: DenseRetNetConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = DenseSSMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DenseRetNetRetention(config, layer_idx)

    def forward(self, hidden_states, *dense_inputs, cache=None, attention_mask=None, reset=None, rotary):
        out, features = self.self_attn(self.input_layernorm(hidden_states), dense_inputs, cache=cache,
                                       attention_mask=attention_mask, reset=reset, rotary=rotary)
        return (hidden_states + out, *features)


class DenseRetNetPreTrainedModel(DenseSSMPreTrainedModel):
    """Weight init and names shared by the DenseRetNet models (the published ones': ``model``, ``embed_tokens``)."""

    config_class = DenseRetNetConfig
    config: DenseRetNetConfig
    base_model_prefix = "model"
    _no_split_modules = ["DenseRetNetBlock"]

    @torch.no_grad()
    def _init_weights(self, module):
        """The published models' init (docs/design.md §3): normal(0, ``initializer_range``) for every ``Linear`` and
        the embeddings, norms at 1, the rotary angles, the dense ablations' layers; loaded weights are kept."""
        std = self.config.initializer_range
        if init_dense_linear(module, init, gate_std=std):
            return
        if isinstance(module, DenseSSMRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DenseRetNetModel):
            head_dim, theta = 2 * module.theta.numel(), module.config.rope_theta
            init.copy_(module.theta, rotary_angles(head_dim, theta, module.theta.device))
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)


class DenseRetNetModel(DenseSSMModel, DenseRetNetPreTrainedModel):
    """The DenseRetNet backbone (``embed_tokens``, ``layers``, ``norm``); ``forward``: :meth:`DenseSSMModel.forward
    <hf_densessm.modeling.modeling_densessm.DenseSSMModel.forward>` (cache: a ``DenseSSMCache``)."""

    def __init__(self, config: DenseRetNetConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DenseRetNetBlock(config, layer_idx=i) for i in range(config.num_hidden_layers))
        self.norm = DenseSSMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        head_dim = config.query_key_dim // config.num_attention_heads  # non-persistent, rebuilt by _init_weights
        self.register_buffer("theta", rotary_angles(head_dim, config.rope_theta), persistent=False)
        self.gradient_checkpointing = False
        self.post_init()

    def layer_inputs(self, embeds, cache, attention_mask, reset) -> dict:
        """``rotary``: ``(cos, sin, row_sums)`` at each token's position (real tokens before it in the row, the
        cache's count first, or in its packed document), in ``embeds``' dtype promoted to float32: ``cos``, ``sin``
        ``(batch, seq_len, 1, head_dim)`` (:func:`theta_shift`), :func:`retention_row_sums`."""
        seen = getattr(cache, "real_tokens_seen", None)  # real tokens per row before this call; counted after it
        if reset is not None:  # packed documents (no cache, no padding): positions restart at each document
            positions = document_positions(reset)
        else:  # count real tokens only, so padding never moves a row's position
            positions = (torch.arange(embeds.shape[1], device=embeds.device).expand(embeds.shape[:2])
                         if attention_mask is None else attention_mask.long().cumsum(-1) - 1)
            positions = positions if seen is None else seen[:, None] + positions
        compute = torch.promote_types(embeds.dtype, torch.float32)  # float32, or float64 for a float64 model
        angles = positions.to(compute)[..., None] * self.theta.to(device=positions.device, dtype=compute)
        cos, sin = angles.cos().repeat_interleave(2, dim=-1), angles.sin()
        sin = torch.stack((-sin, sin), dim=-1).flatten(2)
        return {"rotary": (cos[:, :, None], sin[:, :, None],
                           retention_row_sums(positions, self.config.num_attention_heads, compute))}


class DenseRetNetForCausalLM(DenseSSMForCausalLM, DenseRetNetPreTrainedModel):
    """DenseRetNet with a language-modeling head ``lm_head`` (untied by default), as the published model."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    backbone_class = DenseRetNetModel


class DenseRetNetForSequenceClassification(DenseSSMForSequenceClassification, DenseRetNetPreTrainedModel):
    """DenseRetNet with a sequence-classification head (docs/design.md §5)."""

    backbone_class = DenseRetNetModel


__all__ = [
    "DenseRetNetForCausalLM", "DenseRetNetForSequenceClassification", "DenseRetNetModel", "DenseRetNetPreTrainedModel",
]
