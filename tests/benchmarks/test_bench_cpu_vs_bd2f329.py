"""benchmarks/bench_cpu_vs_bd2f329.py runs end to end (``--dry``: the tiny presets, one step each) and writes a
well-formed JSON: a plumbing check only, no timing is asserted, only that every figure of both versions is there,
finite and positive."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_cpu_vs_bd2f329 as bench  # noqa: E402


def test_dry_run_reports_both_versions(tmp_path):
    if shutil.which("git") is None or subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{bench.RETIRED}^{{commit}}"], capture_output=True).returncode:
        pytest.skip(f"no git history with {bench.RETIRED}")
    out = tmp_path / "steps.json"
    report = bench.main(["--dry", "--threads", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for version in ("current", "bd2f329"):
        for name in bench.MODELS:
            seconds = report["median_s"][version][name]["eager"]
            assert math.isfinite(seconds) and seconds > 0
            assert report["profile_self_cpu_s_and_calls"][version][name]  # each op's share of one step
        assert set(report["ratio_current_over_bd2f329"]) == set(bench.MODELS)
