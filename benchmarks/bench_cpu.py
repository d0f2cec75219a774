"""CPU benchmark of DenseMamba and DenseRetNet against transformers' own Mamba and against the machine's limits.

Everything runs side by side in one process, at the 30M-parameter presets (vocabulary 32000): transformers'
``MambaForCausalLM`` loaded with DenseMamba ``dense_layers=0``'s weights (their logits are checked to agree),
DenseMamba ``dense_layers`` = 0 and the default 4, DenseRetNet 0 and the default 2 (transformers has no RetNet).
Within each repeat the models take turns (``interleaved_times``), and every ratio is the median over repeats of
back-to-back pairs (``paired_ratio``), so the load of other processes, which the JSON records, skews it less. The
machine's limits are measured in the same run, interleaved with the models in the same way, never taken from a
data sheet. Each part can be run alone (``--parts``), and ``--models`` keeps some of the DenseSSM models
(transformers' Mamba, the anchor, always runs).

The compiled rows use only the standard mechanisms: ``generate()`` with ``compile_decode_step()`` on
(transformers' own generation compile path: ``generation_config.compile_config``, the decoding steps compiled by
``get_compiled_call``, the prefill eager) and ``torch.compile(model)`` for the training step. Each compiled row is
compiled in an untimed first call, whose time is recorded (``first_call_seconds`` / ``compile_seconds``). Should
compiling a row fail, its error is recorded in that row (``"error"``; the JSON's ``errors`` lists them) and the
benchmark goes on without it. ``--no-compiled`` skips every compiled row.

``forward``
    Throughput (tokens/s) of one full-logits inference-mode pass over ``--seq-len`` tokens at each of
    ``--batch-sizes``. Anchor: transformers' Mamba with the same weights (speed-up, target >= 2x), and
    ``dense_layers`` = 0 for the cost of the dense connection (DenseMamba m=4 / m=0 time, target <= 1.2x).

``training``
    One training step (train mode, ``model(ids, labels=ids).loss.backward()``), batch ``--train-batch`` x
    ``--train-seq-len`` tokens (default 2 x 1024), float32, eager and, as ``"<name> compiled"``, the same step
    through ``torch.compile(model)`` (``compiled(ids, labels=ids).loss.backward()``; its first loss is compared
    with the eager step's, ``compiled_loss_abs_diff``). Figures:

    - tokens/s, and model FLOP/s = 6 x N x tokens/s, where N is the number of parameters that multiply each token:
      all parameters except the input-embedding table when it is not tied to the LM head (a lookup, no
      arithmetic); the scan / retention arithmetic itself is not counted, as usual for "model FLOPs".
    - limit: the machine's fp32 matrix-multiply peak, the best FLOP/s of ``--matmul-calls`` square
      ``torch.mm`` of size ``--matmul-size`` (2 n^3 FLOP each) per repeat, at the same thread count, taking its
      turn with the models; fraction of peak = model FLOP/s (median step time) / peak (target >= 45%, eager and
      compiled alike).
    - the compiled step's speed-up over the eager one (paired; reported, no target).
    - anchor: the same model's forward pass (inference mode, ``model(ids, labels=ids)``: full logits and the loss,
      i.e. exactly the training step's forward); eager training-step time / forward time (target <= 3.3x).
    - anchor: the same family at ``dense_layers=0``; m>0 / m=0 eager training-step time (target <= 1.10x).
    - transformers' Mamba (same weights) against DenseMamba m=0, eager, at the shorter ``--mamba-train-len`` (its
      PyTorch path is very slow; 0 skips it): training speed-up.

``generation``
    Batch-1 greedy generation, prompt ``--prompt-len``, up to ``--new-tokens`` new tokens (the plain greedy call,
    ``GENERATE_CALL``; the time includes the prompt's prefill), in each of ``--dtypes`` (float32, bfloat16: the
    models cast with ``.to(dtype)``). New tokens/s; anchor: transformers' Mamba, eager, with the same weights in
    the same dtype (speed-up per token). Rows:

    - each model eager (``generate()`` as it comes). Target: DenseMamba m=0, the same weights as the anchor, at
      least 1.2x in every dtype (the other eager rows are reported).
    - ``"<name> compiled"``, in each of ``--compiled-dtypes`` (default float32): a copy of each DenseSSM model with
      ``compile_decode_step()`` on. Its tokens are compared with the eager model's (``same_tokens_as_eager``), and
      ``compiled_path_taken`` records that ``generate()`` did go through ``get_compiled_call``. Target: at least
      2.0x transformers' eager Mamba in float32, for every compiled row (both families).

    Limit: the memory-bandwidth roofline. One decoding step reads every weight once: all parameters (a tied LM
    head counted once, as the embedding table it is), except that an untied input-embedding table contributes
    only the one row it looks up; the recurrent state (a few hundred KB) is not counted. Ideal tokens/s = measured
    read bandwidth / those bytes; fraction = measured / ideal. The read bandwidth is the best of ``torch.sum`` over
    a ``--bandwidth-mib`` MiB float32 buffer (default 4 x the last-level cache, at least 1 GiB: main memory),
    interleaved with the generations; the copy bandwidth (bytes read + written) is recorded as well. A 30M model's
    weights (120 MB float32, 60 MB bfloat16) can fit in a large last-level cache, and then this main-memory
    roofline can be beaten (fraction > 1): a second limit, the same probe over a buffer as large as the largest
    model's weights in that dtype, gives the rate such a buffer is read at wherever it lives
    (``ideal_tokens_per_s_weight_sized_buffer`` and its fraction).

``batched``
    Greedy generation for a batch of ``--batched-size`` left-padded prompts of different lengths (from
    ``--prompt-len`` / 2 to ``--prompt-len`` tokens, ``attention_mask`` zero on the padding), up to
    ``--batched-new-tokens`` new tokens per row, float32: new tokens/s (all rows) against transformers' eager Mamba,
    the compiled rows too. Reported, no target.

It prints one table per part, then every figure with its anchor, its limit and the fraction reached, and any
compiled row that failed, and writes everything, with the environment (CPU model, its AVX-512 / AMX flags,
threads, load averages, versions), to ``--out`` as JSON.

Run from the repository root. The full default run is every part above with twelve compilations besides the
measurements: the four DenseSSM models' training step (``torch.compile``), their decoding step at batch 1 in
float32, and again at the batched part's batch size; each takes tens of seconds on a 2-core CPU (the tiny presets'
take 10-60 s there). Its run time at this design is not measured yet (the previous design's full run took 535-618 s
with ``--threads 1`` on a 2-core VM shared with other work, 2026-11-22). Commands::

    python benchmarks/bench_cpu.py --threads 1
    python benchmarks/bench_cpu.py --threads 1 --parts generation --out /tmp/cpu_generation.json  # generate() only
    python benchmarks/bench_cpu.py --threads 1 --parts training --out /tmp/cpu_training.json      # training only
    python benchmarks/bench_cpu.py --threads 1 --parts generation --dtypes bfloat16 --no-compiled --out /tmp/g.json

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
import traceback
from functools import partial
from pathlib import Path

import torch
import transformers
from transformers import MambaConfig, MambaForCausalLM

import hf_densessm
from hf_densessm import DenseMambaConfig, DenseMambaForCausalLM, DenseRetNetConfig, DenseRetNetForCausalLM

VOCAB_SIZE = 32000
PARTS = ("forward", "training", "generation", "batched")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: /proc/cpuinfo flags that decide the CPU's matmul peak (recorded in the JSON).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
MAMBA = "transformers Mamba"
#: Suffix of a compiled row's name: ``compile_decode_step()`` in the generation parts, ``torch.compile(model)`` in
#: the training part.
COMPILED = " compiled"
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
    "train_fraction_of_peak": (">=", 0.45),  # eager and torch.compile(model) alike
    "train_over_forward": ("<=", 3.3),
    "train_dense_cost": ("<=", 1.10),
    "generation_eager_speedup": (">=", 1.2),  # DenseMamba m=0 (the anchor's weights), every dtype
    "generation_compiled_speedup": (">=", 2.0),  # every compile_decode_step() row, float32
}
#: The dtype the compiled-generation target is set in.
COMPILED_TARGET_DTYPE = "float32"
#: Dynamo's compiled-code cache entries per code object: every compiled row of a family shares its classes' code
#: objects (one entry per model, dtype and batch size; training's more), past Dynamo's default limit of 8, beyond
#: which it would silently run the rest eagerly.
RECOMPILE_LIMIT = 64
#: Characters of an error message kept in a failed row.
ERROR_CHARS = 2000


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", type=Path, default=Path("benchmarks/results/cpu.json"), help="JSON output (default: %(default)s)")
    add("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run (default: all)")
    add("--models", nargs="+", default=None,
        help="DenseSSM models to run, by name (e.g. 'DenseMamba m=0'; default: all four); transformers' Mamba, the "
             "anchor, always runs")
    add("--seq-len", type=int, default=1024, help="forward sequence length (default: %(default)s)")
    add("--batch-sizes", type=int, nargs="+", default=[1, 4], help="forward batch sizes (default: %(default)s)")
    add("--train-seq-len", type=int, default=1024, help="training-step sequence length (default: %(default)s)")
    add("--train-batch", type=int, default=2, help="training-step batch size (default: %(default)s)")
    add("--mamba-train-len", type=int, default=128,
        help="sequence length of the transformers-Mamba training comparison, 0 to skip (default: %(default)s)")
    add("--prompt-len", type=int, default=64, help="generation prompt length (default: %(default)s)")
    add("--new-tokens", type=int, default=128, help="batch-1 generated tokens (default: %(default)s)")
    add("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES), help="generation dtypes (default: both)")
    add("--compiled-dtypes", nargs="+", choices=tuple(DTYPES), default=["float32"],
        help="generation dtypes with compile_decode_step() rows (default: %(default)s)")
    add("--batched-size", type=int, default=8, help="batched-generation batch size (default: %(default)s)")
    add("--batched-new-tokens", type=int, default=32, help="batched generated tokens per row (default: %(default)s)")
    add("--warmup", type=int, default=1, help="untimed runs of everything before timing (default: %(default)s)")
    add("--repeats", type=int, default=5, help="timed forward / training repeats, median kept (default: %(default)s)")
    add("--gen-repeats", type=int, default=5, help="timed generation repeats, median kept (default: %(default)s)")
    add("--no-compiled", dest="compiled", action="store_false",
        help="skip the compiled rows (compile_decode_step() in generation, torch.compile(model) in training)")
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
    if args.models is not None:
        known = model_names(args.size)
        unknown = [name for name in args.models if name not in known or name == MAMBA]
        if unknown:
            parser.error(f"argument --models: unknown {unknown}; choose from {[n for n in known if n != MAMBA]}")
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


def training_step(model, ids, compiled=None) -> torch.Tensor:
    """One training forward + backward of ``model`` on ``ids`` (labels = inputs), through ``compiled`` (e.g.
    ``torch.compile(model)``) when given; returns the loss (detached)."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = (model if compiled is None else compiled)(ids, labels=ids).loss
    loss.backward()
    return loss.detach()


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


def model_names(size: str = "30m") -> list[str]:
    """The names :func:`build_models` gives its models, transformers' Mamba first."""
    mamba_m = DenseMambaConfig.from_preset(f"densemamba-{size}").dense_layers  # the default m
    retnet_m = DenseRetNetConfig.from_preset(f"denseretnet-{size}").dense_layers
    return [MAMBA, "DenseMamba m=0", f"DenseMamba m={mamba_m}", "DenseRetNet m=0", f"DenseRetNet m={retnet_m}"]


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


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:ERROR_CHARS]


def first_call(fn, name: str, errors: dict | None):
    """``(result, seconds, error)`` of ``fn()``: the untimed first call of a row (for a compiled row, the one that
    compiles). With ``errors`` (a compiled row), an exception is recorded there under ``name`` (and its traceback
    printed) instead of raised, and ``result`` is ``None``."""
    start = time.perf_counter()
    if errors is None:
        return fn(), time.perf_counter() - start, None
    try:
        result = fn()
    except Exception as error:  # a compiled row that cannot be compiled: reported, the run goes on
        seconds = time.perf_counter() - start
        errors[name] = _error_text(error)
        print(f"\n{name}: compiling failed after {seconds:.1f} s; its row is left out", file=sys.stderr)
        traceback.print_exc()
        return None, seconds, errors[name]
    return result, time.perf_counter() - start, None


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
        if "DenseMamba m=0" in models:
            figures.append(figure(
                f"forward speed-up, DenseMamba m=0 vs transformers Mamba, B={batch}",
                paired_ratio(times, MAMBA, "DenseMamba m=0"), "x", anchor="transformers Mamba, same weights",
                target=TARGETS["forward_speedup"], target_on="value"))
        for family, target in (("DenseMamba", TARGETS["forward_dense_cost"]), ("DenseRetNet", None)):
            if f"{family} m=0" not in models:
                continue
            for name in [n for n in models if n.startswith(f"{family} m=") and n != f"{family} m=0"]:
                figures.append(figure(
                    f"forward time, {name} / m=0, B={batch}", paired_ratio(times, name, f"{family} m=0"), "x",
                    anchor=f"{family} m=0", target=target, target_on=None if target is None else "value"))
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
    results = {
        "batch": args.train_batch, "seq_len": args.train_seq_len, "compiled_with": "torch.compile(model)",
        "models": {}, "errors": {},
    }
    compiled_rows = {}
    for name, model in ours.items():
        fns[f"{name} | train"] = partial(training_step, model, ids)
        fns[f"{name} | forward"] = partial(full_forward, model, ids)
        if args.compiled:
            # the same module: the compiled step trains the eager row's parameters (both only read them here)
            compiled = torch.compile(model)
            eager_loss = float(training_step(model, ids))
            loss, seconds, error = first_call(partial(training_step, model, ids, compiled), name + COMPILED,
                                              results["errors"])
            compiled_rows[name] = {"compile_seconds": seconds, "error": error,
                                   "loss_abs_diff": None if error else abs(float(loss) - eager_loss)}
            if error is None:
                fns[f"{name}{COMPILED} | train"] = partial(training_step, model, ids, compiled)
    times = interleaved_times(fns, args.warmup, args.repeats)
    peak_flops = peak.flop_per_s()
    limit = f"fp32 matmul peak {peak_flops / 1e9:.1f} GFLOP/s"
    results["matmul_peak"] = {"n": args.matmul_size, "calls": len(peak.times), "flop_per_s": peak_flops,
                              "all_seconds": peak.times}
    where = f"B={args.train_batch}, L={args.train_seq_len}"
    rows = []
    for name, model in ours.items():
        model.zero_grad(set_to_none=True)
        model.eval()
        family = name.split(" ")[0]
        n_flop = flop_parameters(model)
        for row in (name, name + COMPILED):
            key = f"{row} | train"
            if row.endswith(COMPILED):
                if not args.compiled:
                    continue
                info = compiled_rows[name]
                if info["error"] is not None:
                    results["models"][row] = {"error": info["error"], "compile_seconds": info["compile_seconds"]}
                    rows.append([row, n_flop / 1e6, "failed", "-", "-", "-", "-", "-"])
                    continue
            seconds = statistics.median(times[key])
            flops = 6 * n_flop * tokens / seconds
            fraction = flops / peak_flops
            entry = {
                "seconds": seconds, "tokens_per_s": tokens / seconds, "flop_parameters": n_flop,
                "model_flop_per_s": flops, "fraction_of_peak": fraction, "all_seconds": times[key],
            }
            figures.append(figure(
                f"training {row} ({where}): model FLOP/s = 6 N tokens/s", flops / 1e9, "GFLOP/s",
                anchor=f"{tokens / seconds:,.0f} tokens/s, N = {n_flop / 1e6:.1f}M", limit=limit,
                limit_value=peak_flops / 1e9, fraction=fraction, target=TARGETS["train_fraction_of_peak"],
                target_on="fraction"))
            if row.endswith(COMPILED):
                speedup = paired_ratio(times, f"{name} | train", key)
                entry.update(speedup_vs_eager=speedup, compile_seconds=info["compile_seconds"],
                             compiled_loss_abs_diff=info["loss_abs_diff"])
                figures.append(figure(f"training step speed-up, {row} (torch.compile) vs eager ({where})", speedup, "x",
                                      anchor=f"{name}, eager"))
                rows.append([row, n_flop / 1e6, tokens / seconds, flops / 1e9, peak_flops / 1e9, fraction, "-",
                             "-", speedup, info["compile_seconds"]])
            else:
                over_forward = paired_ratio(times, key, f"{name} | forward")
                dense_cost = (None if name.endswith("m=0") or f"{family} m=0" not in ours
                              else paired_ratio(times, key, f"{family} m=0 | train"))
                entry.update(forward_seconds=statistics.median(times[f"{name} | forward"]),
                             train_over_forward=over_forward, train_over_m0=dense_cost,
                             all_forward_seconds=times[f"{name} | forward"])
                figures.append(figure(
                    f"training step / forward time, {name} ({where})", over_forward, "x",
                    anchor="same model's forward with labels, inference mode", target=TARGETS["train_over_forward"],
                    target_on="value"))
                if dense_cost is not None:
                    figures.append(figure(
                        f"training step time, {name} / m=0 ({where})", dense_cost, "x", anchor=f"{family} m=0",
                        target=TARGETS["train_dense_cost"], target_on="value"))
                rows.append([name, n_flop / 1e6, tokens / seconds, flops / 1e9, peak_flops / 1e9, fraction,
                             over_forward, "-" if dense_cost is None else dense_cost, "-", "-"])
            results["models"][row] = entry
    rows = [row + ["-"] * (10 - len(row)) for row in rows]
    print_table(
        f"training step, B={args.train_batch} x L={args.train_seq_len}, float32, eager and torch.compile(model) "
        f"(limit: {limit}, best of {len(peak.times)} {args.matmul_size}^3 matmuls)",
        ["model", "N (M)", "tokens/s", "GFLOP/s", "peak GFLOP/s", "fraction", "train/fwd", "vs m=0", "vs eager",
         "compile s"], rows)

    if args.mamba_train_len and "DenseMamba m=0" in ours:
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


def with_compiled(args, models: dict, compiled: bool) -> dict:
    """``models`` plus, when ``compiled``, a copy of each DenseSSM model with ``compile_decode_step()`` on, named
    ``"<name> compiled"``: its ``generate()`` takes transformers' compile path (it compiles on its first decoding
    step, in the untimed first call)."""
    out = dict(models)
    if compiled:
        for name, model in models.items():
            if name != MAMBA:
                out[name + COMPILED] = copy.deepcopy(model).compile_decode_step()
    return out


def _eager_name(name: str) -> str:
    return name.removesuffix(COMPILED)


def first_generations(models: dict, ids, kwargs) -> tuple[dict, dict, dict]:
    """The untimed first ``generate()`` of every row (the compiled ones compile in it): ``(outputs, seconds,
    errors)``; a compiled row that fails is recorded in ``errors`` and removed from ``models``."""
    outputs, seconds, errors = {}, {}, {}
    with torch.inference_mode():
        for name, model in list(models.items()):
            compiled = name.endswith(COMPILED)
            out, seconds[name], error = first_call(partial(model.generate, ids, **kwargs), name,
                                                   errors if compiled else None)
            if error is None:
                outputs[name] = out
            else:
                del models[name]
    return outputs, seconds, errors


def compiled_path_taken(model) -> bool:
    """Whether ``generate()`` took transformers' compile path for ``model``: ``get_compiled_call`` keeps the
    compiled callable on the model."""
    return "_compiled_call" in vars(model)


def run_generation(args, models, generator, figures) -> dict:
    prompt = torch.randint(3, args.vocab_size, (1, args.prompt_len), generator=generator)
    # The plain greedy call (GENERATE_CALL): no min_new_tokens, whose processor costs every model about 0.6 ms per
    # token here (an isin and a where over the 32000 logits), so the models' own step is what is compared.
    generate_kwargs = dict(attention_mask=torch.ones_like(prompt), **GENERATE_CALL, max_new_tokens=args.new_tokens)
    bandwidth = Bandwidth(args.bandwidth_mib * 2**20)
    results = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "generate_call": GENERATE_CALL_TEXT,
               "compiled_with": "compile_decode_step() (transformers' generation compile path)",
               "dtypes": {}, "errors": {}}
    timed = {}
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        cast = {name: (model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)) for name, model in models.items()}
        cast = with_compiled(args, cast, args.compiled and dtype_name in args.compiled_dtypes)
        outputs, first_seconds, errors = first_generations(cast, prompt, generate_kwargs)
        # The same probe over a buffer as large as the largest model's weights: where those fit in the cache, this
        # is the rate they can be read at from there (a second, cache-aware limit).
        weight_sized = Bandwidth(max(weight_bytes_per_token(model) for model in cast.values()))
        with torch.inference_mode():
            fns = {"bandwidth": bandwidth, "weight-sized bandwidth": weight_sized,
                   **{name: partial(model.generate, prompt, **generate_kwargs) for name, model in cast.items()}}
            times = interleaved_times(fns, args.warmup, args.gen_repeats)
        timed[dtype_name] = (cast, times, outputs, weight_sized, first_seconds, errors)
    read_bw = bandwidth.read_bytes_per_s()
    limit = f"read bandwidth {read_bw / 1e9:.1f} GB/s"
    results["bandwidth"] = {
        "buffer_mib": args.bandwidth_mib, "read_bytes_per_s": read_bw, "copy_bytes_per_s": bandwidth.copy_bytes_per_s(),
        "calls": len(bandwidth.read_times), "all_read_seconds": bandwidth.read_times, "all_copy_seconds": bandwidth.copy_times,
    }
    for dtype_name, (cast, times, outputs, weight_sized, first_seconds, errors) in timed.items():
        rows, entry = [], {}
        sized_bw = weight_sized.read_bytes_per_s()
        results[f"weight_sized_bandwidth_{dtype_name}"] = {
            "buffer_bytes": weight_sized.buffer.numel() * 4, "read_bytes_per_s": sized_bw,
            "all_read_seconds": weight_sized.read_times,
        }
        produced = {name: outputs[name].shape[1] - args.prompt_len for name in cast}  # fewer if EOS came first
        anchor = f"transformers Mamba (eager) {produced[MAMBA] / statistics.median(times[MAMBA]):.1f} tokens/s"
        for name, model in cast.items():
            seconds = statistics.median(times[name])
            weight_bytes = weight_bytes_per_token(model)
            ideal = read_bw / weight_bytes
            tps = produced[name] / seconds
            speedup = paired_ratio(times, MAMBA, name) * produced[name] / produced[MAMBA]  # per token
            compiled = name.endswith(COMPILED)
            entry[name] = {
                "seconds": seconds, "tokens_per_s": tps, "speedup_vs_transformers_mamba": speedup,
                "new_tokens_produced": produced[name],
                "weight_bytes_per_token": weight_bytes, "ideal_tokens_per_s": ideal, "fraction_of_ideal": tps / ideal,
                "ideal_tokens_per_s_weight_sized_buffer": sized_bw / weight_bytes,
                "fraction_of_ideal_weight_sized_buffer": tps * weight_bytes / sized_bw,
                # the same weights (DenseMamba m=0 only): greedy tokens agree unless rounding flips an argmax
                "same_tokens_as_transformers_mamba": (
                    bool(torch.equal(outputs[name], outputs[MAMBA])) if name.startswith("DenseMamba m=0") else None),
                # the compiled steps against the same model's eager steps
                "same_tokens_as_eager": (
                    bool(torch.equal(outputs[name], outputs[_eager_name(name)])) if compiled else None),
                "compiled_path_taken": compiled_path_taken(model),
                "first_call_seconds": first_seconds[name],
                "all_seconds": times[name],
            }
            rows.append([name, weight_bytes / 1e6, tps, speedup, ideal, tps / ideal, sized_bw / weight_bytes,
                         tps * weight_bytes / sized_bw, first_seconds[name]])
            if compiled:
                target = TARGETS["generation_compiled_speedup"] if dtype_name == COMPILED_TARGET_DTYPE else None
            else:
                target = TARGETS["generation_eager_speedup"] if name == "DenseMamba m=0" else None
            if name != MAMBA:
                figures.append(figure(
                    f"generation speed-up, {name} vs transformers Mamba (eager), {dtype_name}, batch 1", speedup, "x",
                    anchor=anchor, target=target, target_on=None if target is None else "value"))
            figures.append(figure(
                f"generation {name}, {dtype_name}, batch 1: tokens/s", tps, "tokens/s",
                anchor=f"weights read per token {weight_bytes / 1e6:.1f} MB",
                limit=f"{limit} / weight bytes = ideal tokens/s", limit_value=ideal, fraction=tps / ideal))
        for name, error in errors.items():
            entry[name] = {"error": error, "first_call_seconds": first_seconds[name]}
            results["errors"][f"{name} | {dtype_name}"] = error
            rows.append([name, "-", "failed", "-", "-", "-", "-", "-", first_seconds[name]])
        results["dtypes"][dtype_name] = entry
        print_table(
            f"batch-1 greedy generation, {dtype_name}, prompt {args.prompt_len} + up to {args.new_tokens} new tokens "
            f"(limit: {limit}, best of {len(bandwidth.read_times)} sums over {args.bandwidth_mib} MiB)",
            ["model", "weight MB/token", "tokens/s", "vs transformers", "ideal tokens/s", "fraction",
             f"ideal, {weight_sized.buffer.numel() * 4 / 1e6:.0f} MB buffer", "fraction", "first call s"], rows)
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
    models = with_compiled(args, models, args.compiled)
    # untimed: compiles the compiled rows' step for this batch size
    outputs, first_seconds, errors = first_generations(models, ids, kwargs)
    steps = {name: out.shape[1] - longest for name, out in outputs.items()}  # fewer if every row hit EOS
    with torch.inference_mode():
        times = interleaved_times({name: partial(model.generate, ids, **kwargs) for name, model in models.items()},
                                  args.warmup, args.gen_repeats)
    results = {"batch": batch, "prompt_lens": lengths, "new_tokens_per_row": args.batched_new_tokens,
               "generate_call": GENERATE_CALL_TEXT, "models": {}, "errors": errors}
    rows = []
    for name, model in models.items():
        seconds = statistics.median(times[name])
        new = batch * steps[name]  # every row is computed at every step, finished or not
        speedup = paired_ratio(times, MAMBA, name) * steps[name] / steps[MAMBA]  # per step
        compiled = name.endswith(COMPILED)
        results["models"][name] = {
            "seconds": seconds, "tokens_per_s": new / seconds, "steps": steps[name],
            "speedup_vs_transformers_mamba": speedup, "first_call_seconds": first_seconds[name],
            "same_tokens_as_eager": bool(torch.equal(outputs[name], outputs[_eager_name(name)])) if compiled else None,
            "compiled_path_taken": compiled_path_taken(model), "all_seconds": times[name],
        }
        rows.append([name, new / seconds, speedup, first_seconds[name]])
        if name != MAMBA:
            figures.append(figure(
                f"batched generation speed-up, {name} vs transformers Mamba (eager), B={batch} left-padded, float32",
                speedup, "x",
                anchor=f"transformers Mamba {batch * steps[MAMBA] / statistics.median(times[MAMBA]):.1f} tokens/s"))
    for name, error in errors.items():
        results["models"][name] = {"error": error, "first_call_seconds": first_seconds[name]}
        rows.append([name, "failed", "-", first_seconds[name]])
    print_table(f"batched greedy generation, B={batch}, left-padded prompts of {lengths[0]}-{lengths[-1]} tokens, "
                f"up to {args.batched_new_tokens} new tokens per row, float32",
                ["model", "tokens/s", "vs transformers", "first call s"], rows)
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


def collect_errors(results: dict) -> dict[str, str]:
    """Every failed compiled row of every part: ``{"<part> | <row>": error}``."""
    return {f"{part} | {row}": error
            for part, result in results.items() for row, error in result.get("errors", {}).items()}


def set_recompile_limit(limit: int) -> dict:
    """Raise Dynamo's per-code-object cache limits to ``limit`` (:data:`RECOMPILE_LIMIT`); returns what was set."""
    config, applied = torch._dynamo.config, {}
    for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, key):
            value = max(getattr(config, key), limit * (8 if key.startswith("accumulated") else 1))
            setattr(config, key, value)
            applied[key] = value
    return applied


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment()
    if args.compiled:
        env["dynamo_limits"] = set_recompile_limit(RECOMPILE_LIMIT)
    print("  ".join(f"{k}={v}" for k, v in env.items() if k != "git"))
    print(f"git commit {env['git']['commit']}, changed or untracked files: {env['git']['changed_files']}")
    busy = env["load_average_1_5_15_min"][0]
    if env["cpu_count"] and args.threads > 1 and busy + args.threads > env["cpu_count"] + 0.5:
        print(f"note: load average {busy:.1f} with {args.threads} threads on {env['cpu_count']} CPUs: other processes "
              "share the cores, and a full thread pool stalls at its barriers; --threads 1 measures more reliably")
    started = time.perf_counter()
    models = build_models(args.vocab_size, args.size)

    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        # Same weights, same logits: the comparisons are between two implementations of one model.
        probe = torch.randint(3, args.vocab_size, (1, min(256, args.seq_len)), generator=generator)
        logits_diff = (
            models[MAMBA](probe, use_cache=False).logits - models["DenseMamba m=0"](probe, use_cache=False).logits
        ).abs().max().item()
    print(f"max |logits(transformers Mamba) - logits(DenseMamba m=0)| = {logits_diff:.2e}")
    if args.models is not None:
        models = {name: model for name, model in models.items() if name == MAMBA or name in args.models}
    params = {name: model.num_parameters() for name, model in models.items()}

    figures, results = [], {}
    runners = {"forward": run_forward, "training": run_training, "generation": run_generation, "batched": run_batched}
    for part in PARTS:
        if part in args.parts:
            results[part] = runners[part](args, models, generator, figures)
    print_figures(figures)
    errors = collect_errors(results)
    if errors:
        print("\ncompiled rows that failed (left out of the figures):")
        for row, error in errors.items():
            print(f"  {row}: {error.splitlines()[0] if error else error}")

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
        "errors": errors,
    }
    if not all(math.isfinite(f["value"]) for f in figures):
        raise RuntimeError("a figure is not finite")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out} ({report['seconds_total']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
