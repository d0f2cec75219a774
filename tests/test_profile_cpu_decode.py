"""benchmarks/profile_cpu_decode.py runs end to end (``--dry-run``: tiny presets, a few tokens) and writes a
well-formed JSON with every part of the compiled step. A plumbing check only: no timing is asserted, only that each
part is there, finite, and that the profiler's events were found (the graph, its fused loops, its one matrix
product: the tiny presets' LM head is the one weight above ``SMALL_WEIGHT_NUMEL``)."""

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_cpu_decode  # noqa: E402

COMPILED_PARTS = ("compiled_fn_ms", "wrapper_ms", "guard_check_ms", "graph_ms", "products_ms", "fused_loops_ms",
                  "driver_ms", "products_read_gb_per_s")


def test_dry_run_reports_every_part(tmp_path):
    out = tmp_path / "profile.json"
    threads = torch.get_num_threads()
    try:
        report = profile_cpu_decode.main(["--dry-run", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = report["models"]
    assert list(rows) == ["transformers Mamba", "DenseMamba m=0", "DenseMamba m=4"]
    for name, row in rows.items():
        for key in ("generate_ms", "model_call_ms", "generate_loop_ms", "floor_ms", "speedup_vs_anchor",
                    "bound_vs_anchor", "weight_bytes_per_token"):
            assert math.isfinite(row[key]), (name, key)
        # generate_ms is a difference of two timings (a few tokens here): finite, its sign left to the machine
        assert row["model_call_ms"] > 0 and row["weight_bytes_per_token"] > 0
        compiled = name != "transformers Mamba"
        assert all((key in row) == compiled for key in COMPILED_PARTS), name
        if compiled:
            assert row["graph_ms"] > 0 and row["fused_loops_ms"] > 0 and row["guard_check_ms"] > 0
            assert row["products"] == 1 and row["products_ms"] > 0  # the LM head, 2048 x 256
            assert row["product_weight_bytes"] == 2048 * 256 * 4
            assert row["products_ms"] + row["fused_loops_ms"] <= row["graph_ms"] * 1.01


def test_unknown_model_names_are_refused():
    try:
        profile_cpu_decode.main(["--dry-run", "--models", "DenseMamba m=9"])
    except SystemExit as error:
        assert "--models" in str(error) and "DenseMamba m=0" in str(error)
    else:
        raise AssertionError("an unknown --models name was accepted")
