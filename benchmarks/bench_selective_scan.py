"""Selective scan: speed of our Triton kernel and PyTorch reference against transformers' and mamba_ssm's scans.

Compared, side by side in one process, on the same inputs (``u, delta, z``: (batch, dim, length); ``B, C``:
(batch, state, length); ``D, delta_bias`` and softplus on, as in a Mamba block):

- ``triton``: :func:`hf_densessm.ops.selective_scan` with ``backend="triton"`` (GPU only);
- ``torch``: the same with ``backend="torch"``, our chunked PyTorch reference (the CPU path of the models);
- ``hf``: transformers' PyTorch fallback ``mamba_selective_scan`` (``models/mamba/modeling_mamba.py``), the scan
  ``MambaMixer`` runs without kernels: a Python loop over tokens after materializing ``(batch, dim, length,
  state)`` tensors;
- ``mamba_ssm``: ``mamba_ssm.ops.selective_scan_interface.selective_scan_fn`` (the authors' CUDA kernel), when
  importable; the table says so when it is not.

Measured: forward time, forward+backward time, the forward's achieved bandwidth (minimal bytes: every input read
once and ``y`` written once, over the time) as a fraction of a measured device-to-device copy bandwidth, and
the latency of one decode step (``selective_state_update`` and the counterparts). Prints a table and writes
every number to the JSON file given by ``--out``.

    python benchmarks/bench_selective_scan.py --out selective_scan_gpu.json          # CUDA: bfloat16, big shapes
    python benchmarks/bench_selective_scan.py --device cpu --out selective_scan_cpu.json   # CPU: small shapes

Defaults: CUDA: batch 1, dim 2048 and 4096, state 16, lengths 512, 2048, 8192, bfloat16. CPU: float32,
batch 1 and 2, dim 512, state 16, lengths 128 and 512, ``--threads 2`` (transformers' backward through its
token loop is slow on the CPU; ``--forward-only`` skips every backward, e.g. for
``--device cpu --batch 1 4 --dim 1024 --length 1024 --forward-only``). A method that fails (e.g. out of
memory) is reported with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch

from hf_densessm.ops import selective_scan, selective_state_update


def _hf_functions():
    """transformers' PyTorch scan and step (the functions undecorated, so that no hub kernel replaces them)."""
    import transformers.models.mamba.modeling_mamba as modeling_mamba

    scan = modeling_mamba.mamba_selective_scan
    step = modeling_mamba.mamba_selective_state_update
    return getattr(scan, "__wrapped__", scan), getattr(step, "__wrapped__", step)


def _mamba_ssm_functions():
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as mamba_step
    except Exception as e:  # ImportError, or a broken build
        return None, None, f"{type(e).__name__}: {e}"
    return selective_scan_fn, mamba_step, None


class Timer:
    """Median wall time of ``fn`` in milliseconds; CUDA events on the GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device, budget_s: float):
        self.device = device
        self.budget_s = budget_s

    def __call__(self, fn) -> float:
        self._sync()
        t0 = time.perf_counter()
        fn()  # warm-up (compilation, autotuning, allocator); its time sizes the repetitions
        self._sync()
        once = time.perf_counter() - t0
        if once > self.budget_s and self.device.type == "cpu":
            return once * 1e3  # slow method on the CPU (nothing to compile): one run is the measurement
        reps = max(1, min(50, int(self.budget_s / max(once, 1e-6))))
        times = []
        for _ in range(reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, timer: Timer) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written)."""
    n = (1 << 28) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def make_inputs(batch, dim, state, length, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    A = -torch.arange(1, state + 1, dtype=torch.float32).repeat(dim, 1)  # S4D-real init
    return dict(
        u=r(batch, dim, length), delta=r(batch, dim, length, scale=0.5), A=A.to(device), B=r(batch, state, length),
        C=r(batch, state, length), D=r(dim, dt=torch.float32), z=r(batch, dim, length),
        delta_bias=r(dim, scale=0.5, dt=torch.float32), delta_softplus=True,
    )


def min_bytes(kw) -> int:
    """Minimal forward traffic: every tensor input read once, ``y`` (like ``u``) written once."""
    n = sum(v.numel() * v.element_size() for v in kw.values() if isinstance(v, torch.Tensor))
    return n + kw["u"].numel() * kw["u"].element_size()


def scan_methods(device, hf_scan, mamba_scan):
    methods = {}
    if device.type == "cuda":
        methods["triton"] = lambda kw: selective_scan(**kw, backend="triton")
    methods["torch"] = lambda kw: selective_scan(**kw, backend="torch")
    methods["hf"] = lambda kw: hf_scan(
        kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"], kw["delta_softplus"]
    )
    if mamba_scan is not None and device.type == "cuda":
        methods["mamba_ssm"] = lambda kw: mamba_scan(
            kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"], kw["delta_softplus"]
        )
    return methods


def run_scan(method, fn, kw, timer, copy_bw, backward):
    batch, dim, length = kw["u"].shape
    rec = dict(kind="scan", method=method, batch=batch, dim=dim, state=kw["A"].shape[1], length=length,
               dtype=str(kw["u"].dtype))
    try:
        with torch.no_grad():
            rec["fwd_ms"] = timer(lambda: fn(kw))
        rec["fwd_GBps"] = min_bytes(kw) / (rec["fwd_ms"] * 1e-3) / 1e9
        rec["fwd_frac_copy_bw"] = rec["fwd_GBps"] * 1e9 / copy_bw
        if backward:
            leaves = {k: (v.detach().requires_grad_(True) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
            inputs = [v for v in leaves.values() if isinstance(v, torch.Tensor)]
            g = torch.randn_like(kw["u"])
            rec["fwdbwd_ms"] = timer(lambda: torch.autograd.grad(fn(leaves), inputs, g))
    except Exception as e:  # OOM and the like: report, go on
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if kw["u"].is_cuda:
        torch.cuda.empty_cache()
    return rec


def run_step(method, fn, shape, device, timer):
    batch, dim, state = shape
    rec = dict(kind="decode_step", method=method, batch=batch, dim=dim, state=state)
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*s, dt=torch.float32):
        return torch.randn(*s, generator=g).to(device=device, dtype=dt)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h = r(batch, dim, state)
    args = (h, r(batch, dim, dt=dtype), r(batch, dim, dt=dtype), -torch.rand(dim, state, generator=g).to(device),
            r(batch, state, dt=dtype), r(batch, state, dt=dtype))
    kw = dict(D=r(dim), z=r(batch, dim, dt=dtype), dt_bias=r(dim), dt_softplus=True)
    try:
        with torch.no_grad():
            rec["step_us"] = timer(lambda: fn(*args, **kw)) * 1e3
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--out", default="bench_selective_scan.json", help="JSON file for the numbers")
    p.add_argument("--batch", type=int, nargs="+", help="default: 1 on CUDA, 1 2 on the CPU")
    p.add_argument("--dim", type=int, nargs="+", help="default: 2048 4096 on CUDA, 512 on the CPU")
    p.add_argument("--length", type=int, nargs="+", help="default: 512 2048 8192 on CUDA, 128 512 on the CPU")
    p.add_argument("--state", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--budget", type=float, default=2.0, help="seconds of repetitions per measurement")
    p.add_argument("--forward-only", action="store_true", help="skip the forward+backward measurements")
    args = p.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if cuda else torch.float32
    batches = args.batch or ([1] if cuda else [1, 2])
    dims = args.dim or ([2048, 4096] if cuda else [512])
    lengths = args.length or ([512, 2048, 8192] if cuda else [128, 512])
    timer = Timer(device, args.budget)

    hf_scan, hf_step = _hf_functions()
    mamba_scan, mamba_step, mamba_error = _mamba_ssm_functions()
    copy_bw = copy_bandwidth(device, timer)
    info = dict(
        device=torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        threads=None if cuda else torch.get_num_threads(), torch=torch.__version__, dtype=str(dtype),
        copy_bandwidth_GBps=copy_bw / 1e9, mamba_ssm=mamba_error or "available",
    )
    print(f"# selective scan on {info['device']} ({device.type}, {dtype}, threads={info['threads']}), "
          f"device copy bandwidth {copy_bw / 1e9:.1f} GB/s")
    if mamba_error:
        print(f"# mamba_ssm not importable, not compared: {mamba_error}")

    records = []
    methods = scan_methods(device, hf_scan, mamba_scan)
    print(f"\n{'method':>10} {'batch':>5} {'dim':>5} {'len':>5} {'fwd ms':>10} {'fwd+bwd ms':>11} {'fwd GB/s':>9} "
          f"{'of copy':>7} {'fwd speedup vs hf':>17}")
    for batch in batches:
        for dim in dims:
            for length in lengths:
                kw = make_inputs(batch, dim, args.state, length, dtype, device)
                row = [run_scan(name, fn, kw, timer, copy_bw, not args.forward_only) for name, fn in methods.items()]
                records.extend(row)
                del kw
                hf_ms = next((r.get("fwd_ms") for r in row if r["method"] == "hf"), None)
                for rec in row:
                    if "error" in rec:
                        print(f"{rec['method']:>10} {batch:>5} {dim:>5} {length:>5}   {rec['error']}", flush=True)
                        continue
                    speedup = hf_ms / rec["fwd_ms"] if hf_ms else math.nan
                    rec["fwd_speedup_vs_hf"] = speedup
                    print(f"{rec['method']:>10} {batch:>5} {dim:>5} {length:>5} {rec['fwd_ms']:>10.3f} "
                          f"{rec.get('fwdbwd_ms', math.nan):>11.3f} {rec['fwd_GBps']:>9.2f} "
                          f"{rec['fwd_frac_copy_bw']:>7.1%} {speedup:>17.2f}", flush=True)

    steps = {"torch": lambda *a, **k: selective_state_update(*a, **k, backend="torch"), "hf": hf_step}
    if cuda:
        steps["triton"] = lambda *a, **k: selective_state_update(*a, **k, backend="triton")
        if mamba_step is not None:
            steps["mamba_ssm"] = mamba_step
    print(f"\n{'method':>10} {'batch':>5} {'dim':>5} {'decode step us':>15}")
    for batch in batches:
        for dim in dims:
            for name, fn in steps.items():
                rec = run_step(name, fn, (batch, dim, args.state), device, timer)
                records.append(rec)
                print(f"{name:>10} {batch:>5} {dim:>5} " + (f"{rec['step_us']:>15.1f}" if "error" not in rec
                                                           else f"  {rec['error']}"), flush=True)

    with open(args.out, "w") as f:
        json.dump(dict(info=info, records=records), f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
