"""What each part of the CPU training step buys: paired training steps with the part on and off, in one process.

Each part is switched off the way a machine without it would run (the model and its weights stay the same):

``workspace``
    the cross-entropy's kept gradient buffer (:mod:`hf_densessm.ops.workspace`); off: a fresh ``(tokens, vocab)``
    gradient every step, as before it existed.
``gated_add``
    the dense fusion kernel with the predecessors' sum and the gate's output layer fused in
    (:mod:`hf_densessm.ops.gated_add`); off: its PyTorch path (the sum, the gate's ``fc2`` call, ``addcmul``), as
    for tensors below the kernel's size threshold.
``rms_norm``
    the RMSNorm kernel (:mod:`hf_densessm.ops.rms_norm`); off: its PyTorch path.

For each model and part the steps alternate on / off (``--repeats`` pairs after ``--warmup`` of each), and the
figure is the median over pairs of time(off) / time(on): the speed-up the part gives, measured back to back. Models:
the 30M presets at ``dense_layers`` 0 and the default (DenseMamba 4, DenseRetNet 2), vocabulary 32000, batch
``--batch`` x ``--seq-len`` tokens (default 2 x 1024), float32, ``model(ids, labels=ids).loss.backward()``.

Run from the repository root (about 4 minutes on the 2-core VM of docs/benchmarks.md)::

    python benchmarks/bench_training_parts.py
    python benchmarks/bench_training_parts.py --parts workspace --models "DenseMamba m=4" --repeats 4
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # noqa: E402  (the same models, environment record and training step)

PARTS = ("workspace", "gated_add", "rms_norm")


@contextlib.contextmanager
def part_off(part: str):
    """Run the block with ``part`` switched off (module docstring)."""
    if part == "workspace":
        module, name, value = importlib.import_module("hf_densessm.ops.workspace"), "_SOLE", None
    elif part == "gated_add":
        module, name, value = importlib.import_module("hf_densessm.ops.gated_add"), "MIN_KERNEL_ELEMENTS", 1 << 62
    elif part == "rms_norm":
        module, name, value = importlib.import_module("hf_densessm.ops.rms_norm"), "MIN_KERNEL_ELEMENTS", 1 << 62
    else:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def measure(model, ids, part: str, warmup: int, repeats: int) -> dict:
    """Paired step times with ``part`` on and off; the speed-up is the median of time(off) / time(on)."""
    def step(on: bool) -> float:
        context = contextlib.nullcontext() if on else part_off(part)
        with context:
            start = time.perf_counter()
            bench_cpu.training_step(model, ids)
            return time.perf_counter() - start

    for _ in range(warmup):
        step(True), step(False)
    on, off = [], []
    for _ in range(repeats):
        on.append(step(True))
        off.append(step(False))
    model.zero_grad(set_to_none=True)
    return {"speedup": statistics.median(b / a for a, b in zip(on, off)), "seconds_on": statistics.median(on),
            "seconds_off": statistics.median(off), "all_on": on, "all_off": off}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--models", nargs="+", default=None, help="names as bench_cpu.py gives them (default: all four)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--size", default="30m")
    p.add_argument("--vocab-size", type=int, default=bench_cpu.VOCAB_SIZE)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/cpu_training_parts.json")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    models = {k: v for k, v in bench_cpu.build_models(args.vocab_size, args.size).items() if k != bench_cpu.MAMBA}
    names = args.models or list(models)
    unknown = [n for n in names if n not in models]
    if unknown:
        raise ValueError(f"--models must be among {list(models)}, got {unknown}")
    ids = torch.randint(3, args.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    results = {"environment": bench_cpu.environment(), "command": " ".join(sys.argv), "batch": args.batch,
               "seq_len": args.seq_len, "repeats": args.repeats, "parts": {}}
    print(f"{'part':10s} {'model':16s} {'on (s)':>8s} {'off (s)':>8s} {'speed-up':>9s}")
    for part in args.parts:
        results["parts"][part] = {}
        for name in names:
            r = measure(models[name], ids, part, args.warmup, args.repeats)
            results["parts"][part][name] = r
            print(f"{part:10s} {name:16s} {r['seconds_on']:8.3f} {r['seconds_off']:8.3f} {r['speedup']:8.3f}x")
    results["seconds_total"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out)
    print(f"wrote {out} ({results['seconds_total']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
