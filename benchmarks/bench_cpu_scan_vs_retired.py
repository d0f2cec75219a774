"""Selective scan on the CPU: the C++ kernel (``csrc/selective_scan_cpu.cpp``, ``cpp_extension`` + ``torch.library``)
against the retired C kernel of commit bd2f329 (``ops/selective_scan/cpu.py``, C in a string, ctypes + OpenMP).

Two versions of one package cannot share a process, so each runs in a child process of this script, back to back
and in alternating order for ``--rounds`` rounds: this checkout's ``src/`` (or ``--current-src``) and bd2f329's
``src/`` (extracted with ``git archive`` into a temporary folder, or ``--retired-src``). Both children build the
same inputs from the same seed, as a Mamba block passes them: float32, ``D``, ``z``, ``delta_bias``, softplus, u,
delta, z and dy token-major views, B and C slices of x_proj's output. Timed, forward and backward, at two levels:

- ``op``: the public op of the version, ``hf_densessm.ops.selective_scan`` (same signature in both; on CPU tensors
  it runs the version's compiled kernel), every input requiring a gradient (so the forward saves its checkpoints),
  then ``y.backward(dy)``: what the model pays, the op's own copies and casts included;
- ``kernel``: the compiled kernel with its softplus and nothing else. C++: ``cpu_kernel.scan_fwd`` / ``scan_bwd``
  (the ``torch.library`` ops ``selective_scan_cpu_fwd`` / ``_bwd``, softplus inside). Retired:
  ``selective_scan_cpu`` (softplus in PyTorch, then its ``autograd.Function`` over the ctypes kernel) and
  ``y.backward(dy)``.

Each figure is the minimum over every repeat of every round, in wall time and in the process's CPU time (which,
with one thread, leaves out the time the OS ran another process); the ratio is C++ / retired (below 1: the C++
kernel is faster). The two versions' outputs and gradients (public op) are compared, maximum relative difference.

    python benchmarks/bench_cpu_scan_vs_retired.py --threads 1 --cpus 1
    python benchmarks/bench_cpu_scan_vs_retired.py --threads 2

``--dry`` runs a tiny shape once (a plumbing test; nothing timed is meaningful). Needs git (bd2f329 in the
repository's history) and a C compiler; the retired kernel is cached in ``$HF_DENSESSM_CACHE`` (its own default
otherwise), the C++ one in ``$TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RETIRED = "bd2f329"
GRADS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def _child(args) -> None:
    """One version's measurements: JSON on stdout, outputs and gradients to ``args.save``."""
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)
    import torch

    torch.set_num_threads(args.threads)
    from hf_densessm.ops import selective_scan

    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    batch, dim, n, length, rank = args.batch, args.dim, args.state, args.length, 32
    _, B, C = r(batch, length, rank + 2 * n).split([rank, n, n], dim=-1)
    kw = dict(u=r(batch, length, dim).transpose(1, 2), delta=r(batch, length, dim, scale=0.5).transpose(1, 2),
              A=-torch.arange(1, n + 1, dtype=torch.float32).repeat(dim, 1), B=B.transpose(1, 2),
              C=C.transpose(1, 2), D=r(dim), z=r(batch, length, 2 * dim).chunk(2, dim=-1)[1].transpose(1, 2),
              delta_bias=r(dim, scale=0.5), delta_softplus=True)
    dy = r(batch, length, dim).transpose(1, 2)
    leaves = {k: v.detach().requires_grad_() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}

    def autograd(fn):  # forward with every input requiring a gradient, then y.backward(dy)
        def fwd():
            for t in leaves.values():
                if isinstance(t, torch.Tensor):
                    t.grad = None
            return fn(**leaves)
        return fwd, lambda y: y.backward(dy)

    if args.child == "current":  # the kernel: the torch.library ops through their Python entry points
        from hf_densessm.ops import cpu_kernel

        if cpu_kernel.missing(kw["u"].device, n):
            raise SystemExit(f"the C++ kernel {cpu_kernel.missing(kw['u'].device, n)}")
        kernel = (lambda: cpu_kernel.scan_fwd(**kw), lambda out: cpu_kernel.scan_bwd(dy, None, **kw,
                                                                                     chunk_states=out[2]))
    else:  # the kernel: softplus in PyTorch, then the ctypes kernel's autograd.Function
        from hf_densessm.ops.selective_scan import cpu

        if not cpu.cpu_kernel_available():
            raise SystemExit(f"the retired C kernel is not available: {cpu.why_unavailable()}")
        kernel = autograd(cpu.selective_scan_cpu)
    out = {}
    for level, (fwd, bwd) in (("op", autograd(selective_scan)), ("kernel", kernel)):
        bwd(fwd())  # warm-up (and the build, if any)
        for _ in range(args.repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            y = fwd()
            w1, c1 = time.perf_counter(), time.process_time()
            bwd(y)
            w2, c2 = time.perf_counter(), time.process_time()
            for key, value in ((f"{level}_forward_wall_s", w1 - w0), (f"{level}_forward_cpu_s", c1 - c0),
                               (f"{level}_backward_wall_s", w2 - w1), (f"{level}_backward_cpu_s", c2 - c1)):
                out.setdefault(key, []).append(value)
    fwd, bwd = autograd(selective_scan)  # the public op's outputs and gradients, to compare the versions
    y = fwd()
    bwd(y)
    torch.save({"y": y.detach(), **{k: leaves[k].grad for k in GRADS}}, args.save)
    print(json.dumps(out))


def _run_child(version, src, args, save) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", version, "--save", str(save),
           *(f"--{k}={getattr(args, k)}" for k in ("batch", "dim", "state", "length", "threads", "repeats"))]
    if args.cpus:
        cmd += ["--cpus", *map(str, args.cpus)]
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the {version} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _extract_retired(folder: Path) -> Path:
    """bd2f329's ``src/`` into ``folder`` (git archive: no worktree, nothing written to the repository)."""
    archive = folder / "src.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", RETIRED, "src"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return folder / "src"


def _cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dim", type=int, default=1024, help="channels (DenseMamba-30M: intermediate_size 1024)")
    p.add_argument("--state", type=int, default=16)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpus", type=int, nargs="*", default=None, help="CPUs the children are pinned to")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per child")
    p.add_argument("--rounds", type=int, default=3, help="child runs per version, alternating")
    p.add_argument("--retired-src", default=None, help="bd2f329's src/ folder (default: git archive)")
    p.add_argument("--current-src", default=str(ROOT / "src"), help="the C++ kernel's src/ (default: this checkout's)")
    p.add_argument("--dry", action="store_true", help="a tiny shape, one round, one repeat (plumbing test)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_scan_vs_retired.json"))
    p.add_argument("--child", choices=("current", "retired"), help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return {}
    if args.dry:
        args.batch, args.dim, args.length, args.repeats, args.rounds = 1, 40, 70, 1, 1
    import torch

    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="scan-vs-retired-") as tmp:
        srcs = {"current": Path(args.current_src),
                "retired": Path(args.retired_src) if args.retired_src else _extract_retired(Path(tmp))}
        runs = {v: [] for v in srcs}
        for i in range(args.rounds):
            for version in (srcs if i % 2 == 0 else reversed(list(srcs))):
                runs[version].append(_run_child(version, srcs[version], args, Path(tmp) / f"{version}.pt"))
        outs = {v: torch.load(Path(tmp) / f"{v}.pt") for v in srcs}
    diff = {k: ((outs["current"][k].double() - outs["retired"][k].double()).abs().max()
                / outs["retired"][k].double().abs().max().clamp_min(1e-30)).item() for k in outs["retired"]}
    best = {v: {k: min(x for run in rs for x in run[k]) for k in rs[0]} for v, rs in runs.items()}
    report = {
        "what": "selective scan fwd / bwd on the CPU: C++ kernel (this checkout) vs retired C kernel (bd2f329); op: "
                "each version's hf_densessm.ops.selective_scan, kernel: the compiled kernel and its softplus",
        "shape": {"batch": args.batch, "dim": args.dim, "state": args.state, "length": args.length,
                  "dtype": "float32", "options": "D, z, delta_bias, softplus; the model's token-major layout"},
        "current_src": args.current_src, "threads": args.threads, "cpus": args.cpus, "rounds": args.rounds,
        "repeats": args.repeats,
        "min_s": best,
        "ratio_current_over_retired": {k: best["current"][k] / best["retired"][k] for k in best["current"]},
        "max_rel_diff": diff,
        "cpu": _cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_1_5_15_min_at_start_and_end": [load_at_start, os.getloadavg()], "torch": torch.__version__,
        "dry": args.dry,
    }
    print(f"batch {args.batch}, dim {args.dim}, state {args.state}, length {args.length}, {args.threads} thread(s), "
          f"{report['cpu']} ({report['cpu_capability']}); min of {args.rounds} x {args.repeats}")
    print(f"{'':26s}{'C++ ms':>10s}{'retired ms':>12s}{'C++/retired':>13s}")
    for k, ratio in report["ratio_current_over_retired"].items():
        print(f"{k:26s}{best['current'][k] * 1e3:10.2f}{best['retired'][k] * 1e3:12.2f}{ratio:13.2f}")
    print("max relative difference:", {k: f"{v:.1e}" for k, v in diff.items()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
