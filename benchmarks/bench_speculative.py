"""Speculative decoding on the CPU: plain greedy ``generate()`` against prompt lookup and assisted decoding, side by
side in one process, on an input-grounded task (docs/design.md §5, "Speculative decoding").

The task: a standard-library source file that ``examples/pretrain.py`` held out of training (nobody here wrote it)
is given in the prompt, then its first lines again; the model writes on (a model that copies writes the file
again). Each method generates exactly ``--new-tokens`` tokens greedily at batch 1 (``eos_token_id=None``: the
end-of-sequence token is ignored, as throughput benchmarks do, e.g. vLLM's ``ignore_eos``; ``min_new_tokens`` would
add a logits processor that assisted generation runs on every verified position, drafted or not: 0.15 s of 0.59 s in
one profiled call), the methods taking turns within each repeat (``bench_cpu.interleaved_times``); speed-ups are
medians of back-to-back pairs. Reported per method: tokens/s, the speed-up, whether the tokens are plain greedy's,
tokens per forward of the target model, the acceptance rate (accepted / drafted tokens), and how many new tokens
copy the file. The assistant is the checkpoint's first ``--assistant-layers`` blocks with its embeddings, final norm
and head (a layer-skipping draft: no second model is trained here).

It also times the rollback against its alternative, on the prompt's cache: a verification forward of the largest
``--lookup-tokens`` + 1 tokens, ``crop`` taking half of them back (the recorded layers' own recurrence re-run over
the kept tokens), and the second forward of the kept tokens that snapshot-and-recompute would run instead.

Run from the repository root, after ``python examples/pretrain.py`` (its default output folder)::

    python benchmarks/bench_speculative.py
    python benchmarks/bench_speculative.py --model-dir outputs/densemamba-tiny --new-tokens 128 --repeats 3

``--device cuda`` runs it on a GPU (``benchmarks/gpu_suite.py``'s ``speculative`` section): there ``generate()``
compiles plain greedy's decoding step by default (CUDA graphs), so a row ``plain greedy, disable_compile`` adds the
eager one; speculative forwards run eagerly (a recording cache is not compileable, docs/design.md §5).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from bench_cpu import environment, interleaved_times, paired_ratio  # noqa: E402
from corpus import is_held_out, stdlib_root  # noqa: E402
from hf_densessm.modeling.cache import DenseSSMCache  # noqa: E402  (importing hf_densessm registers the Auto classes)

DEFAULT_FILE = "code.py"  # held out of examples/pretrain.py's training (corpus.is_held_out)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("outputs/densemamba-tiny"))
    parser.add_argument("--file", default=DEFAULT_FILE, help="standard-library file, relative to its root")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens of the file given in the prompt")
    parser.add_argument("--restart-tokens", type=int, default=16, help="its first tokens, given again")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--lookup-tokens", type=int, nargs="+", default=[5, 10],
                        help="prompt_lookup_num_tokens: one row per value")
    parser.add_argument("--assistant-layers", type=int, default=None, help="default: half the blocks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: adds plain greedy with disable_compile=True")
    return parser.parse_args(argv)


def layer_skipping_assistant(model, layers: int):
    """The first ``layers`` blocks of ``model`` with its embeddings, final norm and head (weights shared)."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    assistant = type(model)(config).to(model.device, model.dtype).eval()
    assistant.load_state_dict(model.state_dict(), strict=False)  # the blocks beyond `layers` are left out
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
    return assistant


class TargetForwards:
    """Counts the target's forwards and the tokens each is fed (a forward pre-hook)."""

    def __init__(self, model):
        self.fed = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.fed.append(ids.shape[1])


def draft_statistics(model, prompt, kwargs) -> dict:
    """Forwards of the target, drafted and accepted tokens of one run of ``generate(prompt, **kwargs)``. A plain
    run (no drafts) is not hooked, as its decoding step may be compiled: one forward per new token."""
    drafts = "prompt_lookup_num_tokens" in kwargs or "assistant_model" in kwargs
    counter = TargetForwards(model) if drafts else None
    try:
        with torch.inference_mode():
            out = model.generate(prompt, **kwargs)
    finally:
        if counter is not None:
            counter.handle.remove()
    new = out.shape[1] - prompt.shape[1]
    if counter is None:
        return {"forwards": new, "drafted": 0, "accepted": 0, "tokens": out}
    forwards = len(counter.fed)
    drafted = counter.fed[0] - prompt.shape[1] + sum(fed - 1 for fed in counter.fed[1:])
    accepted = new - forwards
    return {"forwards": forwards, "drafted": drafted, "accepted": accepted, "tokens": out}


def rollback_costs(model, prompt, draft: int, repeats: int) -> dict:
    """Median seconds of a verification forward of ``draft + 1`` tokens on the prompt's cache, of ``crop`` taking
    half of them back, and of a forward of the kept tokens (what snapshot-and-recompute runs instead)."""
    ids = prompt[:, -(draft + 1) :]
    kept = (draft + 1) - (draft + 1) // 2
    times = {"verify": [], "crop": [], "recompute": []}
    clock = _clock(prompt.device)
    with torch.inference_mode():
        for _ in range(repeats + 1):
            cache = DenseSSMCache(config=model.config)
            model(prompt[:, : -(draft + 1)], cache=cache, use_cache=True, logits_to_keep=1)
            cache.activate_past_recording()
            start = clock()
            model(ids, cache=cache, use_cache=True)
            middle = clock()
            cache.crop(-((draft + 1) // 2))
            end = clock()
            model(ids[:, :kept], cache=DenseSSMCache(config=model.config), use_cache=True)
            recomputed = clock() - end
            for name, seconds in (("verify", middle - start), ("crop", end - middle), ("recompute", recomputed)):
                times[name].append(seconds)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def _clock(device):
    """``time.perf_counter`` after the device's queued work (a CUDA synchronize first)."""
    def clock():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


def _synchronized(device, fn):
    """``fn()``, then :func:`_clock`'s wait for the device's queued work (so that a timer stops after it)."""
    fn()
    _clock(device)()


def main(argv=None) -> dict:
    """Prints the table and the rollback's costs; returns ``{method: {"tokens_per_s", "speedup", "same_tokens",
    "acceptance", "copied"}}``."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not is_held_out(f"stdlib/{args.file}"):
        print(f"note: stdlib/{args.file} was in examples/pretrain.py's training text (not held out)")
    text = (stdlib_root() / args.file).read_text(encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(device).eval()
    file_ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
    prompt = torch.cat([file_ids[:, : args.prompt_tokens], file_ids[:, : args.restart_tokens]], dim=1)
    layers = args.assistant_layers or max(1, model.config.num_hidden_layers // 2)
    assistant = layer_skipping_assistant(model, layers)
    base = dict(do_sample=False, max_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    methods = {
        "plain greedy": base,
        **({"plain greedy, disable_compile": dict(base, disable_compile=True)} if device.type == "cuda" else {}),
        **{f"prompt lookup ({k})": dict(base, prompt_lookup_num_tokens=k) for k in args.lookup_tokens},
        f"assisted ({layers}-block draft)": dict(base, assistant_model=assistant),
    }
    stats = {name: draft_statistics(model, prompt, kwargs) for name, kwargs in methods.items()}
    with torch.inference_mode():
        times = interleaved_times(
            {name: partial(_synchronized, device, partial(model.generate, prompt, **kwargs))
             for name, kwargs in methods.items()},
            args.warmup, args.repeats,
        )
    plain = stats["plain greedy"]["tokens"]
    truth = file_ids[0, args.restart_tokens : args.restart_tokens + args.new_tokens]
    print(f"# {args.model_dir} ({model.config.model_type}, {model.num_parameters() / 1e6:.1f}M parameters), "
          f"stdlib/{args.file}: prompt {prompt.shape[1]} tokens, {args.new_tokens} new, batch 1, float32, {device}")
    print(f"# {environment()}")
    print("| method | tokens/s | speed-up | same tokens | tokens per target forward | acceptance | copies the file |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    for name in methods:
        s, seconds = stats[name], statistics.median(times[name])
        new = s["tokens"][0, prompt.shape[1] :]
        results[name] = row = {
            "tokens_per_s": args.new_tokens / seconds, "speedup": paired_ratio(times, "plain greedy", name),
            "same_tokens": torch.equal(s["tokens"], plain), "tokens_per_forward": args.new_tokens / s["forwards"],
            "acceptance": s["accepted"] / s["drafted"] if s["drafted"] else None,
            "copied": (new[: truth.numel()] == truth[: new.numel()]).float().mean().item(),
        }
        acceptance = f"{row['acceptance']:.0%} of {s['drafted']}" if s["drafted"] else "-"
        print(f"| {name} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | {'yes' if row['same_tokens'] else 'NO'} "
              f"| {row['tokens_per_forward']:.2f} | {acceptance} | {row['copied']:.0%} |")
    lookup = max(args.lookup_tokens)
    costs = rollback_costs(model, prompt, lookup, args.repeats)
    print(f"\nrollback of {(lookup + 1) // 2} of {lookup + 1} verified tokens: verification "
          f"forward {costs['verify'] * 1e3:.1f} ms, crop (recurrence re-run) {costs['crop'] * 1e3:.1f} ms, "
          f"recomputing the kept tokens instead {costs['recompute'] * 1e3:.1f} ms")
    return results


if __name__ == "__main__":
    main()
