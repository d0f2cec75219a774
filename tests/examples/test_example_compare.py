"""Plumbing test of ``examples/compare.py`` (issue 13's paired comparison): ``--quick`` runs every variant for a few
steps on a slice of the corpus, in a subprocess as a user would, and the JSON and PNG it writes are checked: every
field, the paired differences against the per-seed losses they come from, parameter counts within the 3% the script
promises, the pairing itself (each dense variant starts from its base's weights under the same seed) and the PNG.
The result of so short a run says nothing about the models and is not checked. The option checks run without
training.
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "compare.py"
VARIANTS = ["mamba", "dm-input", "dm-state", "retnet", "denseretnet"]
DIFFERENCES = {
    "dm-input - mamba": ("dm-input", "mamba"),
    "dm-state - mamba": ("dm-state", "mamba"),
    "denseretnet - retnet": ("denseretnet", "retnet"),
    "dm-state - dm-input": ("dm-state", "dm-input"),
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("compare")
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output-dir", str(output_dir)],
        capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return output_dir, json.loads((output_dir / "results.json").read_text()), completed.stdout


def test_quick_run_writes_every_field(quick_run):
    output_dir, report, stdout = quick_run
    assert report["quick"] is True
    settings = report["settings"]
    seeds, steps = settings["seeds"], settings["steps"]
    assert len(seeds) >= 2 and steps >= 2
    assert settings["tokens_per_run"] == steps * settings["batch_size"] * settings["block_size"]
    assert report["data"]["train_tokens"] > settings["tokens_per_run"]
    assert report["data"]["held_out_documents"] > 0 and settings["eval_tokens"] > 0
    assert list(report["variants"]) == VARIANTS

    for name, variant in report["variants"].items():
        assert variant["parameters"] > 0
        assert abs(variant["parameters_vs_base"]) <= 0.03
        loss = variant["held_out_loss"]
        per_seed = [loss["per_seed"][str(s)] for s in seeds]
        assert all(math.isfinite(x) and 0 < x < 20 for x in per_seed)
        assert loss["mean"] == pytest.approx(sum(per_seed) / len(per_seed))
        assert loss["std"] >= 0 and loss["n"] == len(seeds)
        assert all(t > 0 for t in variant["seconds_per_step"]["per_seed"].values())
        for seed in seeds:
            curve = variant["curves"][str(seed)]
            assert curve[0][0] == 0 and curve[-1][0] == steps  # before training ... the last step
            assert curve[-1][1] == loss["per_seed"][str(seed)]
            assert [step for step, _ in curve] == sorted({step for step, _ in curve})
    assert report["variants"]["mamba"]["parameters_vs_base"] == 0.0
    assert report["variants"]["dm-input"]["parameters"] > report["variants"]["mamba"]["parameters"]

    assert set(report["paired_differences"]) == set(DIFFERENCES)
    for label, (a, b) in DIFFERENCES.items():
        difference = report["paired_differences"][label]
        for seed in seeds:
            expected = report["variants"][a]["held_out_loss"]["per_seed"][str(seed)] - (
                report["variants"][b]["held_out_loss"]["per_seed"][str(seed)]
            )
            assert difference["per_seed"][str(seed)] == pytest.approx(expected, abs=1e-12)
        assert difference["mean"] == pytest.approx(sum(difference["per_seed"].values()) / len(seeds))
        assert difference["ci95_half_width"] >= difference["stderr"] >= 0
        assert isinstance(difference["resolves_target"], bool) and label in difference["verdict"]
    assert report["target_nats"] == 0.03
    assert ("does NOT resolve" in report["resolution"]) == (not report["resolves_target"])
    assert report["resolution"] in stdout

    png = output_dir / report["png"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (output_dir / "data").is_dir()  # the tokenized data, cached for the next run


def test_runs_are_paired(quick_run):
    """Same seed: each dense variant starts from its base's weights (only its gates are new), so the losses before
    training are close; different seeds start apart."""
    _, report, _ = quick_run
    variants = report["variants"]
    for name in ("dm-input", "dm-state", "denseretnet"):
        base = "mamba" if name.startswith("dm-") else "retnet"
        assert 0.9 < variants[name]["shared_init_fraction"] < 1.0
        for seed in report["settings"]["seeds"]:
            start, base_start = variants[name]["curves"][str(seed)][0][1], variants[base]["curves"][str(seed)][0][1]
            assert abs(start - base_start) < 0.05
    starts = [variants["mamba"]["curves"][str(s)][0][1] for s in report["settings"]["seeds"]]
    assert len(set(starts)) == len(starts)


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("compare_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--variants", "dm-input"], "--variants"),  # no base to pair with
        (["--variants", "mamba", "mamba"], "--variants"),
        (["--variants", "transformer"], "--variants"),
        (["--hidden-size", "100"], "--hidden-size"),
        (["--seeds", "1"], "--seeds"),
        (["--steps", "0"], "--steps"),
        (["--eval-every", "50", "--steps", "10"], "--eval-every"),
    ],
)
def test_bad_options_are_argparse_errors(compare, argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        compare.parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err
