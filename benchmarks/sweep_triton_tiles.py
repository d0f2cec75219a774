"""Sweep the launch choices (tiles, warps, stages) of the Triton kernels on the GPU at hand.

The tables in :func:`hf_densessm.ops.selective_scan.chunk.selective_scan_config` and
:func:`hf_densessm.ops.retention.chunk.chunk_retention_config` were first chosen for register use alone (by the
compile test, without a GPU). This script times every candidate on a real GPU, at the presets' shapes in bfloat16,
so that the tables can be chosen by measurement::

    python benchmarks/sweep_triton_tiles.py --out benchmarks/results/sweep_triton_tiles.json

For each candidate it records the median time (``triton.testing.do_bench``) of the forward pass alone and of the
forward + backward pass, and the largest deviation of its outputs and gradients from the default choice's,
relative to the largest entry (a candidate that computes something else is marked, not ranked). The selective
scan's candidates set both kernels alike (the two passes must share the chunk length); retention's vary one
kernel at a time, the other two at their default. The JSON is rewritten after every candidate, so a run cut
short keeps what it measured. ``--dry-run`` runs two candidates of each at tiny shapes under the Triton
interpreter on the CPU, to check the plumbing (its times mean nothing).

``--compare`` times, instead of the sweep, the tables' current choice against the first choice (the tables
before the sweep, :data:`FIRST_CHOICE`), in turns (``--repeats`` pairs, median of the ratios), at every shape::

    python benchmarks/sweep_triton_tiles.py --compare --out benchmarks/results/triton_tiles_compare.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be on before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

SCAN_SHAPES = {"gpu": [(1, 2048, 16, 8192), (8, 2048, 16, 2048)], "dry": [(1, 8, 4, 32)]}
RETENTION_SHAPES = {"gpu": [(8, 2048, 2, 384, 1536)], "dry": [(1, 32, 2, 16, 32)]}


def _first_choice():
    """The tables before the sweep (sm_90, bfloat16, state 16 / the presets' heads): the selective scan with 16-token
    chunks, 8 channels and 4 warps in both kernels (retention's kernels have been replaced since: not compared)."""
    from hf_densessm.ops.selective_scan.chunk import SelectiveScanConfig

    return dict(scan=SelectiveScanConfig(chunk=16, fwd_block_d=8, fwd_d_steps=1, fwd_warps=4, bwd_block_d=8,
                                         bwd_d_steps=1, bwd_warps=4))


def _time_ms(fn, dry):
    """Median milliseconds of ``fn`` (one call when dry)."""
    if dry:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median"))


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _scan_inputs(batch, dim, nstate, length, device, dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    u = rnd(batch, dim, length).to(dtype)
    delta = rnd(batch, dim, length, scale=0.5).to(dtype)
    z = rnd(batch, dim, length).to(dtype)
    B = rnd(batch, nstate, length).to(dtype)
    C = rnd(batch, nstate, length).to(dtype)
    A = -torch.arange(1, nstate + 1, dtype=torch.float32, device=device).repeat(dim, 1)  # Mamba's S4D-real init
    D = torch.ones(dim, device=device)
    bias = (rnd(dim) * 0.5 - 3.0)  # softplus(bias) ~ 0.05: the init's dt range (Mamba App. E)
    return dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=bias)


def _scan_runner(shape, device, dtype):
    """``run(config, backward)``: the fused scan on fixed inputs of ``shape`` (batch, dim, state, length), returning
    ``[y]`` or ``[y, du, ddelta, dB, dC, dz]``."""
    from hf_densessm.ops.selective_scan.chunk import selective_scan_triton_bwd, selective_scan_triton_fwd

    inputs = _scan_inputs(*shape, device, dtype)
    gy = torch.randn(shape[0], shape[1], shape[3], device=device, dtype=dtype)

    def run(config, backward):  # the kernels themselves, with the launch choice the op would make for itself
        y, _, states = selective_scan_triton_fwd(**inputs, delta_softplus=True, save_states=backward, config=config)
        if not backward:
            return [y]
        du, ddelta, _, dB, dC, _, dz, _, _ = selective_scan_triton_bwd(
            gy, None, **inputs, delta_softplus=True, chunk_states=states, config=config
        )
        return [y, du, ddelta, dB, dC, dz]

    return run


def _retention_runner(shape, device, dtype):
    """``run(config, backward)``: the chunkwise retention kernels on fixed inputs of ``shape`` (batch, length, heads,
    key, value), returning ``[o]`` or ``[o, dq, dk, dv]``."""
    from hf_densessm.ops.retention.chunk import chunk_retention_bwd_triton, chunk_retention_fwd_triton

    batch, length, heads, key_dim, value_dim = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k = (torch.randn(batch, length, heads, key_dim, generator=gen).to(device, dtype) for _ in range(2))
    v, do = (torch.randn(batch, length, heads, value_dim, generator=gen).to(device, dtype) for _ in range(2))

    def run(config, backward):
        o, _ = chunk_retention_fwd_triton(q, k, v, key_dim ** -0.5, config=config)
        if not backward:
            return [o]
        return [o, *chunk_retention_bwd_triton(do, None, q, k, v, key_dim ** -0.5, config=config)[:3]]

    return run


def _scan_candidates(dry):
    from hf_densessm.ops.selective_scan.chunk import SelectiveScanConfig

    if dry:
        return [SelectiveScanConfig(), SelectiveScanConfig(chunk=32, fwd_block_d=4, bwd_block_d=4, fwd_warps=2,
                                                           bwd_warps=2)]
    # the thread-per-channel kernels: chunk length, warps per program, one or two channels per thread forward (the
    # backward, one channel per thread, sums dB, dC by each warp's shuffles; 16 warps cap it at 128 registers)
    return [SelectiveScanConfig(chunk=chunk, fwd_block_d=32 * warps * per_thread, fwd_warps=warps,
                                bwd_block_d=32 * warps, bwd_warps=warps)
            for chunk, per_thread, warps in itertools.product((16, 32, 64, 128), (1, 2), (1, 2, 4, 16))]


def sweep_scan(device, dtype, dry, record):
    from hf_densessm.ops.backend import device_arch
    from hf_densessm.ops.selective_scan.chunk import selective_scan_config

    for shape in SCAN_SHAPES["dry" if dry else "gpu"]:
        run = _scan_runner(shape, device, dtype)
        default = selective_scan_config(device_arch(device), dtype, shape[2])
        reference = run(default, True)
        for config in _scan_candidates(dry):
            row = dict(kernel="selective_scan", shape=list(shape), dtype=str(dtype), config=config.__dict__,
                       default=config == default)
            try:
                outs = run(config, True)
                row["max_rel_dev"] = max(_rel(a, b) for a, b in zip(outs, reference))
                row["fwd_ms"] = _time_ms(lambda: run(config, False), dry)
                row["fwd_bwd_ms"] = _time_ms(lambda: run(config, True), dry)
            except Exception as error:  # a candidate that fails to compile or launch is recorded, not fatal
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            record(row)


def _retention_candidates(dry, default):
    from hf_densessm.ops.retention.chunk import StateTiles

    if dry:
        tiles = [StateTiles(16, 16, 4, 1), StateTiles(16, 32, 4, 1)]
    else:
        tiles = [StateTiles(bk, bv, w, s) for (bk, bv), w, s in itertools.product(
            ((32, 32), (32, 64), (64, 64), (64, 128), (128, 64)), (4, 8), (1, 2))]
    return [(kernel, dataclasses.replace(default, **{kernel: t})) for kernel in ("h", "o", "dh", "dqk", "dv")
            for t in tiles]


def sweep_retention(device, dtype, dry, record):
    from hf_densessm.ops.backend import device_arch
    from hf_densessm.ops.retention.chunk import chunk_retention_config

    for batch, length, heads, key_dim, value_dim in RETENTION_SHAPES["dry" if dry else "gpu"]:
        run = _retention_runner((batch, length, heads, key_dim, value_dim), device, dtype)
        default = chunk_retention_config(device_arch(device), dtype, key_dim, value_dim)
        reference = run(default, True)
        for kernel, config in _retention_candidates(dry, default):
            tiles = getattr(config, kernel).fit(key_dim, value_dim)
            config = dataclasses.replace(config, **{kernel: tiles})
            row = dict(kernel=f"retention_{kernel}", shape=[batch, length, heads, key_dim, value_dim],
                       dtype=str(dtype), config=tiles.__dict__, default=tiles == getattr(default, kernel))
            try:
                outs = run(config, True)
                row["max_rel_dev"] = max(_rel(a, b) for a, b in zip(outs, reference))
                if kernel in ("h", "o"):
                    row["fwd_ms"] = _time_ms(lambda: run(config, False), dry)
                row["fwd_bwd_ms"] = _time_ms(lambda: run(config, True), dry)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            record(row)


def compare(device, dtype, dry, record, repeats):
    """The tables' choice against :func:`_first_choice`, forward and forward + backward, in alternating turns."""
    from hf_densessm.ops.backend import device_arch
    from hf_densessm.ops.selective_scan.chunk import selective_scan_config

    first = _first_choice()
    cases = []
    for shape in SCAN_SHAPES["dry" if dry else "gpu"]:
        new = selective_scan_config(device_arch(device), dtype, shape[2])
        cases.append(("selective_scan", list(shape), _scan_runner(shape, device, dtype), first["scan"], new))
    for kernel, shape, fn, old, new in cases:
        for backward in (False, True):
            times = {"first": [], "table": []}
            for _ in range(repeats):
                for name, config in (("first", old), ("table", new)):
                    times[name].append(_time_ms(lambda: fn(config, backward), dry))
            ratios = sorted(a / b for a, b in zip(times["first"], times["table"]))
            record(dict(kernel=kernel, shape=shape, dtype=str(dtype), config=str(new), pass_="fwd+bwd" if backward
                        else "fwd", first_ms=min(times["first"]), table_ms=min(times["table"]),
                        speedup_median=ratios[len(ratios) // 2]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file, rewritten after every candidate")
    parser.add_argument("--kernels", nargs="+", default=["selective_scan", "retention"],
                        choices=["selective_scan", "retention"])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under the interpreter")
    parser.add_argument("--compare", action="store_true", help="the tables' choice against the first choice")
    parser.add_argument("--repeats", type=int, default=5, help="pairs of timings per case with --compare")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32  # the interpreter cannot compute bfloat16
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: run on a machine with an NVIDIA GPU, or pass --dry-run")
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
                torch=torch.__version__, dry_run=args.dry_run)

    def record(row):
        rows.append(row)
        timing = {k: round(v, 4) for k, v in row.items() if k.endswith("_ms")}
        extra = {k: round(v, 3) for k, v in row.items() if k == "speedup_median"}
        print(row["kernel"], row["shape"], row["config"], row.get("pass_", ""), timing, extra, row.get("error", ""),
              flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        tmp.replace(args.out)

    if args.compare:
        compare(device, dtype, args.dry_run, record, 1 if args.dry_run else args.repeats)
        return 0
    if "selective_scan" in args.kernels:
        sweep_scan(device, dtype, args.dry_run, record)
    if "retention" in args.kernels:
        sweep_retention(device, dtype, args.dry_run, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
