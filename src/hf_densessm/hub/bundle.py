"""The remote code of a saved folder: the flat code files and ``auto_map`` that ``tools/remote_code.py`` generated
into ``remote_code/`` (per model type in ``remote_code/manifest.json``), copied verbatim (why and how:
docs/hub_and_conversion.md, "What a saved folder holds")."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

REMOTE_CODE = Path(__file__).resolve().parent / "remote_code"
BUNDLE_MARKER = "# hf_densessm bundle:"  # first line of every generated code file


class BundleError(RuntimeError):
    """No remote code was generated for a model's type (``python tools/remote_code.py --write`` generates it)."""


def remote_code(model) -> tuple[dict[str, str], dict[str, Path]]:
    """``(auto_map, {file name in a saved folder: its generated file})`` of ``model``'s ``config.model_type``, e.g.
    ``({"AutoConfig": "configuration_densemamba.DenseMambaConfig", "AutoModelForCausalLM":
    "modeling_densemamba.DenseMambaForCausalLM", ...}, {"modeling_densemamba.py": .../modeling_densemamba.py.txt,
    ...})``.

    Raises:
        BundleError: no remote code was generated for that model type.
    """
    manifest = json.loads((REMOTE_CODE / "manifest.json").read_text(encoding="utf-8"))
    entry = manifest["families"].get(model.config.model_type)
    if entry is None:
        raise BundleError(f"No remote code was generated for model_type {model.config.model_type!r} (generated: "
                          f"{sorted(manifest['families'])}): run `python tools/remote_code.py --write`.")
    return entry["auto_map"], {name: REMOTE_CODE / f"{name}.txt" for name in entry["files"]}


def hub_auto_map(model) -> dict[str, str]:
    """The ``auto_map`` of ``model``'s saved folder (:func:`remote_code`)."""
    return remote_code(model)[0]


def write_bundle(model, folder: str | os.PathLike) -> dict[str, str]:
    """Copy the code files of ``model`` (:func:`remote_code`) into ``folder`` and set ``auto_map`` in its
    ``config.json`` (which ``config.save_pretrained`` must have written). Returns the ``auto_map``.

    Raises:
        FileNotFoundError: ``folder`` has no ``config.json``.
        BundleError: see :func:`remote_code`.
    """
    folder = Path(folder)
    auto_map, files = remote_code(model)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for name, source in files.items():
        shutil.copyfile(source, folder / name)
    config["auto_map"] = auto_map
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return auto_map


def file_head(path: str | os.PathLike, size: int) -> str:
    """The first ``size`` characters of ``path`` if it is a regular file (not a symlink), else ``""``."""
    path = Path(path)
    if not path.is_file() or path.is_symlink():
        return ""
    with open(path, encoding="utf-8", errors="replace") as file:
        return file.read(size)


def is_bundled_code(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a code file a save of this package wrote (its first line is :data:`BUNDLE_MARKER`)."""
    return Path(path).suffix == ".py" and file_head(path, len(BUNDLE_MARKER)) == BUNDLE_MARKER
