"""Hub-ready folders: what the models' ``save_pretrained`` / ``push_to_hub`` run (never shipped with remote code);
one module per job, :mod:`.bundle`, :mod:`.card`, :mod:`.saving` (docs/hub_and_conversion.md)."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from transformers import PreTrainedModel

from .bundle import BUNDLE_MARKER, BundleError, hub_auto_map, is_bundled_code, remote_code, write_bundle
from .card import CARD_MARKER, is_generated_card, model_card, write_model_card
from .saving import staged_save

_HUB_ARGUMENTS = ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision", "tags")


def replaced_by_save(path: Path, variant: str | None = None) -> bool:
    """Whether an entry of a folder is owned by a save of this package, so that a new save that does not rewrite
    it deletes it: weights of the same ``variant`` (``model[.variant][-0000k-of-0000n].safetensors``, their index),
    a generated code file (:func:`~.bundle.is_bundled_code`), a generated card (:func:`~.card.is_generated_card`)."""
    v = re.escape(f".{variant}") if variant else ""
    weights = rf"model{v}(-\d{{5}}-of-\d{{5}})?\.safetensors|model\.safetensors\.index{v}\.json"
    if re.fullmatch(weights, path.name):
        return path.is_file() and not path.is_symlink()
    return is_bundled_code(path) or (path.name == "README.md" and is_generated_card(path))


def save_pretrained(
    model: PreTrainedModel, save_directory: str | os.PathLike, is_main_process: bool = True,
    state_dict: dict | None = None, push_to_hub: bool = False, **kwargs,
):
    """``model.save_pretrained``: ``PreTrainedModel.save_pretrained`` (same arguments), plus the generated remote
    code, ``auto_map`` and the model card (an existing ``README.md`` this package did not write is kept), all written
    kill-safely (:func:`~.saving.staged_save`); ``push_to_hub=True`` (with ``repo_id``, ``token``, ... as transformers
    takes them) then runs ``model.push_to_hub``. Left to transformers unchanged: ``is_main_process=False``,
    ``distributed_checkpoint=True``, models with PEFT adapters loaded (only the adapters are saved) and models loaded
    as remote code.

    Raises:
        NotADirectoryError: ``save_directory`` is a file.
        BundleError: no remote code was generated for the model's type (nothing is written).
    """
    if (
        model.is_remote_code()
        or not is_main_process
        or kwargs.get("distributed_checkpoint", False)
        or getattr(model, "_hf_peft_config_loaded", False)
    ):
        return PreTrainedModel.save_pretrained(
            model, save_directory, is_main_process=is_main_process, state_dict=state_dict, push_to_hub=push_to_hub,
            **kwargs,
        )
    hub_kwargs = {key: kwargs.pop(key) for key in _HUB_ARGUMENTS if key in kwargs}
    variant = kwargs.get("variant")
    with staged_save(save_directory, lambda path: replaced_by_save(path, variant), variant) as staging:
        PreTrainedModel.save_pretrained(model, staging, state_dict=state_dict, **kwargs)
        write_bundle(model, staging)
        old_card = Path(save_directory) / "README.md"
        if not old_card.exists() or is_generated_card(old_card):
            write_model_card(model, staging)
    if push_to_hub:
        repo_id = hub_kwargs.pop("repo_id", Path(save_directory).resolve().name)
        model.push_to_hub(
            repo_id, token=kwargs.get("token"), max_shard_size=kwargs.get("max_shard_size", "50GB"), **hub_kwargs
        )


def push_to_hub(
    model: PreTrainedModel, repo_id: str, *, commit_message: str | None = None, commit_description: str | None = None,
    private: bool | None = None, token: bool | str | None = None, revision: str | None = None, create_pr: bool = False,
    max_shard_size: int | str | None = "50GB", tags: list[str] | None = None,
):
    """``model.push_to_hub``: upload the folder :func:`save_pretrained` writes to the Hub repository ``repo_id``
    (created if needed) as one commit, with transformers' arguments and return value (the commit info) but the
    DenseSSM card naming ``repo_id``, unless the repository has a ``README.md`` (docs/hub_and_conversion.md).
    Raises huggingface_hub's errors (no network, no token, no write access)."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True)
    has_card = api.file_exists(repo_id, "README.md", revision=revision)
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    tags += [tag for tag in (getattr(model, "model_tags", None) or []) if tag not in tags]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "repo"
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        if has_card:
            (folder / "README.md").unlink(missing_ok=True)
        else:
            write_model_card(model, folder, repo_id=repo_id, tags=tags)
        return api.upload_folder(
            repo_id=repo_id, folder_path=folder, commit_message=commit_message or "Upload model",
            commit_description=commit_description, revision=revision, create_pr=create_pr,
        )


__all__ = [
    "BUNDLE_MARKER", "CARD_MARKER", "BundleError", "hub_auto_map", "model_card", "push_to_hub", "remote_code",
    "replaced_by_save", "save_pretrained", "staged_save", "write_bundle", "write_model_card",
]
