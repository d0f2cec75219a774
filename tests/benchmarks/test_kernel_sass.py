"""benchmarks/kernel_sass.py: its SASS loop finder on a known listing, and its quick mode end to end (every Triton
kernel of the package compiled for sm_90, read, modeled). A plumbing check: no figure is asserted, only that every
kernel is there with its resources, hot loops, instructions and bytes per element, and the two passes of the scan
and of the causal conv."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_sass.py"
sys.path.insert(0, str(SCRIPT.parent))
import kernel_sass  # noqa: E402

# two nested loops (0x40-0x60 inside 0x20-0x90), a predicated branch, and the self-branch after EXIT
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   NOP ;
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0030*/                   FFMA R3, R3, R4, R5 ;
        /*0040*/                   MUFU.EX2 R6, R7 ;
        /*0050*/                   NOP ;
        /*0060*/              @!P0 BRA 0x40 ;
        /*0070*/                   FADD R8, R8, R6 ;
        /*0080*/                   ISETP.GE.AND P1, PT, R2, R9, PT ;
        /*0090*/               @P1 BRA 0x20 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0;
"""


def test_loops_of_finds_innermost_loops_without_nops():
    assert kernel_sass.loops_of(LISTING) == [dict(start=0x40, end=0x60, instructions=2)]
    assert kernel_sass.instructions_of(LISTING) == 10


def test_quick_mode_reports_every_kernel(tmp_path):
    sys.path.insert(0, str(SCRIPT.parents[1] / "tests" / "ops"))
    import kernel_compile

    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed")
    problem = kernel_compile.compile_api_problem()
    if problem:
        pytest.skip(f"cannot compile for CUDA here: {problem}")
    out = tmp_path / "sass.json"
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True,
                          text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {r["arch"] for r in rows} == {"sm_90"} and {r["dtype"] for r in rows} == {"bfloat16"}
    assert {r["kernel"] for r in rows} == set(kernel_sass.MODELS), "every kernel of the package has a model"
    for r in rows:
        name = r["kernel"]
        assert r["registers"] > 0 and r["instructions"] > 0 and 0 < r["occupancy"] <= 1, r
        assert r["spills"] >= 0 and r["shared"] >= 0, r
        assert all(body > 0 for body in r["hot_loops"]), r
        for key in ("per_element", "moved", "least"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r)
        assert r["moved"] >= r["least"] * (1 - 1e-9), r
        assert f"| {name.strip('_')} (" in done.stdout
    assert {(t["op"], t["direction"]) for t in report["totals"]} == set(kernel_sass.PASSES)
    for t in report["totals"]:
        assert set(t["kernels"]) == set(kernel_sass.PASSES[(t["op"], t["direction"])]), t
        assert math.isfinite(t["per_element"]) and t["per_element"] > 0 and t["least"] > 0, t
