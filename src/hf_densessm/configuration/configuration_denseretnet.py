"""Configuration of DenseRetNet (DenseSSM paper §3.3 "Extension to RetNet", §4.2, Table 3; docs/design.md §3)."""

from __future__ import annotations

from .configuration_densessm import PAPER_OPTIMIZER, DenseSSMConfig, check_bool, check_positive_float, check_size

_SHARED = dict(v_factor=2.0, dense_layers=2)  # every preset's
_PAPER = dict(dropout=0.1, **_SHARED)  # Table 3's
# Table 3 of the DenseSSM paper (vocabulary 32000), plus small sizes for examples, tests and CPU benchmarks.
DENSERETNET_PRESETS = {
    "denseretnet-tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=2, query_key_dim=128, **_SHARED),
    "denseretnet-30m": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=2, query_key_dim=192, **_SHARED),
    "denseretnet-350m": dict(hidden_size=1536, num_hidden_layers=16, num_attention_heads=2, query_key_dim=768,
                             **_PAPER),
    "denseretnet-1.3b": dict(hidden_size=2560, num_hidden_layers=25, num_attention_heads=4, query_key_dim=1280,
                             **_PAPER),
}

#: The paper's training settings (§4.2, Table 3), for :func:`hf_densessm.paper_training_arguments`.
DENSERETNET_PAPER_TRAINING = {
    name: dict(learning_rate=6e-4, adam_beta1=0.9, adam_beta2=0.98, **PAPER_OPTIMIZER)
    for name in ("denseretnet-350m", "denseretnet-1.3b")
}


class DenseRetNetConfig(DenseSSMConfig):
    r"""Configuration of a :class:`~hf_densessm.DenseRetNetModel` / :class:`~hf_densessm.DenseRetNetForCausalLM`.

    Each block is a pre-norm GAU-style multi-scale retention unit with the dense KV connection (Eq. 18-24;
    docs/design.md §3).

    Args:
        vocab_size (`int`, defaults to 32000): vocabulary size (the paper's LLaMA tokenizer).
        hidden_size (`int`, defaults to 1536): model width ``d``.
        num_hidden_layers (`int`, defaults to 16): number of retention blocks.
        num_attention_heads (`int`, defaults to 2): retention heads ``H`` (each with its own decay).
        query_key_dim (`int`, defaults to 768): total query/key width ``d_qk``; ``d_qk / H`` must be even.
        v_factor (`float`, defaults to 2.0): value/gate width ``d_v = v_factor * d``.
        rms_norm_eps (`float`, defaults to 1e-6): epsilon of every RMSNorm.
        dropout (`float`, defaults to 0.0): dropout on each block's output (0.1 in the paper's presets).
        rope_theta (`float`, defaults to 10000.0): base of the rotary angles ``rope_theta^-linspace(0, 1, d_qk/H/2)``.
        initializer_range (`float`, defaults to 0.02): std of the embedding init.
        pad_token_id, bos_token_id, eos_token_id (`int`, defaults to 0, 1, 2): LLaMA tokenizer ids.
        use_cache (`bool`, defaults to True): return the recurrent-state cache.
        tie_word_embeddings (`bool`, defaults to False): the published model has an untied ``lm_head``.
        dense_layers, dense_projection, dense_selection, dense_shared_gate, dense_fusion, dense_every,
        dense_gate_hidden_size, kernel_backend: :data:`~.configuration_densessm.DENSE_KNOBS`.

    Raises:
        ValueError, TypeError: for any field outside its allowed values (the message names it), including head
            counts that do not divide ``query_key_dim`` or ``d_v``.
    """

    model_type = "denseretnet"
    dense_defaults = {"dense_layers": 2}
    presets = DENSERETNET_PRESETS
    cache_slots = {"conv": (), "recurrent": (0,)}  # the retention state (docs/design.md §5)
    cache_counts_row_tokens = True  # the rotary angles and the retention normalization place each row's tokens

    def cache_shapes(self, batch: int) -> dict[tuple[str, int], tuple[int, ...]]:
        """The retention state ``(batch, heads, query_key_dim / heads, value_dim / heads)`` (float32)."""
        heads = self.num_attention_heads
        return {("recurrent", 0): (batch, heads, self.query_key_dim // heads, self.value_dim // heads)}

    def __init__(
        self, vocab_size: int = 32000, hidden_size: int = 1536, num_hidden_layers: int = 16,
        num_attention_heads: int = 2, query_key_dim: int = 768, v_factor: float = 2.0, rms_norm_eps: float = 1e-6,
        dropout: float = 0.0, rope_theta: float = 10000.0, initializer_range: float = 0.02,
        pad_token_id: int | None = 0, bos_token_id: int | None = 1, eos_token_id: int | list[int] | None = 2,
        use_cache: bool = True, tie_word_embeddings: bool = False, **kwargs,
    ):
        self.set_checked(check_size, vocab_size=vocab_size, hidden_size=hidden_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         query_key_dim=query_key_dim)
        self.set_checked(check_positive_float, v_factor=v_factor, rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
                         initializer_range=initializer_range)
        self.use_cache = check_bool("use_cache", use_cache)
        value_dim = self.v_factor * self.hidden_size
        if value_dim != int(value_dim):
            raise ValueError(f"`v_factor * hidden_size` must be an integer, got {v_factor} * {hidden_size}.")
        heads = self.num_attention_heads
        if self.query_key_dim % heads or (self.query_key_dim // heads) % 2:
            raise ValueError(f"`query_key_dim` ({query_key_dim}) must be divisible by `num_attention_heads` ({heads}) "
                             "into heads of even width (the rotary shift rotates channel pairs).")
        if int(value_dim) % heads:
            raise ValueError(f"`v_factor * hidden_size` ({int(value_dim)}) must be divisible by `num_attention_heads` "
                             f"({heads}).")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be a float in [0, 1), got {dropout!r}.")
        self.dropout = float(dropout)
        # Configs saved before the cache redesign carry `number_of_conv_states: 2` (docs/design.md §5): dropped.
        kwargs.pop("number_of_conv_states", None)
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def value_dim(self) -> int:
        """``d_v = v_factor * hidden_size``, the value and gate width."""
        return int(self.v_factor * self.hidden_size)
