"""One whole save per load (docs/hub_and_conversion.md, "Saving survives a hard kill"): ``from_pretrained`` of a local
folder checks the save ids of ``config.json``, the weights and the index before and after loading. In remote code."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from ..configuration.configuration_densessm import SAVE_ID  # in config.json, safetensors headers, the shard index

try:
    import fcntl
except ImportError:  # Windows: a running save cannot be told from a killed one; a load waits for both
    fcntl = None

OWN_PREFIX = ".hf_densessm-"  # the folders a save keeps inside the target folder, never published
STAGING_PREFIX = OWN_PREFIX + "saving-"  # a save's staging folder
BACKUP_PREFIX = OWN_PREFIX + "previous-"  # the files of the previous whole save while a new save is moved in
LOCK_NAME = ".lock"  # inside a staging folder: held (flock) by its save while it runs
WAIT_S = 60.0  #: how long a load waits for a running save to make the folder whole again
PASSED = "the config passed to from_pretrained"  # its save id's entry beside the files'


class MixedSaveError(OSError):
    """The folder (with the config passed in, if any) holds files of different saves: it would load as neither."""


def file_save_id(path: Path) -> str | None:
    """The save id of ``config.json``, a ``*.safetensors`` file or a shard index; ``None`` if none or unreadable."""
    try:
        with open(path, "rb") as file:
            if path.suffix == ".safetensors":  # 8-byte little-endian header length, then the JSON header
                size = int.from_bytes(file.read(8), "little")
                return json.loads(file.read(size))["__metadata__"].get(SAVE_ID) if size <= 10**8 else None
            data = json.load(file)
            return (data if path.name == "config.json" else data["metadata"]).get(SAVE_ID)
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        return None


def save_ids(folder: Path, variant: str | None = None) -> dict[str, str | None]:
    """``{file name: save id}`` of ``config.json`` and the weight files transformers loads from ``folder``:
    ``model[.variant].safetensors`` if it exists, else the shard index and the shards it names."""
    v = f".{variant}" if variant else ""
    names = ["config.json"]
    if (folder / f"model{v}.safetensors").is_file():
        names.append(f"model{v}.safetensors")
    elif (folder / f"model.safetensors.index{v}.json").is_file():
        names.append(f"model.safetensors.index{v}.json")
        with contextlib.suppress(OSError, ValueError, LookupError, TypeError, AttributeError):
            names += sorted(set(json.loads((folder / names[-1]).read_bytes())["weight_map"].values()))
    return {name: file_save_id(folder / name) for name in names}


def save_running(folder: Path) -> bool:
    """Whether a save runs in ``folder``: it holds the lock of its staging folder."""
    for entry in folder.glob(STAGING_PREFIX + "*"):
        try:
            fd = os.open(entry / LOCK_NAME, os.O_RDONLY)
        except OSError:
            continue
        try:
            if fcntl is None:
                return True
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while the save holds its exclusive lock
        except OSError:
            return True
        finally:
            os.close(fd)
    return False


def _error(folder: Path, ids: dict, running: bool) -> MixedSaveError:
    """The error for ``folder`` whose files (and config passed in) carry the save ids ``ids``."""
    files = {name: save_id for name, save_id in ids.items() if name != PASSED}
    if ids.get(PASSED) == ids.get("config.json"):
        ids = files
    found = "; ".join(f"{f'save {i}' if i else 'no save id'}: {', '.join(n for n, s in ids.items() if s == i)}"
                      for i in dict.fromkeys(ids.values()))
    if running:
        return MixedSaveError(f"{folder} did not hold one whole save for {WAIT_S:.0f} s while saves ran in it "
                              f"({found}). Load it again when no save is running.")
    if len(set(files.values())) == 1:
        return MixedSaveError("The config passed to from_pretrained (by you, or by an AutoModel class that read it "
                              f"just before) is not of the save {folder} holds ({found}): load again (the folder was "
                              f"saved again meanwhile), or set the config's `{SAVE_ID}` to None to load these weights "
                              "with it.")
    backups = sorted(str(p) for p in folder.glob(BACKUP_PREFIX + "*") if p.is_dir())
    how = (f"The previous whole save is kept in {' or '.join(backups)}: load it from there and save it again into the "
           "folder, or save the new model again." if backups else "Save the model again into the folder.")
    return MixedSaveError(f"{folder} holds files of different saves, so it would load as neither ({found}): a save "
                          f"into it was interrupted, or files were copied in from another save. {how}")


def load_one_save(load, path, kwargs: dict):
    """``load()`` (transformers' ``from_pretrained(path, **kwargs)``); for a local folder, its files (:func:`save_ids`)
    and the ``config`` passed in must name one save before and after, a load that saw the folder change runs again,
    and a running save is waited for (:data:`WAIT_S`). The loaded config's save id is dropped. ``MixedSaveError`` (an
    ``OSError``): the files belong to different saves (the message lists which file belongs to which save, and how to
    recover), or saves kept changing the folder for :data:`WAIT_S` seconds."""
    folder = Path(path, kwargs.get("subfolder") or "") if isinstance(path, (str, os.PathLike)) else None
    if folder is None or not (folder / "config.json").is_file() or kwargs.get("use_safetensors") is False:
        model = load()
    else:
        config_id = getattr(kwargs.get("config"), SAVE_ID, None)  # a config object read from a save
        passed = {PASSED: config_id} if config_id else {}
        model = _checked_load(load, folder, kwargs.get("variant"), passed)
    loaded = model[0] if isinstance(model, tuple) else model  # (model, loading info) with output_loading_info=True
    vars(loaded.config).pop(SAVE_ID, None)  # a later load with this config is not held to this save
    return model


def _checked_load(load, folder: Path, variant: str | None, passed: dict):
    """:func:`load_one_save` of a local folder; ``passed``: ``{PASSED: the config's save id}`` or ``{}``."""
    deadline = time.monotonic() + WAIT_S
    while True:
        before = {**save_ids(folder, variant), **passed}
        found = set(before.values())  # a file without an id counts only while a save runs or was cut off here
        if None in found and len(found) > 1 and not any(folder.glob(OWN_PREFIX + "*")):
            found.discard(None)
        if len(found) == 1:
            try:
                model = load()
            except Exception:
                if {**save_ids(folder, variant), **passed} == before:
                    raise
            else:
                if {**save_ids(folder, variant), **passed} == before:
                    return model
        elif ((not save_running(folder) or any(list(before.values()).count(i) == 1 for i in passed.values()))
              and {**save_ids(folder, variant), **passed} == before):  # read alike twice: not a save that just ended
            raise _error(folder, before, running=False)  # a config passed in of another save never matches again
        if time.monotonic() > deadline:
            raise _error(folder, before, running=True)
        time.sleep(0.05)
