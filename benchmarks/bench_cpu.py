"""CPU benchmark of DenseMamba and DenseRetNet against transformers' own Mamba and against the machine's limits.

Everything runs side by side in one process, at the 30M-parameter presets (vocabulary 32000): transformers'
``MambaForCausalLM`` loaded with DenseMamba ``dense_layers=0``'s weights (their logits are checked to agree),
DenseMamba ``dense_layers`` = 0 and the default 4, DenseRetNet 0 and the default 2 (transformers has no RetNet).
Within each repeat the models take turns (``interleaved_times``), and every ratio is the median over repeats of
back-to-back pairs (``paired_ratio``), so the load of other processes, which the JSON records, skews it less. The
machine's limits are measured in the same run, interleaved with the models in the same way, never taken from a
data sheet. Each part can be run alone (``--parts``):

``forward``
    Throughput (tokens/s) of one full-logits inference-mode pass over ``--seq-len`` tokens at each of
    ``--batch-sizes``. Anchor: transformers' Mamba with the same weights (speed-up, target >= 2x), and
    ``dense_layers`` = 0 for the cost of the dense connection (DenseMamba m=4 / m=0 time, target <= 1.2x).

``training``
    One training step (train mode, ``model(ids, labels=ids).loss.backward()``), batch ``--train-batch`` x
    ``--train-seq-len`` tokens (default 2 x 1024). Figures:

    - tokens/s, and model FLOP/s = 6 x N x tokens/s, where N is the number of parameters that multiply each token:
      all parameters except the input-embedding table when it is not tied to the LM head (a lookup, no
      arithmetic); the scan / retention arithmetic itself is not counted, as usual for "model FLOPs".
    - limit: the machine's fp32 matrix-multiply peak, the best FLOP/s of ``--matmul-calls`` square
      ``torch.mm`` of size ``--matmul-size`` (2 n^3 FLOP each) per repeat, at the same thread count, taking its
      turn with the models; fraction of peak = model FLOP/s (median step time) / peak (target >= 45%).
    - anchor: the same model's forward pass (inference mode, ``model(ids, labels=ids)``: full logits and the loss,
      i.e. exactly the training step's forward); training-step time / forward time (target <= 3.3x).
    - anchor: the same family at ``dense_layers=0``; m>0 / m=0 training-step time (target <= 1.10x).
    - transformers' Mamba (same weights) against DenseMamba m=0, at the shorter ``--mamba-train-len`` (its
      PyTorch path is very slow; 0 skips it): training speed-up.

``generation``
    Batch-1 greedy generation, prompt ``--prompt-len``, exactly ``--new-tokens`` new tokens (min = max new
    tokens; the time includes the prompt's prefill), in each of ``--dtypes`` (float32, bfloat16: the models cast
    with ``.to(dtype)``). New tokens/s; anchor: transformers' Mamba with the same weights in the same dtype
    (speed-up; target >= 2x for DenseMamba). Limit: the memory-bandwidth roofline. One decoding step reads every
    weight once: all parameters (a tied LM head counted once, as the embedding table it is), except that an
    untied input-embedding table contributes only the one row it looks up; the recurrent state (a few hundred KB)
    is not counted. Ideal tokens/s = measured read bandwidth / those bytes; fraction = measured / ideal. The read
    bandwidth is the best of ``torch.sum`` over a ``--bandwidth-mib`` MiB float32 buffer (default 4 x the
    last-level cache, at least 1 GiB: main memory), interleaved with the generations; the copy bandwidth (bytes
    read + written) is recorded as well. A 30M model's weights (120 MB float32, 60 MB bfloat16) can fit in a
    large last-level cache, and then this main-memory roofline can be beaten (fraction > 1): a second limit, the
    same probe over a buffer as large as the largest model's weights in that dtype, gives the rate such a buffer
    is read at wherever it lives (``ideal_tokens_per_s_weight_sized_buffer`` and its fraction). Each DenseSSM
    model is also timed as ``"<name> compiled"``: a copy with ``compile_decode_step()`` on (the one-token step as one
    compiled function: DenseMamba's C kernel step in float32, else ``torch.compile``), compiled in the untimed first
    call (``first_call_seconds`` records it), its tokens compared with the eager model's (``same_tokens_as_eager``);
    where that is the C kernel, also as ``"<name> torch.compile"`` (``implementation="torch_compile"``), and the
    paired ratio of the two is ``speedup_vs_torch_compile_step``; ``--no-compiled`` skips these rows.

``batched``
    Greedy generation for a batch of ``--batched-size`` left-padded prompts of different lengths (from
    ``--prompt-len`` / 2 to ``--prompt-len`` tokens, ``attention_mask`` zero on the padding), exactly
    ``--batched-new-tokens`` new tokens per row, float32: new tokens/s (all rows) against transformers' Mamba, the
    compiled rows too. Reported, no target.

It prints one table per part, then every figure with its anchor, its limit and the fraction reached, and writes
everything, with the environment (CPU model, its AVX-512 / AMX flags, threads, load averages, versions), to
``--out`` as JSON.

Run from the repository root (the full default run: 535-618 s with ``--threads 1`` on a 2-core VM shared with
other work, 2026-11-22)::

    python benchmarks/bench_cpu.py
    python benchmarks/bench_cpu.py --parts training --repeats 3 --out /tmp/cpu.json        # one part
    python benchmarks/bench_cpu.py --parts generation --dtypes bfloat16 --new-tokens 32 --out /tmp/cpu.json

On a machine whose cores other processes are using, pass ``--threads 1``: a pool of as many threads as cores then
stalls at every barrier (measured on 2 shared cores: a tiny model's forward 100x slower, and the full run's
forward part not done after 7 minutes). Every limit is measured at the same thread count, so
the fractions stay meaningful (per thread).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch
import transformers
from transformers import MambaConfig, MambaForCausalLM

import hf_densessm
from hf_densessm import DenseMambaConfig, DenseMambaForCausalLM, DenseRetNetConfig, DenseRetNetForCausalLM
from hf_densessm.ops import densemamba_step

VOCAB_SIZE = 32000
PARTS = ("forward", "training", "generation", "batched")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: /proc/cpuinfo flags that decide the CPU's matmul peak (recorded in the JSON).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
MAMBA = "transformers Mamba"
RUNTIME_ENV_PREFIXES = ("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD", "OMP_", "GOMP_", "KMP_", "MKL_", "THP_MEM_ALLOC")
#: Every generation figure's ``generate()`` arguments besides the inputs and ``max_new_tokens``: plain greedy decoding,
#: each model's own ``eos_token_id`` (a model that stops early is counted per token it made). Runs A-F also passed
#: ``min_new_tokens`` (docs/benchmarks.md).
GENERATE_CALL = dict(do_sample=False, pad_token_id=0)
GENERATE_CALL_TEXT = (
    "generate(input_ids, attention_mask=..., " + ", ".join(f"{k}={v!r}" for k, v in GENERATE_CALL.items())
    + ", max_new_tokens=N)"
)
TARGETS = {
    "forward_speedup": (">=", 2.0),
    "forward_dense_cost": ("<=", 1.2),
    "train_fraction_of_peak": (">=", 0.45),
    "train_over_forward": ("<=", 3.3),
    "train_dense_cost": ("<=", 1.10),
    "generation_speedup": (">=", 2.0),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", type=Path, default=Path("benchmarks/results/cpu.json"), help="JSON output (default: %(default)s)")
    add("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run (default: all)")
    add("--seq-len", type=int, default=1024, help="forward sequence length (default: %(default)s)")
    add("--batch-sizes", type=int, nargs="+", default=[1, 4], help="forward batch sizes (default: %(default)s)")
    add("--train-seq-len", type=int, default=1024, help="training-step sequence length (default: %(default)s)")
    add("--train-batch", type=int, default=2, help="training-step batch size (default: %(default)s)")
    add("--mamba-train-len", type=int, default=128,
        help="sequence length of the transformers-Mamba training comparison, 0 to skip (default: %(default)s)")
    add("--prompt-len", type=int, default=64, help="generation prompt length (default: %(default)s)")
    add("--new-tokens", type=int, default=128, help="batch-1 generated tokens (default: %(default)s)")
    add("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES), help="generation dtypes (default: both)")
    add("--batched-size", type=int, default=8, help="batched-generation batch size (default: %(default)s)")
    add("--batched-new-tokens", type=int, default=32, help="batched generated tokens per row (default: %(default)s)")
    add("--warmup", type=int, default=1, help="untimed runs of everything before timing (default: %(default)s)")
    add("--repeats", type=int, default=5, help="timed forward / training repeats, median kept (default: %(default)s)")
    add("--gen-repeats", type=int, default=5, help="timed generation repeats, median kept (default: %(default)s)")
    add("--no-compiled", dest="compiled", action="store_false",
        help="skip the rows of the DenseSSM models with compile_decode_step() in the generation parts")
    add("--matmul-size", type=int, default=2048, help="square fp32 matmul of the peak probe (default: %(default)s)")
    add("--matmul-calls", type=int, default=3, help="matmuls per repeat of the peak probe (default: %(default)s)")
    add("--bandwidth-mib", type=int, default=None,
        help="buffer of the bandwidth probe, MiB (default: 4 x the last-level cache, at least 1024)")
    add("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: %(default)s)")
    add("--vocab-size", type=int, default=VOCAB_SIZE, help="vocabulary size (default: %(default)s)")
    # For CI: the package's tiny presets instead of the 30M ones (a plumbing check, not a benchmark).
    add("--size", choices=("30m", "tiny"), default="30m", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("seq_len", "train_seq_len", "train_batch", "prompt_len", "new_tokens", "batched_size",
                 "batched_new_tokens", "repeats", "gen_repeats", "matmul_size", "matmul_calls", "threads", "vocab_size"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if args.warmup < 0 or args.mamba_train_len < 0:
        parser.error("arguments --warmup, --mamba-train-len: must be >= 0")
    if min(args.batch_sizes) < 1:
        parser.error("argument --batch-sizes: must be >= 1")
    if args.bandwidth_mib is None:
        args.bandwidth_mib = max(1024, 4 * (last_level_cache_bytes() or 0) // 2**20)
    elif args.bandwidth_mib < 1:
        parser.error("argument --bandwidth-mib: must be >= 1")
    return args


def git_state() -> dict:
    """The commit this checkout (package and script) was at, and the files changed or added since: uncommitted
    work the run included (``None`` outside git)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "changed_files": None}
    if commit.returncode:
        return {"commit": None, "changed_files": None}
    return {"commit": commit.stdout.strip(), "changed_files": [line[3:] for line in status.stdout.splitlines()]}


def environment() -> dict:
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == (platform.processor() or platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
        "cpu_count": os.cpu_count(),
        "last_level_cache_bytes": last_level_cache_bytes(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_densessm": hf_densessm.__version__,
        "git": git_state(),
        "load_average_1_5_15_min": os.getloadavg(),  # other processes on the machine skew every timing
        # allocator and thread-runtime settings read at process start (e.g. glibc's MALLOC_MMAP_MAX_, which changes
        # the training figures: docs/training.md)
        "runtime_env": {
            key: value for key, value in sorted(os.environ.items()) if key.startswith(RUNTIME_ENV_PREFIXES)
        },
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


def full_forward(model, ids) -> None:
    """The training step's forward without the backward: inference mode, ``model(ids, labels=ids)`` (logits at
    every position and the loss)."""
    model.eval()
    with torch.inference_mode():
        model(ids, labels=ids)


def training_step(model, ids) -> None:
    """One training forward + backward of ``model`` on ``ids`` (labels = inputs)."""
    model.train()
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()


def paired_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median over repeats of time(numerator) / time(denominator), each pair measured back to back."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


# ----------------------------------------------------------------------------------------------------
# The machine's limits, measured in the same process, taking turns with the models.
# ----------------------------------------------------------------------------------------------------


class MatmulPeak:
    """fp32 matrix-multiply peak: each call runs ``calls`` square ``torch.mm`` of size ``n``, timing each one;
    :meth:`flop_per_s` is 2 n^3 over the fastest of all of them (FLOP/s)."""

    def __init__(self, n: int, calls: int):
        generator = torch.Generator().manual_seed(1)
        self.n, self.calls, self.times = n, calls, []
        self.a = torch.randn(n, n, generator=generator)
        self.b = torch.randn(n, n, generator=generator)
        self.out = torch.empty(n, n)

    def __call__(self) -> None:
        for _ in range(self.calls):
            start = time.perf_counter()
            torch.mm(self.a, self.b, out=self.out)
            self.times.append(time.perf_counter() - start)

    def flop_per_s(self) -> float:
        return 2 * self.n**3 / min(self.times)


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache (sysfs), or ``None`` where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes) if sizes else None


class Bandwidth:
    """Memory bandwidth: each call sums a float32 buffer of ``nbytes`` bytes (bytes read) and copies it into
    another (bytes read + written), timing each; the best of all calls is kept (bytes/s)."""

    def __init__(self, nbytes: int):
        self.buffer = torch.ones(max(1, nbytes // 4))
        self.target = torch.empty_like(self.buffer)
        self.read_times, self.copy_times = [], []

    def __call__(self) -> None:
        start = time.perf_counter()
        torch.sum(self.buffer)
        self.read_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        self.target.copy_(self.buffer)
        self.copy_times.append(time.perf_counter() - start)

    def read_bytes_per_s(self) -> float:
        return self.buffer.numel() * 4 / min(self.read_times)

    def copy_bytes_per_s(self) -> float:
        return 2 * self.buffer.numel() * 4 / min(self.copy_times)


def _untied_input_embedding(model):
    """The input-embedding weight when it is not shared with the LM head, else ``None``."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embedding.data_ptr()
    return None if tied else embedding


def flop_parameters(model) -> int:
    """Parameters that multiply each token (N in 6 N tokens): all of them (shared ones once), less an untied
    input-embedding table, which is only looked up."""
    embedding = _untied_input_embedding(model)
    return model.num_parameters() - (0 if embedding is None else embedding.numel())


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one batch-1 decoding step reads: every parameter once (a tied LM head once), except that an
    untied input-embedding table contributes only the row it looks up."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared parameters once
    embedding = _untied_input_embedding(model)
    if embedding is not None:
        total -= (embedding.shape[0] - 1) * embedding.shape[1] * embedding.element_size()
    return total


# ----------------------------------------------------------------------------------------------------
# Models: all from one size of presets, one seed; transformers' Mamba gets DenseMamba m=0's weights.
# ----------------------------------------------------------------------------------------------------


def build_models(vocab_size: int = VOCAB_SIZE, size: str = "30m") -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    mamba_preset, retnet_preset = f"densemamba-{size}", f"denseretnet-{size}"
    mamba_m = DenseMambaConfig.from_preset(mamba_preset, vocab_size=vocab_size).dense_layers  # the default m
    retnet_m = DenseRetNetConfig.from_preset(retnet_preset, vocab_size=vocab_size).dense_layers
    models = {}
    dense_mamba_0 = DenseMambaForCausalLM(DenseMambaConfig.from_preset(mamba_preset, vocab_size=vocab_size, dense_layers=0))
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
    models[MAMBA] = mamba
    models["DenseMamba m=0"] = dense_mamba_0
    models[f"DenseMamba m={mamba_m}"] = DenseMambaForCausalLM(
        DenseMambaConfig.from_preset(mamba_preset, vocab_size=vocab_size, dense_layers=mamba_m)
    )
    for m in (0, retnet_m):
        models[f"DenseRetNet m={m}"] = DenseRetNetForCausalLM(
            DenseRetNetConfig.from_preset(retnet_preset, vocab_size=vocab_size, dense_layers=m)
        )
    for model in models.values():
        model.eval()
    return models


# ----------------------------------------------------------------------------------------------------
# Figures: a value, what it is compared against (anchor), the machine's limit and the fraction reached.
# ----------------------------------------------------------------------------------------------------


def figure(label, value, unit, anchor=None, limit=None, limit_value=None, fraction=None, target=None, target_on=None):
    """One reported figure. ``target`` = (op, bound) applies to ``target_on`` ("value" or "fraction")."""
    checked = value if target_on == "value" else fraction
    met = None if target is None else (checked >= target[1] if target[0] == ">=" else checked <= target[1])
    return {
        "figure": label, "value": value, "unit": unit, "anchor": anchor, "limit": limit, "limit_value": limit_value,
        "fraction_of_limit": fraction,
        "target": None if target is None else f"{target_on} {target[0]} {target[1]}", "met": met,
    }


def _fmt(value: float) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [[str(c) if isinstance(c, str) else _fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
    print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    for row in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


# ----------------------------------------------------------------------------------------------------
# The parts.
# ----------------------------------------------------------------------------------------------------


def run_forward(args, models, generator, figures) -> dict:
    results = {}
    for batch in args.batch_sizes:
        ids = torch.randint(3, args.vocab_size, (batch, args.seq_len), generator=generator)

        def call(model, ids=ids):
            with torch.inference_mode():
                model(ids, use_cache=False)

        times = interleaved_times({name: partial(call, model) for name, model in models.items()}, args.warmup, args.repeats)
        for name, all_seconds in times.items():
            seconds = statistics.median(all_seconds)
            results[f"{name} | B={batch}"] = {
                "model": name, "batch": batch, "seq_len": args.seq_len, "seconds": seconds,
                "tokens_per_s": batch * args.seq_len / seconds, "all_seconds": all_seconds,
            }
        names = [n for n in models if n.startswith("DenseMamba m=") and n != "DenseMamba m=0"]
        figures.append(figure(
            f"forward speed-up, DenseMamba m=0 vs transformers Mamba, B={batch}",
            paired_ratio(times, MAMBA, "DenseMamba m=0"), "x", anchor="transformers Mamba, same weights",
            target=TARGETS["forward_speedup"], target_on="value"))
        for name in names:
            figures.append(figure(
                f"forward time, {name} / m=0, B={batch}", paired_ratio(times, name, "DenseMamba m=0"), "x",
                anchor="DenseMamba m=0", target=TARGETS["forward_dense_cost"], target_on="value"))
        for name in [n for n in models if n.startswith("DenseRetNet m=") and n != "DenseRetNet m=0"]:
            figures.append(figure(
                f"forward time, {name} / m=0, B={batch}", paired_ratio(times, name, "DenseRetNet m=0"), "x",
                anchor="DenseRetNet m=0"))
    print_table(
        f"forward, L={args.seq_len}, inference mode, tokens/s",
        ["model", *(f"B={b}" for b in args.batch_sizes)],
        [[name, *(results[f"{name} | B={b}"]["tokens_per_s"] for b in args.batch_sizes)] for name in models],
    )
    return results


def run_training(args, models, generator, figures) -> dict:
    ours = {name: model for name, model in models.items() if name != MAMBA}
    ids = torch.randint(3, args.vocab_size, (args.train_batch, args.train_seq_len), generator=generator)
    tokens = ids.numel()
    peak = MatmulPeak(args.matmul_size, args.matmul_calls)
    fns = {"matmul peak": peak}
    for name, model in ours.items():
        fns[f"{name} | train"] = partial(training_step, model, ids)
        fns[f"{name} | forward"] = partial(full_forward, model, ids)
    times = interleaved_times(fns, args.warmup, args.repeats)
    peak_flops = peak.flop_per_s()
    limit = f"fp32 matmul peak {peak_flops / 1e9:.1f} GFLOP/s"
    results = {
        "batch": args.train_batch, "seq_len": args.train_seq_len,
        "matmul_peak": {"n": args.matmul_size, "calls": len(peak.times), "flop_per_s": peak_flops,
                        "all_seconds": peak.times},
        "models": {},
    }
    rows = []
    for name, model in ours.items():
        model.zero_grad(set_to_none=True)
        model.eval()
        family = name.split(" ")[0]
        seconds = statistics.median(times[f"{name} | train"])
        n_flop = flop_parameters(model)
        flops = 6 * n_flop * tokens / seconds
        fraction = flops / peak_flops
        over_forward = paired_ratio(times, f"{name} | train", f"{name} | forward")
        dense_cost = None if name.endswith("m=0") else paired_ratio(times, f"{name} | train", f"{family} m=0 | train")
        results["models"][name] = {
            "seconds": seconds, "tokens_per_s": tokens / seconds, "flop_parameters": n_flop,
            "model_flop_per_s": flops, "fraction_of_peak": fraction,
            "forward_seconds": statistics.median(times[f"{name} | forward"]), "train_over_forward": over_forward,
            "train_over_m0": dense_cost,
            "all_seconds": times[f"{name} | train"], "all_forward_seconds": times[f"{name} | forward"],
        }
        rows.append([name, n_flop / 1e6, tokens / seconds, flops / 1e9, peak_flops / 1e9, fraction, over_forward,
                     "-" if dense_cost is None else dense_cost])
        where = f"B={args.train_batch}, L={args.train_seq_len}"
        figures.append(figure(
            f"training {name} ({where}): model FLOP/s = 6 N tokens/s", flops / 1e9, "GFLOP/s",
            anchor=f"{tokens / seconds:,.0f} tokens/s, N = {n_flop / 1e6:.1f}M", limit=limit, limit_value=peak_flops / 1e9,
            fraction=fraction, target=TARGETS["train_fraction_of_peak"], target_on="fraction"))
        figures.append(figure(
            f"training step / forward time, {name} ({where})", over_forward, "x",
            anchor="same model's forward with labels, inference mode", target=TARGETS["train_over_forward"],
            target_on="value"))
        if dense_cost is not None:
            figures.append(figure(
                f"training step time, {name} / m=0 ({where})", dense_cost, "x", anchor=f"{family} m=0",
                target=TARGETS["train_dense_cost"], target_on="value"))
    print_table(
        f"training step, B={args.train_batch} x L={args.train_seq_len}, float32 "
        f"(limit: {limit}, best of {len(peak.times)} {args.matmul_size}^3 matmuls)",
        ["model", "N (M)", "tokens/s", "GFLOP/s", "peak GFLOP/s", "fraction", "train/fwd", "vs m=0"], rows)

    if args.mamba_train_len:
        short = torch.randint(3, args.vocab_size, (args.train_batch, args.mamba_train_len), generator=generator)
        pair = {name: partial(training_step, models[name], short) for name in (MAMBA, "DenseMamba m=0")}
        mamba_times = interleaved_times(pair, args.warmup, args.repeats)
        for name in pair:
            models[name].zero_grad(set_to_none=True)
            models[name].eval()
        speedup = paired_ratio(mamba_times, MAMBA, "DenseMamba m=0")
        results["vs_transformers_mamba"] = {
            "seq_len": args.mamba_train_len, "speedup": speedup,
            **{name: {"seconds": statistics.median(t), "tokens_per_s": short.numel() / statistics.median(t),
                      "all_seconds": t} for name, t in mamba_times.items()},
        }
        figures.append(figure(
            f"training speed-up, DenseMamba m=0 vs transformers Mamba (B={args.train_batch}, L={args.mamba_train_len})",
            speedup, "x", anchor="transformers Mamba, same weights"))
        print_table(
            f"training step vs transformers Mamba, B={args.train_batch} x L={args.mamba_train_len}",
            ["model", "tokens/s", "speed-up"],
            [[MAMBA, results["vs_transformers_mamba"][MAMBA]["tokens_per_s"], 1.0],
             ["DenseMamba m=0", results["vs_transformers_mamba"]["DenseMamba m=0"]["tokens_per_s"], speedup]])
    return results


COMPILED = " compiled"
#: Where ``compile_decode_step()`` runs DenseMamba's C kernel step (float32 / float64,
#: :func:`hf_densessm.ops.densemamba_step.unsupported_reason`), the same model with the ``torch.compile`` step as
#: well, ``"<name> torch.compile"``, for the paired ratio between the two.
TORCH_COMPILE = " torch.compile"


def with_compiled(args, models: dict) -> dict:
    """``models`` plus, unless ``--no-compiled``, a copy of each DenseSSM model with
    ``compile_decode_step()`` on, named ``"<name> compiled"`` (it compiles on its first one-token step, in the
    untimed check call), and ``"<name> torch.compile"`` (``implementation="torch_compile"``) where the first runs
    DenseMamba's C kernel step."""
    out = dict(models)
    if args.compiled:
        for name, model in models.items():
            if name != MAMBA:
                out[name + COMPILED] = copy.deepcopy(model).compile_decode_step()
                if densemamba_step.unsupported_reason(model) is None:
                    out[name + TORCH_COMPILE] = copy.deepcopy(model).compile_decode_step(implementation="torch_compile")
    return out


def _eager_name(name: str) -> str:
    return name.removesuffix(COMPILED).removesuffix(TORCH_COMPILE)


def run_generation(args, models, generator, figures) -> dict:
    prompt = torch.randint(3, args.vocab_size, (1, args.prompt_len), generator=generator)
    # The plain greedy call (GENERATE_CALL): no min_new_tokens, whose processor costs every model about 0.6 ms per
    # token here (an isin and a where over the 32000 logits), so the models' own step is what is compared.
    generate_kwargs = dict(attention_mask=torch.ones_like(prompt), **GENERATE_CALL, max_new_tokens=args.new_tokens)
    bandwidth = Bandwidth(args.bandwidth_mib * 2**20)
    results = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "generate_call": GENERATE_CALL_TEXT,
               "dtypes": {}}
    timed = {}
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        cast = {name: (model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)) for name, model in models.items()}
        cast = with_compiled(args, cast)
        # The same probe over a buffer as large as the largest model's weights: where those fit in the cache, this
        # is the rate they can be read at from there (a second, cache-aware limit).
        weight_sized = Bandwidth(max(weight_bytes_per_token(model) for model in cast.values()))
        outputs, first_call = {}, {}
        with torch.inference_mode():
            for name, model in cast.items():  # the check, once: how many tokens each makes (compiles, if on)
                start = time.perf_counter()
                outputs[name] = model.generate(prompt, **generate_kwargs)
                first_call[name] = time.perf_counter() - start
            fns = {"bandwidth": bandwidth, "weight-sized bandwidth": weight_sized,
                   **{name: partial(model.generate, prompt, **generate_kwargs) for name, model in cast.items()}}
            times = interleaved_times(fns, args.warmup, args.gen_repeats)
        timed[dtype_name] = (cast, times, outputs, weight_sized, first_call)
    read_bw = bandwidth.read_bytes_per_s()
    limit = f"read bandwidth {read_bw / 1e9:.1f} GB/s"
    results["bandwidth"] = {
        "buffer_mib": args.bandwidth_mib, "read_bytes_per_s": read_bw, "copy_bytes_per_s": bandwidth.copy_bytes_per_s(),
        "calls": len(bandwidth.read_times), "all_read_seconds": bandwidth.read_times, "all_copy_seconds": bandwidth.copy_times,
    }
    for dtype_name, (cast, times, outputs, weight_sized, first_call) in timed.items():
        rows, entry = [], {}
        sized_bw = weight_sized.read_bytes_per_s()
        results[f"weight_sized_bandwidth_{dtype_name}"] = {
            "buffer_bytes": weight_sized.buffer.numel() * 4, "read_bytes_per_s": sized_bw,
            "all_read_seconds": weight_sized.read_times,
        }
        produced = {name: outputs[name].shape[1] - args.prompt_len for name in cast}  # fewer if EOS came first
        for name, model in cast.items():
            seconds = statistics.median(times[name])
            weight_bytes = weight_bytes_per_token(model)
            ideal = read_bw / weight_bytes
            tps = produced[name] / seconds
            speedup = paired_ratio(times, MAMBA, name) * produced[name] / produced[MAMBA]  # per token
            entry[name] = {
                "seconds": seconds, "tokens_per_s": tps, "speedup_vs_transformers_mamba": speedup,
                "new_tokens_produced": produced[name],
                "weight_bytes_per_token": weight_bytes, "ideal_tokens_per_s": ideal, "fraction_of_ideal": tps / ideal,
                "ideal_tokens_per_s_weight_sized_buffer": sized_bw / weight_bytes,
                "fraction_of_ideal_weight_sized_buffer": tps * weight_bytes / sized_bw,
                # the same weights (DenseMamba m=0 only): greedy tokens agree unless rounding flips an argmax
                "same_tokens_as_transformers_mamba": (
                    bool(torch.equal(outputs[name], outputs[MAMBA])) if name.startswith("DenseMamba m=0") else None),
                # the compiled step against the same model's eager step
                "same_tokens_as_eager": (
                    bool(torch.equal(outputs[name], outputs[_eager_name(name)])) if _eager_name(name) != name
                    else None),
                # DenseMamba's kernel step against the torch.compile step of the same model, paired
                "speedup_vs_torch_compile_step": (
                    paired_ratio(times, _eager_name(name) + TORCH_COMPILE, name)
                    if name.endswith(COMPILED) and _eager_name(name) + TORCH_COMPILE in times else None),
                "first_call_seconds": first_call[name],
                "all_seconds": times[name],
            }
            rows.append([name, weight_bytes / 1e6, tps, speedup, ideal, tps / ideal, sized_bw / weight_bytes,
                         tps * weight_bytes / sized_bw])
            target = (TARGETS["generation_speedup"] if name.startswith("DenseMamba") and not name.endswith(TORCH_COMPILE)
                      else None)
            if name != MAMBA:
                figures.append(figure(
                    f"generation speed-up, {name} vs transformers Mamba, {dtype_name}, batch 1", speedup, "x",
                    anchor=f"transformers Mamba {produced[MAMBA] / statistics.median(times[MAMBA]):.1f} tokens/s",
                    target=target, target_on="value"))
            if entry[name]["speedup_vs_torch_compile_step"] is not None:
                figures.append(figure(
                    f"generation speed-up, {name} (C kernel step) vs its torch.compile step, {dtype_name}, batch 1",
                    entry[name]["speedup_vs_torch_compile_step"], "x", anchor=_eager_name(name) + TORCH_COMPILE))
            figures.append(figure(
                f"generation {name}, {dtype_name}, batch 1: tokens/s", tps, "tokens/s",
                anchor=f"weights read per token {weight_bytes / 1e6:.1f} MB",
                limit=f"{limit} / weight bytes = ideal tokens/s", limit_value=ideal, fraction=tps / ideal))
        results["dtypes"][dtype_name] = entry
        print_table(
            f"batch-1 greedy generation, {dtype_name}, prompt {args.prompt_len} + up to {args.new_tokens} new tokens "
            f"(limit: {limit}, best of {len(bandwidth.read_times)} sums over {args.bandwidth_mib} MiB)",
            ["model", "weight MB/token", "tokens/s", "vs transformers", "ideal tokens/s", "fraction",
             f"ideal, {weight_sized.buffer.numel() * 4 / 1e6:.0f} MB buffer", "fraction"], rows)
    return results


def run_batched(args, models, generator, figures) -> dict:
    batch, longest = args.batched_size, args.prompt_len
    lengths = [max(1, round(longest / 2 + (longest / 2) * i / max(1, batch - 1))) for i in range(batch)]
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for row, length in enumerate(lengths):  # left padding: the prompt at the right end, zeros in the mask before it
        ids[row, longest - length:] = torch.randint(3, args.vocab_size, (length,), generator=generator)
        mask[row, longest - length:] = 1
    kwargs = dict(attention_mask=mask, **GENERATE_CALL, max_new_tokens=args.batched_new_tokens)
    models = with_compiled(args, models)
    steps = {}
    with torch.inference_mode():
        for name, model in models.items():  # untimed: compiles the compiled rows' step for this batch size
            steps[name] = model.generate(ids, **kwargs).shape[1] - longest  # fewer if every row hit EOS
        times = interleaved_times({name: partial(model.generate, ids, **kwargs) for name, model in models.items()},
                                  args.warmup, args.gen_repeats)
    results = {"batch": batch, "prompt_lens": lengths, "new_tokens_per_row": args.batched_new_tokens,
               "generate_call": GENERATE_CALL_TEXT, "models": {}}
    rows = []
    for name in models:
        seconds = statistics.median(times[name])
        new = batch * steps[name]  # every row is computed at every step, finished or not
        speedup = paired_ratio(times, MAMBA, name) * steps[name] / steps[MAMBA]  # per step
        results["models"][name] = {"seconds": seconds, "tokens_per_s": new / seconds, "steps": steps[name],
                                   "speedup_vs_transformers_mamba": speedup, "all_seconds": times[name]}
        rows.append([name, new / seconds, speedup])
        if name != MAMBA:
            figures.append(figure(
                f"batched generation speed-up, {name} vs transformers Mamba, B={batch} left-padded, float32",
                speedup, "x",
                anchor=f"transformers Mamba {batch * steps[MAMBA] / statistics.median(times[MAMBA]):.1f} tokens/s"))
    print_table(f"batched greedy generation, B={batch}, left-padded prompts of {lengths[0]}-{lengths[-1]} tokens, "
                f"up to {args.batched_new_tokens} new tokens per row, float32",
                ["model", "tokens/s", "vs transformers"], rows)
    return results


def print_figures(figures: list[dict]) -> None:
    print("\nfigures: value | anchor | limit | fraction of the limit | target")
    for f in figures:
        parts = [f"{f['figure']}: {_fmt(f['value'])} {f['unit']}"]
        if f["anchor"]:
            parts.append(f"anchor: {f['anchor']}")
        if f["limit"]:
            parts.append(f"limit: {f['limit']} ({_fmt(f['limit_value'])})")
        if f["fraction_of_limit"] is not None:
            parts.append(f"fraction {f['fraction_of_limit']:.1%}")
        if f["target"]:
            parts.append(f"target {f['target']}: {'met' if f['met'] else 'MISSED'}")
        print("  " + " | ".join(parts))


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment()
    print("  ".join(f"{k}={v}" for k, v in env.items() if k != "git"))
    print(f"git commit {env['git']['commit']}, changed or untracked files: {env['git']['changed_files']}")
    busy = env["load_average_1_5_15_min"][0]
    if env["cpu_count"] and args.threads > 1 and busy + args.threads > env["cpu_count"] + 0.5:
        print(f"note: load average {busy:.1f} with {args.threads} threads on {env['cpu_count']} CPUs: other processes "
              "share the cores, and a full thread pool stalls at its barriers; --threads 1 measures more reliably")
    started = time.perf_counter()
    models = build_models(args.vocab_size, args.size)
    params = {name: model.num_parameters() for name, model in models.items()}

    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        # Same weights, same logits: the comparisons are between two implementations of one model.
        probe = torch.randint(3, args.vocab_size, (1, min(256, args.seq_len)), generator=generator)
        logits_diff = (
            models[MAMBA](probe, use_cache=False).logits - models["DenseMamba m=0"](probe, use_cache=False).logits
        ).abs().max().item()
    print(f"max |logits(transformers Mamba) - logits(DenseMamba m=0)| = {logits_diff:.2e}")

    figures, results = [], {}
    runners = {"forward": run_forward, "training": run_training, "generation": run_generation, "batched": run_batched}
    for part in PARTS:
        if part in args.parts:
            results[part] = runners[part](args, models, generator, figures)
    print_figures(figures)

    env["load_average_at_end"] = os.getloadavg()
    report = {
        "environment": env,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "command": "python benchmarks/bench_cpu.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "seconds_total": time.perf_counter() - started,
        "params": params,
        "logits_max_abs_diff_mamba_vs_densemamba_m0": logits_diff,
        **results,
        "figures": figures,
    }
    if not all(math.isfinite(f["value"]) for f in figures):
        raise RuntimeError("a figure is not finite")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out} ({report['seconds_total']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
