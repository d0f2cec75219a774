"""Every GPU figure of the project from one command: CUDA-only correctness checks and every GPU benchmark.

On a machine with one NVIDIA GPU (meant to take under 10 minutes on an A100 / H100, plus the compilations of the
training and decoding steps)::

    python benchmarks/gpu_suite.py --out-dir benchmarks/results          # gpu_suite.json + gpu_suite.md
    python benchmarks/gpu_suite.py --sections decode training            # the issue's GPU targets only

Sections (each runs on its own: an error is recorded in its row and the suite goes on):

1. ``environment``: GPU, versions, the device's measured copy bandwidth (bytes read + written per second of a
   1 GiB device-to-device copy), which every achieved bandwidth below is a fraction of.
2. ``kernel-correctness``: each Triton kernel in float32, bfloat16 and float16 (forward, every gradient, the decode
   step) against the float64 PyTorch references on the GPU (the Triton interpreter of the CPU tests cannot run
   bfloat16): the largest error relative to the largest reference entry, and whether it is under the tolerance.
3. ``model-parity``: DenseMamba and DenseRetNet (small configs, dense connection on) through the public API,
   ``config.kernel_backend="triton"`` against ``"torch"``: logits, parameter gradients, and the scores of a
   greedy ``generate`` through the cache.
4. ``kernels``: time of each kernel against its PyTorch path, transformers' Mamba scan, ``mamba_ssm`` and ``fla``
   where importable, forward and forward+backward, with the achieved bandwidth (minimal bytes over time) as a
   fraction of the copy bandwidth and the ideal time (minimal bytes at the copy bandwidth); decode steps.
5. ``training``: one optimizer step (bfloat16 autocast, AdamW) of DenseMamba-360M and DenseRetNet-350M, with the
   dense connection and without it (``dense_layers=0``), eager and with the model under ``torch.compile(model)``
   (the same step, module and optimizer): milliseconds and tokens per second of each, the compiled step's first
   call (it compiles), and its speed-up over eager.
6. ``decode``: batch-1 decoding of both models through ``generate()`` at 1K and 16K tokens of context, by
   ``generate()`` as it comes (on CUDA transformers compiles the decoding step with CUDA graphs by default; whether
   it did is recorded) and with ``disable_compile=True``: the first call's seconds, milliseconds per token (time
   of 1 + n new tokens minus time of 1, over n; the issue's target is 3 ms or less), and counted with
   ``torch.profiler`` over the same calls: kernel launches per token (``cudaLaunchKernel`` / ``cuLaunchKernel``,
   ``cudaGraphLaunch``, and their sum), GPU kernels, host syncs and copies per token.

7. ``speculative``: ``benchmarks/bench_speculative.py --device cuda`` (issue 37): plain greedy ``generate()`` (its
   decoding step compiled with CUDA graphs, as ``generate()`` does by default, and with ``disable_compile=True``)
   against prompt lookup (5 and 10 drafted tokens) and assisted decoding, in float32 at batch 1 on the same held-out
   standard-library file: tokens per second, speed-ups, same tokens as plain greedy (a check), tokens per forward,
   acceptance. It needs a trained model (``--speculative-model``, default ``outputs/denseretnet-600``: the main
   job's ``python examples/pretrain.py --model denseretnet --max-steps 600 --output-dir outputs/denseretnet-600``,
   carried to the GPU machine); without one the section records ``skipped``. A dry run trains nothing: a micro
   model with a small tokenizer, its figures meaningless.

Every row fails on its own: an error (e.g. a model that cannot be compiled yet) is recorded in its row as
``error`` and the suite goes on.

``--dry-run`` runs every section end to end on the CPU at tiny shapes (kernels under the Triton interpreter,
float32 instead of the half dtypes, which the interpreter cannot compute; ``torch.compile`` with the ``aot_eager``
backend, and the decoding step compiled through ``compile_decode_step()``, the CPU's opt-in), to check the
plumbing; its numbers mean nothing, and its launch counts are zero (no CUDA). The exit status is 1 if a
correctness check failed or a section raised, else 0.

Only public, long-standing APIs are used, so that it runs as is on torch 2.11 / triton 3.6 / transformers 5.17 as
well as on the newest releases.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be on before triton is first imported (by anything)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent

#: Shapes per mode. "gpu": the presets (DenseMamba-360M: 2048 channels, state 16; DenseRetNet-350M: 2 heads,
#: key 384 and value 1536 per head; DenseRetNet-1.3B: 4 heads, key 320, value 1280). "dry": tiny.
SIZES = {
    "gpu": dict(
        check_scan=(2, 512, 16, 1024),  # batch, dim, state, length
        check_retention=[(1, 1024, 2, 384, 1536), (1, 1024, 4, 320, 1280)],  # batch, length, heads, key, value
        bench_scan=[(1, 2048, 16, 2048), (1, 2048, 16, 8192), (8, 2048, 16, 2048)],
        bench_retention=[(8, 2048, 2, 384, 1536), (4, 2048, 4, 320, 1280)],
        bench_steps=[1, 64],  # decode batch sizes
        train=dict(batch=4, length=1024, steps=5),
        decode_contexts=[1024, 16384],
        decode_new=32,
        parity_length=256,
        repeats=20,
    ),
    "dry": dict(
        check_scan=(1, 8, 4, 20),
        check_retention=[(1, 20, 2, 16, 32)],
        bench_scan=[(1, 8, 4, 16)],
        bench_retention=[(1, 16, 2, 16, 32)],
        bench_steps=[1],
        train=dict(batch=1, length=8, steps=1),
        decode_contexts=[8, 16],
        decode_new=2,
        parity_length=8,
        repeats=1,
    ),
}
#: Method names of the training section: the eager step, and the same step through ``torch.compile(model)``.
EAGER_TRAINING, COMPILED_TRAINING = "eager", "torch.compile"
#: Method names of the decode section, with the ``generate()`` keywords each adds.
DEFAULT_DECODE = "generate (default)"
DECODE_METHODS = {DEFAULT_DECODE: {}, "generate eager (disable_compile)": {"disable_compile": True}}
#: The issue's target for batch-1 bfloat16 decoding of the 350M presets on a GPU, milliseconds per token.
DECODE_TARGET_MS = 3.0
#: Profiler events of one kernel launch by the host, and of one CUDA graph launch (each graph replays many kernels).
KERNEL_LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                        "cudaLaunchCooperativeKernel")
GRAPH_LAUNCH_EVENTS = ("cudaGraphLaunch", "cuGraphLaunch")
#: Dynamo's compiled-code cache entries per code object: the compiled training steps and decoding steps of one
#: family share its classes' code objects (one entry per model and dtype, more while a cache warms up), past
#: Dynamo's default limit of 8, at which a ``fullgraph=True`` compilation (``generate()``'s) fails.
RECOMPILE_LIMIT = 64
#: Largest error relative to the largest reference entry that a check accepts, per dtype.
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}
H100_SXM_BANDWIDTH = 3.35e12  # bytes/s, HBM3 of the H100 SXM: the physical limit docs/benchmarks.md uses


class Suite:
    """Runs the sections and collects one record per figure: ``section, case, method, metric, value`` (+ ``ok``
    for checks, ``note``); writes them as JSON and as one markdown table."""

    def __init__(self, device: torch.device, dry: bool, speculative_model: Path | None = None):
        self.device = device
        self.dry = dry
        self.speculative_model = speculative_model
        self.sizes = SIZES["dry" if dry else "gpu"]
        self.records: list[dict] = []
        self.failed = False
        self.copy_bandwidth = float("nan")

    # ----------------------------------------------------------------------------------------- plumbing

    def add(self, section, case, method, metric, value, unit="", ok=None, note=""):
        record = dict(section=section, case=case, method=method, metric=metric, value=value, unit=unit, note=note)
        if ok is not None:
            record["ok"] = bool(ok)
            self.failed |= not ok
        self.records.append(record)
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"[{section}] {case} | {method} | {metric} = {shown} {unit} {'' if ok is None else ('ok' if ok else 'FAIL')}"
              f" {note}".rstrip(), flush=True)

    def section(self, name, fn):
        start = time.perf_counter()
        try:
            fn()
        except Exception as error:  # record, go on with the next section
            self.failed = True
            self.add(name, "section", "-", "error", f"{type(error).__name__}: {error}"[:300], ok=False)
            traceback.print_exc()
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.add(name, "section", "-", "seconds", time.perf_counter() - start, "s")

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_ms(self, fn, repeats=None, budget_s=3.0):
        """Median milliseconds of ``fn()`` after one warm-up call (CUDA events on the GPU): ``repeats`` runs, fewer
        (at least 3) once they have taken ``budget_s`` seconds, so that slow methods (a token loop) stay bounded."""
        repeats = repeats or self.sizes["repeats"]
        fn()
        self.sync()
        times = []
        started = time.perf_counter()
        for index in range(repeats):
            if index >= 3 and time.perf_counter() - started > budget_s:
                break
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def half_dtypes(self):
        """The dtypes the correctness checks cover: float32 and both half types on a GPU, float32 in a dry run."""
        return [torch.float32] if self.dry else [torch.float32, torch.bfloat16, torch.float16]

    def bench_dtype(self):
        return torch.float32 if self.dry else torch.bfloat16

    def randn(self, *shape, dtype=torch.float32, scale=1.0, generator=None):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(self.device, dtype)

    # ----------------------------------------------------------------------------------------- sections

    def environment(self):
        import transformers

        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "not installed"
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else platform.processor()
        for metric, value in (("device", name or platform.machine()), ("torch", torch.__version__),
                              ("triton", triton_version), ("transformers", transformers.__version__),
                              ("dry_run", str(self.dry)),
                              ("dynamo_recompile_limit", str(getattr(torch._dynamo.config, "recompile_limit",
                                                                     torch._dynamo.config.cache_size_limit)))):
            self.add("environment", "-", "-", metric, value)
        if self.device.type == "cuda":
            from hf_densessm.ops.backend import device_arch

            self.add("environment", "-", "-", "arch", device_arch(self.device).name)
        n = (1 << 28) if self.device.type == "cuda" else (1 << 20)
        src = torch.ones(n, device=self.device)
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        self.copy_bandwidth = 2 * src.numel() * 4 / (ms * 1e-3)
        self.add("environment", f"{2 * n * 4 >> 20} MiB moved", "torch copy_", "copy_bandwidth",
                 self.copy_bandwidth / 1e9, "GB/s")

    def kernel_correctness(self):
        from hf_densessm.ops.retention import chunk_retention
        from hf_densessm.ops.retention.chunked_torch import retention_state_update_torch
        from hf_densessm.ops.retention.fused_recurrent import retention_state_update_triton
        from hf_densessm.ops.retention.naive import chunk_retention_naive
        from hf_densessm.ops.selective_scan import selective_scan
        from hf_densessm.ops.selective_scan.chunked_torch import selective_state_update_torch
        from hf_densessm.ops.selective_scan.fused_recurrent import selective_state_update_triton

        gen = torch.Generator().manual_seed(0)
        batch, dim, n, length = self.sizes["check_scan"]
        base = dict(u=self.randn(batch, dim, length, dtype=torch.float64, generator=gen),
                    delta=self.randn(batch, dim, length, dtype=torch.float64, scale=0.5, generator=gen),
                    A=-torch.rand(dim, n, generator=gen, dtype=torch.float64).add(0.1).to(self.device),
                    B=self.randn(batch, n, length, dtype=torch.float64, generator=gen),
                    C=self.randn(batch, n, length, dtype=torch.float64, generator=gen),
                    D=self.randn(dim, dtype=torch.float64, generator=gen),
                    z=self.randn(batch, dim, length, dtype=torch.float64, generator=gen),
                    delta_bias=self.randn(dim, dtype=torch.float64, scale=0.5, generator=gen))
        gy = self.randn(batch, dim, length, dtype=torch.float64, generator=gen)
        state0 = self.randn(batch, dim, n, generator=gen)
        for dtype in self.half_dtypes():
            # the inputs rounded to dtype (parameters in float32, as in the models); the reference sees the same
            # rounded values in float64, so the error is the kernel's own
            inputs = {k: v.to(dtype if k in ("u", "delta", "B", "C", "z") else torch.float32) for k, v in base.items()}
            exact = {k: v.double() for k, v in inputs.items()}
            case, method = f"scan b{batch} d{dim} n{n} L{length}", f"triton {_short(dtype)}"
            ref = _run_with_grads(lambda **kw: selective_scan(**kw, delta_softplus=True, backend="torch"), exact, gy)
            got = _run_with_grads(lambda **kw: selective_scan(**kw, delta_softplus=True, backend="triton"), inputs,
                                  gy.to(dtype))
            for name in ref:
                self._check(case, method, name, got[name], ref[name], dtype)
            step = [v[..., 0] if v.dim() == 3 else v for v in inputs.values()]  # u, delta, A, B, C, D, z, bias
            h_ref, h = state0.double(), state0.clone()
            y_ref = selective_state_update_torch(h_ref, *[t.double() for t in step[:6]], z=step[6].double(),
                                                 dt_bias=step[7].double(), dt_softplus=True)
            y = selective_state_update_triton(h, *step[:6], z=step[6], dt_bias=step[7], dt_softplus=True)
            self._check(f"scan step b{batch} d{dim} n{n}", method, "y", y, y_ref, dtype)
            self._check(f"scan step b{batch} d{dim} n{n}", method, "state", h, h_ref, torch.float32)

        for batch, length, heads, key, value in self.sizes["check_retention"]:
            qkv = [self.randn(batch, length, heads, d, dtype=torch.float64, generator=gen) for d in (key, key, value)]
            s0 = self.randn(batch, heads, key, value, generator=gen)
            go = self.randn(batch, length, heads, value, dtype=torch.float64, generator=gen)
            case = f"retention b{batch} L{length} h{heads} k{key} v{value}"
            step_case = f"retention step b{batch} h{heads} k{key} v{value}"
            for dtype in self.half_dtypes():
                q, k, v = (x.to(dtype) for x in qkv)
                method = f"triton {_short(dtype)}"
                ref = _run_with_grads(lambda q, k, v: chunk_retention_naive(q, k, v), _doubles(q=q, k=k, v=v), go)
                got = _run_with_grads(lambda q, k, v: chunk_retention(q, k, v, key**-0.5, backend="triton")[0],
                                      dict(q=q, k=k, v=v), go.to(dtype))
                for name in ref:
                    self._check(case, method, name, got[name], ref[name], dtype)
                state_ref, state = s0.double(), s0.clone()
                o_ref = retention_state_update_torch(state_ref, q[:, 0].double(), k[:, 0].double(),
                                                     v[:, 0].double(), key**-0.5)
                o = retention_state_update_triton(state, q[:, 0], k[:, 0], v[:, 0], key**-0.5)
                self._check(step_case, method, "o", o, o_ref, dtype)
                self._check(step_case, method, "state", state, state_ref, torch.float32)

    def _check(self, case, method, name, got, expected, dtype):
        error = _relative_error(got, expected)
        tolerance = TOLERANCE[dtype]
        self.add("kernel-correctness", case, method, f"rel_err {name}", error, ok=error < tolerance,
                 note=f"(tolerance {tolerance:g})")

    def model_parity(self):
        from transformers import AutoModelForCausalLM

        length = self.sizes["parity_length"]
        for family, config in _small_configs(self.dry).items():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).to(self.device)
            ids = torch.randint(3, config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
            ids = ids.to(self.device)
            results = {}
            for backend in ("torch", "triton"):
                model.config.kernel_backend = backend
                model.zero_grad(set_to_none=True)
                model.train()
                out = model(ids, labels=ids)
                out.loss.backward()
                grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
                model.eval()
                with torch.no_grad():
                    generated = model.generate(ids[:1, : length // 2], max_new_tokens=4, min_new_tokens=4,
                                               do_sample=False, output_scores=True, return_dict_in_generate=True,
                                               pad_token_id=0)
                results[backend] = dict(logits=out.logits.detach(), grads=grads,
                                        scores=torch.stack(generated.scores), tokens=generated.sequences)
            for name in ("logits", "grads", "scores"):
                error = _relative_error(results["triton"][name], results["torch"][name])
                self.add("model-parity", f"{family} L{length} float32", "triton vs torch", f"rel_err {name}", error,
                         ok=error < 2e-3, note="(tolerance 0.002)")
            same = torch.equal(results["triton"]["tokens"], results["torch"]["tokens"])
            self.add("model-parity", f"{family} L{length} float32", "triton vs torch", "same greedy tokens", str(same),
                     ok=same)

    def kernels(self):
        sys.path.insert(0, str(HERE))
        import bench_retention
        import bench_selective_scan

        from hf_densessm.ops import chunk_retention, retention_state_update, selective_scan, selective_state_update

        dtype = self.bench_dtype()
        hf_scan, hf_step = _optional(bench_selective_scan._hf_functions)
        mamba_scan, mamba_step, mamba_error = bench_selective_scan._mamba_ssm_functions()
        fla_fn, fla_error = bench_retention._load_fla()
        self.add("kernels", "-", "mamba_ssm", "available", mamba_error or "yes")
        self.add("kernels", "-", "fla", "available", fla_error or "yes")
        self.add("kernels", "-", "transformers mamba_selective_scan", "available", "yes" if hf_scan else "no")
        scan_methods = {"triton": lambda kw: selective_scan(**kw, backend="triton"),
                        "torch": lambda kw: selective_scan(**kw, backend="torch")}
        if hf_scan is not None:
            scan_methods["transformers"] = lambda kw: hf_scan(kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"],
                                                              kw["z"], kw["delta_bias"], kw["delta_softplus"])
        if mamba_scan is not None and self.device.type == "cuda":
            scan_methods["mamba_ssm"] = lambda kw: mamba_scan(kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"],
                                                             kw["z"], kw["delta_bias"], kw["delta_softplus"])
        for batch, dim, n, length in self.sizes["bench_scan"]:
            kw = bench_selective_scan.make_inputs(batch, dim, n, length, dtype, self.device)
            self._bench(f"scan b{batch} d{dim} n{n} L{length} {_short(dtype)}", scan_methods, kw,
                        bench_selective_scan.min_bytes(kw))
        retention_methods = {"triton": lambda kw: chunk_retention(**kw, backend="triton")[0],
                             "torch": lambda kw: chunk_retention(**kw, backend="torch")[0]}
        if fla_fn is not None and self.device.type == "cuda":
            # our layout is (batch, length, heads, dim); fla versions that still have ``head_first`` are told so
            fla_kwargs = {"head_first": False} if "head_first" in inspect.signature(fla_fn).parameters else {}
            retention_methods["fla"] = lambda kw: fla_fn(kw["q"], kw["k"], kw["v"], **fla_kwargs)[0]
        for batch, length, heads, key, value in self.sizes["bench_retention"]:
            kw = dict(zip("qkv", (self.randn(batch, length, heads, d, dtype=dtype) for d in (key, key, value))))
            moved = sum(t.numel() * t.element_size() for t in kw.values()) + kw["v"].numel() * kw["v"].element_size()
            self._bench(f"retention b{batch} L{length} h{heads} k{key} v{value} {_short(dtype)}", retention_methods, kw,
                        moved)
        self._bench_steps(dtype, selective_state_update, retention_state_update, hf_step, mamba_step)

    def _bench(self, case, methods, kw, moved_bytes):
        """Forward and forward+backward time of every method on ``kw``; bandwidth of the forward."""
        self.add("kernels", case, "-", "ideal_ms (min bytes at copy bandwidth)", moved_bytes / self.copy_bandwidth * 1e3,
                 "ms")
        leaves = {k: (v.detach().requires_grad_(True) if torch.is_tensor(v) and v.is_floating_point() else v)
                  for k, v in kw.items()}
        inputs = [v for v in leaves.values() if torch.is_tensor(v) and v.requires_grad]
        for name, fn in methods.items():
            try:
                with torch.no_grad():
                    ms = self.time_ms(lambda: fn(kw))
                self.add("kernels", case, name, "fwd_ms", ms, "ms")
                self.add("kernels", case, name, "fwd_frac_copy_bw", moved_bytes / (ms * 1e-3) / self.copy_bandwidth)
                out = fn(leaves)
                grad = torch.randn_like(out)
                ms = self.time_ms(lambda: torch.autograd.grad(fn(leaves), inputs, grad))
                self.add("kernels", case, name, "fwd_bwd_ms", ms, "ms")
            except Exception as error:  # e.g. out of memory for the PyTorch paths at long lengths
                self.add("kernels", case, name, "error", f"{type(error).__name__}: {str(error)[:150]}")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _bench_steps(self, dtype, scan_step, retention_step, hf_step, mamba_step):
        (_, dim, n, _), (_, _, heads, key, value) = self.sizes["bench_scan"][0], self.sizes["bench_retention"][0]
        for batch in self.sizes["bench_steps"]:
            h = self.randn(batch, dim, n)
            args = (h, self.randn(batch, dim, dtype=dtype), self.randn(batch, dim, dtype=dtype),
                    -torch.rand(dim, n, device=self.device), self.randn(batch, n, dtype=dtype),
                    self.randn(batch, n, dtype=dtype))
            kwargs = dict(D=self.randn(dim), z=self.randn(batch, dim, dtype=dtype), dt_bias=self.randn(dim),
                          dt_softplus=True)
            steps = {f"{b}": (lambda b=b: scan_step(*args, **kwargs, backend=b)) for b in ("triton", "torch")}
            if hf_step is not None:
                steps["transformers"] = lambda: hf_step(*args, **kwargs)
            if mamba_step is not None and self.device.type == "cuda":
                steps["mamba_ssm"] = lambda: mamba_step(*args, **kwargs)
            state_bytes = 2 * h.numel() * 4  # the float32 state, read and written
            self._bench_step(f"scan step b{batch} d{dim} n{n}", steps, state_bytes)
            state = torch.zeros(batch, heads, key, value, device=self.device)
            q, k, v = (self.randn(batch, heads, d, dtype=dtype) for d in (key, key, value))
            steps = {b: (lambda b=b: retention_step(state, q, k, v, backend=b)) for b in ("triton", "torch")}
            self._bench_step(f"retention step b{batch} h{heads} k{key} v{value}", steps, 2 * state.numel() * 4)

    def _bench_step(self, case, steps, state_bytes):
        self.add("kernels", case, "-", "ideal_us (state read + write at copy bandwidth)",
                 state_bytes / self.copy_bandwidth * 1e6, "us")
        for name, fn in steps.items():
            try:
                with torch.no_grad():
                    us = self.time_ms(fn, repeats=self.sizes["repeats"] * 5) * 1e3
                self.add("kernels", case, name, "step_us", us, "us")
                self.add("kernels", case, name, "frac_copy_bw", state_bytes / (us * 1e-6) / self.copy_bandwidth)
            except Exception as error:
                self.add("kernels", case, name, "error", f"{type(error).__name__}: {str(error)[:150]}")

    def training(self):
        from transformers import AutoModelForCausalLM

        sizes = self.sizes["train"]
        for dense in ("dense", "dense_layers=0"):
            overrides = {} if dense == "dense" else dict(dense_layers=0)
            for name, config in _preset_configs(self.dry, **overrides).items():
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(config).to(self.device).train()
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=self.device.type == "cuda")
                ids = torch.randint(3, config.vocab_size, (sizes["batch"], sizes["length"]), device=self.device)

                def step(forward):
                    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=not self.dry):
                        loss = forward(ids, labels=ids).loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

                case = f"{name} {dense} b{sizes['batch']} L{sizes['length']} bf16-autocast"
                eager_ms = None
                try:
                    eager_ms = self.time_ms(lambda: step(model), repeats=sizes["steps"])
                    self.add("training", case, EAGER_TRAINING, "step_ms", eager_ms, "ms")
                    self.add("training", case, EAGER_TRAINING, "tokens_per_s",
                             sizes["batch"] * sizes["length"] / (eager_ms * 1e-3))
                except Exception as error:
                    self.add("training", case, EAGER_TRAINING, "error", f"{type(error).__name__}: {str(error)[:150]}")
                # the same step through torch.compile(model) (the same module, parameters and optimizer)
                try:
                    compiled = torch.compile(model, backend=self.compile_backend())
                    start = time.perf_counter()
                    step(compiled)  # compiles (forward and backward)
                    self.sync()
                    self.add("training", case, COMPILED_TRAINING, "first_step_s (compiles)",
                             time.perf_counter() - start, "s")
                    ms = self.time_ms(lambda: step(compiled), repeats=sizes["steps"])
                    self.add("training", case, COMPILED_TRAINING, "step_ms", ms, "ms")
                    self.add("training", case, COMPILED_TRAINING, "tokens_per_s",
                             sizes["batch"] * sizes["length"] / (ms * 1e-3))
                    if eager_ms is not None:
                        self.add("training", case, COMPILED_TRAINING, "speedup_vs_eager", eager_ms / ms, "x")
                except Exception as error:
                    self.add("training", case, COMPILED_TRAINING, "error", f"{type(error).__name__}: {str(error)[:300]}")
                del model, optimizer
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def compile_backend(self):
        """Inductor on a GPU; in a dry run ``aot_eager`` (Dynamo's and AOTAutograd's tracing, without Inductor's
        code generation, which would take minutes on the CPU): the plumbing, not the speed."""
        return "aot_eager" if self.dry else "inductor"

    def decode(self):
        """Batch-1 decoding through ``generate()`` (bfloat16 on a GPU), per context length, by two methods:

        - ``generate (default)``: ``generate()`` as it comes. On CUDA transformers compiles the decoding step with
          CUDA graphs by default (``mode="reduce-overhead"``) when it holds a compileable cache at its decision,
          which the models' cache is; ``compiled_path`` records whether it did. In a dry run (the CPU, where that is
          opt-in) ``compile_decode_step()`` opts in, with :meth:`compile_backend`.
        - ``generate eager (disable_compile)``: the same call with ``disable_compile=True``.

        Figures: the first call's seconds (it compiles), milliseconds per token (time of 1 + n new tokens minus
        time of 1, over n), and, counted with ``torch.profiler`` over the same two calls (their difference over n):
        kernel launches per token (``cudaLaunchKernel`` / ``cuLaunchKernel(Ex)`` calls, ``cudaGraphLaunch`` calls,
        and their sum), GPU kernels run per token, host syncs and copies per token."""
        from transformers import AutoModelForCausalLM

        new = self.sizes["decode_new"]
        for name, config in _preset_configs(self.dry).items():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).to(self.device, self.bench_dtype()).eval()
            if self.dry:
                model.compile_decode_step()
                model.generation_config.compile_config.backend = self.compile_backend()
                model.generation_config.compile_config.mode = None  # reduce-overhead is Inductor's
            for context in self.sizes["decode_contexts"]:
                prompt = torch.randint(3, config.vocab_size, (1, context), device=self.device)
                case = f"{name} context {context} batch 1 {_short(self.bench_dtype())}"
                for method, extra in DECODE_METHODS.items():

                    def generate(tokens, extra=extra):
                        with torch.no_grad():
                            model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                           pad_token_id=0, **extra)

                    try:
                        start = time.perf_counter()
                        generate(2)  # compiles the decoding step, where it is compiled
                        self.sync()
                        self.add("decode", case, method, "first_call_s", time.perf_counter() - start, "s")
                        if method == DEFAULT_DECODE:
                            self.add("decode", case, method, "compiled_path", str(_compiled_path_taken(model)))
                        repeats = max(1, self.sizes["repeats"] // 5)
                        one = self.time_ms(lambda: generate(1), repeats=repeats)
                        more = self.time_ms(lambda: generate(1 + new), repeats=repeats)
                        self.add("decode", case, method, "prefill_and_first_token_ms", one, "ms")
                        self.add("decode", case, method, "ms_per_token", (more - one) / new, "ms",
                                 note=f"(target <= {DECODE_TARGET_MS:g} ms: DenseMamba-360M, DenseRetNet-350M, bf16)"
                                 if not self.dry else "")
                        counts_one, counts_more = self.count_events(lambda: generate(1)), \
                            self.count_events(lambda: generate(1 + new))
                        for metric in counts_more:
                            self.add("decode", case, method, f"{metric}_per_token",
                                     (counts_more[metric] - counts_one[metric]) / new)
                    except Exception as error:
                        self.add("decode", case, method, "error", f"{type(error).__name__}: {str(error)[:300]}")
            del model
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def count_events(self, fn) -> dict:
        """Profiler event counts of one call of ``fn``: ``kernel_launches`` (:data:`KERNEL_LAUNCH_EVENTS`),
        ``graph_launches`` (:data:`GRAPH_LAUNCH_EVENTS`), ``launches`` (the two together),
        ``gpu_kernels`` (what ran on the GPU), ``syncs``, ``copies``. Zero on the CPU (a dry run)."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            fn()
            self.sync()
        events = prof.key_averages()

        def count(keys):
            return sum(e.count for e in events if e.key in keys)

        counts = {"kernel_launches": count(KERNEL_LAUNCH_EVENTS), "graph_launches": count(GRAPH_LAUNCH_EVENTS)}
        counts["launches"] = counts["kernel_launches"] + counts["graph_launches"]
        counts["gpu_kernels"] = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        counts["syncs"] = count(("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"))
        counts["copies"] = count(("cudaMemcpyAsync", "cudaMemcpy"))
        return counts

    def speculative(self):
        """Speculative decoding through ``generate()`` (:mod:`bench_speculative` on this device); see the module
        docstring, item 7."""
        import tempfile

        import bench_speculative

        with tempfile.TemporaryDirectory() as tmp:
            model_dir = _micro_speculative_model(Path(tmp)) if self.dry else self.speculative_model
            if not (model_dir / "config.json").is_file():
                self.add("speculative", "-", "-", "skipped", f"no trained model in {model_dir} (--speculative-model)")
                return
            sizes = (["--prompt-tokens", "48", "--new-tokens", "8", "--repeats", "1", "--warmup", "0"] if self.dry
                     else ["--repeats", "5"])
            results = bench_speculative.main(["--model-dir", str(model_dir), "--device", self.device.type, *sizes])
        case = f"{'micro DenseRetNet (dry)' if self.dry else model_dir.name} batch 1 fp32"
        for method, row in results.items():
            self.add("speculative", case, method, "same_tokens", str(row["same_tokens"]), ok=row["same_tokens"],
                     note="(greedy: plain greedy's tokens)")
            for metric, unit in (("tokens_per_s", "tokens/s"), ("speedup", "x"), ("tokens_per_forward", ""),
                                 ("acceptance", "")):
                if row[metric] is not None:
                    self.add("speculative", case, method, metric, float(row[metric]), unit)

    # ----------------------------------------------------------------------------------------- output

    def write(self, out_dir: Path):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu_suite.json").write_text(json.dumps(dict(failed=self.failed, records=self.records), indent=1))
        lines = ["| section | case | method | metric | value | unit | check |", "|---|---|---|---|---|---|---|"]
        for r in self.records:
            value = f"{r['value']:.4g}" if isinstance(r["value"], float) else str(r["value"]).replace("|", "/")
            check = "" if "ok" not in r else ("ok " if r["ok"] else "**FAIL** ") + r["note"]
            lines.append(f"| {r['section']} | {r['case']} | {r['method']} | {r['metric']} | {value} | {r['unit']} "
                         f"| {check} |")
        (out_dir / "gpu_suite.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {out_dir / 'gpu_suite.json'} and {out_dir / 'gpu_suite.md'}")


def _compiled_path_taken(model) -> bool:
    """Whether ``generate()`` took transformers' compile path: ``get_compiled_call`` keeps the compiled callable on
    the model."""
    return "_compiled_call" in vars(model)


def _short(dtype):
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}[dtype]


def _relative_error(got, expected):
    """Largest absolute difference over the largest reference entry, on the finite entries (generation scores
    hold -inf for suppressed tokens); infinite where the two disagree on which entries are finite."""
    got, expected = got.double(), expected.double()
    finite = torch.isfinite(expected)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    got, expected = got[finite], expected[finite]
    return ((got - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def _run_with_grads(fn, inputs, grad_out):
    """``fn(**inputs)`` and the gradient of ``<output, grad_out>`` in every floating input: ``{name: tensor}``
    with ``out`` for the output."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    out = fn(**leaves)
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out)
    return dict(out=out.detach(), **{f"d{k}": g for k, g in zip(leaves, grads)})


def _doubles(**tensors):
    return {k: v.double() for k, v in tensors.items()}


def _optional(loader):
    try:
        return loader()
    except Exception:  # e.g. a transformers version without the function
        return None, None


def _micro_speculative_model(folder: Path) -> Path:
    """A micro DenseRetNet with a small byte-level BPE tokenizer saved in ``folder`` (the dry run's stand-in for a
    trained model); returns ``folder``."""
    sys.path.insert(0, str(HERE.parent / "examples"))
    import corpus
    from hf_densessm import DenseRetNetConfig, DenseRetNetForCausalLM

    tokenizer = corpus.train_tokenizer([(corpus.stdlib_root() / "textwrap.py").read_text()], 300)
    torch.manual_seed(0)
    config = DenseRetNetConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=4,
                               num_attention_heads=2, query_key_dim=16)
    DenseRetNetForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _small_configs(dry, **overrides):
    """DenseMamba and DenseRetNet with the dense connection on, small enough to compare two backends quickly."""
    from hf_densessm import DenseMambaConfig, DenseRetNetConfig

    vocab, layers = (97, 2) if dry else (1024, 4)
    hidden = 32 if dry else 256
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, **{"dense_layers": 2, **overrides})
    return {
        "densemamba": DenseMambaConfig(state_size=8 if dry else 16, **common),
        "denseretnet": DenseRetNetConfig(num_attention_heads=2, query_key_dim=16 if dry else 128, **common),
    }


def _preset_configs(dry, **overrides):
    """DenseMamba-360M and DenseRetNet-350M (the paper's Table 2 / 3 sizes) with ``overrides`` (e.g.
    ``dense_layers=0``); in a dry run, tiny stand-ins."""
    from hf_densessm import DenseMambaConfig, DenseRetNetConfig

    if dry:
        small = _small_configs(True, **overrides)
        return {"DenseMamba (dry)": small["densemamba"], "DenseRetNet (dry)": small["denseretnet"]}
    return {"DenseMamba-360M": DenseMambaConfig.from_preset("densemamba-360m", **overrides),
            "DenseRetNet-350M": DenseRetNetConfig.from_preset("denseretnet-350m", **{"dropout": 0.0, **overrides})}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=HERE / "results", help="folder for gpu_suite.json / .md")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the plumbing only")
    parser.add_argument("--sections", nargs="+", default=None,
                        help="run only these sections (environment always runs): kernel-correctness model-parity "
                             "kernels training decode speculative")
    parser.add_argument("--speculative-model", type=Path, default=HERE.parent / "outputs" / "denseretnet-600",
                        help="a trained model folder for the speculative section")
    args = parser.parse_args(argv)
    import hf_densessm  # noqa: F401  (registers the models with transformers' Auto classes)

    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--dry-run needs TRITON_INTERPRET=1 set before triton is imported (run this file as a script)")
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: run on a machine with an NVIDIA GPU, or pass --dry-run")
    else:
        device = torch.device("cuda")
    suite = Suite(device, args.dry_run, args.speculative_model)
    sys.path.insert(0, str(HERE))
    from bench_cpu import set_recompile_limit  # the same limits as the CPU benchmark

    set_recompile_limit(RECOMPILE_LIMIT)
    sections = {"kernel-correctness": suite.kernel_correctness, "model-parity": suite.model_parity,
                "kernels": suite.kernels, "training": suite.training, "decode": suite.decode,
                "speculative": suite.speculative}
    unknown = set(args.sections or ()) - set(sections)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {sorted(sections)}")
    suite.section("environment", suite.environment)
    for name, fn in sections.items():
        if args.sections is None or name in args.sections:
            suite.section(name, fn)
    suite.write(args.out_dir)
    return 1 if suite.failed else 0


if __name__ == "__main__":
    sys.exit(main())
