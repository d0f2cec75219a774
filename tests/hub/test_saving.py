"""Kill-safe saves (hf_densessm.hub.saving): a save killed (SIGKILL) at any file-system step leaves every file of the
folder whole, old or new, and the user's files untouched; the next save cleans up (issue 10, item 10); the folder then
loads as exactly the old model or the new one, or is refused with the backup of the old one named (issue 33, item 4).
Saved files get the process umask, weights included (issue 10, item 11)."""

import os
import re
import shutil
import signal
import sys
import traceback
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from hf_densessm import DenseMambaForCausalLM, hub
from hf_densessm.hub import saving
from hf_densessm.modeling.save_check import BACKUP_PREFIX, OWN_PREFIX, MixedSaveError, save_ids
from helpers import micro_model, same_model

USER_FILES = {"tokenizer.json": b'{"version": "1.0"}', "notes.txt": b"my notes", "runs/log.txt": b"step 1"}
# file-system audit events (sys.addaudithook) of the operations by which a save changes the disk
FS_EVENTS = {
    "open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.truncate", "os.link", "shutil.rmtree"
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def changes_disk(event: str, args: tuple) -> bool:
    """Whether the audit event ``event`` changes the file system (opening for reading does not)."""
    if event != "open":
        return event in FS_EVENTS
    mode, flags = args[1], args[2]
    return bool(flags & WRITE_FLAGS) or (isinstance(mode, str) and any(c in mode for c in "wax+"))
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child")


SAVE_ID = re.compile(rb'("_save_id": ?")[0-9a-f]{32}"')


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes, each save's own id blanked), the staging folders of killed
    saves and backups left out."""
    return {
        path.relative_to(folder).as_posix(): SAVE_ID.sub(rb'\1' + b"0" * 32 + b'"', path.read_bytes())
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.relative_to(folder).parts[0].startswith(OWN_PREFIX)
    }


def own_folders(folder: Path) -> list[str]:
    """The staging folders and backups in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(OWN_PREFIX))


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


def save_killed_at(model, folder: Path, step: int, publish_only: bool = False, **kwargs) -> bool:
    """Save ``model`` into ``folder`` in a forked child that SIGKILLs itself just before its ``step``-th file-system
    operation inside ``folder`` (``publish_only``: not counting those only inside its staging folder); returns whether
    the save completed before reaching that step."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            torch.set_num_threads(1)
            prefix, staging, count = str(folder), str(folder / saving.STAGING_PREFIX), [0]

            def fault(event, args):
                paths = [os.fspath(arg) for arg in args[:2] if isinstance(arg, (str, os.PathLike))]
                inside = [path for path in paths if path.startswith(prefix)]
                if publish_only:
                    inside = [path for path in inside if not path.startswith(staging)]
                if event in FS_EVENTS and inside and changes_disk(event, args):
                    if count[0] == step:
                        os.kill(os.getpid(), signal.SIGKILL)
                    count[0] += 1

            sys.addaudithook(fault)
            model.save_pretrained(folder, **kwargs)
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
def test_a_save_killed_at_any_step_leaves_every_file_old_or_new(versions, tmp_path, existing):
    old_folder, old, newer = versions
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
            assert state == new and own_folders(folder) == []
            break
        newer.save_pretrained(folder)  # the next save completes the folder and removes the killed save's staging
        assert snapshot(folder) == new and own_folders(folder) == []
        shutil.rmtree(folder)
        steps += 1
    assert steps > 20  # every step of the save was interrupted once: writing, publishing, removing stale shards


@pytest.fixture(scope="module")
def issue_pair(tmp_path_factory):
    """Issue 33's two models, of equal parameter shapes: ``(old, new, old folder)``, the old one (DenseMamba
    ``dense_layers=4``) saved in shards."""
    old = micro_model("densemamba", seed=0, dense_layers=4)
    new = micro_model("densemamba", seed=1, dense_layers=2)
    assert {k: v.shape for k, v in old.state_dict().items()} == {k: v.shape for k, v in new.state_dict().items()}
    folder = tmp_path_factory.mktemp("issue33") / "old"
    old.save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("model-*.safetensors"))) == 2
    return old, new, folder


@pytest.fixture
def no_code(monkeypatch):
    """Saves write no code files (the package's classes load the model; fewer steps to kill)."""
    monkeypatch.setattr(hub, "remote_code", lambda model: ({}, {}))


@pytest.mark.parametrize("shards", ["100KB", None], ids=["same-shards", "unsharded"])
def test_a_killed_save_loads_as_the_old_or_the_new_model_or_is_refused(issue_pair, no_code, tmp_path, shards):
    """Issue 33, item 4: a save killed at any step of its publishing over a folder of a model of the same shapes
    never leaves a folder that loads as a third model; a refused folder names the backup, which loads as the old
    model bit for bit, and saving that again over the mixed folder puts the old model back. (That the next save of
    the new model completes a killed one: test_a_save_killed_at_any_step_leaves_every_file_old_or_new.)"""
    old, new, old_folder = issue_pair
    kwargs = {"max_shard_size": shards} if shards else {}
    seen, step = set(), 0
    while True:
        folder = tmp_path / f"step{step}"
        shutil.copytree(old_folder, folder)
        completed = save_killed_at(new, folder, step, publish_only=True, **kwargs)
        try:
            loaded = DenseMambaForCausalLM.from_pretrained(folder)
        except MixedSaveError as error:
            backups = sorted(folder.glob(BACKUP_PREFIX + "*"))
            assert len(backups) == 1 and f"kept in {backups[0]}:" in str(error), (step, str(error))
            previous = DenseMambaForCausalLM.from_pretrained(backups[0])  # the recovery the message gives
            assert same_model(previous, old), step
            previous.save_pretrained(folder, **kwargs)  # over the mixed folder: the backup stays until it is whole
            assert same_model(DenseMambaForCausalLM.from_pretrained(folder), old) and own_folders(folder) == []
            seen.add("refused")
        else:
            assert same_model(loaded, old) or same_model(loaded, new), f"killed at step {step}: a third model loads"
            seen.add("old" if same_model(loaded, old) else "new")
        shutil.rmtree(folder)
        if completed:
            break
        step += 1
    assert seen == {"old", "refused", "new"} and step > 10


def test_the_backup_is_of_a_whole_save_only(issue_pair, tmp_path):
    """The previous files are kept (hard links) only if they are one whole save; an older backup is then dropped,
    while over a mixed folder the backup an interrupted save left is kept. No cleanup deletes a backup."""
    old, new, old_folder = issue_pair
    folder = tmp_path / "folder"
    shutil.copytree(old_folder, folder)
    replaced = [folder / name for name in save_ids(folder)]  # config.json, the index and the shards
    (folder / f"{BACKUP_PREFIX}older").mkdir()  # as a save killed after its config.json was in leaves it
    saving.keep_previous(folder, replaced, "first")
    backup = folder / f"{BACKUP_PREFIX}first"
    assert own_folders(folder) == [backup.name] and all(
        (backup / path.name).stat().st_ino == path.stat().st_ino for path in replaced
    )
    assert saving.remove_stale_staging(folder) == [] and backup.is_dir()
    new.save_pretrained(tmp_path / "new", max_shard_size="100KB")
    os.replace(tmp_path / "new" / replaced[-1].name, replaced[-1])  # one shard of another save, as a kill leaves it
    saving.keep_previous(folder, replaced, "second")
    assert own_folders(folder) == [backup.name]  # mixed: the whole old save stays the backup
    assert same_model(DenseMambaForCausalLM.from_pretrained(backup), old)
    new.save_pretrained(folder, max_shard_size="20KB")
    assert own_folders(folder) == [] and same_model(DenseMambaForCausalLM.from_pretrained(folder), new)


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


def test_a_torn_read_of_a_save_that_ended_meanwhile_is_read_again(tmp_path, monkeypatch):
    """A load reads the files' save ids one by one: a save finishing in between gives a mixed view while no save runs
    any more (seen once in CI's racing test). The load reads the ids again before refusing, and loads the whole
    save."""
    from hf_densessm.modeling import save_check

    model = micro_model("densemamba")
    model.save_pretrained(tmp_path / "folder")
    real, calls = save_check.save_ids, []

    def torn_once(folder, variant=None):
        ids = real(folder, variant)
        calls.append(1)
        return {**ids, "config.json": "0" * 32} if len(calls) == 1 else ids  # the first read: config of another save

    monkeypatch.setattr(save_check, "save_ids", torn_once)
    loaded = DenseMambaForCausalLM.from_pretrained(tmp_path / "folder")
    assert same_model(loaded, model) and len(calls) >= 3
