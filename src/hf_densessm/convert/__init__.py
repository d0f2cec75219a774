"""Checkpoint conversion into hf_densessm models (command line: ``python -m hf_densessm.convert``).

- :func:`densemamba_from_mamba`: upcycle a pretrained transformers Mamba into a DenseMamba that computes exactly
  the same function at conversion (DESIGN.md §3: "a gate whose last layer starts at zero makes a DenseMamba exactly
  equal to its base Mamba") and whose dense gates train from there.
- :func:`denseretnet_from_official`: load a checkpoint of the authors' published DenseRetNet (DESIGN.md §2: their
  parameter names and config keys) into :class:`~hf_densessm.DenseRetNetForCausalLM`.

Both read strictly: a missing file, a config of another ``model_type``, a parameter name that is missing,
unexpected or of the wrong shape raises an error that names it. Converted models are float32 and in eval mode;
save them with ``save_pretrained`` (atomic, with the remote code; see ``hf_densessm.hub``).
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import torch
from torch import nn

from ..configuration import DenseMambaConfig, DenseRetNetConfig
from ..modeling import DenseMambaForCausalLM, DenseRetNetForCausalLM

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
DENSE_ARGUMENTS = (
    "dense_layers",
    "dense_projection",
    "dense_selection",
    "dense_shared_gate",
    "dense_fusion",
    "dense_every",
    "dense_gate_hidden_size",
    "kernel_backend",
)
# Config fields a transformers MambaConfig shares with DenseMambaConfig (same names and meanings).
MAMBA_FIELDS = tuple(
    name
    for name, parameter in inspect.signature(DenseMambaConfig.__init__).parameters.items()
    if name not in DENSE_ARGUMENTS and name != "self" and parameter.kind is parameter.POSITIONAL_OR_KEYWORD
)
OFFICIAL_DENSERETNET_KEYS = (
    "hidden_size",
    "query_key_dim",
    "num_attention_heads",
    "num_hidden_layers",
    "v_factor",
    "dense_block_layers",
    "vocab_size",
)
# Our DenseRetNet parameter name -> the authors' (DESIGN.md §2); names not listed are the same in both.
OFFICIAL_DENSERETNET_RENAMES = (
    (".self_attn.hidden_proj.", ".self_attn.to_hidden.0."),
    (".self_attn.o_proj.", ".self_attn.to_out.0."),
    (".self_attn.dense_k.gate.", ".self_attn.k_select."),
    (".self_attn.dense_v.gate.", ".self_attn.v_select."),
)
# Parameters the authors' blocks create in every layer but use only in layers with predecessors (``dense=idx>=1``).
OFFICIAL_DENSE_ONLY = ("k_select.fc1", "k_select.fc2", "v_select.fc1", "v_select.fc2", "k_norm", "v_norm")
# Persistent buffers of the authors' relative position module (rotary angles and log-decays), recomputed here.
OFFICIAL_REL_POS = ("model.retnet_rel_pos.angle", "model.retnet_rel_pos.decay")


# ----------------------------------------------------------------------------------------------- reading


def load_checkpoint_folder(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read ``folder/config.json`` and the full state dict of a transformers-style checkpoint folder.

    Weights are the first found of :data:`WEIGHT_FILES` (``model.safetensors``, its shard index,
    ``pytorch_model.bin``, its shard index); ``.bin`` files are read with ``torch.load(weights_only=True)``.

    Returns:
        ``(config dict, {name: tensor})``, tensors on the CPU in their stored dtype.

    Raises:
        FileNotFoundError: ``folder`` is not a folder, has no ``config.json``, no weights file, or a shard named in
            an index is absent (the message names the file and lists what the folder holds).
        ValueError: ``config.json`` is not a JSON object, or a weights file cannot be read or holds non-tensors.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"Checkpoint folder {str(folder)!r} does not exist or is not a folder.")
    holds = sorted(p.name for p in folder.iterdir())
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json (it holds: {', '.join(holds) or 'nothing'}).")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(config).__name__}.")
    weights = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if weights is None:
        raise FileNotFoundError(
            f"{str(folder)!r} has no weights: looked for {', '.join(WEIGHT_FILES)} (it holds: {', '.join(holds)})."
        )
    files = [weights]
    if weights.name.endswith(".index.json"):
        try:
            weight_map = json.loads(weights.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{weights} is not a shard index with a 'weight_map': {error}") from error
        files = [folder / shard for shard in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{weights} names shards that {str(folder)!r} does not hold: {', '.join(absent)}.")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(_read_weights(file))
    return config, state_dict


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.name.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors = load_file(file)
        else:
            tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # corrupt or foreign file: say which one
        raise ValueError(f"Cannot read the weights file {file}: {error}") from error
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError(f"{file} must hold a flat {{name: tensor}} state dict.")
    return tensors


def check_state_dict(
    provided: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    source: str,
    optional: frozenset[str] | set[str] = frozenset(),
) -> None:
    """Check that ``provided`` has exactly the names of ``expected`` with those shapes (``optional`` names may be
    present or not, with any shape).

    Raises:
        ValueError: listing every missing name, every unexpected name and every shape mismatch, naming ``source``.
    """
    missing = sorted(set(expected) - set(provided))
    unexpected = sorted(set(provided) - set(expected) - set(optional))
    wrong = [
        f"{name}: {tuple(provided[name].shape)}, expected {tuple(shape)}"
        for name, shape in expected.items()
        if name in provided and tuple(provided[name].shape) != tuple(shape)
    ]
    problems = [
        f"{title} ({len(names)}):\n  "
        + "\n  ".join(names[:40])
        + (f"\n  ... and {len(names) - 40} more" if len(names) > 40 else "")
        for title, names in (
            ("missing parameters", missing),
            ("unexpected parameters", unexpected),
            ("wrong shapes", wrong),
        )
        if names
    ]
    if problems:
        raise ValueError(f"The state dict of {source} does not match the model:\n" + "\n".join(problems))


def _check_model_type(config: dict, allowed: tuple, source: str, expected_what: str) -> None:
    model_type = config.get("model_type")
    if model_type not in allowed:
        hint = ""
        if model_type in ("densemamba", "denseretnet"):
            hint = " It is already an hf_densessm model: load it with `AutoModelForCausalLM.from_pretrained`."
        raise ValueError(f"config.json of {source} has model_type {model_type!r}; expected {expected_what}.{hint}")


# ----------------------------------------------------------------------------------------------- Mamba


def densemamba_from_mamba(src, **dense_kwargs) -> DenseMambaForCausalLM:
    """Upcycle a pretrained Mamba into DenseMamba: same logits at conversion, dense gates trainable from there.

    The Mamba weights are copied strictly (with no dense connection the parameter names and shapes are
    transformers' ``MambaForCausalLM``'s, DESIGN.md §3); the parameters DenseMamba adds (names containing
    ``dense``) start so that the connection adds nothing: with ``dense_fusion="add"`` each gate's last layer is
    zero (``SiLU(0) = 0``, :meth:`~hf_densessm.modeling.dense.DenseHiddenConnection.zero_gates`); with
    ``"concat"`` the reduction starts as ``[I, 0]`` (its init), which passes ``f^l`` through, and the gates keep
    their init so that the reduction's zero block receives gradients. The outputs then equal the Mamba's (to
    float32 rounding of the scan; bit for bit against ``dense_layers=0``), and the gates' last layers (or the
    reduction) get nonzero gradients, so fine-tuning learns the connection.

    Args:
        src: a folder holding a transformers Mamba checkpoint (``config.json`` with ``model_type`` "mamba", weights
            as safetensors or ``pytorch_model.bin``, sharded or not), or a loaded ``transformers.MambaForCausalLM`` /
            ``MambaModel``.
        dense_kwargs: the DenseSSM knobs of the result (``dense_layers``, ``dense_projection``, ``dense_selection``,
            ``dense_shared_gate``, ``dense_fusion``, ``dense_every``, ``dense_gate_hidden_size``) and
            ``kernel_backend``; defaults as :class:`~hf_densessm.DenseMambaConfig` (``dense_layers=4``, Table 2).

    Returns:
        A float32 :class:`~hf_densessm.DenseMambaForCausalLM` in eval mode.

    Raises:
        TypeError: a keyword that is not a dense knob, or ``src`` is neither a folder nor a Mamba model.
        FileNotFoundError, ValueError: see :func:`load_checkpoint_folder`; ``model_type`` is not "mamba"; the
            state dict has missing, unexpected or misshapen names (all listed); ``dense_selection="none"`` with
            ``dense_fusion="add"``, which has no gate to close and cannot start as a no-op.
    """
    unknown = sorted(set(dense_kwargs) - set(DENSE_ARGUMENTS))
    if unknown:
        raise TypeError(f"densemamba_from_mamba() takes only the dense knobs {DENSE_ARGUMENTS}; got {unknown}.")
    if isinstance(src, nn.Module):
        if not hasattr(src, "config"):
            raise TypeError(f"`src` must be a transformers Mamba model or a folder, got {type(src).__name__}.")
        config, source = src.config.to_dict(), f"the given {type(src).__name__}"
        state_dict = dict(src.state_dict())
        if not any(name.startswith("backbone.") for name in state_dict):  # a MambaModel: add the CausalLM prefix
            state_dict = {f"backbone.{name}": tensor for name, tensor in state_dict.items()}
    elif isinstance(src, (str, Path)):
        config, state_dict = load_checkpoint_folder(src)
        source = repr(str(src))
    else:
        raise TypeError(f"`src` must be a transformers Mamba model or a folder, got {type(src).__name__}.")
    _check_model_type(
        config, ("mamba",), source, "'mamba' (a transformers Mamba checkpoint, e.g. state-spaces/mamba-130m-hf)"
    )
    dense_config = DenseMambaConfig(**{k: config[k] for k in MAMBA_FIELDS if k in config}, **dense_kwargs)
    if dense_config.dense_layers and dense_config.dense_selection == "none" and dense_config.dense_fusion == "add":
        raise ValueError(
            "dense_selection='none' with dense_fusion='add' has no gate to close, so the converted model could not "
            "start equal to the Mamba; use dense_selection='mlp' or 'linear' (or dense_fusion='concat')."
        )
    model = DenseMambaForCausalLM(dense_config)
    tied = dense_config.tie_word_embeddings
    expected = {
        name: tuple(t.shape)
        for name, t in model.state_dict().items()
        if "dense" not in name and not (tied and name == "lm_head.weight")
    }
    check_state_dict(state_dict, expected, source, optional={"lm_head.weight"} if tied else set())
    model.load_state_dict({name: state_dict[name] for name in expected}, strict=False)
    if dense_config.dense_fusion == "add":
        for layer in model.backbone.layers:
            for connection in (layer.mixer.dense_u, layer.mixer.dense_B):
                if connection is not None:
                    connection.zero_gates()
    return model.eval()


# ----------------------------------------------------------------------------------------------- DenseRetNet


def official_denseretnet_config(config: dict, source: str = "the checkpoint") -> DenseRetNetConfig:
    """The :class:`~hf_densessm.DenseRetNetConfig` of an authors' DenseRetNet ``config.json`` (a dict).

    Their keys (DESIGN.md §2) map to ours by name, ``dense_block_layers`` to ``dense_layers``; the connection is
    theirs: identity projection, 2-layer MLP gate ``d -> d // 32 -> out`` shared by the predecessors, add fusion,
    every layer but the first. ``rms_norm_eps`` (default 1e-6), ``dropout`` (0), ``initializer_range``,
    ``tie_word_embeddings`` (False) and the token ids are taken when present. Keys their forward pass does not read
    (``max_position_embeddings``, ``hidden_act``, ``layernorm_eps``, ``retnorm``; ``deepnorm``, which only scales
    their initialization) are ignored.

    Raises:
        ValueError: ``model_type`` is neither "llama" (what their config says) nor absent; a required key is
            missing (all listed); ``dense_block_layers < 1`` (their code then still normalizes ``k`` and ``v`` in
            layers >= 1, which no DenseRetNetConfig expresses); ``hidden_size < 32`` (their gate would have width 0);
            or a value is out of range for DenseRetNetConfig.
    """
    _check_model_type(
        config, ("llama", None), source, "'llama' with the DenseRetNet keys (the authors' published config.json)"
    )
    missing = [key for key in OFFICIAL_DENSERETNET_KEYS if key not in config]
    if missing:
        raise ValueError(
            f"config.json of {source} is not an authors' DenseRetNet config: missing {', '.join(missing)}."
        )
    m = config["dense_block_layers"]
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"`dense_block_layers` of {source} must be an int >= 1, got {m!r}.")
    if config["hidden_size"] < 32:
        raise ValueError(f"`hidden_size` of {source} must be >= 32 (their gates are d -> d // 32 -> ...).")
    optional = {
        key: config[key]
        for key in (
            "rms_norm_eps",
            "dropout",
            "initializer_range",
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
            "tie_word_embeddings",
        )
        if config.get(key) is not None
    }
    return DenseRetNetConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        query_key_dim=config["query_key_dim"],
        v_factor=config["v_factor"],
        dense_layers=m,
        dense_projection="identity",
        dense_selection="mlp",
        dense_shared_gate=True,
        dense_fusion="add",
        dense_every=1,
        dense_gate_hidden_size=config["hidden_size"] // 32,
        **optional,
    )


def official_denseretnet_name(name: str) -> str:
    """The authors' parameter name of our DenseRetNet parameter ``name`` (e.g.
    ``model.layers.3.self_attn.hidden_proj.weight`` -> ``model.layers.3.self_attn.to_hidden.0.weight``)."""
    for ours, theirs in OFFICIAL_DENSERETNET_RENAMES:
        name = name.replace(ours, theirs)
    return name


def denseretnet_from_official(src: str | Path) -> DenseRetNetForCausalLM:
    """Load a checkpoint of the authors' published DenseRetNet into :class:`~hf_densessm.DenseRetNetForCausalLM`,
    which computes the same function (DESIGN.md §2; the parallel form's per-row rescalings are absorbed by the
    per-head RMSNorm, see ``modeling_denseretnet``).

    Names map as in DESIGN.md §2 (``to_hidden.0`` -> ``hidden_proj``, ``to_out.0`` -> ``o_proj``,
    ``k_select``/``v_select`` -> ``dense_k.gate``/``dense_v.gate``, the rest unchanged). Their ``group_norm`` weight
    is one ``(d_v / H,)`` vector shared by the heads; ours is ``(d_v,)``, so it is tiled ``H`` times.

    Layer 0: the authors' blocks create ``k_select``, ``v_select``, ``k_norm``, ``v_norm`` in every layer, but their
    forward pass uses them only in layers with predecessors (``dense = idx >= 1``); layer 0 of our model has none of
    them. So layer 0's copies are accepted and dropped (they never affected an output), present or not. Their
    ``model.retnet_rel_pos.angle`` / ``.decay`` buffers, if saved, are checked against the angles and decays computed
    here and dropped. Every other name must match exactly.

    Args:
        src: folder with the authors' ``config.json`` and weights (``pytorch_model.bin`` or safetensors, sharded or
            not).

    Returns:
        A float32 :class:`~hf_densessm.DenseRetNetForCausalLM` in eval mode.

    Raises:
        FileNotFoundError, ValueError: see :func:`load_checkpoint_folder` and :func:`official_denseretnet_config`;
            missing, unexpected or misshapen parameter names (all listed); saved rotary angles or decays that differ
            from the published definition.
    """
    raw_config, state_dict = load_checkpoint_folder(src)
    source = repr(str(src))
    config = official_denseretnet_config(raw_config, source)
    model = DenseRetNetForCausalLM(config)
    heads, tied = config.num_attention_heads, config.tie_word_embeddings
    ours = {name: t for name, t in model.state_dict().items() if not (tied and name == "lm_head.weight")}
    theirs_of = {name: official_denseretnet_name(name) for name in ours}
    expected = {theirs_of[name]: tuple(t.shape) for name, t in ours.items()}
    for name, t in ours.items():
        if name.endswith(".self_attn.group_norm.weight"):
            expected[theirs_of[name]] = (t.shape[0] // heads,)
    optional = {name for name in OFFICIAL_REL_POS}
    optional |= {"lm_head.weight"} if tied else set()
    for i, layer in enumerate(model.model.layers):
        if layer.self_attn.dense_k is None:
            optional |= {f"model.layers.{i}.self_attn.{part}.weight" for part in OFFICIAL_DENSE_ONLY}
    check_state_dict(state_dict, expected, source, optional)
    _check_rel_pos(state_dict, config, source)
    converted = {}
    for name in ours:
        tensor = state_dict[theirs_of[name]]
        converted[name] = tensor.repeat(heads) if name.endswith(".self_attn.group_norm.weight") else tensor
    missing, unexpected = model.load_state_dict(converted, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def _check_rel_pos(state_dict: dict, config: DenseRetNetConfig, source: str) -> None:
    """Compare saved rotary angles / log-decays with the published definition (DESIGN.md §2)."""
    head_dim = config.query_key_dim // config.num_attention_heads
    exponents = torch.linspace(0, 1, head_dim // 2, dtype=torch.float64)
    reference = {
        "model.retnet_rel_pos.angle": (config.rope_theta**-exponents).repeat_interleave(2),
        "model.retnet_rel_pos.decay": torch.tensor(
            [math.log(1 - 2 ** (-5 - h)) for h in range(config.num_attention_heads)], dtype=torch.float64
        ),
    }
    for name, value in reference.items():
        saved = state_dict.get(name)
        if saved is None:
            continue
        if saved.shape != value.shape or not torch.allclose(saved.double(), value, rtol=1e-4, atol=1e-6):
            raise ValueError(
                f"{name} of {source} differs from the published definition (shape {tuple(saved.shape)}, expected "
                f"{tuple(value.shape)}): this checkpoint is not the architecture DenseRetNetConfig describes."
            )


__all__ = [
    "check_state_dict",
    "densemamba_from_mamba",
    "denseretnet_from_official",
    "load_checkpoint_folder",
    "official_denseretnet_config",
    "official_denseretnet_name",
]
