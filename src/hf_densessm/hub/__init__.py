"""Hub-ready folders (docs/hub_and_conversion.md; not shipped with remote code): the models' ``save_pretrained`` /
``push_to_hub`` add the remote code ``tools/remote_code.py`` generated into ``remote_code/`` and a model card built
from the model's own docs, saved kill-safely (:mod:`.saving`)."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from huggingface_hub import ModelCardData
from transformers import PreTrainedModel

from .saving import staged_save

_HUB_ARGUMENTS = ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision", "tags")
REMOTE_CODE = Path(__file__).resolve().parent / "remote_code"
BUNDLE_MARKER = "# hf_densessm bundle:"  # first line of every generated code file


class BundleError(RuntimeError):
    """No remote code was generated for a model's type (``python tools/remote_code.py --write`` generates it)."""


def remote_code(model) -> tuple[dict[str, str], dict[str, Path]]:
    """``(auto_map, {file name in a saved folder: its generated file})`` of ``model``'s ``config.model_type`` (from
    ``remote_code/manifest.json``); ``BundleError`` if none was generated for that model type."""
    manifest = json.loads((REMOTE_CODE / "manifest.json").read_text(encoding="utf-8"))
    entry = manifest["families"].get(model.config.model_type)
    if entry is None:
        raise BundleError(f"No remote code was generated for model_type {model.config.model_type!r} (generated: "
                          f"{sorted(manifest['families'])}): run `python tools/remote_code.py --write`.")
    return entry["auto_map"], {name: REMOTE_CODE / f"{name}.txt" for name in entry["files"]}


def write_bundle(model, folder: str | os.PathLike) -> dict[str, str]:
    """Copy the code files of ``model`` (:func:`remote_code`) into ``folder`` and set ``auto_map`` in its
    ``config.json``; returns the ``auto_map``. Raises ``FileNotFoundError`` (no ``config.json``), ``BundleError``."""
    auto_map, files = remote_code(model)
    config_file = Path(folder, "config.json")
    config = {**json.loads(config_file.read_text(encoding="utf-8")), "auto_map": auto_map}
    for name, source in files.items():
        shutil.copyfile(source, Path(folder, name))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return auto_map


def is_bundled_code(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a code file a save of this package wrote (its first line is :data:`BUNDLE_MARKER`)."""
    return Path(path).suffix == ".py" and file_head(path, len(BUNDLE_MARKER)) == BUNDLE_MARKER


CARD_MARKER = "<!-- hf_densessm model card -->"
CITATION = """@article{he2024densessm,
  title   = {DenseMamba: State Space Models with Dense Hidden Connection for Efficient Large Language Models},
  author  = {He, Wei and Han, Kai and Tang, Yehui and Wang, Chengcheng and Yang, Yujie and Guo, Tianyu and Wang, Yunhe},
  journal = {arXiv preprint arXiv:2403.00818},
  year    = {2024}
}"""


def _markdown(text: str) -> str:
    """reStructuredText inline code (````x````) and roles (``:class:`~a.B```) as Markdown code."""
    return re.sub(r":\w+:`~?([^`]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text).replace("``", "`")


def field_docs(config_class: type) -> dict[str, str]:
    """``{field: meaning}`` from the ``Args:`` section of ``config_class``'s docstring (Google style: ``name (type,
    defaults to x): meaning`` indented 4 spaces, continuation lines deeper; ``a, b (type): meaning`` documents both)."""
    section = re.search(r"^Args:\n(.*?)(?=^\S|\Z)", inspect.cleandoc(config_class.__doc__ or ""), re.M | re.S)
    docs = {}
    for entry in re.split(r"\n(?=    \S)", section.group(1).strip("\n")) if section else []:
        names, _, meaning = " ".join(entry.split()).partition(": ")
        for name in re.sub(r"\s*\(.*\)\s*$", "", names).split(","):
            docs[name.strip()] = _markdown(meaning)
    return docs


def model_card(model, files: list[str], repo_id: str | None = None, tags: list[str] | None = None) -> str:
    """The ``README.md`` of a folder holding ``model`` and ``files``: Hub metadata (``tags`` added), architecture,
    config fields (value, meaning), how to load (from ``repo_id``, else a placeholder), files, citation."""
    config = model.config
    family = type(config).__name__.removesuffix("Config")
    where = repo_id or "path/to/this/folder"
    all_tags = list(dict.fromkeys(["densessm", config.model_type, *(tag for tag in tags or [] if tag)]))
    metadata = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=all_tags).to_yaml()
    architecture = _markdown(inspect.cleandoc(sys.modules[type(model).__module__].__doc__ or ""))
    docs, parameters = field_docs(type(config)), inspect.signature(type(config).__init__).parameters.values()
    rows = [(p.name, getattr(config, p.name, None), docs.get(p.name, ""))  # the family's fields, then its knobs
            for p in parameters if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]
    rows += [(knob.name, getattr(config, knob.name), _markdown(knob.help)) for knob in type(config).knobs()]
    rows = "\n".join(f"| `{name}` | `{value!r}` | {meaning} |" for name, value, meaning in rows)
    code = ", ".join(f"`{name}`" for name in files if name.endswith(".py"))
    weights = ", ".join(f"`{name}`" for name in files if name.endswith((".safetensors", ".safetensors.index.json")))
    bos = config.bos_token_id if config.bos_token_id is not None else 0
    count = model.num_parameters()
    size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count:,}"
    return f"""---
{metadata}
---
{CARD_MARKER}

# {family} ({size} parameters, `{type(model).__name__}`)

{architecture}

## Configuration

| field | value | meaning |
|---|---|---|
{rows}

## How to load

```python
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("{where}", trust_remote_code=True)
out = model.generate(torch.tensor([[{bos}, 450, 4996]]), max_new_tokens=32)  # ids from the model's tokenizer
```

The modeling code is in this repository ({code}); it needs only `torch` and `transformers` (`triton` for the fused
CUDA kernels). With the `hf_densessm` package installed, `import hf_densessm` registers `{config.model_type}` and the
same call works without `trust_remote_code`. Weights: {weights or "none"}.

## Citation

```bibtex
{CITATION}
```
"""


def write_model_card(model, folder: str | os.PathLike, repo_id: str | None = None, tags: list[str] | None = None):
    """Write :func:`model_card` as ``folder/README.md`` (listing the files already in ``folder``); returns its path."""
    path = Path(folder, "README.md")
    files = sorted(p.name for p in path.parent.iterdir() if p.is_file() and p != path)
    path.write_text(model_card(model, files, repo_id=repo_id, tags=tags), encoding="utf-8")
    return path


def file_head(path: str | os.PathLike, size: int) -> str:
    """The first ``size`` characters of ``path`` if it is a regular file (not a symlink), else ``""``."""
    if not Path(path).is_file() or Path(path).is_symlink():
        return ""
    with open(path, encoding="utf-8", errors="replace") as file:
        return file.read(size)


def replaced_by_save(path: Path, variant: str | None = None) -> bool:
    """Whether a folder's entry is owned by a save of this package (a new save that does not rewrite it deletes it):
    weights of the same ``variant`` and their index, generated code (:func:`is_bundled_code`) or card (holding
    :data:`CARD_MARKER`; not one a person wrote)."""
    v = re.escape(f".{variant}") if variant else ""
    weights = rf"model{v}(-\d{{5}}-of-\d{{5}})?\.safetensors|model\.safetensors\.index{v}\.json"
    if re.fullmatch(weights, path.name):
        return path.is_file() and not path.is_symlink()
    return is_bundled_code(path) or (path.name == "README.md" and CARD_MARKER in file_head(path, 4096))


def save_pretrained(
    model: PreTrainedModel, save_directory: str | os.PathLike, is_main_process: bool = True,
    state_dict: dict | None = None, push_to_hub: bool = False, **kwargs,
):
    """``model.save_pretrained``: transformers' (same arguments) plus the remote code, ``auto_map`` and the model card
    (not over a ``README.md`` a person wrote), kill-safely (:func:`~.saving.staged_save`); transformers' alone for
    ``is_main_process=False``, ``distributed_checkpoint=True``, PEFT adapters and models loaded as remote code.
    ``NotADirectoryError``: ``save_directory`` is a file; ``BundleError``: no remote code was generated for the model's
    type (nothing is written)."""
    if (model.is_remote_code() or not is_main_process or kwargs.get("distributed_checkpoint", False)
            or getattr(model, "_hf_peft_config_loaded", False)):
        return PreTrainedModel.save_pretrained(model, save_directory, is_main_process=is_main_process,
                                               state_dict=state_dict, push_to_hub=push_to_hub, **kwargs)
    hub_kwargs = {key: kwargs.pop(key) for key in _HUB_ARGUMENTS if key in kwargs}
    variant = kwargs.get("variant")
    with staged_save(save_directory, lambda path: replaced_by_save(path, variant), variant) as staging:
        PreTrainedModel.save_pretrained(model, staging, state_dict=state_dict, **kwargs)
        write_bundle(model, staging)
        old_card = Path(save_directory) / "README.md"
        if not old_card.exists() or replaced_by_save(old_card):
            write_model_card(model, staging)
    if push_to_hub:
        repo_id = hub_kwargs.pop("repo_id", Path(save_directory).resolve().name)
        model.push_to_hub(repo_id, token=kwargs.get("token"), max_shard_size=kwargs.get("max_shard_size", "50GB"),
                          **hub_kwargs)


def push_to_hub(
    model: PreTrainedModel, repo_id: str, *, commit_message: str | None = None, commit_description: str | None = None,
    private: bool | None = None, token: bool | str | None = None, revision: str | None = None, create_pr: bool = False,
    max_shard_size: int | str | None = "50GB", tags: list[str] | None = None,
):
    """``model.push_to_hub``: upload the folder :func:`save_pretrained` writes to ``repo_id`` (created if needed) in
    one commit, with transformers' arguments and return value; the card names ``repo_id`` unless the repository has a
    ``README.md``. Raises huggingface_hub's errors (no network, no token, no write access)."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True)
    has_card = api.file_exists(repo_id, "README.md", revision=revision)
    tags = [*([tags] if isinstance(tags, str) else tags or []), *(getattr(model, "model_tags", None) or [])]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "repo"
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        if has_card:
            (folder / "README.md").unlink(missing_ok=True)
        else:
            write_model_card(model, folder, repo_id=repo_id, tags=tags)
        return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message or "Upload model",
                                 commit_description=commit_description, revision=revision, create_pr=create_pr)


__all__ = ["BUNDLE_MARKER", "CARD_MARKER", "BundleError", "model_card", "push_to_hub", "remote_code",
           "replaced_by_save", "save_pretrained", "staged_save", "write_bundle", "write_model_card"]
