"""Checkpoints cross transformers releases: a folder saved (weights and remote code) under one release loads under
another and gives the same logits and greedy tokens, both ways, with this package installed and with
``trust_remote_code=True`` where it cannot be imported.

The other release lives in a second Python environment, named by ``HF_DENSESSM_OTHER_PYTHON`` (its interpreter;
that environment has this checkout installed too). ``.ci/run`` sets it: the README's test run points it at the
environment pinned to the floor release, and the floor run at the newest. Without it these tests are skipped:
one environment cannot hold two transformers releases.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from helpers import FAMILIES

OTHER_PYTHON = os.environ.get("HF_DENSESSM_OTHER_PYTHON")
TESTS = Path(__file__).resolve().parents[1]  # tests/, where helpers.py is

pytestmark = pytest.mark.skipif(
    not OTHER_PYTHON,
    reason="needs a second environment holding another transformers release: set HF_DENSESSM_OTHER_PYTHON to its "
    "python (.ci/run does)",
)

#: Run by either interpreter, with a JSON job as its argument:
#: - ``save``: build both families' micro models (seeded) with the package, save them under ``save``/<family>, and
#:   write their logits and greedy tokens for fixed ids to ``save``/expected.pt;
#: - ``load``: load each folder of ``load`` and report its logits' largest difference from the folder's
#:   expected.pt, whether its greedy tokens match, and the class's module; with ``remote`` the package is made
#:   unimportable first and the folders load with ``trust_remote_code=True``.
SCRIPT = r"""
import json, sys
job = json.loads(sys.argv[1])
if job.get("remote"):
    sys.modules["hf_densessm"] = None  # installed (editable) in this environment: make it unimportable
    sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("/src")]
    try:
        import hf_densessm
        raise SystemExit("hf_densessm is importable")
    except ImportError:
        pass
import torch, transformers
from transformers import AutoModelForCausalLM

report = {"transformers": transformers.__version__, "loaded": {}}
if job.get("save"):
    sys.path.insert(0, job["tests"])
    from helpers import FAMILIES, micro_model, random_ids
    expected = {}
    for family in FAMILIES:
        model = micro_model(family, seed=5)
        ids = random_ids(2, 7, seed=11)
        with torch.no_grad():
            expected[family] = dict(ids=ids, logits=model(ids).logits,
                                    generated=model.generate(ids, max_new_tokens=4, do_sample=False))
        model.save_pretrained(job["save"] + "/" + family)
    torch.save(expected, job["save"] + "/expected.pt")
for root in job.get("load", []):
    expected = torch.load(root + "/expected.pt", weights_only=True)
    for family, want in expected.items():
        if not job.get("remote"):
            import hf_densessm  # registers the classes with the Auto classes
        model = AutoModelForCausalLM.from_pretrained(root + "/" + family, trust_remote_code=bool(job.get("remote")))
        with torch.no_grad():
            logits = model(want["ids"]).logits
            generated = model.generate(want["ids"], max_new_tokens=4, do_sample=False)
        report["loaded"][root + "/" + family] = dict(
            cls=type(model).__module__,
            logits_diff=(logits - want["logits"]).abs().max().item(),
            scale=want["logits"].abs().max().item(),
            generated=torch.equal(generated, want["generated"]),
        )
if job.get("remote"):
    report["leaked"] = [n for n, m in sys.modules.items() if "hf_densessm" in n and m is not None]
print("REPORT" + json.dumps(report))
"""


def run(python: str, tmp_path: Path, **job) -> dict:
    """Run :data:`SCRIPT` with ``python`` on ``job``, offline, with its own module caches; its report."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / f"modules-{len(list(tmp_path.iterdir()))}"),
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONPATH": "",
    }
    job["tests"] = str(TESTS)
    result = subprocess.run([python, "-c", SCRIPT, json.dumps(job)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"{python}: {result.stderr[-4000:]}"
    return json.loads(result.stdout.split("REPORT", 1)[1])


def check_loaded(report: dict, root: Path, remote: bool) -> None:
    for family in FAMILIES:
        entry = report["loaded"][f"{root}/{family}"]
        if remote:  # the bundled code, in transformers' module cache
            assert entry["cls"].startswith("transformers_modules."), entry
        else:
            assert entry["cls"].startswith("hf_densessm."), entry
        # same weights and code, another transformers (and perhaps torch): equal up to float32 rounding
        assert entry["logits_diff"] <= 1e-5 * max(1.0, entry["scale"]), (family, entry)
        assert entry["generated"], (family, entry)
    if remote:
        assert report["leaked"] == []


@pytest.fixture(scope="module")
def other_version(tmp_path_factory):
    """The other environment's transformers release; it must differ from this one's, or nothing crosses."""
    result = subprocess.run([OTHER_PYTHON, "-c", "import transformers; print(transformers.__version__)"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"HF_DENSESSM_OTHER_PYTHON={OTHER_PYTHON} cannot import transformers: " \
                                   f"{result.stderr[-2000:]}"
    version = result.stdout.strip()
    assert version != transformers.__version__, (
        f"HF_DENSESSM_OTHER_PYTHON runs transformers {version}, the same release as this environment")
    return version


def test_saved_here_loads_there(other_version, tmp_path):
    """Saved under this release; loaded under the other with the package, and with remote code without it."""
    saved = tmp_path / "saved-here"
    run(sys.executable, tmp_path, save=str(saved))
    for remote in (False, True):
        report = run(OTHER_PYTHON, tmp_path, load=[str(saved)], remote=remote)
        assert report["transformers"] == other_version
        check_loaded(report, saved, remote)


def test_saved_there_loads_here(other_version, tmp_path):
    """Saved under the other release; loaded here in this process with the package, and in a process of this
    environment with remote code without it."""
    saved = tmp_path / "saved-there"
    assert run(OTHER_PYTHON, tmp_path, save=str(saved))["transformers"] == other_version
    expected = torch.load(saved / "expected.pt", weights_only=True)
    for family, want in expected.items():
        model = AutoModelForCausalLM.from_pretrained(saved / family)
        assert type(model).__module__.startswith("hf_densessm.")
        with torch.no_grad():
            logits = model(want["ids"]).logits
            generated = model.generate(want["ids"], max_new_tokens=4, do_sample=False)
        torch.testing.assert_close(logits, want["logits"], rtol=0, atol=1e-5 * max(1.0, want["logits"].abs().max()))
        assert torch.equal(generated, want["generated"])
    report = run(sys.executable, tmp_path, load=[str(saved)], remote=True)
    assert report["transformers"] == transformers.__version__
    check_loaded(report, saved, remote=True)
