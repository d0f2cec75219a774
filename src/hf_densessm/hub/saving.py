"""Kill-safe saving into a folder that may hold other files (docs/hub_and_conversion.md, "Saving survives a hard
kill"): staged files moved in with ``os.replace``, each staging folder locked with ``filelock`` while its save runs."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

STAGING_PREFIX = ".hf_densessm-saving-"
LOCK_NAME = ".lock"  # inside a staging folder: held by its save while it runs; never published


def _publish_order(name: str) -> tuple:
    """Weights first, ``config.json`` (which names the code and weights the folder needs) last."""
    return (name == "config.json", not name.endswith((".safetensors", ".safetensors.index.json")), name)


def remove_stale_staging(folder: str | os.PathLike) -> list[str]:
    """Delete the staging folders that killed saves left in ``folder``; returns their names. A staging folder whose
    lock (:data:`LOCK_NAME`) a running save holds is kept."""
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


@contextlib.contextmanager
def staged_save(
    save_directory: str | os.PathLike, is_stale: Callable[[Path], bool] = lambda path: False
) -> Iterator[Path]:
    """Save into ``save_directory`` kill-safely: yields an empty staging folder inside it; on a clean exit, every file
    written there replaces the file of the same name in ``save_directory`` (with the process's new-file mode, flushed,
    by ``os.replace``; weights first, ``config.json`` last), then the entries the save did not write and for which
    ``is_stale(path)`` is true are deleted; other entries are never touched. On an exception inside the ``with``
    block, ``save_directory`` is left as it was (removed if this call created it and it is still empty). Staging
    folders of killed saves are deleted first (:func:`remove_stale_staging`).

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
        names = sorted((p.name for p in staging.iterdir() if p.name != LOCK_NAME), key=_publish_order)
        mode = _new_file_mode(staging)
        for name in names:
            path = staging / name
            if path.is_dir():
                raise IsADirectoryError(f"The save wrote the folder {name!r}; only files can be published.")
            os.chmod(path, mode)
            _fsync(path)
        published = True
        for name in names:
            os.replace(staging / name, target / name)
        for entry in sorted(target.iterdir()):
            if entry.name not in names and not entry.name.startswith(STAGING_PREFIX) and is_stale(entry):
                entry.unlink()
        _fsync(target)
    finally:
        lock.release()
        shutil.rmtree(staging, ignore_errors=True)
        if created and not published:
            with contextlib.suppress(OSError):
                target.rmdir()
