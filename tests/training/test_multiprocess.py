"""Multi-process training: ``accelerate launch`` starts 2 CPU processes (gloo) running ``examples/train_ddp.py``
(``transformers.Trainer``, unchanged), and the run logs the same losses as one process on the same global batch; and
FSDP2 (``fully_shard`` per ``_no_split_modules`` block) on two CPU processes matches one process."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import FAMILIES

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
MICRO = {
    "densemamba": ["hidden_size=32", "num_hidden_layers=3", "state_size=8", "dense_layers=2"],
    "denseretnet": ["hidden_size=32", "num_hidden_layers=3", "query_key_dim=16", "dense_layers=2"],
}
STEPS, GLOBAL_BATCH = 4, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command, family, output_dir):
    """Run ``command SCRIPT ...`` for a few steps; return its stdout and the logged training losses."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # CPU processes (gloo), also on a GPU machine
    args = ["--max-steps", str(STEPS), "--global-batch-size", str(GLOBAL_BATCH), "--block-size", "32"]
    result = subprocess.run(
        [*command, str(SCRIPT), *args, "--output-dir", str(output_dir), "--model", family, "--config", *MICRO[family]],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    history = json.loads((output_dir / "log_history.json").read_text())
    return result.stdout, [entry for entry in history if "loss" in entry]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_process_run_matches_one_process(family, tmp_path):
    single_out, single = _run([sys.executable], family, tmp_path / "single")
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
    ]
    multi_out, multi = _run(launch, family, tmp_path / "multi")

    assert re.search(rf"^1 process\(es\), {GLOBAL_BATCH} sequences each", single_out, re.M), single_out
    assert re.search(rf"^2 process\(es\), {GLOBAL_BATCH // 2} sequences each", multi_out, re.M), multi_out
    assert [e["step"] for e in single] == [e["step"] for e in multi] == list(range(1, STEPS + 1))
    for one, two in zip(single, multi):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-4), (one, two)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-3), (one, two)
    assert single[-1]["loss"] < single[0]["loss"]

    single_weights = load_file(tmp_path / "single" / "model.safetensors")
    multi_weights = load_file(tmp_path / "multi" / "model.safetensors")
    assert single_weights.keys() == multi_weights.keys()
    for name in single_weights:
        torch.testing.assert_close(multi_weights[name], single_weights[name], atol=1e-5, rtol=1e-4, msg=name)


WORKER = Path(__file__).resolve().parent / "fsdp2_worker.py"


def _worker(*args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(WORKER.parents[1]))  # tests/: helpers.py
    result = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_on_cpu_matches_one_process(family):
    """FSDP2 itself runs on CPUs (gloo): ``fully_shard`` on every ``_no_split_modules`` block, two processes, the
    same losses as one process on the whole batch. (accelerate's FSDP integration is GPU-only: on CPUs the Trainer
    silently runs DDP instead, docs/training.md.)"""
    single = _worker(str(WORKER), family, "--single")
    sharded = _worker(
        "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), str(WORKER), family,
    )
    assert sharded["sharded_parameters"] > 0 and single["sharded_parameters"] == 0
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-4)
    assert single["losses"][-1] < single["losses"][0]
