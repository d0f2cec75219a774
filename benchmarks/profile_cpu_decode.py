"""Where a compiled CPU decoding step's time goes, per generated token, against the machine's read bandwidth.

Batch-1 decoding in float32 reads every weight once per token, so its floor is weight bytes / read bandwidth, plus
the per-token work of ``generate()`` itself, which every model pays. This script splits the time of one token of the
plain greedy ``generate()`` call (docs/benchmarks.md) of each model into parts, each measured, so that a change can be
judged by the part it removes and the distance to the floor is known::

    python benchmarks/profile_cpu_decode.py --out benchmarks/results/cpu_decode_profile.json

Per model (``bench_cpu.build_models()``: 30M presets, vocabulary 32000, one seed; the ``torch.compile`` step,
``compile_decode_step(implementation="torch_compile")``, on for the DenseSSM models: this script splits that step,
whose parts are PyTorch's; DenseMamba's C kernel step, the float32 default since run Y, is timed by
``bench_cpu.py``), after a ``--prompt-len`` prefill, medians over ``--repeats`` rounds in which the models take
turns (each measured in a block of steps, so its weights are as warm in the cache as in ``generate()``):

- ``generate_ms``: one token of ``generate()``: (time of 1 + ``--new-tokens`` new tokens - time of 1 new token)
  / ``--new-tokens`` (the prefill cancels out);
- ``model_call_ms``: ``model(input_ids=token, <cache>=cache, use_cache=True)``, the step ``generate()`` makes;
- ``compiled_fn_ms``: the compiled function alone (PyTorch's frame entry and guard check, then the graph);
- derived, medians of the per-round differences: ``generate_loop_ms`` = generate - model call (``generate()``'s
  own work: logits processing, stopping criteria, ``prepare_inputs_for_generation``), ``wrapper_ms`` = model call -
  compiled function (this package's checks around the step and the output object);
- from ``torch.profiler`` over ``--profile-steps`` steps of a second copy compiled with Inductor's per-kernel
  profiling (``cpp.enable_kernel_profile``): ``guard_check_ms`` (PyTorch's "TorchDynamo Cache Lookup"),
  ``graph_ms`` (the compiled graph), ``products_ms`` (its matrix products: the weights above
  ``SMALL_WEIGHT_NUMEL`` elements, handed to the BLAS), ``fused_loops_ms`` (Inductor's generated C++ loops: the
  small weights, the convolution, the scan step, the dense connection), ``driver_ms`` = graph - products - fused
  loops (the graph's own driver between kernels: allocations, argument wrapping, and the profiler's records);
- ``products_read_gb_per_s``: the products' weight bytes over their time, next to the read bandwidth probe
  (``bench_cpu.Bandwidth``: the fastest sum over a ``--bandwidth-mib`` buffer, 4x the last-level cache);
- ``floor_ms``: every weight byte once (a tied LM head once, one row of an untied input-embedding table) over the
  read bandwidth, plus ``generate_loop_ms``; ``bound_vs_anchor``: transformers' Mamba's ``generate_ms`` over
  ``floor_ms``, the largest speed-up against it any step of this size could show here.

``--dry-run`` runs the tiny presets with a few tokens and steps: it checks the plumbing (CI), not the figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_densessm.modeling.cache import cache_field, output_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import DTYPES, MAMBA, Bandwidth, build_models, environment, weight_bytes_per_token  # noqa: E402

#: Profiler event names of the compiled graph's matrix products (cpp_wrapper's ``aoti_torch_cpu_*`` shims, or the
#: ATen ops a Python wrapper calls).
PRODUCT_EVENT = re.compile(r"^(aoti_torch_cpu_|aten::)(mm|addmm|mv|addmv|bmm|baddbmm|linear)(_out)?$")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default: none)")
    parser.add_argument("--models", nargs="+", default=["DenseMamba m=0", "DenseMamba m=4"],
                        help="DenseSSM names from bench_cpu.build_models(); transformers' Mamba is always the anchor")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per timed generate() call")
    parser.add_argument("--steps", type=int, default=128, help="steps per timed block of model calls")
    parser.add_argument("--profile-steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bandwidth-mib", type=int, default=1920)
    parser.add_argument("--dry-run", action="store_true", help="tiny presets, few tokens: checks the plumbing only")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.prompt_len, args.new_tokens, args.steps, args.profile_steps, args.repeats = 8, 3, 3, 2, 1
        args.bandwidth_mib = 16
    return args


class Stepper:
    """One model after a prefill: its decoding step through ``model(...)`` and (compiled models) through the
    compiled function alone, each on the same cache, whose states keep advancing (the step's cost does not depend
    on the position)."""

    def __init__(self, model, prompt):
        self.model = model
        with torch.inference_mode():
            outputs = model(prompt, use_cache=True)
        # the output's cache field is also the keyword the model takes it under, in every transformers release
        self.keyword = cache_field(type(outputs))
        self.cache = output_cache(outputs)
        self.token = outputs.logits[:, -1:].argmax(-1)
        self.compiled = model.__dict__.get("_compile_decode_step", False)

    def call(self):
        return self.model(input_ids=self.token, use_cache=True, **{self.keyword: self.cache})

    def compiled_fn(self):
        return self.model._compiled_decode_fn()(self.model, self.token, self.cache)


def block_ms(fn, steps: int) -> float:
    """Milliseconds per call over ``steps`` calls in a row, after 3 untimed ones."""
    with torch.inference_mode():
        for _ in range(3):
            fn()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
    return (time.perf_counter() - start) / steps * 1e3


def generate_ms(model, prompt, new_tokens: int) -> float:
    """Milliseconds per token of the plain greedy ``generate()`` call, the prefill cancelled out."""
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=1, **kwargs)
        one = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=1 + new_tokens, **kwargs)
        many = time.perf_counter() - start
    made = out.shape[1] - prompt.shape[1] - 1  # fewer should the model stop at its EOS token
    return (many - one) / max(made, 1) * 1e3


def kernel_profile(model, prompt, steps: int) -> dict:
    """The compiled step's parts (ms per step, medians over ``steps`` profiled steps) from a copy of ``model``
    compiled with Inductor's per-kernel profiler records."""
    from torch.profiler import profile

    profiled = copy.deepcopy(model).compile_decode_step(implementation="torch_compile")
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        stepper = Stepper(profiled, prompt)
        block_ms(stepper.call, 3)  # compiles, with the records
    with torch.inference_mode(), profile() as prof:
        for _ in range(steps):
            stepper.call()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    graphs = [e for e in events if e.name.startswith("## Call CompiledFxGraph")]
    lookups = [e for e in events if e.name == "TorchDynamo Cache Lookup"]
    parts = {"graph_ms": [], "products_ms": [], "fused_loops_ms": [], "products": []}
    for graph in graphs:
        inner = [e for e in events
                 if graph.time_range.start <= e.time_range.start and e.time_range.end <= graph.time_range.end]
        products = [e for e in inner if PRODUCT_EVENT.match(e.name)]
        parts["graph_ms"].append(graph.cpu_time_total / 1e3)
        parts["products_ms"].append(sum(e.cpu_time_total for e in products) / 1e3)
        parts["fused_loops_ms"].append(sum(e.cpu_time_total for e in inner if "cpp_fused" in e.name) / 1e3)
        parts["products"].append(len(products))
    if not graphs:
        raise RuntimeError("the profiler saw no compiled graph: the compiled step did not run")
    row = {key: statistics.median(values) for key, values in parts.items()}
    row["driver_ms"] = row["graph_ms"] - row["products_ms"] - row["fused_loops_ms"]
    row["guard_check_ms"] = statistics.median(e.cpu_time_total for e in lookups) / 1e3 if lookups else 0.0
    return row


def product_weight_bytes(model) -> int:
    """Bytes of the weights the compiled step hands to matrix-product calls: every ``nn.Linear`` weight above
    ``SMALL_WEIGHT_NUMEL`` elements (smaller ones are fused loops, see ``decode_linear``), shared ones once."""
    from hf_densessm.modeling.decode import SMALL_WEIGHT_NUMEL

    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.numel() > SMALL_WEIGHT_NUMEL:
            if module.weight.data_ptr() not in seen:
                seen.add(module.weight.data_ptr())
                total += module.weight.numel() * module.weight.element_size()
    return total


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    built = build_models(vocab_size=2048 if args.dry_run else 32000, size="tiny" if args.dry_run else "30m")
    unknown = [name for name in args.models if name not in built or name == MAMBA]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {[n for n in built if n != MAMBA]}")
    models = {MAMBA: built[MAMBA].to(dtype)}  # the anchor: transformers' Mamba with DenseMamba m=0's weights
    for name in args.models:
        models[name] = built[name].to(dtype).compile_decode_step(implementation="torch_compile")
    prompt = torch.randint(3, models[MAMBA].config.vocab_size, (1, args.prompt_len),
                           generator=torch.Generator().manual_seed(1))
    steppers = {name: Stepper(model, prompt) for name, model in models.items()}
    bandwidth = Bandwidth(args.bandwidth_mib * 2**20)
    samples = {name: {"generate_ms": [], "model_call_ms": [], "compiled_fn_ms": []} for name in models}
    for name, model in models.items():  # untimed: compiles each step, warms generate()
        generate_ms(model, prompt, 2)
    for _ in range(args.repeats):
        bandwidth()
        for name, model in models.items():
            stepper = steppers[name]
            samples[name]["generate_ms"].append(generate_ms(model, prompt, args.new_tokens))
            samples[name]["model_call_ms"].append(block_ms(stepper.call, args.steps))
            if stepper.compiled:
                samples[name]["compiled_fn_ms"].append(block_ms(stepper.compiled_fn, args.steps))
    read_bw = bandwidth.read_bytes_per_s()
    rows = {}
    for name, model in models.items():
        taken = samples[name]
        row = {key: statistics.median(values) for key, values in taken.items() if values}
        # differences of two timings: the median of the per-repeat differences (measured back to back)
        row["generate_loop_ms"] = statistics.median(a - b for a, b in zip(taken["generate_ms"], taken["model_call_ms"]))
        weights = weight_bytes_per_token(model)
        row["weight_bytes_per_token"] = weights
        row["floor_ms"] = weights / read_bw * 1e3 + row["generate_loop_ms"]
        if steppers[name].compiled:
            pairs = zip(taken["model_call_ms"], taken["compiled_fn_ms"])
            row["wrapper_ms"] = statistics.median(a - b for a, b in pairs)
            row.update(kernel_profile(model, prompt, args.profile_steps))
            row["product_weight_bytes"] = product_weight_bytes(model)
            if row["products_ms"] > 0:  # the tiny presets have no weight above SMALL_WEIGHT_NUMEL
                row["products_read_gb_per_s"] = row["product_weight_bytes"] / (row["products_ms"] / 1e3) / 1e9
        rows[name] = row
    anchor = rows[MAMBA]["generate_ms"]
    for name, row in rows.items():
        row["speedup_vs_anchor"] = anchor / row["generate_ms"]
        row["bound_vs_anchor"] = anchor / row["floor_ms"]
    result = {
        "environment": environment(), "dtype": args.dtype, "dry_run": args.dry_run, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "read_bandwidth_gb_per_s": read_bw / 1e9, "models": rows,
    }
    print(f"read bandwidth {read_bw / 1e9:.1f} GB/s ({args.bandwidth_mib} MiB sum, best of {args.repeats}); "
          f"{args.dtype}, ms per generated token")
    columns = ["generate_ms", "model_call_ms", "generate_loop_ms", "compiled_fn_ms", "wrapper_ms", "guard_check_ms",
               "graph_ms", "products_ms", "products_read_gb_per_s", "fused_loops_ms", "driver_ms", "floor_ms",
               "speedup_vs_anchor", "bound_vs_anchor"]
    print("| model | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.3g}" if c in row else "—" for c in columns) + " |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
