"""Where a batch-1 CPU decoding step's time goes: the matrix products of the ``nn.Linear`` layers against the rest.

``bench_cpu.py`` compares ``generate()`` of the DenseSSM models with transformers' Mamba. Both models call the same
``nn.Linear`` layers with the same weights; at batch 1 each is a matrix-vector product that ``torch`` hands to its
BLAS. This script measures how much of each model's time per token those products take, so that a speed-up target
can be checked against what is left once they are paid::

    python benchmarks/profile_cpu_decode.py --threads 2 --out benchmarks/results/cpu_decode_profile.json

For each model (the 30M presets of ``bench_cpu.py``, random weights; transformers' Mamba has DenseMamba m=0's) and
dtype, it times ``generate()`` (``bench_cpu.GENERATE_CALL``, the plain greedy call, under ``torch.inference_mode``)
of ``--new-tokens`` tokens against one token, the models taking turns, and takes the median difference per token;
then it profiles one call with ``torch.profiler`` and sums the self time of ``aten::mm`` / ``aten::addmm`` (the
linear layers and the LM head) per token made. ``bound`` is transformers' Mamba's time per token over the model's
time in those products: the speed-up the model would have if everything else it does took no time.
``--compiled`` adds DenseMamba m=0 with ``compile_decode_step()`` (transformers' generation compile path).
``lm_head_ms`` times one call of the LM head (transformers' Mamba's, the same shape in every model) against one read
of its weight.

``--ops`` counts instead (no timing): the operators one eager decoding step (one token after a ``--prompt-len``
prefill, float32) dispatches per block and outside the blocks, for the 30M presets (``--size``) of both families at
m = 0 and the default m (:func:`decode_ops`; tests/models/test_decode_ops.py bounds them)::

    python benchmarks/profile_cpu_decode.py --ops --out benchmarks/results/cpu_decode_ops.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

from hf_densessm.modeling.cache_names import output_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import GENERATE_CALL, MAMBA, build_models, environment  # noqa: E402

GEMM_OPS = ("aten::mm", "aten::addmm")


_NO_KERNEL = (torch.ops.aten._unsafe_view.default,)  # a view of a fresh tensor (nn.Linear's reshapes)


class _OpCounter(TorchDispatchMode):
    """Counts the operators dispatched, per ``where`` (a block's index, ``None`` outside the blocks): the package's
    ``hf_densessm`` ops are counted as the operators their bodies run (what ``torch.compile`` decomposes them into;
    a C++ or Triton body counts as one); views (``OpOverload.is_view``, ``_unsafe_view``) apart from the rest, ops
    that return no tensor (``promote_types``) not at all."""

    def __init__(self):
        super().__init__()
        self.where, self.counts = None, collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = OPDEFS.get(func._schema.name) if func.namespace == "hf_densessm" else None
        if body is not None:
            with self:
                return body._abstract_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) for t in (out if isinstance(out, (tuple, list)) else (out,))):
            self.counts[self.where][("views" if func.is_view or func in _NO_KERNEL else "ops", str(func))] += 1
        return out


def decode_ops(model, prompt_len=8, attention_mask=False):
    """The operators of one eager decoding step of ``model`` (one token after a ``prompt_len``-token prefill, batch
    1, no gradients; ``attention_mask``: pass an all-ones mask): ``{"per_block": [{"ops", "views"} per block],
    "outside": {...}}`` (the embedding, the final norm and head, the shared per-forward terms)."""
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_len + 1), generator=torch.Generator().manual_seed(0))
    mask = {"attention_mask": torch.ones_like(ids)} if attention_mask else {}
    counter, layers = _OpCounter(), model.base_model.layers
    hooks = [h for i, layer in enumerate(layers) for h in (
        layer.register_forward_pre_hook(lambda *_, i=i: setattr(counter, "where", i)),
        layer.register_forward_hook(lambda *_: setattr(counter, "where", None)))]
    try:
        with torch.no_grad():
            cache = output_cache(model(ids[:, :-1], use_cache=True))
            with counter:
                model(ids[:, -1:], cache=cache, use_cache=True, **mask)
    finally:
        for hook in hooks:
            hook.remove()
    def totals(counts):
        return {kind: sum(n for (k, _), n in counts.items() if k == kind) for kind in ("ops", "views")} | {
            "by_op": {name: n for (k, name), n in sorted(counts.items()) if k == "ops"}}

    return {"per_block": [totals(counter.counts[i]) for i in range(len(layers))], "outside": totals(counter.counts[None])}


def count_ops(args, built):
    """``--ops``: :func:`decode_ops` of the DenseSSM models, printed and returned as rows."""
    rows = []
    for name, model in built.items():
        if name == MAMBA:
            continue
        counts = decode_ops(model, args.prompt_len)
        ops = [block.get("ops", 0) for block in counts["per_block"]]
        views = [block.get("views", 0) for block in counts["per_block"]]
        rows.append(dict(model=name, layers=len(ops), ops_per_block=ops, views_per_block=views,
                         outside=counts["outside"]))
        print(f"{name:18s} ops per block: first {ops[0]}, max {max(ops)}, mean {sum(ops) / len(ops):.1f} "
              f"(+ views mean {sum(views) / len(views):.1f}); outside the blocks {counts['outside']['ops']} "
              f"(+ {counts['outside']['views']} views)")
    return rows


def per_token_ms(models, prompt, new_tokens, repeats):
    """Median over ``repeats`` of (time of up to ``new_tokens + 1`` new tokens - time of 1) / the tokens the first
    call made beyond the second's (fewer than ``new_tokens`` if the model's EOS came first), in ms."""
    def once(model, n):
        start = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, **GENERATE_CALL)
        return time.perf_counter() - start, out.shape[1]

    diffs = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            (long_s, long_len), (short_s, short_len) = once(model, new_tokens + 1), once(model, 1)
            diffs[name].append((long_s - short_s) / max(long_len - short_len, 1) * 1e3)
    return {name: statistics.median(d) for name, d in diffs.items()}


def gemm_ms(model, prompt, new_tokens, top=8):
    """Self time of :data:`GEMM_OPS` per token, the total profiled self time per token, and the ``top`` other ops
    by self time per token, in ms, over one ``generate()`` of ``new_tokens`` new tokens (the prompt's prefill
    included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             **GENERATE_CALL)
    new_tokens = out.shape[1] - prompt.shape[1]
    events = prof.key_averages()
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS) / 1e3 / new_tokens
    others = sorted((e for e in events if e.key not in GEMM_OPS), key=lambda e: -e.self_cpu_time_total)[:top]
    return (gemm, sum(e.self_cpu_time_total for e in events) / 1e3 / new_tokens,
            {e.key: e.self_cpu_time_total / 1e3 / new_tokens for e in others})


def lm_head_ms(model, repeats=50):
    """Median time of one batch-1 call of ``model.lm_head`` (the module, one hidden vector) and of one read of its
    weight (``torch.sum``), in ms: how far the BLAS's matrix-vector product is from reading the weight once."""
    x = torch.randn(1, 1, model.config.hidden_size, dtype=model.lm_head.weight.dtype)
    times = {"call": [], "read": []}
    for _ in range(repeats):
        for key, fn in (("call", lambda: model.lm_head(x)), ("read", lambda: model.lm_head.weight.sum())):
            start = time.perf_counter()
            fn()
            times[key].append((time.perf_counter() - start) * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--compiled", action="store_true", help="add DenseMamba m=0 with compile_decode_step()")
    parser.add_argument("--ops", action="store_true", help="count each block's operators of one step; no timing")
    parser.add_argument("--out", default="benchmarks/results/cpu_decode_profile.json")
    # For CI: the package's tiny presets instead of the 30M ones (a plumbing check, not a measurement).
    parser.add_argument("--size", choices=("30m", "tiny"), default="30m", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    built = build_models(size=args.size)
    if args.ops:
        results = {"command": "python benchmarks/profile_cpu_decode.py " + " ".join(argv or sys.argv[1:]),
                   "rows": count_ops(args, built)}
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        return results
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, built[MAMBA].config.vocab_size, (1, args.prompt_len), generator=generator)
    results = {"command": "python benchmarks/profile_cpu_decode.py " + " ".join(argv or sys.argv[1:]),
               "machine": environment(), "threads": args.threads, "new_tokens": args.new_tokens, "rows": []}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        models = {name: built[name].to(dtype) for name in (MAMBA, "DenseMamba m=0", "DenseRetNet m=0")}
        if args.compiled:
            import copy

            models["DenseMamba m=0 compiled"] = copy.deepcopy(models["DenseMamba m=0"]).compile_decode_step()
        with torch.inference_mode():
            for model in models.values():  # warm up (the compiled row compiles here)
                for n in (1, args.new_tokens + 1):
                    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, **GENERATE_CALL)
            wall = per_token_ms(models, prompt, args.new_tokens, args.repeats)
            head = lm_head_ms(models[MAMBA])
            results.setdefault("lm_head_ms", {})[dtype_name] = head
            print(f"{dtype_name:9s} LM head ({tuple(models[MAMBA].lm_head.weight.shape)}) call {head['call']:.3f} ms, "
                  f"read of its weight {head['read']:.3f} ms")
            for name, model in models.items():
                gemm, profiled, others = gemm_ms(model, prompt, args.new_tokens)
                row = dict(model=name, dtype=dtype_name, ms_per_token=wall[name], gemm_ms_per_token=gemm,
                           profiled_ms_per_token=profiled, gemm_share_of_profiled=gemm / profiled,
                           speedup_vs_mamba=wall[MAMBA] / wall[name], bound_vs_mamba=wall[MAMBA] / gemm,
                           top_other_ops_ms_per_token=others)
                results["rows"].append(row)
                print(f"{dtype_name:9s} {name:26s} {wall[name]:7.3f} ms/token, GEMM {gemm:6.3f} ms/token "
                      f"({row['gemm_share_of_profiled']:.0%} of profiled), {row['speedup_vs_mamba']:.2f}x Mamba, "
                      f"bound {row['bound_vs_mamba']:.2f}x")
        for model in built.values():
            model.float()
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
