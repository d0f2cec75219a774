"""CPU cost of DenseMamba's state-level dense connection (``dense_target="state"``, DenseSSM paper Eq. 14) against
the input-level one (``"input"``) and the plain Mamba (``dense_layers=0``), side by side in one process.

At the 30M preset (vocabulary 32000), ``--seq-len`` tokens (default 1024), batch 1: the forward pass (inference
mode) and a training step's forward + backward, the models taking turns within each repeat; ratios are medians of
back-to-back pairs (``bench_cpu.paired_ratio``). Writes a JSON with the environment.

    python benchmarks/bench_dense_target.py --out benchmarks/results/dense_target.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_densessm  # noqa: F401
from bench_cpu import environment, forward_pass, interleaved_times, paired_ratio, training_step
from hf_densessm import DenseMambaConfig

VARIANTS = {
    "mamba (dense_layers=0)": dict(dense_layers=0),
    'input (m=4)': dict(dense_layers=4, dense_target="input"),
    'state (m=4)': dict(dense_layers=4, dense_target="state"),
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/dense_target.json"))
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)

    ids = torch.randint(3, 32000, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    models = {}
    for name, overrides in VARIANTS.items():
        torch.manual_seed(0)
        models[name] = AutoModelForCausalLM.from_config(
            DenseMambaConfig.from_preset("densemamba-30m", vocab_size=32000, **overrides)
        )

    results = {"environment": environment(), "seq_len": args.seq_len, "batch": 1, "preset": "densemamba-30m"}
    for phase, fn in (("forward", forward_pass), ("forward+backward", training_step)):
        times = interleaved_times({n: (lambda m=m: fn(m, ids)) for n, m in models.items()}, args.warmup, args.repeats)
        base = "mamba (dense_layers=0)"
        results[phase] = {
            n: {"median_s": statistics.median(t), "vs_mamba": paired_ratio(times, n, base),
                "vs_input": paired_ratio(times, n, "input (m=4)")}
            for n, t in times.items()
        }
    print(f"densemamba-30m, batch 1, {args.seq_len} tokens, {results['environment'].get('cpu', '')}")
    print("| variant | forward (s) | vs Mamba | fwd+bwd (s) | vs Mamba | vs input, fwd / fwd+bwd |")
    print("|---|---|---|---|---|---|")
    for n in VARIANTS:
        f, t = results["forward"][n], results["forward+backward"][n]
        print(f"| {n} | {f['median_s']:.3f} | {f['vs_mamba']:.2f}x | {t['median_s']:.3f} | {t['vs_mamba']:.2f}x | "
              f"{f['vs_input']:.2f}x / {t['vs_input']:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
