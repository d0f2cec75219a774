"""DenseMamba: Mamba (Gu & Dao 2023) with DenseSSM's dense hidden connection (He et al. 2024, §3.3, §4.2) on the scan
inputs ``u``, ``B`` or on the states read out with each layer's ``C`` (``dense_target``, Eq. 14): docs/design.md §4."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.mamba.modeling_mamba import MambaCausalLMOutput, MambaOutput

from ..configuration.configuration_densemamba import DenseMambaConfig
from ..ops.causal_conv1d import causal_conv1d
from ..ops.selective_scan import selective_scan, selective_state_update
from .cache import cache_state, record_states, store_conv_inputs, store_recurrent_state
from .cache_names import with_old_name
from .dense_connection import build_dense_connection, init_dense_linear, split_dense_inputs
from .modeling_densessm import (
    DenseSSMForCausalLM, DenseSSMForSequenceClassification, DenseSSMModel, DenseSSMPreTrainedModel, DenseSSMRMSNorm,
)


def _state_after(u, dt, A, B, C, softplus, initial_state, n):
    """The SSM state after the first ``n`` of a forward's tokens (``dt`` channel-major, the rest token-major), for
    ``crop`` (:func:`~.cache.record_states`)."""
    return selective_scan(u[:, :n].transpose(1, 2), dt[..., :n], A, B[:, :n].transpose(1, 2), C[:, :n].transpose(1, 2),
                          delta_softplus=softplus, initial_state=initial_state, return_last_state=True)[1]


class DenseMambaMixer(nn.Module):
    """Sequence mixing of one DenseMamba block: transformers' ``MambaMixer`` (Mamba paper Alg. 2, Fig. 3) with the
    dense connection (``dense_u``, ``dense_B`` or ``dense_h``; docs/design.md §4); ``D = intermediate_size``."""

    def __init__(self, config: DenseMambaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.intermediate_size = config.intermediate_size
        self.ssm_state_size = config.state_size
        self.conv_kernel_size = config.conv_kernel
        self.time_step_rank = config.time_step_rank
        D, k = self.intermediate_size, config.conv_kernel
        self.conv1d = nn.Conv1d(D, D, k, groups=D, padding=k - 1, bias=config.use_conv_bias)
        self.in_proj = nn.Linear(config.hidden_size, self.intermediate_size * 2, bias=config.use_bias)
        self.x_proj = nn.Linear(self.intermediate_size, self.time_step_rank + self.ssm_state_size * 2, bias=False)
        self.dt_proj = nn.Linear(self.time_step_rank, self.intermediate_size, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.intermediate_size, self.ssm_state_size))
        self.D = nn.Parameter(torch.empty(self.intermediate_size))
        self.out_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.use_bias)
        on_states = config.dense_target == "state"  # Eq. 14: gates on the lower states' readouts; else u and B (§4)
        self.dense_u = None if on_states else build_dense_connection(config, layer_idx, self.intermediate_size)
        self.dense_B = None if on_states else build_dense_connection(config, layer_idx, self.ssm_state_size)
        self.dense_h = build_dense_connection(config, layer_idx, self.intermediate_size) if on_states else None

    def _read_lower_states(self, dense_inputs, C, cache, decode: bool, continuing: bool, reset=None):
        """``C^l_t . h^{l-i}_t`` per predecessor ``i`` (nearest first), ``(batch, seq_len, D)`` each: from the cached
        states when decoding, else one scan of the lower layer's ``(u, dt, B, A)`` read out with ``C^l``."""
        if decode:
            n = len(dense_inputs) // 4
            C_t = C[:, 0, :, None].to(torch.promote_types(C.dtype, torch.float32))
            return [torch.bmm(cache_state(cache, self.layer_idx - i).to(C_t.dtype), C_t).transpose(1, 2)
                    for i in range(1, n + 1)]
        us, dts, Bs, As, *initial = split_dense_inputs(dense_inputs, 5 if continuing else 4)
        initial = initial[0] if initial else [None] * len(us)
        return [selective_scan(u.transpose(1, 2), dt, A, B.transpose(1, 2), C.transpose(1, 2), initial_state=h0,
                               reset=reset).transpose(1, 2) for u, dt, B, A, h0 in zip(us, dts, Bs, As, initial)]

    def forward(
        self, hidden_states: torch.Tensor, dense_inputs: tuple[torch.Tensor, ...], cache=None,
        attention_mask: torch.Tensor | None = None, reset: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``hidden_states`` ``(batch, seq_len, hidden_size)`` (normalized) -> ``(output, features)``: ``output`` of the
        same shape and the pre-fusion ``(u, B)`` (``"input"``) or ``(u, dt, B, A[, state before this call])``
        (``"state"``). ``dense_inputs``: the predecessors' features grouped by feature, nearest first; ``cache``,
        ``attention_mask`` ``(batch, seq_len)`` 0/1 and ``reset`` ``(batch, seq_len)`` bool may be ``None``. One token
        over a filled cache without gradients decodes in place; any other call scans (docs/design.md §5)."""
        seq_len = hidden_states.shape[1]
        keep = attention_mask[..., None].bool() if attention_mask is not None else None  # selects, never multiplies
        acc = torch.promote_types(self.A_log.dtype, torch.float32)  # the scan's float32 (float64 in float64 models)

        # 1. x (to the conv) and the gate z, token-major (batch, seq_len, D): transposing costs more than the conv
        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)
        if keep is not None:
            x = torch.where(keep, x, 0)
        z = z.transpose(1, 2)  # (batch, D, seq_len) view, the scan's layout

        # 2. causal depthwise convolution, continuing from the cached window of the last `conv_kernel` inputs
        window = cache_state(cache, self.layer_idx, "conv")
        previous_window = window.clone() if window is not None and keep is not None else None
        u = causal_conv1d(x, self.conv1d.weight, self.conv1d.bias, window, reset=reset, activation="silu")
        if cache is not None:
            store_conv_inputs(cache, self.layer_idx, x.transpose(1, 2), self.conv_kernel_size)
            if previous_window is not None:  # rows given only padding keep their window
                updated = cache_state(cache, self.layer_idx, "conv")
                updated.copy_(torch.where(attention_mask.bool().any(dim=-1)[:, None, None], updated, previous_window))
        if keep is not None:
            u = torch.where(keep, u, 0)

        # 3. input-dependent dt, B, C from the un-fused u
        time_step, B, C = self.x_proj(u).split([self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
        # a module call (bias included), so that adapters such as LoRA take effect
        dt = self.dt_proj(time_step).transpose(1, 2)  # (batch, D, seq_len), before the softplus
        softplus = keep is None
        if keep is not None:  # dt = 0 at padding: exp(0 * A) = 1 and no input, the state is left as it was
            dt = torch.where(keep.transpose(1, 2), F.softplus(dt.to(acc)), 0)

        A = -torch.exp(self.A_log.to(acc))
        state = cache_state(cache, self.layer_idx)
        # with gradients on, the scan (differentiable everywhere, the cached state left as it was)
        decode = state is not None and seq_len == 1 and not torch.is_grad_enabled()
        fuse_states = self.dense_h is not None

        # 4. dense connection (Eq. 10-17; docs/design.md §4): on u and B ("input"), or hand up what makes the state
        if self.config.dense_target == "state":
            if softplus:
                dt, softplus = F.softplus(dt.to(acc)), False
            features = (u, dt, B, A) + ((state.clone(),) if state is not None and not decode else ())
        else:
            features = (u, B)
            if self.dense_u is not None:
                dense_u, dense_B = split_dense_inputs(dense_inputs, 2)
                u = self.dense_u(hidden_states, u, dense_u)
                B = self.dense_B(hidden_states, B, dense_B)

        # 5. selective scan (Mamba Alg. 2) from the cached state; with state fusion, D and SiLU(z) after the fusion
        D, z_scan = (None, None) if fuse_states else (self.D.to(acc), z)
        record_states(cache, self.layer_idx, state, _state_after, u, dt, A, B, C, softplus)
        if decode:
            y = selective_state_update(state, u[:, 0], dt[..., 0], A, B[:, 0], C[:, 0], D,
                                       z=None if fuse_states else z[..., 0], dt_softplus=softplus)[..., None]
        else:
            y = selective_scan(u.transpose(1, 2), dt, A, B.transpose(1, 2), C.transpose(1, 2), D=D, z=z_scan,
                               delta_softplus=softplus, initial_state=state, return_last_state=cache is not None,
                               reset=reset)
            if cache is not None:
                y, last_state = y
                store_recurrent_state(cache, self.layer_idx, last_state)
        if fuse_states:
            readouts = self._read_lower_states(dense_inputs, C, cache, decode, state is not None, reset)
            y = self.dense_h(hidden_states, y.transpose(1, 2), readouts).transpose(1, 2)  # Eq. 14
            y = (y + self.D.to(acc)[:, None] * u.transpose(1, 2)) * F.silu(z.to(y.dtype))
        return self.out_proj(y.transpose(1, 2).to(hidden_states.dtype)), features


class DenseMambaBlock(GradientCheckpointingLayer):
    """Pre-norm residual block ``x + mixer(RMSNorm(x))`` (as ``transformers.MambaBlock``; the residual in float32
    with ``config.residual_in_fp32``); ``forward``: a block of :func:`~.dense_connection.run_dense_layers`."""

    def __init__(self, config: DenseMambaConfig, layer_idx: int):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = DenseSSMRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = DenseMambaMixer(config, layer_idx=layer_idx)

    def forward(self, hidden_states, *dense_inputs, cache=None, attention_mask=None, reset=None):
        residual = hidden_states
        hidden_states = self.norm(hidden_states.to(dtype=self.norm.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.to(torch.promote_types(residual.dtype, torch.float32))
        out, features = self.mixer(hidden_states, dense_inputs, cache=cache, attention_mask=attention_mask, reset=reset)
        return (residual + out, *features)


class DenseMambaPreTrainedModel(DenseSSMPreTrainedModel):
    """Weight init and names of the DenseMamba models (as ``transformers.MambaPreTrainedModel``'s)."""

    config_class = DenseMambaConfig
    config: DenseMambaConfig
    base_model_prefix = "backbone"
    _no_split_modules = ["DenseMambaBlock"]
    _input_embed_layer = "embeddings"  # transformers' get/set_input_embeddings find them by this name
    old_cache_names = ("cache_params", "past_key_values")  # transformers' Mamba's name first (docs/design.md §5)

    @torch.no_grad()
    def _init_weights(self, module):
        """Mamba's init (S4D-Real ``A``, log-uniform ``dt`` bias, Kaiming conv and ``out_proj``) per ``init_scheme``,
        and the dense connection's (docs/design.md §4); loaded weights are kept."""
        config = self.config
        if init_dense_linear(module, init):
            return
        if config.init_scheme == "mamba_ssm" and isinstance(module, nn.Linear):  # PyTorch's default, biases 0
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))
            if module.bias is not None:
                init.zeros_(module.bias)
        else:
            super()._init_weights(module)
        if isinstance(module, DenseSSMRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DenseMambaMixer):
            A = torch.arange(1, module.ssm_state_size + 1, dtype=torch.float32, device=module.A_log.device)
            init.copy_(module.A_log, torch.log(A).expand(module.intermediate_size, -1).contiguous())
            init.ones_(module.D)
            dt_init_std = config.time_step_rank**-0.5 * config.time_step_scale
            if config.time_step_init_scheme == "constant":
                init.constant_(module.dt_proj.weight, dt_init_std)
            else:
                init.uniform_(module.dt_proj.weight, -dt_init_std, dt_init_std)
            log_min, log_max = math.log(config.time_step_min), math.log(config.time_step_max)
            rand = torch.rand(module.intermediate_size, device=module.dt_proj.bias.device, dtype=torch.float32)
            dt = torch.exp(rand * (log_max - log_min) + log_min).clamp(min=config.time_step_floor)
            init.copy_(module.dt_proj.bias, dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            init.kaiming_uniform_(module.conv1d.weight, a=math.sqrt(5))
            if module.conv1d.bias is not None and config.init_scheme == "mamba_ssm":  # PyTorch's default
                bound = 1 / math.sqrt(module.conv_kernel_size)
                init.uniform_(module.conv1d.bias, -bound, bound)
            elif module.conv1d.bias is not None:
                init.zeros_(module.conv1d.bias)
            init.kaiming_uniform_(module.out_proj.weight, a=math.sqrt(5))
            if config.rescale_prenorm_residual:
                init.copy_(module.out_proj.weight, module.out_proj.weight / math.sqrt(config.num_hidden_layers))


@with_old_name
@dataclass
class DenseMambaOutput(MambaOutput):
    """Output of :class:`DenseMambaModel`: transformers' ``MambaOutput`` (the cache field named by the release,
    docs/design.md §5), plus ``attentions``, always ``None``, which transformers' generic heads read."""

    attentions: tuple[torch.Tensor, ...] | None = None


@with_old_name
@dataclass
class DenseMambaCausalLMOutput(MambaCausalLMOutput):
    """Output of :class:`DenseMambaForCausalLM`: transformers' ``MambaCausalLMOutput`` (cache field as above)."""


class DenseMambaModel(DenseSSMModel, DenseMambaPreTrainedModel):
    """The DenseMamba backbone (``embeddings``, ``layers``, ``norm_f`` as in ``transformers.MambaModel``); ``forward``:
    :meth:`DenseSSMModel.forward <hf_densessm.modeling.modeling_densessm.DenseSSMModel.forward>` -> DenseMambaOutput."""

    output_class = DenseMambaOutput
    final_norm_name = "norm_f"

    def __init__(self, config: DenseMambaConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DenseMambaBlock(config, layer_idx=i) for i in range(config.num_hidden_layers))
        self.gradient_checkpointing = False
        self.norm_f = DenseSSMRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.post_init()


class DenseMambaForCausalLM(DenseSSMForCausalLM, DenseMambaPreTrainedModel):
    """DenseMamba with a language-modeling head tied to the input embeddings (``backbone``, ``lm_head`` as in
    ``transformers.MambaForCausalLM``); ``forward`` returns a :class:`DenseMambaCausalLMOutput`."""

    _tied_weights_keys = {"lm_head.weight": "backbone.embeddings.weight"}
    backbone_class = DenseMambaModel
    output_class = DenseMambaCausalLMOutput


class DenseMambaForSequenceClassification(DenseSSMForSequenceClassification, DenseMambaPreTrainedModel):
    """DenseMamba with a sequence-classification head (docs/design.md §5)."""

    backbone_class = DenseMambaModel


__all__ = [
    "DenseMambaForCausalLM", "DenseMambaForSequenceClassification", "DenseMambaModel", "DenseMambaPreTrainedModel",
]
