"""benchmarks/profile_cpu_decode.py runs end to end (tiny presets, a few tokens) and writes a well-formed JSON.

A plumbing check only: no timing is asserted, only that every row is there with finite, positive figures, that the
matrix products are a part of the profiled time and that the bound is computed from them.
"""

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_cpu_decode  # noqa: E402


def test_rows_and_bound(tmp_path):
    threads = torch.get_num_threads()
    out = tmp_path / "profile.json"
    try:
        report = profile_cpu_decode.main(
            ["--size", "tiny", "--threads", "1", "--new-tokens", "2", "--repeats", "1", "--prompt-len", "4",
             "--dtypes", "float32", "--compiled", "--out", str(out)]
        )
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = {row["model"]: row for row in report["rows"]}
    assert set(rows) == {"transformers Mamba", "DenseMamba m=0", "DenseRetNet m=0", "DenseMamba m=0 compiled"}
    for row in rows.values():
        for key in ("ms_per_token", "gemm_ms_per_token", "profiled_ms_per_token", "speedup_vs_mamba"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["model"], key)
        assert 0 < row["gemm_share_of_profiled"] < 1
        mamba_ms = rows["transformers Mamba"]["ms_per_token"]
        assert math.isclose(row["bound_vs_mamba"], mamba_ms / row["gemm_ms_per_token"])
        assert row["top_other_ops_ms_per_token"] and "aten::mm" not in row["top_other_ops_ms_per_token"]
    assert rows["transformers Mamba"]["speedup_vs_mamba"] == 1.0
    assert set(report["lm_head_ms"]) == {"float32"}
    assert all(math.isfinite(v) and v > 0 for v in report["lm_head_ms"]["float32"].values())
