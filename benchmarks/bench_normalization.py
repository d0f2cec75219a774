"""CPU cost of DenseRetNet's published retention normalization (each head's output divided by ``sqrt(s_t)``,
``docs/design.md`` §3), folded into the per-head RMSNorm as ``eps * s_t``: the model with it against the same model
with ``s_t`` replaced by one (no normalization), side by side in one process (paired, as ``bench_cpu.py``).

    python benchmarks/bench_normalization.py --out benchmarks/results/normalization.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_densessm  # noqa: F401
import hf_densessm.modeling.modeling_denseretnet as retnet
from bench_cpu import environment, forward_pass, interleaved_times, paired_ratio, training_step
from hf_densessm import DenseRetNetConfig


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/normalization.json"))
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DenseRetNetConfig.from_preset("denseretnet-30m", vocab_size=32000))
    ids = torch.randint(3, 32000, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    normalizer = retnet.retention_row_sums

    def ones(positions, num_heads, dtype):
        return torch.ones(*positions.shape, num_heads, 1, dtype=dtype, device=positions.device)

    def with_normalizer(fn, replacement):
        def run():
            retnet.retention_row_sums = replacement
            try:
                fn()
            finally:
                retnet.retention_row_sums = normalizer
        return run

    results = {"environment": environment(), "seq_len": args.seq_len, "preset": "denseretnet-30m"}
    for phase, step in (("forward", forward_pass), ("forward+backward", training_step)):
        fn = lambda step=step: step(model, ids)  # noqa: E731
        times = interleaved_times(
            {"normalized": with_normalizer(fn, normalizer), "factor one": with_normalizer(fn, ones)}, 1, args.repeats
        )
        results[phase] = {
            "normalized_s": statistics.median(times["normalized"]),
            "without_s": statistics.median(times["factor one"]),
            "ratio": paired_ratio(times, "normalized", "factor one"),
        }
        print(f"{phase}: {results[phase]['ratio']:.3f}x with the normalization "
              f"({results[phase]['normalized_s']:.3f} s vs {results[phase]['without_s']:.3f} s, median)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
