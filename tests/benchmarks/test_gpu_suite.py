"""``benchmarks/gpu_suite.py --dry-run``: every section of the GPU suite runs end to end on the CPU at tiny shapes
(kernels under the Triton interpreter) and writes its JSON and markdown table, so that the one command meant for a
GPU machine is known to work before a GPU is at hand. Its numbers mean nothing and are not checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"
SECTIONS = ("environment", "kernel-correctness", "model-parity", "kernels", "training", "decode", "speculative")


def test_dry_run_covers_every_section(tmp_path):
    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, str(SUITE), "--dry-run", "--out-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    records = report["records"]
    assert not report["failed"]
    assert {r["section"] for r in records} == set(SECTIONS)
    errors = [r for r in records if r["metric"] == "error" and r["method"] not in ("mamba_ssm", "fla")]
    assert not errors, errors
    checks = [r for r in records if "ok" in r]
    assert checks and all(r["ok"] for r in checks)
    metrics = {(r["section"], r["method"], r["metric"]) for r in records}
    for expected in [("kernels", "triton", "fwd_ms"), ("kernels", "torch", "fwd_bwd_ms"),
                     ("kernels", "triton", "step_us"), ("training", "eager", "step_ms"),
                     ("training", "torch.compile", "step_ms"), ("training", "torch.compile", "speedup_vs_eager"),
                     ("training", "torch.compile", "first_step_s (compiles)"),
                     ("environment", "torch copy_", "copy_bandwidth")]:
        assert expected in metrics, expected
    for method in ("generate (default)", "generate eager (disable_compile)"):
        for metric in ("first_call_s", "ms_per_token", "launches_per_token", "kernel_launches_per_token",
                       "graph_launches_per_token", "gpu_kernels_per_token"):
            assert ("decode", method, metric) in metrics, (method, metric)
    # both families, with and without the dense connection, eager and compiled
    for method in ("eager", "torch.compile"):
        training = {r["case"].split(" b")[0] for r in records
                    if r["section"] == "training" and r["method"] == method and r["metric"] == "step_ms"}
        assert len(training) == 4, (method, training)
    # generate() took transformers' compile path (opted in on the CPU) for both families at every context
    compiled = [r for r in records if r["section"] == "decode" and r["metric"] == "compiled_path"]
    assert len(compiled) == 4 and all(r["value"] == "True" for r in compiled), compiled
    # speculative decoding: plain greedy, prompt lookup (5, 10), assisted; each gives plain greedy's tokens
    speculative = {r["method"] for r in records if r["section"] == "speculative" and r["metric"] == "same_tokens"}
    assert speculative == {"plain greedy", "prompt lookup (5)", "prompt lookup (10)", "assisted (2-block draft)"}
    assert ("speculative", "prompt lookup (5)", "speedup") in metrics
    table = (tmp_path / "gpu_suite.md").read_text().splitlines()
    assert table[0].startswith("| section |") and len(table) == len(records) + 2


def test_gpu_session_dry_run(tmp_path):
    """``benchmarks/gpu_session.sh --dry``: the lent GPU's prepared calls (both parts) run end to end on the CPU and
    leave each part's JSON, table and log under ``$OUT``, with every check passed."""
    pytest.importorskip("triton")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(SUITE.parent / "gpu_session.sh"), "--dry"], cwd=SUITE.parents[1], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sections = set()
    for part in ("part1-checks", "part1-kernels", "part2"):
        report = json.loads((tmp_path / part / "gpu_suite.json").read_text())
        assert not report["failed"] and (tmp_path / part / "log.txt").is_file()
        sections |= {r["section"] for r in report["records"]}
    assert sections == set(SECTIONS)


SWEEP = SUITE.parent / "sweep_triton_tiles.py"


@pytest.mark.parametrize("mode", [[], ["--compare"]])
def test_tile_sweep_dry_run(tmp_path, mode):
    """``benchmarks/sweep_triton_tiles.py --dry-run`` (and ``--compare``): every candidate compiles and runs under
    the interpreter, computes what the table's choice computes (float32, to rounding), and lands in the JSON."""
    pytest.importorskip("triton")
    out = tmp_path / "sweep.json"
    result = subprocess.run([sys.executable, str(SWEEP), "--dry-run", "--out", str(out), *mode],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and not [r for r in rows if "error" in r]
    if mode:
        assert {(r["kernel"], r["pass_"]) for r in rows} == {("selective_scan", p) for p in ("fwd", "fwd+bwd")}
        assert all(r["first_ms"] > 0 and r["table_ms"] > 0 and r["speedup_median"] > 0 for r in rows)
    else:
        retention = {f"retention_{k}" for k in ("h", "o", "dh", "dqk", "dv")}
        assert {r["kernel"] for r in rows} == {"selective_scan"} | retention
        assert all(r["max_rel_dev"] < 1e-5 and r["fwd_bwd_ms"] > 0 for r in rows)


def _profile_dry_run(script, tmp_path):
    """Run ``benchmarks/<script> --dry-run``; its rows, checked to be one per family's tiny preset."""
    out = tmp_path / "profile.json"
    result = subprocess.run([sys.executable, str(SUITE.parent / script), "--dry-run", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == ["DenseMamba-TINY", "DenseRetNet-TINY"]
    return rows


def test_decode_profile_dry_run(tmp_path):
    """``benchmarks/profile_gpu_decode.py --dry-run``: both families' tiny presets prefill, step through the cache
    and are profiled on the CPU; the JSON holds a row per family with the counters (zero without CUDA)."""
    rows = _profile_dry_run("profile_gpu_decode.py", tmp_path)
    assert all(r["ms_per_step"] > 0 and r["host_ms"] > 0 and "cudaStreamSynchronize" in r for r in rows)


def test_training_profile_dry_run(tmp_path):
    """``benchmarks/profile_gpu_training.py --dry-run``: both families' tiny presets take profiled training steps
    on the CPU, and the kernel families are told apart by name (real kernel names of the H100 run)."""
    sys.path.insert(0, str(SUITE.parent))
    try:
        from profile_gpu_training import family_of
    finally:
        sys.path.remove(str(SUITE.parent))
    assert family_of("_selective_scan_bwd_kernel") == "selective_scan"
    assert family_of("_retention_bwd_dkv_kernel") == "retention"
    assert family_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert family_of("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizer>") \
        == "optimizer"
    assert family_of("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add>") == "other"
    rows = _profile_dry_run("profile_gpu_training.py", tmp_path)
    assert all(r["step_ms"] > 0 for r in rows)
