"""CPU benchmark of DenseMamba and DenseRetNet against transformers' own Mamba, side by side in one process.

Measures, at the 30M-parameter presets (vocabulary 32000), with ``torch.inference_mode``, warm-up runs and the
median of several repeats, the models taking turns within each repeat (ratios are medians of back-to-back pairs,
so that other processes' load, which the JSON records, skews them less):

- forward throughput (tokens/s) of one full-sequence pass, ``--seq-len`` tokens (default 1024), batch 1 and 4:
  transformers' ``MambaForCausalLM`` and DenseMamba ``dense_layers=0`` with the SAME weights (the DenseMamba state
  dict loaded strictly into a ``MambaConfig`` of the same sizes; their logits are checked to match), DenseMamba
  ``dense_layers=4``, and DenseRetNet ``dense_layers=0`` and ``2`` (transformers has no RetNet);
- batch-1 greedy generation throughput (new tokens/s, prompt ``--prompt-len``, exactly ``--new-tokens`` new
  tokens: ``min_new_tokens = max_new_tokens``; the time includes the prompt's prefill) of the same models.

It prints a table and the ratios the project targets, and writes everything, with the torch/transformers
versions, the CPU model and the thread count, to ``--out`` as JSON.

Run from the repository root::

    python benchmarks/bench_cpu.py                       # ~4 minutes on 2 cores
    python benchmarks/bench_cpu.py --batch-sizes 1 --repeats 3 --out /tmp/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import transformers
from transformers import MambaConfig, MambaForCausalLM

import hf_densessm
from hf_densessm import DenseMambaConfig, DenseMambaForCausalLM, DenseRetNetConfig, DenseRetNetForCausalLM

VOCAB_SIZE = 32000
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu.json"), help="JSON output (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=1024, help="forward sequence length (default: %(default)s)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4], help="forward batch sizes (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=64, help="generation prompt length (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=128, help="generated tokens (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forward runs, median kept (default: %(default)s)")
    parser.add_argument("--gen-repeats", type=int, default=5, help="timed generations, median kept (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: %(default)s)")
    args = parser.parse_args(argv)
    for name in ("seq_len", "prompt_len", "new_tokens", "repeats", "gen_repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if min(args.batch_sizes) < 1:
        parser.error("argument --batch-sizes: must be >= 1")
    return args


def environment() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_densessm": hf_densessm.__version__,
        "load_average_1_5_15_min": os.getloadavg(),  # other processes on the machine skew every timing
    }


def interleaved_times(fns: dict, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of each call of each function, the functions taking turns in every repeat, so that a change in
    the machine's load (other processes) hits all of them alike; ratios are then taken repeat by repeat."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def forward_pass(model, ids) -> None:
    """One inference-mode forward pass of ``model`` over ``ids`` (only the last position's logits)."""
    model.eval()
    with torch.inference_mode():
        model(ids, logits_to_keep=1)


def training_step(model, ids) -> None:
    """One training forward + backward of ``model`` on ``ids`` (labels = inputs)."""
    model.train()
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()


def paired_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median over repeats of time(numerator) / time(denominator), each pair measured back to back."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


# ----------------------------------------------------------------------------------------------------
# Models: all 30M presets, vocabulary 32000, one seed; transformers' Mamba gets DenseMamba m=0's weights.
# ----------------------------------------------------------------------------------------------------


def build_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    models = {}
    dense_mamba_0 = DenseMambaForCausalLM(DenseMambaConfig.from_preset("densemamba-30m", vocab_size=VOCAB_SIZE, dense_layers=0))
    c = dense_mamba_0.config
    mamba_config = MambaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, state_size=c.state_size,
        num_hidden_layers=c.num_hidden_layers, layer_norm_epsilon=c.layer_norm_epsilon, expand=c.expand,
        conv_kernel=c.conv_kernel, use_bias=c.use_bias, use_conv_bias=c.use_conv_bias, hidden_act=c.hidden_act,
        residual_in_fp32=c.residual_in_fp32, time_step_rank=c.time_step_rank, tie_word_embeddings=c.tie_word_embeddings,
        pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
    )
    mamba = MambaForCausalLM(mamba_config)
    mamba.load_state_dict(dense_mamba_0.state_dict(), strict=True)
    models["transformers Mamba"] = mamba
    models["DenseMamba m=0"] = dense_mamba_0
    models["DenseMamba m=4"] = DenseMambaForCausalLM(
        DenseMambaConfig.from_preset("densemamba-30m", vocab_size=VOCAB_SIZE, dense_layers=4)
    )
    for m in (0, 2):
        models[f"DenseRetNet m={m}"] = DenseRetNetForCausalLM(
            DenseRetNetConfig.from_preset("denseretnet-30m", vocab_size=VOCAB_SIZE, dense_layers=m)
        )
    for model in models.values():
        model.eval()
    return models


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment()
    print("  ".join(f"{k}={v}" for k, v in env.items()))
    models = build_models()
    params = {name: model.num_parameters() for name, model in models.items()}

    generator = torch.Generator().manual_seed(0)
    results = {"forward": {}, "generation": {}}
    with torch.inference_mode():
        # Same weights, same logits: the comparison below is between two implementations of one model.
        probe = torch.randint(3, VOCAB_SIZE, (1, 256), generator=generator)
        logits_diff = (
            models["transformers Mamba"](probe, use_cache=False).logits
            - models["DenseMamba m=0"](probe, use_cache=False).logits
        ).abs().max().item()
        print(f"max |logits(transformers Mamba) - logits(DenseMamba m=0)| = {logits_diff:.2e}")

        forward_times = {}
        for batch in args.batch_sizes:
            input_ids = torch.randint(3, VOCAB_SIZE, (batch, args.seq_len), generator=generator)
            forward_times[batch] = interleaved_times(
                {name: partial(model, input_ids, use_cache=False) for name, model in models.items()},
                args.warmup, args.repeats,
            )
            for name, times in forward_times[batch].items():
                seconds = statistics.median(times)
                results["forward"][f"{name} | B={batch}"] = {
                    "model": name, "batch": batch, "seq_len": args.seq_len, "seconds": seconds,
                    "tokens_per_s": batch * args.seq_len / seconds, "all_seconds": times,
                }
                print(f"forward  B={batch} L={args.seq_len}  {name:20s} {seconds * 1e3:9.1f} ms  {batch * args.seq_len / seconds:9.0f} tok/s")

        prompt = torch.randint(3, VOCAB_SIZE, (1, args.prompt_len), generator=generator)
        generate_kwargs = dict(
            attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=0,
            max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,  # every model makes the same count
        )
        for name, model in models.items():  # the check, once: exactly --new-tokens new tokens
            assert model.generate(prompt, **generate_kwargs).shape[1] == args.prompt_len + args.new_tokens, name
        generation_times = interleaved_times(
            {name: partial(model.generate, prompt, **generate_kwargs) for name, model in models.items()},
            args.warmup, args.gen_repeats,
        )
        for name, times in generation_times.items():
            seconds = statistics.median(times)
            results["generation"][name] = {
                "model": name, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "seconds": seconds,
                "tokens_per_s": args.new_tokens / seconds, "all_seconds": times,
            }
            print(f"generate prompt {args.prompt_len} + {args.new_tokens} new  {name:20s} {seconds:7.2f} s  {args.new_tokens / seconds:7.1f} tok/s")

    # Ratios of times measured back to back (median over repeats); a speed-up is time(transformers) / time(ours).
    # Targets as the project set them.
    ratios = {}  # label -> (value, target or None)
    for b, times in forward_times.items():
        ratios[f"forward speed-up, DenseMamba m=0 vs transformers Mamba, B={b}"] = (
            paired_ratio(times, "transformers Mamba", "DenseMamba m=0"), (">=", 2.0))
        ratios[f"forward time, DenseMamba m=4 / m=0, B={b}"] = (
            paired_ratio(times, "DenseMamba m=4", "DenseMamba m=0"), ("<=", 1.2))
        ratios[f"forward time, DenseRetNet m=2 / m=0, B={b}"] = (
            paired_ratio(times, "DenseRetNet m=2", "DenseRetNet m=0"), None)
    ratios["generation speed-up, DenseMamba m=0 vs transformers Mamba"] = (
        paired_ratio(generation_times, "transformers Mamba", "DenseMamba m=0"), (">=", 1.0))
    ratios["generation speed-up, DenseMamba m=4 vs transformers Mamba"] = (
        paired_ratio(generation_times, "transformers Mamba", "DenseMamba m=4"), None)
    ratios["generation time, DenseRetNet m=2 / m=0"] = (
        paired_ratio(generation_times, "DenseRetNet m=2", "DenseRetNet m=0"), None)

    # The table.
    print()
    header = f"{'model':20s} {'params':>8s} " + " ".join(f"{'fwd B=' + str(b) + ' tok/s':>15s}" for b in args.batch_sizes)
    header += f" {'gen tok/s':>10s}"
    print(header)
    print("-" * len(header))
    for name in models:
        cells = " ".join(f"{results['forward'][f'{name} | B={b}']['tokens_per_s']:15.0f}" for b in args.batch_sizes)
        print(f"{name:20s} {params[name] / 1e6:7.1f}M {cells} {results['generation'][name]['tokens_per_s']:10.1f}")
    print()
    ratio_report = {}
    for label, (value, target) in ratios.items():
        met = None if target is None else (value >= target[1] if target[0] == ">=" else value <= target[1])
        verdict = "" if target is None else f"  (target {target[0]} {target[1]}x: {'met' if met else 'MISSED'})"
        print(f"{label:60s} {value:6.2f}x{verdict}")
        ratio_report[label] = {"value": value, "target": None if target is None else f"{target[0]} {target[1]}", "met": met}

    env["load_average_at_end"] = os.getloadavg()
    report = {
        "environment": env,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "params": params,
        "logits_max_abs_diff_mamba_vs_densemamba_m0": logits_diff,
        **results,
        "ratios": ratio_report,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
