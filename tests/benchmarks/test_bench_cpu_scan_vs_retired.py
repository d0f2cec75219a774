"""benchmarks/bench_cpu_scan_vs_retired.py runs end to end (``--dry``: a tiny shape, one round) and writes a
well-formed JSON.

A plumbing check only: no timing is asserted, only that every figure of both versions is there, finite and
positive, and that the C++ kernel and the retired C kernel (bd2f329, extracted with ``git archive``) give the same
outputs and gradients.
"""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_cpu_scan_vs_retired as bench  # noqa: E402


def test_dry_run_reports_both_kernels(tmp_path, monkeypatch):
    if shutil.which("git") is None or subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{bench.RETIRED}^{{commit}}"], capture_output=True).returncode:
        pytest.skip(f"no git history with {bench.RETIRED} (the retired kernel)")
    if not any(shutil.which(c) for c in ("cc", "gcc")) or not any(shutil.which(c) for c in ("c++", "g++")):
        pytest.skip("no C / C++ compiler: neither kernel can be built")
    monkeypatch.setenv("HF_DENSESSM_CACHE", str(tmp_path / "retired-cache"))  # the retired kernel's own cache
    out = tmp_path / "scan.json"
    report = bench.main(["--dry", "--threads", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    keys = {f"{level}_{part}_{clock}_s" for level in ("op", "kernel") for part in ("forward", "backward")
            for clock in ("wall", "cpu")}
    assert set(report["min_s"]) == {"current", "retired"}
    for version in ("current", "retired"):
        assert set(report["min_s"][version]) == keys
        assert all(math.isfinite(v) and v > 0 for v in report["min_s"][version].values()), version
    assert set(report["ratio_current_over_retired"]) == keys
    assert set(report["max_rel_diff"]) == {"y", *bench.GRADS}
    assert max(report["max_rel_diff"].values()) < 1e-4, report["max_rel_diff"]
    assert report["cpu"] and report["dry"] and report["shape"]["dim"] == 40
