"""Checkpoint conversion (command line: ``python -m hf_densessm.convert``): :func:`densemamba_from_mamba` upcycles a
transformers Mamba, :func:`denseretnet_from_official` loads the authors' DenseRetNet (docs/hub_and_conversion.md)."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
from pathlib import Path

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, cached_file
from transformers.utils.hub import get_checkpoint_shard_files

from ..configuration import DenseMambaConfig, DenseRetNetConfig
from ..modeling import DenseMambaForCausalLM, DenseRetNetForCausalLM
from ..modeling.dense_connection import DenseHiddenConnection
from ..modeling.modeling_denseretnet import rotary_angles
from ..ops.retention import retention_gamma

#: What transformers reads as a checkpoint's weights, in its order of preference.
WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
#: The keywords :func:`densemamba_from_mamba` takes: DenseMamba's dense knobs.
DENSE_ARGUMENTS = tuple(knob.name for knob in DenseMambaConfig.knobs())
# Config fields a transformers MambaConfig shares with DenseMambaConfig.
MAMBA_FIELDS = tuple(name for name, p in inspect.signature(DenseMambaConfig.__init__).parameters.items()
                     if name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD)
# The authors' config keys (docs/hub_and_conversion.md): required, taken when present; their dense connection.
OFFICIAL_DENSERETNET_KEYS = ("hidden_size", "query_key_dim", "num_attention_heads", "num_hidden_layers", "v_factor",
                             "dense_block_layers", "vocab_size")
OFFICIAL_OPTIONAL_KEYS = ("rms_norm_eps", "dropout", "initializer_range", "pad_token_id", "bos_token_id",
                          "eos_token_id", "tie_word_embeddings")
OFFICIAL_CONNECTION = dict(dense_projection="identity", dense_selection="mlp", dense_shared_gate=True,
                           dense_fusion="add", dense_every=1)
# Our DenseRetNet parameter names -> the authors' (the others are the same in both).
OFFICIAL_DENSERETNET_RENAMES = ((".self_attn.hidden_proj.", ".self_attn.to_hidden.0."),
                                (".self_attn.o_proj.", ".self_attn.to_out.0."),
                                (".self_attn.dense_k.gate.", ".self_attn.k_select."),
                                (".self_attn.dense_v.gate.", ".self_attn.v_select."))
#: ``key_mapping`` of ``from_pretrained`` for the authors' names (a regular expression of theirs -> ours).
OFFICIAL_KEY_MAPPING = {re.escape(theirs): ours for ours, theirs in OFFICIAL_DENSERETNET_RENAMES}
#: ``from_pretrained`` keywords of both converters: float32, wrong shapes reported (:func:`_check_loading_info`).
_LOAD_KWARGS = dict(dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True)
# Parameters the authors' blocks create in every layer but use only in layers with predecessors (``dense=idx>=1``).
OFFICIAL_DENSE_ONLY = ("k_select.fc1", "k_select.fc2", "v_select.fc1", "v_select.fc2", "k_norm", "v_norm")
# Persistent buffers of the authors' relative position module (rotary angles and log-decays), recomputed here.
OFFICIAL_REL_POS = ("model.retnet_rel_pos.angle", "model.retnet_rel_pos.decay")


def read_config(src: str | os.PathLike) -> dict:
    """The ``config.json`` (a dict) of the checkpoint ``src``: a local folder, which must hold one of
    :data:`WEIGHT_FILES`, or a Hub repository id (a ``Path`` is always a folder). ``FileNotFoundError``: ``src`` does
    not exist, has no ``config.json`` or no weights; ``ValueError``: ``config.json`` is not a JSON object; ``OSError``:
    a Hub repository cannot be read (transformers')."""
    if not os.path.isdir(src):
        if not isinstance(src, Path) and not os.path.exists(src):
            with contextlib.suppress(HFValidationError):
                validate_repo_id(str(src))
                return PretrainedConfig.get_config_dict(str(src))[0]
        raise FileNotFoundError(f"Checkpoint folder {str(src)!r} does not exist or is not a folder.")
    folder = Path(src)
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
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise FileNotFoundError(f"{str(folder)!r} has no weights: looked for {', '.join(WEIGHT_FILES)} (it holds: "
                                f"{', '.join(holds)}).")
    return config


def read_tensors(src: str | os.PathLike, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (those present) of the checkpoint ``src``, read from the weights files transformers
    would load (:data:`WEIGHT_FILES`, local or Hub); ``ValueError`` naming a weights file that cannot be read."""
    files: list[str] = []
    for name in WEIGHT_FILES:  # the first present, as transformers picks it; an index names the shards
        found = cached_file(str(src), name, _raise_exceptions_for_missing_entries=False)
        if found is not None:
            files = get_checkpoint_shard_files(str(src), found)[0] if name.endswith(".json") else [found]
            break
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            if file.endswith(".safetensors"):
                with safe_open(file, framework="pt") as weights:
                    tensors.update({name: weights.get_tensor(name) for name in names & set(weights.keys())})
            else:
                weights = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                tensors.update({name: weights[name] for name in names & set(weights)})
        except Exception as error:  # corrupt or foreign file: say which one
            raise ValueError(f"Cannot read the weights file {file}: {error}") from error
    return tensors


def _check_loading_info(info: dict, source: str, rename=lambda name: name, optional=frozenset(), new=frozenset()):
    """One ``ValueError`` listing every missing name (but ``new`` ones), unexpected name (but ``optional`` ones) and
    shape mismatch in ``from_pretrained``'s loading ``info``, names through ``rename``, if there are any."""
    wrong = [f"{rename(n)}: {tuple(saved)}, expected {tuple(shape)}" for n, saved, shape in info["mismatched_keys"]]
    unexpected = {rename(name) for name in info["unexpected_keys"]} - set(optional)
    missing = [rename(name) for name in info["missing_keys"] if name not in new]
    problems = [
        f"{title} ({len(names)}):\n  " + "\n  ".join(names[:40])
        + (f"\n  ... and {len(names) - 40} more" if len(names) > 40 else "")
        for title, names in (("missing parameters", sorted(missing)), ("unexpected parameters", sorted(unexpected)),
                             ("wrong shapes", sorted(wrong)))
        if names
    ]
    if problems:
        raise ValueError(f"The state dict of {source} does not match the model:\n" + "\n".join(problems))


def _check_model_type(config: dict, allowed: tuple, source: str, expected_what: str) -> None:
    """``ValueError`` unless ``config``'s ``model_type`` is in ``allowed``."""
    model_type = config.get("model_type")
    if model_type not in allowed:
        hint = " It is already an hf_densessm model: load it with `AutoModelForCausalLM.from_pretrained`."
        hint = hint if model_type in ("densemamba", "denseretnet") else ""
        raise ValueError(f"config.json of {source} has model_type {model_type!r}; expected {expected_what}.{hint}")


def densemamba_from_mamba(src, **dense_kwargs) -> DenseMambaForCausalLM:
    """Upcycle a pretrained Mamba into DenseMamba whose dense parameters start as a no-op (docs/hub_and_conversion.md).

    Args:
        src: a transformers Mamba checkpoint (local folder or Hub id, e.g. ``"state-spaces/mamba-130m-hf"``) or a
            loaded ``MambaForCausalLM`` / ``MambaModel``.
        dense_kwargs: the dense knobs of the result (:data:`DENSE_ARGUMENTS`; defaults as ``DenseMambaConfig``).

    Returns:
        A float32 :class:`~hf_densessm.DenseMambaForCausalLM` in eval mode.

    Raises:
        TypeError: a keyword that is not a dense knob, or ``src`` of another type.
        FileNotFoundError, ValueError: see :func:`read_config`; ``model_type`` not "mamba"; a refused knob value;
            missing, unexpected or misshapen names (all listed); ``dense_selection="none"`` with ``"add"`` fusion.
        OSError: a Hub repository cannot be downloaded (transformers' error).
    """
    if unknown := sorted(set(dense_kwargs) - set(DENSE_ARGUMENTS)):
        raise TypeError(f"densemamba_from_mamba() takes only the dense knobs {DENSE_ARGUMENTS}; got {unknown}.")
    if isinstance(src, nn.Module) and hasattr(src, "config"):
        config, source = src.config.to_dict(), f"the given {type(src).__name__}"
    elif isinstance(src, (str, Path)):
        config, source = read_config(src), repr(str(src))
    else:
        raise TypeError(f"`src` must be a transformers Mamba model or a folder, got {type(src).__name__}.")
    _check_model_type(config, ("mamba",), source, "'mamba' (a transformers Mamba checkpoint, e.g. "
                      "state-spaces/mamba-130m-hf)")
    dense_config = DenseMambaConfig(**{k: config[k] for k in MAMBA_FIELDS if k in config}, **dense_kwargs)
    if dense_config.dense_layers and dense_config.dense_selection == "none" and dense_config.dense_fusion == "add":
        raise ValueError("dense_selection='none' with dense_fusion='add' has no gate to close, so the converted model "
                         "could not start equal to the Mamba; use dense_selection='mlp' or 'linear' (or "
                         "dense_fusion='concat').")
    state_dict = None
    if isinstance(src, nn.Module):  # copies (the result shares no tensor with src), under the CausalLM's names
        prefix = "" if any(name.startswith("backbone.") for name in src.state_dict()) else "backbone."  # MambaModel
        state_dict, src = {prefix + name: tensor.clone() for name, tensor in src.state_dict().items()}, None
    model, info = DenseMambaForCausalLM.from_pretrained(src, config=dense_config, state_dict=state_dict, **_LOAD_KWARGS)
    _check_loading_info(info, source, optional={"lm_head.weight"}, new={n for n in model.state_dict() if "dense" in n})
    if dense_config.dense_fusion == "add":
        for module in model.modules():
            if isinstance(module, DenseHiddenConnection):
                module.zero_gates()
    return model.eval()


def official_denseretnet_config(config: dict, source: str = "the checkpoint") -> DenseRetNetConfig:
    """The :class:`~hf_densessm.DenseRetNetConfig` of an authors' DenseRetNet ``config.json`` dict (the key mapping:
    docs/hub_and_conversion.md); ``source`` names the file in errors. ``ValueError``: ``model_type`` neither "llama"
    nor absent; required keys missing (all listed); ``dense_block_layers < 1``; ``hidden_size < 32``; a value
    DenseRetNetConfig refuses."""
    _check_model_type(config, ("llama", None), source, "'llama' with the DenseRetNet keys (the authors' published "
                      "config.json)")
    if missing := ", ".join(key for key in OFFICIAL_DENSERETNET_KEYS if key not in config):
        raise ValueError(f"config.json of {source} is not an authors' DenseRetNet config: missing {missing}.")
    m = config["dense_block_layers"]
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"`dense_block_layers` of {source} must be an int >= 1, got {m!r}.")
    if config["hidden_size"] < 32:
        raise ValueError(f"`hidden_size` of {source} must be >= 32 (their gates are d -> d // 32 -> ...).")
    fields = {key: config[key] for key in OFFICIAL_DENSERETNET_KEYS if key != "dense_block_layers"}
    fields.update({key: config[key] for key in OFFICIAL_OPTIONAL_KEYS if config.get(key) is not None})
    return DenseRetNetConfig(**fields, **OFFICIAL_CONNECTION, dense_layers=m,
                             dense_gate_hidden_size=config["hidden_size"] // 32)


def official_denseretnet_name(name: str) -> str:
    """The authors' name of our DenseRetNet parameter ``name`` (e.g. ``...self_attn.hidden_proj.weight`` ->
    ``...self_attn.to_hidden.0.weight``)."""
    for ours, theirs in OFFICIAL_DENSERETNET_RENAMES:
        name = name.replace(ours, theirs)
    return name


def denseretnet_from_official(src: str | os.PathLike) -> DenseRetNetForCausalLM:
    """Load a checkpoint of the authors' published DenseRetNet (a local folder or Hub id with their ``config.json``
    and weights) into :class:`~hf_densessm.DenseRetNetForCausalLM` (float32, eval mode), saved under our names
    (docs/hub_and_conversion.md).

    Raises:
        FileNotFoundError, ValueError: see :func:`read_config`, :func:`read_tensors` and
            :func:`official_denseretnet_config`; missing, unexpected or misshapen names (all listed, in the
            authors' names); saved rotary angles or decays that differ from the published definition.
        OSError: a Hub repository cannot be downloaded (transformers' error).
    """
    source = repr(str(src))
    config = official_denseretnet_config(read_config(src), source)
    rel_pos = read_tensors(src, set(OFFICIAL_REL_POS))  # first: a clear error on an unreadable weights file
    model, info = DenseRetNetForCausalLM.from_pretrained(src, config=config, key_mapping=OFFICIAL_KEY_MAPPING,
                                                         **_LOAD_KWARGS)
    vars(model).pop("_weight_conversions", None)  # else save_pretrained would write the authors' names back
    optional = {f"model.layers.{i}.self_attn.{part}.weight" for i, block in enumerate(model.model.layers)
                if block.self_attn.dense_k is None for part in OFFICIAL_DENSE_ONLY}
    _check_loading_info(info, source, official_denseretnet_name, optional | set(OFFICIAL_REL_POS))
    # the saved rotary angles and log-decays must be the published definition (docs/design.md §3)
    heads = config.num_attention_heads
    angle = rotary_angles(config.query_key_dim // heads, config.rope_theta).double().repeat_interleave(2)
    decay = retention_gamma(heads, dtype=torch.float64).log()
    for name, value in zip(OFFICIAL_REL_POS, (angle, decay)):
        tensor = rel_pos.get(name, value)  # an absent buffer passes
        if tensor.shape != value.shape or not torch.allclose(tensor.double(), value, rtol=1e-4, atol=1e-6):
            raise ValueError(f"{name} of {source} differs from the published definition (shape {tuple(tensor.shape)}, "
                             f"expected {tuple(value.shape)}): this checkpoint is not the architecture "
                             "DenseRetNetConfig describes.")
    return model.eval()


__all__ = ["DENSE_ARGUMENTS", "densemamba_from_mamba", "denseretnet_from_official", "official_denseretnet_config",
           "official_denseretnet_name", "read_config", "read_tensors"]
