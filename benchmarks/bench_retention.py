"""Benchmark multi-scale retention: Triton kernels vs the PyTorch references (vs flash-linear-attention).

GPU (one call, one process, bfloat16, the DenseRetNet-1.3B retention shape: 4 heads, key 320 and value 1280
per head; lengths 512 / 2048 / 8192, batch = ``--tokens // length``):

    python benchmarks/bench_retention.py --out retention_gpu.json

  rows: forward and forward+backward time of ``chunk_retention`` with ``backend="triton"``, with
  ``backend="torch"`` (chunked reference) and of ``fla.ops.retention.chunk_retention`` when ``fla-core`` is
  installed; the largest error of each against the Triton kernel; decode-step latency of
  ``retention_state_update`` (Triton vs torch) for a few batch sizes.

CPU (small shapes, float32): the chunked reference at several chunk sizes vs the parallel (quadratic) reference,
and the torch decode step:

    python benchmarks/bench_retention.py --device cpu --out retention_cpu.json

Prints a table and writes every number to the JSON file given by ``--out``.
"""

import argparse
import functools
import inspect
import json
import platform
import statistics
import sys
import time

import torch

from hf_densessm.ops.retention import chunk_retention, retention_state_update
from hf_densessm.ops.retention.chunked_torch import chunk_retention_torch, default_chunk_size
from hf_densessm.ops.retention.naive import chunk_retention_naive


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, device, warmup, repeats):
    """Wall time of ``fn()`` in milliseconds, the device synchronized around each call: the median on a GPU,
    the minimum on the CPU (shared CPUs only ever add time, so the minimum is the stable estimate there)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times) if device.type == "cuda" else min(times)


def _free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _inputs(batch, length, heads, key_dim, value_dim, dtype, device, requires_grad):
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(batch, length, heads, d, device=device, dtype=dtype, generator=gen).requires_grad_(requires_grad)
        for d in (key_dim, key_dim, value_dim)
    )
    return q, k, v


def _load_fla():
    try:
        from fla.ops.retention import chunk_retention as fla_chunk_retention
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"
        return None, f"{type(error).__name__}: {error}"
    return fla_chunk_retention, None


def _measure(name, fn, inputs, device, warmup, repeats):
    """Forward and forward+backward time of ``fn(q, k, v) -> o``; 'oom' where memory runs out."""
    q, k, v = inputs
    grad = torch.randn_like(v)
    row = {"impl": name}

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    def forward_backward():
        o = fn(q, k, v)
        torch.autograd.backward(o, grad)
        q.grad = k.grad = v.grad = None

    for key, step in (("fwd_ms", forward), ("fwd_bwd_ms", forward_backward)):
        try:
            row[key] = _time_ms(step, device, warmup, repeats)
        except torch.OutOfMemoryError:
            row[key] = "oom"
            q.grad = k.grad = v.grad = None
        _free(device)
    return row


def _error(fn, reference_output, inputs):
    try:
        with torch.no_grad():
            o = fn(*inputs).float()
    except torch.OutOfMemoryError:
        return "oom"
    return ((o - reference_output).abs().max() / reference_output.abs().max()).item()


def bench_gpu(args, device):
    dtype = getattr(torch, args.dtype)
    heads, key_dim, value_dim = args.heads, args.key_dim, args.value_dim
    fla_fn, fla_missing = _load_fla()
    impls = {
        "triton": lambda q, k, v: chunk_retention(q, k, v, backend="triton")[0],
        "torch (chunked reference)": lambda q, k, v: chunk_retention(q, k, v, backend="torch")[0],
    }
    if fla_fn is not None:
        # Our layout is (batch, length, heads, dim); fla versions that still have ``head_first`` are told so.
        fla_kwargs = {"head_first": False} if "head_first" in inspect.signature(fla_fn).parameters else {}
        impls["fla chunk_retention"] = lambda q, k, v: fla_fn(q, k, v, **fla_kwargs)[0]
    rows = []
    for length in args.lengths:
        batch = args.batch or max(1, args.tokens // length)
        inputs = _inputs(batch, length, heads, key_dim, value_dim, dtype, device, requires_grad=True)
        with torch.no_grad():
            reference = impls["triton"](*inputs).float()
        for name, fn in impls.items():
            row = {"length": length, "batch": batch, **_measure(name, fn, inputs, device, args.warmup, args.repeats)}
            row["max_rel_err_vs_triton"] = 0.0 if name == "triton" else _error(fn, reference, inputs)
            rows.append(row)
            print(_format_row(row), flush=True)
        del inputs, reference
        _free(device)
    return rows, fla_missing


def bench_decode(args, device, backends):
    dtype = getattr(torch, args.dtype)
    heads, key_dim, value_dim = args.heads, args.key_dim, args.value_dim
    rows = []
    for batch in args.decode_batches:
        q, k, v = (torch.randn(batch, heads, d, device=device, dtype=dtype) for d in (key_dim, key_dim, value_dim))
        state = torch.zeros(batch, heads, key_dim, value_dim, device=device, dtype=torch.float32)
        for backend in backends:
            step = lambda: retention_state_update(state, q, k, v, backend=backend)  # noqa: E731
            ms = _time_ms(step, device, args.warmup, args.repeats * 5)
            row = {"impl": f"decode step ({backend})", "batch": batch, "step_ms": ms}
            row["state_GB_per_s"] = 2 * state.numel() * 4 / (ms * 1e-3) / 1e9  # read + write of the float32 state
            rows.append(row)
            print(_format_row(row), flush=True)
    return rows


def _chunked_output(q, k, v, chunk_size):
    return chunk_retention_torch(q, k, v, chunk_size=chunk_size)[0]


def bench_cpu(args, device):
    dtype = getattr(torch, args.dtype)
    rows = []
    for length in args.lengths:
        batch = args.batch or max(1, args.tokens // length)
        inputs = _inputs(batch, length, args.heads, args.key_dim, args.value_dim, dtype, device, requires_grad=True)
        default = default_chunk_size(args.key_dim, args.value_dim)
        impls = {}
        for chunk_size in args.chunk_sizes:
            name = f"torch chunked C={chunk_size}" + (" (default)" if chunk_size == default else "")
            impls[name] = functools.partial(_chunked_output, chunk_size=chunk_size)
        impls["torch parallel (quadratic, naive)"] = chunk_retention_naive
        for name, fn in impls.items():
            row = _measure(name, fn, inputs, device, args.warmup, args.repeats)
            rows.append({"length": length, "batch": batch, **row})
            print(_format_row(rows[-1]), flush=True)
    return rows


def _format_row(row):
    def cell(value):
        return f"{value:10.3f}" if isinstance(value, float) else f"{value!s:>10}"

    if "step_ms" in row:
        return (
            f"{row['impl']:<32} batch {row['batch']:>4}  step {cell(row['step_ms'])} ms"
            f"  state {cell(row['state_GB_per_s'])} GB/s"
        )
    error = row.get("max_rel_err_vs_triton")
    error = "" if error is None else f"  err {error:.1e}" if isinstance(error, float) else f"  err {error}"
    return (
        f"{row['impl']:<32} L {row['length']:>5} batch {row['batch']:>4}  fwd {cell(row['fwd_ms'])} ms"
        f"  fwd+bwd {cell(row['fwd_bwd_ms'])} ms{error}"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench_retention.json", help="JSON file for the numbers")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on the GPU, float32 on the CPU")
    parser.add_argument("--lengths", type=int, nargs="+", help="default 512 2048 8192 (GPU), 256 1024 2048 (CPU)")
    parser.add_argument("--tokens", type=int, help="batch = tokens // length; default 65536 (GPU), 4096 (CPU)")
    parser.add_argument("--batch", type=int, default=None, help="fixed batch size instead of --tokens")
    parser.add_argument("--heads", type=int, default=None, help="default 4 (GPU, 1.3B preset), 2 (CPU)")
    parser.add_argument("--key-dim", type=int, default=None, help="per head; default 320 (GPU), 32 (CPU)")
    parser.add_argument("--value-dim", type=int, default=None, help="per head; default 1280 (GPU), 128 (CPU)")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[32, 64, 128, 256], help="CPU: reference chunks")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=None, help="default 1 16 64 (GPU), 1 8 (CPU)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's own choice)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    defaults = dict(
        dtype="bfloat16" if gpu else "float32",
        lengths=[512, 2048, 8192] if gpu else [256, 1024, 2048],
        tokens=65536 if gpu else 4096,
        heads=4 if gpu else 2,
        key_dim=320 if gpu else 32,
        value_dim=1280 if gpu else 128,
        decode_batches=[1, 16, 64] if gpu else [1, 8],
        warmup=3 if gpu else 1,
        repeats=10 if gpu else 5,
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    name = torch.cuda.get_device_name(device) if gpu else platform.processor() or "cpu"
    print(f"device {device} ({name}), torch {torch.__version__}, dtype {args.dtype}, heads {args.heads}, "
          f"key {args.key_dim}, value {args.value_dim} per head")
    result = {"device": str(device), "device_name": name, "torch": torch.__version__}
    result.update(dtype=args.dtype, heads=args.heads, key_dim=args.key_dim, value_dim=args.value_dim)
    if gpu:
        result["chunk"], fla_missing = bench_gpu(args, device)
        result["fla"] = "not importable: " + fla_missing if fla_missing else "measured"
        if fla_missing:
            print(f"fla.ops.retention.chunk_retention not measured (pip install fla-core): {fla_missing}")
        result["decode"] = bench_decode(args, device, ["triton", "torch"])
    else:
        result["threads"] = torch.get_num_threads()
        result["chunk"] = bench_cpu(args, device)
        result["decode"] = bench_decode(args, device, ["torch"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
