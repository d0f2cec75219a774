"""Training throughput in real tokens per second: packed rows (transformers' ``DataCollatorWithFlattening``, every
state reset at each document) against padded batches (``DataCollatorWithPadding``-style right padding with an
attention mask), on the same documents, in one process on the CPU.

The documents are ``pydoc_data.topics`` entries (tens to thousands of bytes; here byte-level ids, truncated to
``--max-len``), in one shuffled order; each step takes ``--docs-per-step`` documents either packed into one row or
padded into a batch. Both variants see the same documents and the same number of real tokens per step; the padded
one computes on the padding as well. The steps alternate between the variants (paired ratio, as ``bench_cpu.py``).

    python benchmarks/bench_packing.py --out benchmarks/results/packing.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import pydoc_data.topics
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

import hf_densessm  # noqa: F401
from bench_cpu import environment
from hf_densessm import DenseMambaConfig, DenseRetNetConfig

PRESETS = {"densemamba": (DenseMambaConfig, "densemamba-tiny"), "denseretnet": (DenseRetNetConfig, "denseretnet-tiny")}


def documents(max_len: int, seed: int) -> list[list[int]]:
    """Every pydoc topic as byte ids (3 .. 258), truncated to ``max_len``, shuffled."""
    docs = [[b + 3 for b in text.encode("utf-8")[:max_len]] for _, text in sorted(pydoc_data.topics.topics.items())]
    random.Random(seed).shuffle(docs)
    return [d for d in docs if len(d) > 1]


def padded(batch: list[list[int]]) -> dict:
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, d in enumerate(batch):
        ids[i, : len(d)] = labels[i, : len(d)] = torch.tensor(d)
        mask[i, : len(d)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), nargs="+", default=sorted(PRESETS))
    parser.add_argument("--max-len", type=int, default=2048, help="truncate documents to this many bytes")
    parser.add_argument("--docs-per-step", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/packing.json"))
    args = parser.parse_args(argv)

    docs = documents(args.max_len, seed=0)
    batches = [docs[i : i + args.docs_per_step] for i in range(0, args.docs_per_step * (args.steps + 1), args.docs_per_step)]
    lengths = [len(d) for d in docs]
    results = {
        "environment": environment(),
        "documents": {"count": len(docs), "median_len": statistics.median(lengths), "max_len": max(lengths)},
        "docs_per_step": args.docs_per_step,
        "steps": args.steps,
    }
    flatten = DataCollatorWithFlattening()
    for family in args.model:
        config_class, preset = PRESETS[family]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config_class.from_preset(preset, vocab_size=259)).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(inputs):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            model(**inputs).loss.backward()
            optimizer.step()
            return time.perf_counter() - start

        variants = {"packed": lambda b: flatten([{"input_ids": d} for d in b]), "padded": padded}
        times = {name: [] for name in variants}
        for i, batch in enumerate(batches):
            for name, collate in variants.items():
                seconds = step(collate(batch))
                if i:  # the first batch warms up
                    times[name].append(seconds)
        real = [sum(map(len, b)) for b in batches[1:]]
        padded_tokens = [len(b) * max(map(len, b)) for b in batches[1:]]
        row = {
            name: {"real_tokens_per_s": sum(real) / sum(t), "median_step_s": statistics.median(t)}
            for name, t in times.items()
        }
        row["packed_vs_padded"] = statistics.median(b / a for a, b in zip(times["packed"], times["padded"]))
        row["padding_fraction"] = 1 - sum(real) / sum(padded_tokens)
        results[family] = row
        print(
            f"{family} ({preset}): packed {row['packed']['real_tokens_per_s']:.0f} real tok/s, padded "
            f"{row['padded']['real_tokens_per_s']:.0f} real tok/s; packed is {row['packed_vs_padded']:.2f}x the padded "
            f"throughput (median paired step); padding was {row['padding_fraction']:.0%} of the padded batches"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
