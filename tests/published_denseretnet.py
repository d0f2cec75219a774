"""An independent float64 transcription of the authors' published DenseRetNet forward pass, for parity tests.

Nothing here imports ``hf_densessm``: it is written from the maths of the published model, on the published
parameter names and ``config.json`` keys, so that a converted checkpoint can be checked against it.

Source read (to understand it; no code copied): the authors' public repository ``WailordHe/DenseSSM``,
``modeling/dense_gau_retnet_350m/modeling_dense_gau_retnet.py`` (commit 3950e790866630f7bec4114ae5cdfecf409297b7;
``modeling/dense_gau_retnet_1p3b/modeling_dense_gau_retnet.py`` is the same code) and
``modeling/dense_gau_retnet_{350m,1p3b}/config.json``. What was verified there, and is transcribed below:

- Model: ``h_0 = embed_tokens[ids]``; each layer ``x <- x + to_out(GAU(input_layernorm(x)))``; final ``model.norm``;
  untied ``lm_head`` (config ``tie_word_embeddings: false``). Every norm is LLaMA's RMSNorm
  ``w * x / sqrt(mean(x^2) + rms_norm_eps)`` (theirs computes the variance in float32; here all in float64).
- Inside a layer, with ``x`` the normalized input, ``H`` heads, ``hk = query_key_dim / H``, ``dv = v_factor * d``:
  ``q = SiLU(q_proj x)``, ``k = SiLU(k_proj x) * hk^-0.5``, ``[v, g] = chunk(SiLU(to_hidden.0 x), 2)`` (``v`` is
  the first half).
- Dense KV connection, in layers ``idx >= 1`` only (layer 0's ``k_select``/``v_select``/``k_norm``/``v_norm`` exist
  but are never used): ``G(x) = fc2(SiLU(fc1 x))`` (``fc1: d -> d // 32``; ``k_select.fc2: -> d // 2``,
  ``v_select.fc2: -> 2 d``, hard-coded, so only ``query_key_dim = d / 2``, ``v_factor = 2`` load),
  ``k' = k_norm(k + sum_i SiLU(G_k(x)) * k_i)``, ``v' = v_norm(v + sum_i SiLU(G_v(x)) * v_i)``, one gate for all
  predecessors. The ``k_i, v_i`` are the *pre-fusion* ``k`` (already scaled by ``hk^-0.5``) and ``v`` of the
  ``dense_block_layers`` layers just below (a sliding window: layer ``l`` reads layers ``max(0, l - m) .. l - 1``).
- Heads are contiguous channel blocks (``view(b, t, H, hk)``); the output gate ``g`` multiplies the head-major
  concatenation of the heads' outputs.
- Rotary "theta shift" on ``q`` and ``k'`` (not ``v``): angles ``theta_j = 10000^-linspace(0, 1, hk / 2)_j``, each
  repeated for the channel pair ``(2j, 2j+1)``; at position ``n``: ``out_2j = x_2j cos(n theta_j) - x_2j+1 sin``,
  ``out_2j+1 = x_2j+1 cos + x_2j sin``. Parallel form: ``n = 0 .. T-1``. Their recurrent form uses angle
  ``(sequence_offset - 1) * theta`` for the token at 0-based position ``sequence_offset``, i.e. positions shifted by
  -1, which changes nothing since ``q_t . k_s`` depends on ``t - s`` only (``published_forward(..., form=
  "recurrent", position_offset=-1)`` checks that).
- Decay per head ``gamma_h = 1 - 2^(-5-h)`` (stored as ``model.retnet_rel_pos.decay = log gamma``; rotary angles as
  ``model.retnet_rel_pos.angle``, both persistent buffers, so in their checkpoints).
- Parallel retention: mask ``D[h, t, s] = gamma_h^(t-s)`` for ``s <= t`` (0 above), each row divided by the square
  root of its sum ``s_t = sum_{j<=t} gamma^j``; ``A = (q k'^T) * D``; then ``A / clamp(sum_s |A[t, s]|, 1, 5e4)``
  (the "clamp"); ``o = A v'``.
- Recurrent retention (their decode path): ``scale_t = scale_{t-1} gamma + 1`` (``scale_0 = 1``),
  ``KV_t = KV_{t-1} sqrt(scale_{t-1}) gamma / sqrt(scale_t) + k'_t^T v'_t / sqrt(scale_t)``, ``o_t = q_t KV_t``:
  exactly the parallel form *without* the clamp, i.e. ``o_t = (1 / sqrt(s_t)) sum_s gamma^(t-s) (q_t . k'_s) v'_s``.
  docs/design.md §3 follows that form. ``clamp=False`` (the default here) transcribes it; ``clamp=True`` adds the
  parallel form's clamp. At the sizes of these tests the two differ by far less than the 1e-5 tolerance
  (``test_published_denseretnet.py`` measures and asserts it), so a model may follow either.
- Per-head ``group_norm``: RMSNorm over each head's ``dv / H`` channels with ONE weight of size ``dv / H`` shared by
  the heads, eps ``rms_norm_eps``; then ``out = to_out.0((norm(o) * g))``; dropout (off in eval).
- Init (their ``post_init`` after ``reset_parameters``): every ``Linear`` and the embedding normal(0,
  ``initializer_range = 0.02``), the embedding's ``pad_token_id`` row zeroed (``nn.Embedding(padding_idx=...)``),
  norm weights 1. :func:`published_checkpoint` builds such a checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# A small published-format config (their config.json keys; d_qk = d / 2 and v_factor = 2 as their gates require).
PUBLISHED_CONFIG = {
    "auto_map": {
        "AutoModelForCausalLM": "modeling_dense_gau_retnet.LlamaForCausalLM",
        "AutoModelForSequenceClassification": "modeling_dense_gau_retnet.LlamaForSequenceClassification",
    },
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 64,
    "query_key_dim": 32,
    "initializer_range": 0.02,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 2,
    "num_hidden_layers": 4,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "layernorm_eps": 1e-5,
    "retnorm": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.29.1",
    "use_cache": False,
    "vocab_size": 100,
    "v_factor": 2,
    "dense_block_layers": 2,
    "dropout": 0.1,
    "deepnorm": False,
}


def _sizes(config: dict) -> tuple[int, int, int, int, int]:
    d, dqk, heads = config["hidden_size"], config["query_key_dim"], config["num_attention_heads"]
    dv = int(d * config["v_factor"])
    return d, dqk, dv, heads, config["vocab_size"]


def published_checkpoint(
    config: dict = PUBLISHED_CONFIG, seed: int = 0, std: float | None = None, norm_std: float = 0.0
):
    """A random float32 state dict with the published names and shapes, initialized as the published models were.

    Every ``Linear`` weight and the embedding are normal(0, ``std``) (default ``config["initializer_range"]``, 0.02),
    the embedding row ``pad_token_id`` is zero, every norm weight is 1 (or ``1 + normal(0, norm_std)``, to make the
    mapping of each norm weight visible); all layers (layer 0 included) carry
    ``k_select``, ``v_select``, ``k_norm``, ``v_norm``; the persistent ``model.retnet_rel_pos.angle`` / ``.decay``
    buffers are included, computed as published (float32).

    Returns:
        ``{name: float32 tensor}``.
    """
    d, dqk, dv, heads, vocab = _sizes(config)
    std = config.get("initializer_range", 0.02) if std is None else std
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * std).float()

    def ones(size):
        return (1 + torch.randn(size, generator=generator, dtype=torch.float64) * norm_std).float()

    sd = {"model.embed_tokens.weight": normal(vocab, d)}
    if config.get("pad_token_id") is not None:
        sd["model.embed_tokens.weight"][config["pad_token_id"]] = 0
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        sd[a + "q_proj.weight"] = normal(dqk, d)
        sd[a + "k_proj.weight"] = normal(dqk, d)
        sd[a + "group_norm.weight"] = ones(dv // heads)
        sd[a + "to_hidden.0.weight"] = normal(2 * dv, d)
        sd[a + "to_out.0.weight"] = normal(d, dv)
        sd[a + "k_select.fc1.weight"] = normal(d // 32, d)
        sd[a + "k_select.fc2.weight"] = normal(d // 2, d // 32)
        sd[a + "v_select.fc1.weight"] = normal(d // 32, d)
        sd[a + "v_select.fc2.weight"] = normal(2 * d, d // 32)
        sd[a + "k_norm.weight"] = ones(dqk)
        sd[a + "v_norm.weight"] = ones(dv)
        sd[p + "input_layernorm.weight"] = ones(d)
    sd["model.norm.weight"] = ones(d)
    sd["lm_head.weight"] = normal(vocab, d)
    angle = 1.0 / (10000 ** torch.linspace(0, 1, (dqk // heads) // 2))
    sd["model.retnet_rel_pos.angle"] = angle.repeat_interleave(2)
    sd["model.retnet_rel_pos.decay"] = torch.log(1 - 2 ** (-5 - torch.arange(heads, dtype=torch.float)))
    return sd


# ----------------------------------------------------------------------------------------------- forward pass


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _theta_shift(x: torch.Tensor, positions: torch.Tensor, head_key_dim: int) -> torch.Tensor:
    """Rotate every channel pair ``(2j, 2j+1)`` of ``x`` ``(b, t, H, hk)`` by ``positions[t] * theta_j``."""
    theta = 10000.0 ** -torch.linspace(0, 1, head_key_dim // 2, dtype=torch.float64)
    angles = positions.to(torch.float64)[:, None] * theta  # (t, hk / 2)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


def _gammas(heads: int) -> torch.Tensor:
    return 1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float64))


def _retention_parallel(q, k, v, clamp: bool, row_normalize: bool = True):
    """``q, k`` ``(b, t, H, hk)``, ``v`` ``(b, t, H, hv)`` -> ``(b, t, H, hv)``: the published parallel form."""
    length = q.shape[1]
    gamma = _gammas(q.shape[2])
    t = torch.arange(length, dtype=torch.float64)
    distance = t[:, None] - t[None, :]
    causal = distance >= 0
    mask = torch.where(causal, gamma[:, None, None] ** distance.clamp(min=0), torch.zeros(()))  # (H, t, t)
    if row_normalize:
        mask = mask / mask.sum(-1, keepdim=True).sqrt()
    scores = torch.einsum("bthd,bshd->bhts", q, k) * mask
    if clamp:
        scores = scores / scores.abs().sum(-1, keepdim=True).clamp(min=1, max=5e4)
    return torch.einsum("bhts,bshv->bthv", scores, v)


def _retention_recurrent(q, k, v):
    """The published recurrent form token by token (normalized state, ``scale = prev_scale * gamma + 1``)."""
    batch, length, heads, _ = q.shape
    gamma = _gammas(heads)[None, :, None, None]
    state = scale = None
    outputs = []
    for t in range(length):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]  # (b, H, hk, hv)
        if state is None:
            state, scale = kv, torch.ones_like(gamma)
        else:
            new_scale = scale * gamma + 1
            state = state * (scale.sqrt() * gamma / new_scale.sqrt()) + kv / new_scale.sqrt()
            scale = new_scale
        outputs.append(torch.einsum("bhd,bhdv->bhv", q[:, t], state))
    return torch.stack(outputs, dim=1)


def published_forward(
    state_dict: dict,
    config: dict,
    input_ids: torch.Tensor,
    *,
    form: str = "parallel",
    clamp: bool = False,
    row_normalize: bool = True,
    position_offset: int = 0,
) -> torch.Tensor:
    """Logits ``(batch, seq_len, vocab_size)`` float64 of the published DenseRetNet on ``input_ids`` (no padding).

    Args:
        state_dict: published names (see :func:`published_checkpoint`); tensors of any float dtype, used in float64.
        config: the published ``config.json`` dict (``hidden_size``, ``query_key_dim``, ``num_attention_heads``,
            ``num_hidden_layers``, ``v_factor``, ``dense_block_layers``, ``rms_norm_eps``, ``vocab_size``).
        form: ``"parallel"`` (row-normalized decay mask) or ``"recurrent"`` (their normalized-state recurrence).
        clamp: parallel form only: also divide each row of ``(q k^T) * D`` by ``clamp(sum |row|, 1, 5e4)`` as their
            parallel form does. Off by default: their recurrent form (and docs/design.md §3) has no clamp.
        row_normalize: parallel form only: ``False`` leaves out the ``1 / sqrt(s_t)`` row normalization of the decay
            mask (NOT the published function; to measure what it changes).
        position_offset: added to every rotary position (their recurrent path uses -1; must not matter).
    """
    if form not in ("parallel", "recurrent"):
        raise ValueError(f"form must be 'parallel' or 'recurrent', got {form!r}")
    W = {name: tensor.to(torch.float64) for name, tensor in state_dict.items()}
    d, dqk, dv, heads, _ = _sizes(config)
    hk, hv = dqk // heads, dv // heads
    eps, m = config.get("rms_norm_eps", 1e-6), config["dense_block_layers"]
    batch, length = input_ids.shape
    positions = torch.arange(length) + position_offset

    x = W["model.embed_tokens.weight"][input_ids]
    window = []  # pre-fusion (k, v) of the last m layers, oldest first
    for i in range(config["num_hidden_layers"]):
        a = f"model.layers.{i}.self_attn."
        h = _rms(x, W[f"model.layers.{i}.input_layernorm.weight"], eps)
        q = F.silu(h @ W[a + "q_proj.weight"].T)
        k = F.silu(h @ W[a + "k_proj.weight"].T) * hk**-0.5
        v, g = F.silu(h @ W[a + "to_hidden.0.weight"].T).split(dv, dim=-1)
        pre_fusion = (k, v)
        if i >= 1:
            gate_k = F.silu(F.silu(h @ W[a + "k_select.fc1.weight"].T) @ W[a + "k_select.fc2.weight"].T)
            gate_v = F.silu(F.silu(h @ W[a + "v_select.fc1.weight"].T) @ W[a + "v_select.fc2.weight"].T)
            k = _rms(k + sum(gate_k * k_past for k_past, _ in window), W[a + "k_norm.weight"], eps)
            v = _rms(v + sum(gate_v * v_past for _, v_past in window), W[a + "v_norm.weight"], eps)
        window = (window + [pre_fusion])[-m:]
        q = _theta_shift(q.view(batch, length, heads, hk), positions, hk)
        k = _theta_shift(k.view(batch, length, heads, hk), positions, hk)
        v = v.view(batch, length, heads, hv)
        if form == "parallel":
            o = _retention_parallel(q, k, v, clamp=clamp, row_normalize=row_normalize)
        else:
            o = _retention_recurrent(q, k, v)
        o = _rms(o, W[a + "group_norm.weight"], eps).reshape(batch, length, dv)  # one weight shared by the heads
        x = x + (o * g) @ W[a + "to_out.0.weight"].T
    return _rms(x, W["model.norm.weight"], eps) @ W["lm_head.weight"].T


def relative_deviation(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``||value - reference|| / ||reference||`` (Frobenius norms, in float64)."""
    value, reference = value.to(torch.float64), reference.to(torch.float64)
    return float(torch.linalg.vector_norm(value - reference) / torch.linalg.vector_norm(reference))


__all__ = ["PUBLISHED_CONFIG", "published_checkpoint", "published_forward", "relative_deviation"]

