"""Kill-safe saving into a folder that may hold other files (docs/hub_and_conversion.md, "Saving survives a hard
kill"): staged files stamped with a new save id, moved in with ``os.replace``, the previous save kept meanwhile."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from ..modeling.save_check import BACKUP_PREFIX, LOCK_NAME, OWN_PREFIX, SAVE_ID, STAGING_PREFIX, fcntl, save_ids


def stamp(path: Path, save_id: str) -> None:
    """Write ``save_id`` (:data:`SAVE_ID`) into a staged ``config.json``, shard index (its ``metadata``) or
    ``*.safetensors`` file (its header's ``__metadata__``; the tensor bytes copied unchanged); other files are left."""
    name = path.name
    if name == "config.json" or (".safetensors.index" in name and name.endswith(".json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        (data if name == "config.json" else data.setdefault("metadata", {}))[SAVE_ID] = save_id
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return
    if not name.endswith(".safetensors"):
        return
    stamped = path.with_name(path.name + ".stamped")
    with open(path, "rb") as src, open(stamped, "wb") as dst:
        size = int.from_bytes(src.read(8), "little")  # the header's length, then the JSON header
        header = json.loads(src.read(size))
        header.setdefault("__metadata__", {})[SAVE_ID] = save_id
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the tensor bytes stay 8-byte aligned, as safetensors writes them
        dst.write(len(text).to_bytes(8, "little") + text)
        dst.flush()
        offset = 8 + size
        try:
            while copied := os.copy_file_range(src.fileno(), dst.fileno(), 1 << 30, offset):
                offset += copied
        except (AttributeError, OSError):  # not Linux, or a file system without it
            src.seek(offset)
            shutil.copyfileobj(src, dst)
    os.replace(stamped, path)


def remove_stale_staging(folder: str | os.PathLike) -> list[str]:
    """Delete the staging folders that killed saves left in ``folder``; returns their names. A staging folder whose
    lock (:data:`LOCK_NAME`) a running save holds is kept; backups (:func:`keep_previous`) are never touched."""
    removed = []
    for entry in Path(folder).iterdir():
        if not entry.name.startswith(STAGING_PREFIX) or entry.is_symlink() or not entry.is_dir():
            continue
        lock = FileLock(entry / LOCK_NAME)
        try:
            lock.acquire(timeout=0)
        except (Timeout, FileNotFoundError):
            continue  # a save running now, or one that just finished
        lock.release()
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed


def _new_file_mode(folder: Path) -> int:
    """The permission bits a new file of this process gets in ``folder`` (``0o666`` less the umask)."""
    probe = folder / ".mode-probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        os.unlink(probe)


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file or, where the platform allows, a folder) to the disk."""
    with contextlib.suppress(OSError):  # folders cannot be opened on Windows, nor flushed on some file systems
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def keep_previous(target: Path, paths: list[Path], save_id: str, variant: str | None = None) -> None:
    """If ``target`` holds one whole save (with ``variant``), hard-link (else copy) the existing files of ``paths``
    into a new backup folder ``<BACKUP_PREFIX><save_id>`` and delete older backups (docs/hub_and_conversion.md)."""
    if len(set(save_ids(target, variant).values())) > 1:
        return
    old = [path for path in paths if path.is_file()]
    backups = [entry for entry in target.iterdir() if entry.name.startswith(BACKUP_PREFIX)]
    if old:
        backup = target / f"{BACKUP_PREFIX}{save_id}"
        backup.mkdir()
        for path in old:
            try:
                os.link(path, backup / path.name)
            except OSError:
                shutil.copy2(path, backup / path.name)
        _fsync(backup)
    for entry in backups:
        shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def _publishing(target: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the folder ``target``, where the platform has it: one save moves files in at a
    time."""
    fd = None
    with contextlib.suppress(AttributeError, OSError):
        fd = os.open(target, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def staged_save(
    save_directory: str | os.PathLike, is_stale: Callable[[Path], bool] = lambda path: False, variant: str | None = None
) -> Iterator[Path]:
    """Save into ``save_directory`` kill-safely (docs/hub_and_conversion.md, "Saving survives a hard kill"): yields an
    empty staging folder; on a clean exit its files, stamped (:func:`stamp`), replace those of the same name,
    ``config.json`` last, and entries not written with ``is_stale(path)`` true are deleted (``variant``: for
    :func:`keep_previous`). On an exception, ``save_directory`` is left as it was (removed if this call created it).

    Raises:
        NotADirectoryError: ``save_directory`` exists and is not a folder.
        IsADirectoryError: something wrote a folder into the staging folder (only files are published).
    """
    target = Path(save_directory)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"Cannot save into {str(save_directory)!r}: it exists and is not a folder.")
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=target))
    lock = FileLock(staging / LOCK_NAME)
    lock.acquire()
    published = False
    try:
        yield staging
        # weights first, config.json (which names what the folder needs) last
        names = sorted((p.name for p in staging.iterdir() if p.name != LOCK_NAME), key=lambda name: (
            name == "config.json", not name.endswith((".safetensors", ".safetensors.index.json")), name))
        mode = _new_file_mode(staging)
        save_id = uuid.uuid4().hex
        for name in names:
            path = staging / name
            if path.is_dir():
                raise IsADirectoryError(f"The save wrote the folder {name!r}; only files can be published.")
            stamp(path, save_id)
            os.chmod(path, mode)
            _fsync(path)
        published = True
        with _publishing(target):
            stale = [e for e in target.iterdir() if e.name not in names and not e.name.startswith(OWN_PREFIX)]
            stale = sorted(entry for entry in stale if is_stale(entry))
            keep_previous(target, [target / name for name in names] + stale, save_id, variant)
            for name in names:
                if name != "config.json":
                    os.replace(staging / name, target / name)
            for entry in stale:
                entry.unlink()
            if "config.json" in names:  # last: until it is in, the folder loads as the previous save or not at all
                os.replace(staging / "config.json", target / "config.json")
            _fsync(target)
            for entry in target.glob(BACKUP_PREFIX + "*"):
                shutil.rmtree(entry, ignore_errors=True)
    finally:
        lock.release()
        shutil.rmtree(staging, ignore_errors=True)
        if created and not published:
            with contextlib.suppress(OSError):
                target.rmdir()
