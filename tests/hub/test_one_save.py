"""A folder loads as one whole save (hf_densessm.modeling.save_check; issue 33, item 5): a load that a save overtakes
runs again, loads racing a process that keeps saving get one of its models exactly or a clear error, saves move
their files in one at a time, the remote code checks too, and the save id is read, never carried into another save.
Kills: tests/hub/test_saving.py."""

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, modeling_utils

from hf_densessm import DenseMambaForCausalLM
from hf_densessm.configuration.configuration_densessm import SAVE_ID
from hf_densessm.modeling.save_check import BACKUP_PREFIX, STAGING_PREFIX, MixedSaveError, save_ids
from helpers import micro_model, same_model

TESTS = Path(__file__).resolve().parents[1]  # tests/, where helpers.py is


@pytest.fixture(scope="module")
def pair():
    """Issue 33's two models of equal parameter shapes: DenseMamba ``dense_layers=4`` and ``dense_layers=2``."""
    return micro_model("densemamba", seed=0, dense_layers=4), micro_model("densemamba", seed=1, dense_layers=2)


def test_a_load_that_a_whole_save_overtook_loads_again(pair, tmp_path, monkeypatch):
    """A whole save of the other model lands between the shards one load opens (its config and first shard are the
    old save's, the other shard the new one's): the load sees the ids change and runs again."""
    old, new = pair
    folder = tmp_path / "folder"
    old.save_pretrained(folder, max_shard_size="100KB")
    opened, real = [], modeling_utils.safe_open

    def safe_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        if len(opened) == 2:
            new.save_pretrained(folder, max_shard_size="100KB")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_open", safe_open)
    loaded = DenseMambaForCausalLM.from_pretrained(folder)
    assert opened[:2] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert same_model(loaded, new) and len(opened) == 4  # read again, whole


SAVER = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from helpers import micro_model
models = [micro_model("densemamba", seed=1, dense_layers=2), micro_model("densemamba", seed=0, dense_layers=4)]
folder, stop, count = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
saves = 0
while not stop.exists():
    models[saves % 2].save_pretrained(folder, max_shard_size="20KB")
    saves += 1
    count.write_text(str(saves))
"""


def test_loads_racing_a_process_that_keeps_saving_get_one_whole_save(pair, tmp_path):
    """Loads while another process saves the two models in turn, in shards, into the folder: each class load returns
    one of them exactly (it waits and runs again); an ``AutoModel`` load, whose config was read first, may instead
    be refused with the clear error when a save lands in between."""
    old, new = pair
    folder, stop, count = tmp_path / "folder", tmp_path / "stop", tmp_path / "saves"
    old.save_pretrained(folder, max_shard_size="20KB")
    saver = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(TESTS), str(folder), str(stop), str(count)],
        env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"}, stderr=subprocess.PIPE, text=True,
    )

    def saves() -> int:
        return int(count.read_text() or 0) if count.exists() else 0

    results = []
    try:
        while saves() == 0 and saver.poll() is None:
            time.sleep(0.1)
        first = saves()
        while (saves() < first + 3 or len(results) < 10) and len(results) < 200 and saver.poll() is None:
            auto = len(results) % 2 == 1
            try:
                loaded = (AutoModelForCausalLM if auto else DenseMambaForCausalLM).from_pretrained(folder)
            except MixedSaveError as error:
                assert auto and str(error).startswith("The config passed to from_pretrained"), str(error)
                results.append("refused")
            else:
                results.append("old" if same_model(loaded, old) else "new" if same_model(loaded, new) else "third")
    finally:
        stop.touch()
        _, errors = saver.communicate(timeout=120)
    assert saver.returncode == 0, errors[-3000:]
    assert saves() >= first + 3 and len(results) >= 10 and "third" not in results, results


def stamped(config: Path) -> bool:
    """Whether the staged ``config`` carries its save's id."""
    try:
        return SAVE_ID in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def test_saves_into_one_folder_move_their_files_in_one_at_a_time(pair, tmp_path):
    """A save waits while another moves its files into the folder (an exclusive ``flock`` on the folder)."""
    old, new = pair
    folder = tmp_path / "folder"
    old.save_pretrained(folder)
    before = (folder / "config.json").read_bytes()
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a save moving its files in holds it
    saver = threading.Thread(target=new.save_pretrained, args=(folder,))
    try:
        saver.start()
        while saver.is_alive() and not any(map(stamped, folder.glob(f"{STAGING_PREFIX}*/config.json"))):
            time.sleep(0.05)
        time.sleep(0.5)  # its files are staged and stamped: the save now waits for the folder
        assert (folder / "config.json").read_bytes() == before and not list(folder.glob(BACKUP_PREFIX + "*"))
    finally:
        os.close(fd)
        saver.join()
    assert same_model(DenseMambaForCausalLM.from_pretrained(folder), new)


def test_the_save_id_is_read_never_carried(pair, tmp_path):
    """``_save_id`` comes from config.json; ``to_dict`` drops it, so neither our saves (which write their own) nor
    transformers' plain ``save_pretrained`` write a stale one; a loaded model's config has none; a config read from
    another save is refused. Folders without ids load as before."""
    old, _ = pair
    old.save_pretrained(tmp_path / "a")
    (first,) = set(save_ids(tmp_path / "a").values())
    config = AutoConfig.from_pretrained(tmp_path / "a")
    assert getattr(config, SAVE_ID) == first and SAVE_ID not in config.to_dict()
    assert SAVE_ID not in config.to_json_string() and SAVE_ID not in repr(config)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a", config=config)  # the config of this save
    assert not hasattr(loaded.config, SAVE_ID) and same_model(loaded, old)
    loaded.save_pretrained(tmp_path / "b")
    (second,) = set(save_ids(tmp_path / "b").values())
    assert second != first
    with pytest.raises(MixedSaveError, match=rf"save {second}: config.json, model.safetensors; save {first}: the conf"):
        DenseMambaForCausalLM.from_pretrained(tmp_path / "b", config=config)
    assert same_model(DenseMambaForCausalLM.from_pretrained(tmp_path / "b", config=loaded.config), old)
    PreTrainedModel.save_pretrained(DenseMambaForCausalLM(config), tmp_path / "plain")  # transformers alone
    assert set(save_ids(tmp_path / "plain").values()) == {None}
    assert isinstance(DenseMambaForCausalLM.from_pretrained(tmp_path / "plain"), DenseMambaForCausalLM)


def test_weights_written_by_another_tool_load_unless_a_save_was_cut_off(pair, tmp_path):
    """A weight file without a save id (safetensors' own ``save_file``, as transformers' common tests and conversion
    scripts write it) loads with the config of our save; once an interrupted save left its backup in the folder, the
    same file is refused, since it may be the old save's."""
    old, new = pair
    old.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in new.state_dict().items() if k != "lm_head.weight"},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = DenseMambaForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.dense_layers == old.config.dense_layers
    assert torch.equal(loaded.backbone.layers[1].mixer.D, new.backbone.layers[1].mixer.D)
    (tmp_path / f"{BACKUP_PREFIX}0123").mkdir()
    with pytest.raises(MixedSaveError, match="no save id: model.safetensors"):
        DenseMambaForCausalLM.from_pretrained(tmp_path)


REMOTE_SCRIPT = r"""
import json, sys
sys.modules["hf_densessm"] = None  # the package is installed (editable): make it unimportable
sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("/src")]
from transformers import AutoModelForCausalLM
report = {}
for name in ("whole", "mixed"):
    try:
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1] + "/" + name, trust_remote_code=True)
        report[name] = dict(module=type(model).__module__, dense_layers=model.config.dense_layers)
    except OSError as error:
        report[name] = dict(error=type(error).__module__ + "." + type(error).__name__, message=str(error))
report["leaked"] = [name for name, module in sys.modules.items() if "hf_densessm" in name and module is not None]
print("REPORT" + json.dumps(report))
"""


def test_the_remote_code_refuses_a_mixed_folder_too(pair, tmp_path):
    """Issue 33, item 4's folder (the old config, the new weights) loaded as remote code where hf_densessm cannot be
    imported: refused by the bundled check; the whole folder loads."""
    old, new = pair
    old.save_pretrained(tmp_path / "whole")
    old.save_pretrained(tmp_path / "mixed")
    new.save_pretrained(tmp_path / "new")
    os.replace(tmp_path / "new" / "model.safetensors", tmp_path / "mixed" / "model.safetensors")
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": "",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.split("REPORT", 1)[1])
    assert report["leaked"] == []
    assert report["whole"]["module"].startswith("transformers_modules.") and report["whole"]["dense_layers"] == 4
    mixed = report["mixed"]
    assert mixed["error"].startswith("transformers_modules.") and mixed["error"].endswith("save_check.MixedSaveError")
    assert "holds files of different saves" in mixed["message"] and "config.json" in mixed["message"]
