"""Configuration of DenseMamba (DenseSSM paper §4.2, Table 2; docs/design.md §4)."""

from __future__ import annotations

import math

from .configuration_densessm import (
    PAPER_OPTIMIZER, DenseSSMConfig, Knob, check_bool, check_choice, check_int, check_positive_float, check_size,
)

#: Widest causal convolution (each tap is one pass over the activations in the PyTorch path); Mamba uses 4.
MAX_CONV_KERNEL = 64

#: The init of the paper's training setup (mamba_ssm; docs/design.md §4).
MAMBA_SSM_INIT = dict(init_scheme="mamba_ssm", initializer_range=0.02, rescale_prenorm_residual=True)

# Table 2 of the paper, plus small sizes; "densemamba-1.3b" is Table 2 exactly, about 1.42B parameters (§4.2).
DENSEMAMBA_PRESETS = {
    "densemamba-tiny": dict(hidden_size=256, num_hidden_layers=4, dense_layers=4),
    "densemamba-30m": dict(hidden_size=512, num_hidden_layers=8, dense_layers=4),
    "densemamba-360m": dict(hidden_size=1024, num_hidden_layers=50, dense_layers=4, **MAMBA_SSM_INIT),
    "densemamba-1.3b": dict(hidden_size=2048, num_hidden_layers=50, dense_layers=4, **MAMBA_SSM_INIT),
}

#: The paper's training settings (§4.2, Table 2), for :func:`hf_densessm.paper_training_arguments`.
DENSEMAMBA_PAPER_TRAINING = {
    "densemamba-360m": dict(learning_rate=3e-4, adam_beta1=0.9, adam_beta2=0.95, **PAPER_OPTIMIZER),
    "densemamba-1.3b": dict(learning_rate=2e-4, adam_beta1=0.9, adam_beta2=0.95, **PAPER_OPTIMIZER),
}


class DenseMambaConfig(DenseSSMConfig):
    r"""Configuration of a :class:`~hf_densessm.DenseMambaModel` / :class:`~hf_densessm.DenseMambaForCausalLM`.

    The Mamba fields are ``transformers.MambaConfig``'s; ``dense_layers=0`` gives its Mamba (docs/design.md §4).

    Args:
        vocab_size (`int`, defaults to 32000): vocabulary size (the paper's LLaMA tokenizer).
        hidden_size (`int`, defaults to 768): model width ``d_model``.
        state_size (`int`, defaults to 16): SSM state size ``N`` per channel.
        num_hidden_layers (`int`, defaults to 32): number of Mamba blocks.
        layer_norm_epsilon (`float`, defaults to 1e-5): RMSNorm epsilon.
        pad_token_id, bos_token_id, eos_token_id (`int`, defaults to 0, 1, 2): LLaMA tokenizer ids.
        expand (`int`, defaults to 2): ``intermediate_size = expand * hidden_size`` (a given one must equal it).
        conv_kernel (`int`, defaults to 4): width of the causal depthwise convolution, 1 to 64.
        use_bias (`bool`, defaults to False): bias in ``in_proj`` and ``out_proj``.
        use_conv_bias (`bool`, defaults to True): bias in the convolution.
        hidden_act (`str`, defaults to "silu"): activation after the convolution and on the gate ``z``.
        initializer_range (`float`, defaults to 0.1): std of the normal init of the embeddings (and of linear
            layers with the "transformers" init).
        init_scheme (`str`, defaults to "transformers"): transformers' Mamba init, or "mamba_ssm" (the paper's: linear
            layers at PyTorch's default Kaiming-uniform, biases 0).
        residual_in_fp32 (`bool`, defaults to True): keep the residual stream in float32.
        time_step_rank (`int` or "auto", defaults to "auto"): rank of ``dt_proj``; "auto" is ``ceil(hidden_size/16)``.
        time_step_scale, time_step_min, time_step_max, time_step_init_scheme, time_step_floor: ``dt`` init
            (``dt`` bias from log-uniform [time_step_min, time_step_max]; Mamba paper §3.6).
        rescale_prenorm_residual (`bool`, defaults to False): GPT-2 style rescaling of ``out_proj`` at init.
        use_cache (`bool`, defaults to True): return the recurrent-state cache.
        tie_word_embeddings (`bool`, defaults to True): tie ``lm_head`` to the embeddings.
        dense_layers, dense_projection, dense_selection, dense_shared_gate, dense_fusion, dense_every,
        dense_gate_hidden_size, dense_target, kernel_backend: :data:`~.configuration_densessm.DENSE_KNOBS`.

    Raises:
        ValueError, TypeError: for any field outside its allowed values (the message names it).
    """

    model_type = "densemamba"
    dense_defaults = {"dense_layers": 4}
    presets = DENSEMAMBA_PRESETS
    family_knobs = (
        Knob("dense_target", str, "input", "fuse the scan inputs u and B ('input', docs/design.md §4) or the lower "
             "layers' states, read out with this layer's C ('state', Eq. 14)", choices=("input", "state")),
    )
    cache_slots = {"conv": (0,), "recurrent": (0,)}  # the conv window, the SSM state

    def cache_shapes(self, batch: int) -> dict[tuple[str, int], tuple[int, ...]]:
        """Conv window ``(batch, intermediate_size, conv_kernel)``, SSM state ``(..., state_size)`` (float32)."""
        return {
            ("conv", 0): (batch, self.intermediate_size, self.conv_kernel),
            ("recurrent", 0): (batch, self.intermediate_size, self.state_size),
        }

    def __init__(
        self, vocab_size: int = 32000, hidden_size: int = 768, state_size: int = 16, num_hidden_layers: int = 32,
        layer_norm_epsilon: float = 1e-5, pad_token_id: int | None = 0, bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2, expand: int = 2, conv_kernel: int = 4, use_bias: bool = False,
        use_conv_bias: bool = True, hidden_act: str = "silu", initializer_range: float = 0.1,
        init_scheme: str = "transformers", residual_in_fp32: bool = True, time_step_rank: int | str = "auto",
        time_step_scale: float = 1.0, time_step_min: float = 0.001, time_step_max: float = 0.1,
        time_step_init_scheme: str = "random", time_step_floor: float = 1e-4, rescale_prenorm_residual: bool = False,
        use_cache: bool = True, tie_word_embeddings: bool = True, **kwargs,
    ):
        intermediate_size = kwargs.pop("intermediate_size", None)  # derived; saved configs carry it
        self.set_checked(check_size, vocab_size=vocab_size, hidden_size=hidden_size, state_size=state_size,
                         num_hidden_layers=num_hidden_layers, expand=expand)
        self.set_checked(check_positive_float, layer_norm_epsilon=layer_norm_epsilon,
                         initializer_range=initializer_range, time_step_scale=time_step_scale,
                         time_step_min=time_step_min, time_step_max=time_step_max, time_step_floor=time_step_floor)
        self.set_checked(check_bool, use_bias=use_bias, use_conv_bias=use_conv_bias, residual_in_fp32=residual_in_fp32,
                         rescale_prenorm_residual=rescale_prenorm_residual, use_cache=use_cache)
        self.conv_kernel = check_int("conv_kernel", conv_kernel, 1, MAX_CONV_KERNEL)
        self.intermediate_size = int(self.expand * self.hidden_size)
        if intermediate_size is not None and intermediate_size != self.intermediate_size:
            raise ValueError(f"`intermediate_size` is derived, `expand * hidden_size` = {self.intermediate_size}; got "
                             f"{intermediate_size!r}. Set `expand` (an int) instead, or leave `intermediate_size` out.")
        self.hidden_act = check_choice("hidden_act", hidden_act, ("silu",))
        self.init_scheme = check_choice("init_scheme", init_scheme, ("transformers", "mamba_ssm"))
        if time_step_rank == "auto":
            time_step_rank = math.ceil(self.hidden_size / 16)
        self.time_step_rank = check_size("time_step_rank", time_step_rank)
        if self.time_step_min > self.time_step_max:
            raise ValueError(f"`time_step_min` ({time_step_min}) must be <= `time_step_max` ({time_step_max}).")
        schemes = ("random", "constant")
        self.time_step_init_scheme = check_choice("time_step_init_scheme", time_step_init_scheme, schemes)
        if 2 * self.time_step_scale * self.time_step_rank**-0.5 > 3.4e38:  # the dt_proj init range in float32
            raise ValueError(f"`time_step_scale` ({time_step_scale}) is too large: the dt_proj init range "
                             "2 * time_step_scale / sqrt(time_step_rank) must fit in float32 (<= 3.4e38).")
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
