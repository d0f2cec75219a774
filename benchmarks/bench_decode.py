"""CPU decoding speed: greedy ``generate()`` of DenseMamba and DenseRetNet against transformers' Mamba, paired.

The models are ``bench_cpu.build_models()`` (30M presets, vocabulary 32000; transformers' ``MambaForCausalLM`` with
DenseMamba m=0's weights), in float32 and in bfloat16 (``model.to(torch.bfloat16)``), taking turns within each
repeat (``bench_cpu.interleaved_times``), so that the machine's load hits them alike; the speed-ups are medians of
back-to-back pairs (``bench_cpu.paired_ratio``).

- batch 1: a ``--prompt-len`` prompt, exactly ``--new-tokens`` new tokens (``min_new_tokens = max_new_tokens``);
  the time includes the prefill and transformers' generation loop, as a user sees it;
- batch ``--batch`` (default 8): left-padded prompts of ``prompt_len / 2 .. prompt_len`` tokens, same count of new
  tokens per row; tokens/s counts every row's new tokens.

Run from the repository root (about 4 minutes on the 2-core CPU here)::

    python benchmarks/bench_decode.py
    python benchmarks/bench_decode.py --dtypes bfloat16 --models "transformers Mamba" "DenseMamba m=0" --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import build_models, environment, interleaved_times, paired_ratio  # noqa: E402

MAMBA = "transformers Mamba"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--models", nargs="+", default=None, help="names from bench_cpu.build_models() (default: all)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="rows of the left-padded batch (0: skip it)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default: none)")
    return parser.parse_args(argv)


def left_padded_batch(batch: int, longest: int, vocab_size: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` ``(batch, longest)`` int64: row ``i`` holds a prompt of ``longest/2 .. longest`` tokens at the
    right end, zeros (mask 0) before it."""
    lengths = [max(1, round(longest / 2 + (longest / 2) * i / max(1, batch - 1))) for i in range(batch)]
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, longest - length :] = torch.randint(3, vocab_size, (length,), generator=generator)
        mask[row, longest - length :] = 1
    return ids, mask


def measure(models: dict, ids, mask, args) -> dict:
    """Paired generation times of ``models`` on ``ids``; returns per model tokens/s and speed-up vs transformers."""
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0,
                  max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    with torch.inference_mode():
        outputs = {name: model.generate(ids, **kwargs) for name, model in models.items()}
        times = interleaved_times({name: partial(m.generate, ids, **kwargs) for name, m in models.items()},
                                  args.warmup, args.repeats)
    new = ids.shape[0] * args.new_tokens
    result = {}
    for name in models:
        seconds = statistics.median(times[name])
        result[name] = {
            "tokens_per_s": new / seconds, "ms_per_step": seconds / args.new_tokens * 1e3,
            "speedup_vs_transformers_mamba": paired_ratio(times, MAMBA, name) if MAMBA in models else None,
            "same_tokens_as_transformers_mamba": (bool(torch.equal(outputs[name], outputs[MAMBA]))
                                                  if MAMBA in models else None),
            "all_seconds": times[name],
        }
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment()
    print("  ".join(f"{k}={v}" for k, v in env.items()))
    models = build_models()
    if args.models:
        models = {name: models[name] for name in args.models}
    generator = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).config.vocab_size
    prompt = torch.randint(3, vocab, (1, args.prompt_len), generator=generator)
    batch_ids, batch_mask = left_padded_batch(args.batch, args.prompt_len, vocab, generator) if args.batch else (None, None)
    report = {"environment": env, "settings": {k: str(v) for k, v in vars(args).items()}, "results": {}}
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        cast = {name: (m if dtype == torch.float32 else copy.deepcopy(m).to(dtype)) for name, m in models.items()}
        runs = {"batch 1": (prompt, torch.ones_like(prompt))}
        if args.batch:
            runs[f"batch {args.batch} left-padded"] = (batch_ids, batch_mask)
        for label, (ids, mask) in runs.items():
            result = measure(cast, ids, mask, args)
            report["results"][f"{dtype_name} | {label}"] = result
            print(f"\n{dtype_name}, {label}, prompt {args.prompt_len} + {args.new_tokens} new tokens per row "
                  f"(median of {args.repeats}; speed-up = median of paired time ratios)")
            for name, r in result.items():
                speedup = r["speedup_vs_transformers_mamba"]
                same = r["same_tokens_as_transformers_mamba"]
                print(f"  {name:20s} {r['tokens_per_s']:8.1f} tok/s  {r['ms_per_step']:6.2f} ms/step"
                      + (f"  x{speedup:4.2f} vs transformers" if speedup is not None else "")
                      + ("" if same is None or name == MAMBA else f"  same tokens: {same}"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
