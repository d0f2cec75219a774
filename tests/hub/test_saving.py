"""Kill-safe saves (hf_densessm.hub.saving): a save killed (SIGKILL) at any file-system step leaves every file of the
folder whole, old or new, and the user's files untouched; the next save cleans up (issue 10, item 10). Saved files
get the process umask, weights included (item 11)."""

import os
import shutil
import signal
import sys
import traceback
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from hf_densessm.hub import bundle, saving
from helpers import micro_model

USER_FILES = {"tokenizer.json": b'{"version": "1.0"}', "notes.txt": b"my notes", "runs/log.txt": b"step 1"}
# file-system audit events (sys.addaudithook) of the operations by which a save changes the disk
FS_EVENTS = {"open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.truncate", "shutil.rmtree"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def changes_disk(event: str, args: tuple) -> bool:
    """Whether the audit event ``event`` changes the file system (opening for reading does not)."""
    if event != "open":
        return event in FS_EVENTS
    mode, flags = args[1], args[2]
    return bool(flags & WRITE_FLAGS) or (isinstance(mode, str) and any(c in mode for c in "wax+"))
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes), staging folders of killed saves left out."""
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.relative_to(folder).parts[0].startswith(saving.STAGING_PREFIX)
    }


def staging_folders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(saving.STAGING_PREFIX))


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """``(old folder, old files, new model)``: the old folder is a sharded save of another model with the user's
    files beside it."""
    root = tmp_path_factory.mktemp("versions")
    old = root / "old"
    micro_model("denseretnet", seed=0).save_pretrained(old, max_shard_size="20KB")
    for name, data in USER_FILES.items():
        (old / name).parent.mkdir(exist_ok=True)
        (old / name).write_bytes(data)
    assert (old / "model.safetensors.index.json").is_file()  # the new, unsharded save makes the shards stale
    return old, snapshot(old), micro_model("denseretnet", seed=1)


def save_killed_at(model, folder: Path, step: int) -> bool:
    """Save ``model`` into ``folder`` in a forked child that SIGKILLs itself just before its ``step``-th file-system
    operation inside ``folder``; returns whether the save completed before reaching that step."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            torch.set_num_threads(1)
            prefix, count = str(folder), [0]

            def fault(event, args):
                if event in FS_EVENTS and args and isinstance(args[0], (str, os.PathLike)):
                    if os.fspath(args[0]).startswith(prefix) and changes_disk(event, args):
                        if count[0] == step:
                            os.kill(os.getpid(), signal.SIGKILL)
                        count[0] += 1

            sys.addaudithook(fault)
            model.save_pretrained(folder)
        except BaseException:
            (folder.parent / "child-error.txt").write_text(traceback.format_exc())
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status):
        error = folder.parent / "child-error.txt"
        assert os.WEXITSTATUS(status) == 0, error.read_text() if error.exists() else status
        return True
    assert os.WTERMSIG(status) == signal.SIGKILL
    return False


@pytest.mark.parametrize("existing", [True, False], ids=["over-an-old-save", "new-folder"])
def test_a_save_killed_at_any_step_leaves_every_file_old_or_new(versions, tmp_path, monkeypatch, existing):
    old_folder, old, newer = versions
    code = bundle.bundle_sources(newer)  # the code as it is now: every save of this test writes the same bytes
    monkeypatch.setattr(bundle, "bundle_sources", lambda model: code)
    reference = tmp_path / "reference"  # what a clean save leaves
    if existing:
        shutil.copytree(old_folder, reference)
    else:
        old = {}
    newer.save_pretrained(reference)
    new = snapshot(reference)
    steps = 0
    while True:
        folder = tmp_path / f"step{steps}"
        if existing:
            shutil.copytree(old_folder, folder)
        completed = save_killed_at(newer, folder, steps)
        state = snapshot(folder) if folder.exists() else {}
        for name, data in state.items():
            assert data in (old.get(name), new.get(name)), f"killed at step {steps}: {name} is neither old nor new"
        for name in set(old) & set(new):  # a file both versions have is replaced, never missing
            assert name in state, f"killed at step {steps}: {name} is missing"
        for name, data in USER_FILES.items():
            assert not existing or state[name] == data
        if completed:
            assert state == new and staging_folders(folder) == []
            break
        newer.save_pretrained(folder)  # the next save completes the folder and removes the killed save's staging
        assert snapshot(folder) == new and staging_folders(folder) == []
        shutil.rmtree(folder)
        steps += 1
    assert steps > 20  # every step of the save was interrupted once: writing, publishing, removing stale shards


def test_a_running_save_keeps_its_staging_folder(tmp_path):
    running = tmp_path / f"{saving.STAGING_PREFIX}12345-abcdef12"
    running.mkdir()
    (running / "model.safetensors").write_bytes(b"half written")
    lock = FileLock(running / saving.LOCK_NAME)
    with lock:
        assert saving.remove_stale_staging(tmp_path) == [] and running.is_dir()  # locked by its save
    # the lock died with its holder: now the folder is stale
    assert saving.remove_stale_staging(tmp_path) == [running.name] and not running.exists()


def test_stale_files_are_only_the_saves_own(tmp_path):
    """Only weights of the saved variant, generated code and a generated card are replaced; user files never."""
    from hf_densessm.hub import replaced_by_save

    micro_model("densemamba").save_pretrained(tmp_path)
    user = {
        "model.fp16.safetensors": b"other variant",
        "model-00001-of-00002.bin": b"bin shard",
        "helper.py": b"print('mine')\n",
        "modeling_extra.py": b"# my own modeling code\n",
    }
    for name, data in user.items():
        (tmp_path / name).write_bytes(data)
    owned = {p.name for p in tmp_path.iterdir() if replaced_by_save(p)}
    assert "model.safetensors" in owned and "README.md" in owned and "modeling_densemamba.py" in owned
    assert not owned & set(user) and not owned & {"config.json", "generation_config.json"}
    assert replaced_by_save(tmp_path / "model.fp16.safetensors", variant="fp16")
    (tmp_path / "README.md").write_text("# my card\n")
    assert not replaced_by_save(tmp_path / "README.md")


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=["022", "002", "077"])
def test_saved_files_get_the_process_umask(tmp_path, umask):
    """Issue 10, item 11: the weights too (safetensors alone writes 0o600)."""
    previous = os.umask(umask)
    try:
        micro_model("densemamba").save_pretrained(tmp_path / "out", max_shard_size="20KB")
    finally:
        os.umask(previous)
    files = list((tmp_path / "out").iterdir())
    assert any(p.name.endswith(".safetensors") for p in files) and (tmp_path / "out" / "config.json").is_file()
    for path in files:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path.name
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
