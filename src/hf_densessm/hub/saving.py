"""Kill-safe saving into a folder that may hold other files (a tokenizer, notes, training state).

:func:`staged_save` yields an empty staging folder inside the target folder; whatever is written there (by
``PreTrainedModel.save_pretrained`` and this package) is then moved into the target one file at a time with
``os.replace``, which is atomic on one file system. So at any instant, a SIGKILL or a power cut included, every file
of the target is whole, in its old or its new version. The save never moves, deletes or hides a file it does not
own: the only files it removes are the ones the caller declares stale (an old weight shard the new save does not
rewrite, an old generated code file), after the new files are in place. A killed save leaves its staging folder
behind (hidden, named ``.hf_densessm-saving-*``); the next save into the folder deletes it.

The staged files get the mode of any new file of the process (``0o666`` less the umask), whatever the writer
chose: ``safetensors`` writes weights as ``0o600``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; stale staging folders are then recognized by age
    fcntl = None

STAGING_PREFIX = ".hf_densessm-saving-"
STALE_AFTER_S = 24 * 3600  # without fcntl, a staging folder this old belongs to a dead save


def _publish_order(name: str) -> tuple:
    """Weights first, ``config.json`` (which names the code and weights the folder needs) last."""
    return (name == "config.json", not name.endswith((".safetensors", ".safetensors.index.json")), name)


def _hold_lock(folder: Path) -> int | None:
    """Take an exclusive advisory lock on ``folder`` (released when the returned descriptor is closed or the
    process dies); ``None`` where advisory locks do not exist.

    Raises:
        BlockingIOError: another process holds the lock.
    """
    if fcntl is None:
        return None
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_stale_staging(folder: str | os.PathLike) -> list[str]:
    """Delete the staging folders that killed saves left in ``folder``; returns their names.

    A staging folder in use is locked by its save (:func:`staged_save`) and kept; where advisory locks do not exist,
    only staging folders older than :data:`STALE_AFTER_S` are deleted.
    """
    removed = []
    for entry in Path(folder).iterdir():
        if not entry.name.startswith(STAGING_PREFIX) or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            fd = _hold_lock(entry)
        except BlockingIOError:
            continue  # a save running now
        except FileNotFoundError:
            continue  # its save just finished
        try:
            if fd is not None or time.time() - entry.stat().st_mtime > STALE_AFTER_S:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        finally:
            if fd is not None:
                os.close(fd)
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
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # folders cannot be opened on Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not flush folders
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged_save(
    save_directory: str | os.PathLike, is_stale: Callable[[Path], bool] = lambda path: False
) -> Iterator[Path]:
    """Save into ``save_directory`` kill-safely: yields an empty staging folder inside it; on a clean exit, every
    file written there replaces (``os.replace``) the file of the same name in ``save_directory``, weights first and
    ``config.json`` last, and then the entries of ``save_directory`` that the save did not write and for which
    ``is_stale(path)`` is true are deleted. Other entries are never touched.

    On an exception inside the ``with`` block, ``save_directory`` is left as it was (and removed if this call
    created it and it is still empty). Staging folders of killed saves are deleted first (:func:`remove_stale_staging`).

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
    staging = target / f"{STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    lock = _hold_lock(staging)
    published = False
    try:
        yield staging
        names = sorted((path.name for path in staging.iterdir()), key=_publish_order)
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
        shutil.rmtree(staging, ignore_errors=True)
        if lock is not None:
            os.close(lock)
        if created and not published:
            with contextlib.suppress(OSError):
                target.rmdir()
