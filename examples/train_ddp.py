"""Train a DenseSSM language model with ``transformers.Trainer`` on one process or many, unchanged.

The same script runs on one process (``python examples/train_ddp.py``) and under ``accelerate launch`` on
several: the Trainer finds the processes ``accelerate`` (``torchrun`` underneath) started and wraps the model in
``DistributedDataParallel`` (or FSDP / DeepSpeed, from an ``accelerate`` config; see ``docs/training.md`` and
``examples/accelerate/``). ``--global-batch-size`` is the number of sequences per optimizer step over all
processes: each process gets ``global / world size``, so one process and N processes take the same optimizer
steps on the same sequences, and log (up to rounding) the same losses.

Data: Python's documentation (``pydoc_data.topics``), encoded as UTF-8 bytes (a 256-token vocabulary, no tokenizer
to train) and cut into ``--block-size`` blocks. The Trainer shuffles them with a seeded sampler that every
process draws alike.

Run it from the repository root::

    python examples/train_ddp.py                                         # one process; ~2 minutes on 2 CPU cores
    accelerate launch --multi_gpu --num_processes 2 examples/train_ddp.py  # two processes (CPU: see below)
    accelerate launch --config_file examples/accelerate/fsdp.yaml examples/train_ddp.py --model denseretnet

On a machine without GPUs, ``accelerate launch --multi_gpu --num_processes N`` starts N CPU processes that talk
through gloo (``--cpu`` alone would start one process: several CPU processes need MPI there). The script trains on
the CPU whenever no GPU is visible. At the end, process 0 writes ``log_history.json`` (every logged loss) and the
model to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator, set_seed

import hf_densessm  # noqa: F401  (registers "densemamba" and "denseretnet" with the Auto classes)
from hf_densessm import DenseMambaConfig, DenseRetNetConfig

CONFIGS = {"densemamba": DenseMambaConfig, "denseretnet": DenseRetNetConfig}
VOCAB_SIZE = 256  # UTF-8 bytes


def byte_blocks(block_size: int) -> Dataset:
    """Python's documentation (topics sorted by name, joined by blank lines) as UTF-8 bytes, cut into blocks of
    ``block_size`` tokens (the last partial block is dropped); ``labels`` are the inputs (the model shifts them)."""
    from pydoc_data.topics import topics

    data = "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")
    blocks = [list(data[i : i + block_size]) for i in range(0, len(data) - block_size + 1, block_size)]
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def parse_overrides(items: list[str]) -> dict:
    """``["hidden_size=64", "dense_layers=2"]`` -> ``{"hidden_size": 64, "dense_layers": 2}`` (values parsed as
    JSON when they are JSON, else kept as strings)."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--config takes KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description="Train a DenseSSM model with transformers.Trainer on one or more processes (accelerate launch).",
    )
    add = parser.add_argument
    add("--model", choices=sorted(CONFIGS), default="densemamba", help="model family (default: %(default)s)")
    add("--preset", help="size preset (default: <model>-tiny)")
    add("--config", nargs="*", default=[], metavar="KEY=VALUE", help="config fields to change, e.g. hidden_size=64")
    add("--max-steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    add("--global-batch-size", type=int, default=8, help="sequences per step over all processes (default: %(default)s)")
    add("--block-size", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    add("--learning-rate", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    add("--seed", type=int, default=0, help="seed of init and data order (default: %(default)s)")
    add("--output-dir", type=Path, default=Path("outputs/train-ddp"), help="(default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    """Train, then (process 0) save the model and the log history; return the log history."""
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch / torchrun
    if args.global_batch_size % world_size:
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by {world_size} processes")

    set_seed(args.seed)
    config = CONFIGS[args.model].from_preset(
        args.preset or f"{args.model}-tiny", vocab_size=VOCAB_SIZE, **parse_overrides(args.config)
    )
    model = AutoModelForCausalLM.from_config(config)

    training_args = TrainingArguments(
        output_dir=str(args.output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.global_batch_size // world_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,  # a fraction: the first 10% of the steps
        weight_decay=0.1,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        data_seed=args.seed,
        dataloader_drop_last=True,
        use_cpu=not torch.cuda.is_available(),  # several CPU processes then talk through gloo
        ddp_find_unused_parameters=False,  # every parameter takes part in every forward pass
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=training_args, data_collator=default_data_collator, train_dataset=byte_blocks(args.block_size)
    )
    trainer.train()

    history = trainer.state.log_history
    if trainer.is_world_process_zero():
        trainer.save_model(str(args.output_dir))
        (args.output_dir / "log_history.json").write_text(json.dumps(history, indent=1), encoding="utf-8")
        losses = [entry["loss"] for entry in history if "loss" in entry]
        print(
            f"{world_size} process(es), {training_args.per_device_train_batch_size} sequences each per step: "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.max_steps} steps; saved to {args.output_dir}"
        )
    return history


if __name__ == "__main__":
    main()
