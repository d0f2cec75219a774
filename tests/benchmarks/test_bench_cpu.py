"""benchmarks/bench_cpu.py runs end to end (every part, tiny presets, a few tokens) and writes a well-formed JSON.

A plumbing check only: nothing here asserts a timing, only that every figure is there, finite and positive, that
the compiled rows go through the standard mechanisms (transformers' generation compile path, ``torch.compile``)
and give the eager rows' tokens and loss, and that a compiled row that fails is reported in its row, not raised.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_cpu  # noqa: E402

TINY = [
    "--size", "tiny", "--vocab-size", "256", "--seq-len", "32", "--batch-sizes", "1", "2",
    "--train-seq-len", "32", "--mamba-train-len", "16", "--prompt-len", "8", "--new-tokens", "4",
    "--batched-size", "4", "--batched-new-tokens", "3", "--repeats", "2", "--gen-repeats", "2", "--warmup", "0",
    "--matmul-size", "128", "--matmul-calls", "2", "--bandwidth-mib", "8",
    "--threads", "1",  # one thread: a shared CI machine's other processes would stall a two-thread pool
]
EAGER_ONLY = [*TINY, "--no-compiled"]  # the compiled rows compile one step per model: their own tests below
NAMES = {"transformers Mamba", "DenseMamba m=0", "DenseMamba m=4", "DenseRetNet m=0", "DenseRetNet m=2"}


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def run(argv):
    threads = torch.get_num_threads()
    torch._dynamo.reset()
    try:
        return bench_cpu.main(argv)
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()


def test_every_part_runs_and_reports_finite_positive_figures(tmp_path):
    out = tmp_path / "cpu.json"
    report = run([*EAGER_ONLY, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))

    env = report["environment"]
    assert {"cpu", "cpu_flags", "torch_threads", "load_average_1_5_15_min", "load_average_at_end"} <= set(env)
    assert env["torch_threads"] == 1
    assert set(bench_cpu.PARTS) <= set(report)
    assert report["logits_max_abs_diff_mamba_vs_densemamba_m0"] < 1e-3
    names = set(report["params"])
    assert names == NAMES == set(bench_cpu.model_names("tiny"))
    assert report["errors"] == {}

    assert {entry["model"] for entry in report["forward"].values()} == names
    assert all(positive(entry["tokens_per_s"]) for entry in report["forward"].values())

    training = report["training"]
    assert positive(training["matmul_peak"]["flop_per_s"])
    assert set(training["models"]) == names - {"transformers Mamba"}  # no compiled rows
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
            assert entry["compiled_path_taken"] is False, (dtype, name)  # eager: the CPU default
    assert "min_new_tokens" not in generation["generate_call"]
    # bfloat16 weights are half the bytes of float32 ones
    f32, bf16 = generation["dtypes"]["float32"], generation["dtypes"]["bfloat16"]
    assert all(f32[n]["weight_bytes_per_token"] == 2 * bf16[n]["weight_bytes_per_token"] for n in names)
    # the same weights, the same greedy tokens
    assert f32["DenseMamba m=0"]["same_tokens_as_transformers_mamba"]

    batched = report["batched"]
    assert batched["batch"] == 4 and len(set(batched["prompt_lens"])) > 1
    assert set(batched["models"]) == names
    assert all(positive(entry["tokens_per_s"]) for entry in batched["models"].values())

    figures = report["figures"]
    assert figures and all(math.isfinite(f["value"]) and f["value"] > 0 for f in figures)
    for f in figures:
        assert f["fraction_of_limit"] is None or positive(f["fraction_of_limit"])
        assert (f["target"] is None) == (f["met"] is None)
    assert any(f["fraction_of_limit"] is not None and "matmul peak" in f["limit"] for f in figures)
    assert any(f["fraction_of_limit"] is not None and "bandwidth" in f["limit"] for f in figures)
    # the eager generation target: DenseMamba m=0 (the anchor's weights), in both dtypes
    eager_targets = [f for f in figures if f["figure"].startswith("generation speed-up") and f["target"]]
    assert [f["figure"].split(", ")[1].split(" ")[0] for f in eager_targets] == ["DenseMamba"] * 2
    assert all(f["target"] == "value >= 1.2" for f in eager_targets)


def test_parts_and_models_can_be_chosen(tmp_path):
    report = run([*EAGER_ONLY, "--parts", "training", "--mamba-train-len", "0", "--models", "DenseRetNet m=2",
                  "--out", str(tmp_path / "t.json")])
    assert "training" in report and not {"forward", "generation", "batched"} & set(report)
    assert "vs_transformers_mamba" not in report["training"]
    assert set(report["params"]) == {"transformers Mamba", "DenseRetNet m=2"}
    assert set(report["training"]["models"]) == {"DenseRetNet m=2"}
    assert report["training"]["models"]["DenseRetNet m=2"]["train_over_m0"] is None  # no m=0 to compare with


def test_unknown_model_names_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_cpu.parse_args(["--size", "tiny", "--models", "DenseMamba m=9"])
    assert "DenseMamba m=0" in capsys.readouterr().err


def test_weight_bytes_count_a_tied_head_once_and_an_untied_table_by_one_row():
    models = bench_cpu.build_models(256, "tiny")
    mamba, retnet = models["DenseMamba m=0"], models["DenseRetNet m=0"]
    assert mamba.config.tie_word_embeddings and not retnet.config.tie_word_embeddings
    assert bench_cpu.weight_bytes_per_token(mamba) == 4 * mamba.num_parameters()
    table = retnet.get_input_embeddings().weight
    assert bench_cpu.weight_bytes_per_token(retnet) == 4 * (retnet.num_parameters() - table.numel() + table.shape[1])
    assert bench_cpu.flop_parameters(retnet) == retnet.num_parameters() - table.numel()


def test_compiled_rows(tmp_path):
    """Compiled rows: ``compile_decode_step()`` rows in generation (through transformers' compile path, the eager
    rows' tokens) and ``torch.compile(model)`` rows in training (the eager step's loss), each with its first call's
    time. One family: the rows are built by one code path for both, and each compilation takes tens of seconds on a
    CI machine (both families compile in ``tests/models/test_torch_compile.py``; the batched part's compiled rows take
    generation's code path at another batch size)."""
    models = ["DenseRetNet m=0"]
    report = run([*TINY, "--parts", "training", "generation", "--dtypes", "float32",
                  "--mamba-train-len", "0", "--models", *models, "--out", str(tmp_path / "c.json")])
    assert report["errors"] == {}, report["errors"]
    assert report["environment"]["dynamo_limits"]
    compiled = {f"{name} compiled" for name in models}

    training = report["training"]["models"]
    assert set(training) == set(models) | compiled
    for name in compiled:
        entry = training[name]
        for key in ("tokens_per_s", "fraction_of_peak", "speedup_vs_eager", "compile_seconds"):
            assert positive(entry[key]), (name, key)
        assert entry["compiled_loss_abs_diff"] < 1e-4, name

    entries = report["generation"]["dtypes"]["float32"]
    assert set(entries) == {"transformers Mamba", *models, *compiled}
    for name in compiled:
        entry = entries[name]
        assert entry["same_tokens_as_eager"] is True, name  # float32: the eager model's greedy tokens
        assert entry["compiled_path_taken"] is True, name  # generate() went through get_compiled_call
        assert positive(entry["speedup_vs_transformers_mamba"]) and positive(entry["first_call_seconds"])

    targets = {f["figure"]: f["target"] for f in report["figures"] if f["target"]}
    for name in compiled:
        assert targets[f"generation speed-up, {name} vs transformers Mamba (eager), float32, batch 1"] == "value >= 2.0"
        assert targets[f"training {name} (B=2, L=32): model FLOP/s = 6 N tokens/s"] == "fraction >= 0.45"


def test_a_compiled_row_that_fails_is_reported_in_its_row(tmp_path, monkeypatch):
    """Should compiling fail (here: every ``torch.compile``'d callable raises), the compiled rows carry the error and
    the rest of the run goes on."""

    def failing_compile(fn=None, **kwargs):
        def call(*args, **kw):
            raise RuntimeError("compiling failed (stand-in)")

        return call

    monkeypatch.setattr(torch, "compile", failing_compile)
    report = run([*TINY, "--parts", "training", "generation", "batched", "--dtypes", "float32",
                  "--mamba-train-len", "0", "--models", "DenseMamba m=0", "--out", str(tmp_path / "f.json")])
    name = "DenseMamba m=0 compiled"
    assert set(report["errors"]) == {f"training | {name}", f"generation | {name} | float32", f"batched | {name}"}
    assert all("compiling failed (stand-in)" in error for error in report["errors"].values())
    for entry in (report["training"]["models"][name], report["generation"]["dtypes"]["float32"][name],
                  report["batched"]["models"][name]):
        assert "compiling failed" in entry["error"], entry
    assert positive(report["generation"]["dtypes"]["float32"]["DenseMamba m=0"]["tokens_per_s"])
    assert positive(report["training"]["models"]["DenseMamba m=0"]["fraction_of_peak"])
    assert not any(name in f["figure"] for f in report["figures"])
    assert json.loads((tmp_path / "f.json").read_text())["errors"] == report["errors"]


def test_environment_records_the_allocator_and_thread_runtime_settings(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("HF_DENSESSM_UNRELATED", "1")
    recorded = bench_cpu.environment()["runtime_env"]
    assert recorded["MALLOC_MMAP_MAX_"] == "0" and recorded["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "HF_DENSESSM_UNRELATED" not in recorded
