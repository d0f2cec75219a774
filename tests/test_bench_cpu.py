"""benchmarks/bench_cpu.py runs end to end (every part, tiny presets, a few tokens) and writes a well-formed JSON.

A plumbing check only: nothing here asserts a timing, only that every figure is there, finite and positive.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_cpu  # noqa: E402

TINY = [
    "--size", "tiny", "--vocab-size", "256", "--seq-len", "32", "--batch-sizes", "1", "2",
    "--train-seq-len", "32", "--mamba-train-len", "16", "--prompt-len", "8", "--new-tokens", "4",
    "--batched-size", "4", "--batched-new-tokens", "3", "--repeats", "2", "--gen-repeats", "2", "--warmup", "0",
    "--matmul-size", "128", "--matmul-calls", "2", "--bandwidth-mib", "8",
    "--threads", "1",  # one thread: a shared CI machine's other processes would stall a two-thread pool
    "--no-compiled",  # the compiled rows compile one step per model, dtype and batch: their own test below
]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_every_part_runs_and_reports_finite_positive_figures(tmp_path):
    out = tmp_path / "cpu.json"
    threads = torch.get_num_threads()
    try:
        report = bench_cpu.main([*TINY, "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))

    env = report["environment"]
    assert {"cpu", "cpu_flags", "torch_threads", "load_average_1_5_15_min", "load_average_at_end"} <= set(env)
    assert env["torch_threads"] == 1
    assert set(bench_cpu.PARTS) <= set(report)
    assert report["logits_max_abs_diff_mamba_vs_densemamba_m0"] < 1e-3
    names = set(report["params"])
    assert names == {"transformers Mamba", "DenseMamba m=0", "DenseMamba m=4", "DenseRetNet m=0", "DenseRetNet m=2"}

    assert {entry["model"] for entry in report["forward"].values()} == names
    assert all(positive(entry["tokens_per_s"]) for entry in report["forward"].values())

    training = report["training"]
    assert positive(training["matmul_peak"]["flop_per_s"])
    assert set(training["models"]) == names - {"transformers Mamba"}
    for name, entry in training["models"].items():
        for key in ("tokens_per_s", "model_flop_per_s", "fraction_of_peak", "train_over_forward", "flop_parameters"):
            assert positive(entry[key]), (name, key)
        assert entry["train_over_m0"] is None if name.endswith("m=0") else positive(entry["train_over_m0"])
    assert positive(training["vs_transformers_mamba"]["speedup"])

    generation = report["generation"]
    assert positive(generation["bandwidth"]["read_bytes_per_s"]) and positive(generation["bandwidth"]["copy_bytes_per_s"])
    assert set(generation["dtypes"]) == {"float32", "bfloat16"}
    for dtype, entries in generation["dtypes"].items():
        assert set(entries) == names
        for name, entry in entries.items():
            for key in ("tokens_per_s", "speedup_vs_transformers_mamba", "ideal_tokens_per_s", "fraction_of_ideal"):
                assert positive(entry[key]), (dtype, name, key)
            # per token made: the plain greedy call may stop at EOS before max_new_tokens
            assert 1 <= entry["new_tokens_produced"] <= generation["new_tokens"], (dtype, name)
            assert entry["tokens_per_s"] == pytest.approx(entry["new_tokens_produced"] / entry["seconds"])
    assert "min_new_tokens" not in generation["generate_call"]
    # bfloat16 weights are half the bytes of float32 ones
    f32, bf16 = generation["dtypes"]["float32"], generation["dtypes"]["bfloat16"]
    assert all(f32[n]["weight_bytes_per_token"] == 2 * bf16[n]["weight_bytes_per_token"] for n in names)
    # the same weights, the same greedy tokens
    assert f32["DenseMamba m=0"]["same_tokens_as_transformers_mamba"]

    batched = report["batched"]
    assert batched["batch"] == 4 and len(set(batched["prompt_lens"])) > 1
    assert all(positive(entry["tokens_per_s"]) for entry in batched["models"].values())

    figures = report["figures"]
    assert figures and all(math.isfinite(f["value"]) and f["value"] > 0 for f in figures)
    for f in figures:
        assert f["fraction_of_limit"] is None or positive(f["fraction_of_limit"])
        assert (f["target"] is None) == (f["met"] is None)
    assert any(f["fraction_of_limit"] is not None and "matmul peak" in f["limit"] for f in figures)
    assert any(f["fraction_of_limit"] is not None and "bandwidth" in f["limit"] for f in figures)


def test_parts_can_be_run_alone(tmp_path):
    threads = torch.get_num_threads()
    try:
        report = bench_cpu.main([*TINY, "--parts", "training", "--mamba-train-len", "0", "--out", str(tmp_path / "t.json")])
    finally:
        torch.set_num_threads(threads)
    assert "training" in report and not {"forward", "generation", "batched"} & set(report)
    assert "vs_transformers_mamba" not in report["training"]


def test_weight_bytes_count_a_tied_head_once_and_an_untied_table_by_one_row():
    models = bench_cpu.build_models(256, "tiny")
    mamba, retnet = models["DenseMamba m=0"], models["DenseRetNet m=0"]
    assert mamba.config.tie_word_embeddings and not retnet.config.tie_word_embeddings
    assert bench_cpu.weight_bytes_per_token(mamba) == 4 * mamba.num_parameters()
    table = retnet.get_input_embeddings().weight
    assert bench_cpu.weight_bytes_per_token(retnet) == 4 * (retnet.num_parameters() - table.numel() + table.shape[1])
    assert bench_cpu.flop_parameters(retnet) == retnet.num_parameters() - table.numel()


def test_generation_with_compiled_rows(tmp_path):
    threads = torch.get_num_threads()
    torch._dynamo.reset()
    args = [a for a in TINY if a != "--no-compiled"]
    try:
        report = bench_cpu.main([*args, "--parts", "generation", "--dtypes", "float32", "--out", str(tmp_path / "g.json")])
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    entries = report["generation"]["dtypes"]["float32"]
    compiled = {name for name in entries if name.endswith(" compiled")}
    torch_compiled = {name for name in entries if name.endswith(" torch.compile")}
    eager = set(entries) - compiled - torch_compiled - {"transformers Mamba"}
    assert compiled == {f"{name} compiled" for name in eager}
    # DenseMamba's float32 compiled rows run the C kernel step, timed against its torch.compile step as well
    assert torch_compiled == {f"{name} torch.compile" for name in eager if name.startswith("DenseMamba")}
    for name in compiled | torch_compiled:
        assert entries[name]["same_tokens_as_eager"] is True, name  # float32: the eager model's greedy tokens
        assert positive(entries[name]["speedup_vs_transformers_mamba"]) and positive(entries[name]["first_call_seconds"])
    for name in compiled:
        ratio = entries[name]["speedup_vs_torch_compile_step"]
        assert positive(ratio) if name.startswith("DenseMamba") else ratio is None, name


def test_environment_records_the_allocator_and_thread_runtime_settings(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("HF_DENSESSM_UNRELATED", "1")
    recorded = bench_cpu.environment()["runtime_env"]
    assert recorded["MALLOC_MMAP_MAX_"] == "0" and recorded["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "HF_DENSESSM_UNRELATED" not in recorded
