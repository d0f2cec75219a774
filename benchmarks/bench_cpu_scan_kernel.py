"""Selective scan on the CPU: the C++ kernel (``csrc/selective_scan_cpu.cpp``) against the chunked PyTorch path.

Both in one process, on the same inputs, independent of ``HF_DENSESSM_CPU_KERNEL``: the C++ ops through
:func:`hf_densessm.ops.cpu_kernel.scan_fwd` / ``scan_bwd`` against
:func:`hf_densessm.ops.selective_scan.chunked_torch.selective_scan_torch_fwd` / ``_bwd``. Shape: one Mamba layer of
the DenseMamba 30M preset (``dim = expand * hidden_size``, ``state = state_size``; read from the preset), batch 2,
length 1024, float32, with ``D``, ``z``, ``delta_bias`` and softplus as in a Mamba block, in the layout the model
passes (token-major views: u, delta, z and dy with channel stride 1, B and C slices of x_proj's output); and the
kernel once more on contiguous (batch, dim, length) copies of the same inputs (which it copies to its layout).
Measured: forward, and forward + backward (median of ``--repeats`` timed runs after a warm-up), their ratios, the
extension's build/load time in this process (0 when it was already in the cache), and the maximum relative
difference of the outputs and gradients between the two paths. Prints a table and writes JSON (``--out``).

    python benchmarks/bench_cpu_scan_kernel.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from hf_densessm import DenseMambaConfig
from hf_densessm.ops import cpu_kernel
from hf_densessm.ops.selective_scan.chunked_torch import selective_scan_torch_bwd, selective_scan_torch_fwd


def _inputs(batch, dim, state, length, rank, seed=0):
    """The layout the model passes (modeling_densemamba.py): u, delta (batch, dim, length) views of token-major
    (batch, length, dim) tensors; z the second half of a token-major in_proj output; B, C slices of x_proj's
    (batch, length, rank + 2 * state) output, transposed."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    A = -torch.exp(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(dim, 1))  # S4D-real init
    proj = r(batch, length, rank + 2 * state)
    _, B, C = proj.split([rank, state, state], dim=-1)
    return dict(u=r(batch, length, dim).transpose(1, 2), delta=r(batch, length, dim, scale=0.5).transpose(1, 2),
                A=A, B=B.transpose(1, 2), C=C.transpose(1, 2), D=r(dim),
                z=r(batch, length, 2 * dim).chunk(2, dim=-1)[1].transpose(1, 2), delta_bias=r(dim, scale=0.5),
                delta_softplus=True)


def _time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="densemamba-30m")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_scan_kernel.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    cfg = DenseMambaConfig.from_preset(args.preset)
    dim, state = cfg.intermediate_size, cfg.state_size
    t0 = time.perf_counter()
    if not cpu_kernel.load_kernel():
        raise SystemExit("the C++ kernel did not build (see the warning)")
    load_s = time.perf_counter() - t0

    kw = _inputs(args.batch, dim, state, args.length, cfg.time_step_rank)
    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(args.batch, args.length, dim, generator=gen).transpose(1, 2)  # out_proj's gradient, transposed
    # the same values in contiguous (batch, channels, length) tensors: what the kernel copies to its layout
    kw_c = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    dy_c = dy.contiguous()
    dlast = torch.randn(args.batch, dim, state, generator=gen)

    def run_cpp():
        return cpu_kernel.scan_fwd(**kw)

    def run_torch():
        return selective_scan_torch_fwd(**kw)

    def fb_cpp():
        y, last, states = cpu_kernel.scan_fwd(**kw)
        return (y, last), cpu_kernel.scan_bwd(dy, dlast, **kw, chunk_states=states)

    def fb_cpp_contiguous():
        y, last, states = cpu_kernel.scan_fwd(**kw_c)
        return (y, last), cpu_kernel.scan_bwd(dy_c, dlast, **kw_c, chunk_states=states)

    def fb_torch():
        y, last, states = selective_scan_torch_fwd(**kw)
        return (y, last), selective_scan_torch_bwd(dy, dlast, **kw, entry=states)

    (yc, lc), gc = fb_cpp()
    (yt, lt), gt = fb_torch()
    names = ("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "dinitial_state")
    diffs = {"y": _rel(yc, yt), "last_state": _rel(lc, lt)}
    diffs.update({n: _rel(a, b) for n, a, b in zip(names, gc, gt) if a is not None and b is not None})

    res = {}
    for label, cpp, ref in (("forward", run_cpp, run_torch), ("forward_backward", fb_cpp, fb_torch),
                            ("forward_backward_contiguous_inputs", fb_cpp_contiguous, fb_torch)):
        tc, tt = _time(cpp, args.repeats), _time(ref, args.repeats)
        res[label] = {"cpp_ms": tc * 1e3, "torch_ms": tt * 1e3, "speedup": tt / tc}

    out = {
        "what": "selective scan on the CPU: C++ kernel (ops/cpu_kernel.py) vs chunked PyTorch path (chunked_torch.py)",
        "shape": {"preset": args.preset, "batch": args.batch, "dim": dim, "state": state, "length": args.length,
                  "dtype": "float32", "options": "D, z, delta_bias, softplus",
                  "layout": "token-major views as the model passes them (u, delta, z, dy channel stride 1; B, C "
                            "slices of x_proj's output); forward_backward_contiguous_inputs: the kernel on "
                            "contiguous (batch, dim, length) copies of the same values (the torch path as is)"},
        "threads": args.threads,
        "repeats": args.repeats,
        "results": res,
        "max_rel_diff_cpp_vs_torch": diffs,
        "extension_load_s_this_process": load_s,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": {"processor": platform.processor() or platform.machine(), "cpu_count": __import__("os").cpu_count(),
                    "note": "shared with other agents' jobs: timings are noisy, ratios are indicative"},
        "torch": torch.__version__,
    }
    print(f"{args.preset}: batch {args.batch}, dim {dim}, state {state}, length {args.length}, float32, "
          f"{args.threads} threads, capability {out['cpu_capability']}")
    print(f"{'':36s}{'C++ ms':>10s}{'torch ms':>10s}{'speedup':>9s}")
    for label, r in res.items():
        print(f"{label:36s}{r['cpp_ms']:10.1f}{r['torch_ms']:10.1f}{r['speedup']:8.2f}x")
    print("max relative difference C++ vs torch:", {k: f"{v:.1e}" for k, v in diffs.items()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
