"""benchmarks/bench_training_parts.py runs end to end on tiny presets and writes its JSON; each part's switch really
changes the path taken (a plumbing check: no timing is asserted)."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_training_parts  # noqa: E402

from hf_densessm.ops import gated_add as gated_add_module  # noqa: E402
from hf_densessm.ops import rms_norm as rms_norm_module  # noqa: E402
from hf_densessm.ops.workspace import Workspace  # noqa: E402


def test_runs_and_writes_every_part(tmp_path):
    out = tmp_path / "parts.json"
    results = bench_training_parts.main([
        "--size", "tiny", "--vocab-size", "256", "--seq-len", "64", "--repeats", "2", "--warmup", "0",
        "--threads", "1", "--out", str(out),
    ])
    written = json.loads(out.read_text())
    assert set(written["parts"]) == set(bench_training_parts.PARTS)
    for part, per_model in results["parts"].items():
        assert len(per_model) == 4
        for r in per_model.values():
            assert math.isfinite(r["speedup"]) and r["speedup"] > 0 and len(r["all_on"]) == len(r["all_off"]) == 2


@pytest.mark.skipif(gated_add_module._library() is None, reason="no C compiler")
def test_switches_take_the_other_path(monkeypatch):
    calls = []
    for fn in (gated_add_module.GatedAddCPUFn, rms_norm_module.RMSNormCPUFn):
        real = fn.apply
        counting = (lambda real, name: lambda *a: calls.append(name) or real(*a))(real, fn.__name__)
        monkeypatch.setattr(fn, "apply", counting)
    models = {k: v for k, v in bench_training_parts.bench_cpu.build_models(256, "tiny").items() if "m=0" not in k}
    model = models["DenseMamba m=4"] if "DenseMamba m=4" in models else next(iter(models.values()))
    ids = torch.randint(3, 256, (2, 300))
    with bench_training_parts.part_off("gated_add"), bench_training_parts.part_off("rms_norm"):
        model(ids, labels=ids)
    assert calls == []
    model(ids, labels=ids)
    assert "GatedAddCPUFn" in calls and "RMSNormCPUFn" in calls
    ws = Workspace()
    kept = ws.take("g", (4,), torch.float32).data_ptr()
    with bench_training_parts.part_off("workspace"):
        assert ws.take("g", (4,), torch.float32).data_ptr() != kept  # not the kept buffer, which is still alive
        assert ws.nbytes() == 16  # and nothing new kept
