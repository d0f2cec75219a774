"""Every Triton kernel (selective scan, retention, causal conv) compiles for sm_80, sm_86, sm_89 and sm_90 in
float32, bfloat16 and float16, at the presets' shapes and a small one, within each architecture's limits: its shared
memory fits the per-block maximum and it spills no registers (cuobjdump's stack frame and local memory are 0). No GPU
is needed: see ``kernel_compile.py``.

The compiling runs once per test session, in worker processes (the kernels must be defined without the
interpreter, which ``tests/conftest.py`` turns on for this process), two at a time; each test reads its share.
Registers, shared memory and theoretical occupancy of every kernel are printed at the end of the module under
``pytest -v`` (the table of ``docs/kernels.md``).
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hf_densessm.ops.backend import ARCHS

sys.path.insert(0, str(Path(__file__).parent))
import kernel_compile  # noqa: E402

WORKER = Path(__file__).with_name("kernel_compile.py")
JOBS = kernel_compile.jobs()


def _skip_reason():
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return kernel_compile.compile_api_problem()


def _run_workers(jobs, workers):
    """Compile ``jobs`` in ``workers`` processes; ``{job id: results}`` (a job whose worker died maps to the
    worker's error output)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    shares = [jobs[i::workers] for i in range(workers)]

    def run(share):
        proc = subprocess.run([sys.executable, str(WORKER)], input=json.dumps(share), capture_output=True,
                              text=True, env=env, timeout=1800)
        done = {}
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                done[record["id"]] = record["results"]
        for job in share:
            done.setdefault(kernel_compile.job_id(job), [dict(kernel="?", error=proc.stderr[-3000:])])
        return done

    results = {}
    with ThreadPoolExecutor(workers) as pool:
        for done in pool.map(run, shares):
            results.update(done)
    return results


@pytest.fixture(scope="module")
def compiled(request):
    reason = _skip_reason()
    if reason:
        pytest.skip(f"cannot compile for CUDA here: {reason}")
    env = dict(os.environ, TRITON_INTERPRET="0")
    probe = subprocess.run([sys.executable, str(WORKER), "--probe"], capture_output=True, text=True, env=env,
                           timeout=600)
    lines = [line for line in probe.stdout.splitlines() if line.startswith("{")]
    problem = json.loads(lines[-1])["problem"] if lines else probe.stderr[-1000:]
    if problem:
        pytest.skip(f"cannot compile a Triton kernel for CUDA on this machine: {problem}")
    results = _run_workers(JOBS, max(1, min(2, os.cpu_count() or 1)))
    yield results
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None and request.config.getoption("verbose") > 0:  # with -v only
        rows = [(job, r) for job in JOBS for r in results.get(kernel_compile.job_id(job), [])]
        with capture.global_and_fixture_disabled():
            reporter.write_line("\nTriton kernels compiled for CUDA (registers, shared memory, spills, occupancy):")
            reporter.write_line(kernel_compile.format_table(rows))


@pytest.mark.parametrize("job", JOBS, ids=kernel_compile.job_id)
def test_kernels_compile_within_the_architecture_limits(compiled, job):
    results = compiled[kernel_compile.job_id(job)]
    arch = ARCHS[job["arch"]]
    expected = {"selective_scan": {"_selective_scan_chunk_state_kernel", "_selective_scan_carry_kernel",
                                   "_selective_scan_chunk_output_kernel", "_selective_state_update_kernel"},
                "retention": {"_retention_chunk_h_kernel", "_retention_chunk_o_kernel",
                              "_retention_step_kernel"},
                "causal_conv1d": {"_causal_conv1d_fwd_kernel"}}[job["op"]]
    if "grad" in job["flags"]:
        expected |= {"selective_scan": {"_selective_scan_chunk_adjoint_kernel", "_selective_scan_chunk_bwd_kernel"},
                     "retention": {"_retention_chunk_dh_kernel", "_retention_chunk_dqk_kernel",
                                   "_retention_chunk_dv_kernel"},
                     "causal_conv1d": {"_causal_conv1d_bwd_kernel"}}[job["op"]]
    assert {r["kernel"] for r in results} == expected, results
    if job["op"] == "retention" and "grad" in job["flags"]:  # the forward's state walk and the backward's recompute
        assert [r["kernel"] for r in results].count("_retention_chunk_h_kernel") == 2, results
    for r in results:
        assert "error" not in r, f"{r['kernel']} {r.get('constexprs', '')}: {r['error']}"
        name = f"{r['kernel']} ({r['constexprs']}, {r['num_warps']} warps, {r['num_stages']} stages)"
        assert r["shared"] <= arch.shared_per_block, (
            f"{name} needs {r['shared']} B of shared memory, over {arch.name}'s {arch.shared_per_block} B per block"
        )
        assert r["stack"] == 0 and r["local"] == 0, (
            f"{name} spills: {r['stack']} B stack frame, {r['local']} B local memory ({r['registers']} registers)"
        )
        assert r["occupancy"] > 0, f"{name}: no block fits on an SM of {arch.name}"
