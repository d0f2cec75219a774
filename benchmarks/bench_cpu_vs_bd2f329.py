"""CPU training step of this checkout against bd2f329 (the code before the redesign, issue 35): step time, model
FLOP/s against the machine's fp32 matmul peak, and each op's share of one step (``torch.profiler``, self CPU time).

Two versions of one package cannot share a process, so each runs in a child process, back to back and in
alternating order for ``--rounds`` rounds: this checkout's ``src/`` and bd2f329's (``git archive`` into a temporary
folder). Each child builds the same models from the same seed with the public API both versions share
(``DenseMambaConfig.from_preset("densemamba-30m", dense_layers=m)``, likewise DenseRetNet-30M), float32, and times a
training step of ``--batch`` x ``--length`` random tokens: forward with labels, backward, AdamW step, eager and (with
``--compiled``) under ``torch.compile(model)``. Each figure is the median over every repeat of every round; the ratio
is this checkout / bd2f329 (below 1: faster now).

    python benchmarks/bench_cpu_vs_bd2f329.py --threads 2
    python benchmarks/bench_cpu_vs_bd2f329.py --threads 2 --compiled

``--dry`` runs the tiny presets once (a plumbing test; nothing timed is meaningful).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_scan_vs_retired import ROOT, RETIRED, _cpu_name, _extract_retired  # noqa: E402
from bench_cpu import RUNTIME_ENV_PREFIXES  # noqa: E402

MODELS = {"DenseMamba m=0": ("densemamba", 0), "DenseMamba m=4": ("densemamba", 4),
          "DenseRetNet m=0": ("denseretnet", 0), "DenseRetNet m=2": ("denseretnet", 2)}


def _child(args) -> None:
    """One version's step times (JSON on stdout): ``{model: {mode: [seconds...]}, "profile": {model: {op: s}}}``."""
    import torch

    torch.set_num_threads(args.threads)
    from hf_densessm import DenseMambaConfig, DenseMambaForCausalLM, DenseRetNetConfig, DenseRetNetForCausalLM

    classes = {"densemamba": (DenseMambaConfig, DenseMambaForCausalLM),
               "denseretnet": (DenseRetNetConfig, DenseRetNetForCausalLM)}
    size = "tiny" if args.dry else "30m"
    out = {"times": {}, "profile": {}, "flop": {}}
    for name, (family, m) in MODELS.items():
        config_cls, model_cls = classes[family]
        torch.manual_seed(0)
        config = config_cls.from_preset(f"{family}-{size}", dense_layers=m, vocab_size=args.vocab_size)
        model = model_cls(config).train()
        ids = torch.randint(3, args.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        out["flop"][name] = 6 * sum(p.numel() for p in model.parameters()) * args.batch * args.length
        modes = {"eager": model}
        if args.compiled:
            modes["compiled"] = torch.compile(model)
        for mode, fn in modes.items():
            def step():
                optimizer.zero_grad(set_to_none=True)
                fn(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()

            for _ in range(args.warmup):
                step()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            out["times"].setdefault(name, {})[mode] = times
            if mode == "eager":
                with torch.profiler.profile() as prof:
                    step()
                top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
                out["profile"][name] = {e.key: [round(e.self_cpu_time_total / 1e6, 4), e.count] for e in top}
    print(json.dumps(out))


def _run_child(version, src, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child",
           *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
             ("batch", "length", "threads", "repeats", "warmup", "vocab_size", "top"))]
    cmd += ["--dry"] * args.dry + ["--compiled"] * args.compiled
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the {version} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _matmul_peak(threads: int, size: int = 2048) -> float:
    """The machine's fp32 matmul FLOP/s: the best of 5 products of two ``size`` x ``size`` matrices."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * size**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per child and mode")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="child runs per version, alternating")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--top", type=int, default=12, help="ops kept from each profile")
    p.add_argument("--compiled", action="store_true", help="also time torch.compile(model)")
    p.add_argument("--dry", action="store_true", help="tiny presets, one round, one repeat (plumbing test)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_vs_bd2f329.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry:
        args.batch, args.length, args.repeats, args.warmup, args.rounds, args.vocab_size = 1, 32, 1, 0, 1, 128
    if args.child:
        _child(args)
        return {}
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cpu-vs-bd2f329-") as tmp:
        srcs = {"current": ROOT / "src", "bd2f329": _extract_retired(Path(tmp))}
        runs = {v: [] for v in srcs}
        for i in range(args.rounds):
            for version in (srcs if i % 2 == 0 else reversed(list(srcs))):
                runs[version].append(_run_child(version, srcs[version], args))
    peak = _matmul_peak(args.threads)
    median = {v: {name: {mode: statistics.median(t for run in rs for t in run["times"][name][mode])
                         for mode in rs[0]["times"][name]} for name in MODELS} for v, rs in runs.items()}
    flop = runs["current"][0]["flop"]
    report = {
        "what": f"training step (forward + backward + AdamW) of {args.batch} x {args.length} tokens, float32, this "
                f"checkout vs {RETIRED}; median seconds; model FLOP/s = 6 x parameters x tokens / step time",
        "median_s": median,
        "ratio_current_over_bd2f329": {name: {mode: median["current"][name][mode] / median["bd2f329"][name][mode]
                                              for mode in median["current"][name]} for name in MODELS},
        "fraction_of_matmul_peak": {v: {name: {mode: flop[name] / t / peak for mode, t in modes.items()}
                                        for name, modes in m.items()} for v, m in median.items()},
        "profile_self_cpu_s_and_calls": {v: rs[-1]["profile"] for v, rs in runs.items()},
        "fp32_matmul_peak_gflops": peak / 1e9, "threads": args.threads, "rounds": args.rounds,
        "repeats": args.repeats, "cpu": _cpu_name(), "load_average_1_5_15_min_at_start_and_end":
            [load_at_start, os.getloadavg()], "dry": args.dry,
        "runtime_env": {key: value for key, value in sorted(os.environ.items())
                        if key.startswith(RUNTIME_ENV_PREFIXES)},
    }
    print(f"{args.batch} x {args.length} tokens, {args.threads} thread(s), {report['cpu']}, fp32 matmul peak "
          f"{peak / 1e9:.0f} GFLOP/s; median of {args.rounds} x {args.repeats}")
    print(f"{'':18s}{'mode':>10s}{'now s':>9s}{'bd2f329 s':>11s}{'now/bd2f329':>13s}{'now %peak':>11s}")
    for name in MODELS:
        for mode, ratio in report["ratio_current_over_bd2f329"][name].items():
            print(f"{name:18s}{mode:>10s}{median['current'][name][mode]:9.3f}{median['bd2f329'][name][mode]:11.3f}"
                  f"{ratio:13.2f}{report['fraction_of_matmul_peak']['current'][name][mode] * 100:10.1f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
