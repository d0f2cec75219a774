"""Does the dense connection help? A controlled, seeded, paired comparison on real text (issue 13).

Trains small models of five variants on the same data, with the same tokens, and reports their held-out loss:

================  ==============================================================
``mamba``         DenseMamba with ``dense_layers=0``: exactly transformers' Mamba
``dm-input``      DenseMamba, ``dense_target="input"``, m = 4 (fuses the scan inputs u, B; docs/design.md §4)
``dm-state``      DenseMamba, ``dense_target="state"``, m = 4 (the paper's Eq. 14, fuses the states)
``retnet``        DenseRetNet with ``dense_layers=0``: RetNet with GAU blocks
``denseretnet``   DenseRetNet, m = 2 (Eq. 20-23)
================  ==============================================================

(``--variants`` also accepts ``denseretnet-m1`` and ``denseretnet-m4``, the other rows of the paper's Table 7.)

How it is controlled:

- **One corpus, one tokenizer.** Python's standard-library sources plus ``pydoc_data.topics`` (``corpus.py``), whole
  files held out; one byte-level BPE trained on training files only; blocks packed with ``datasets``. The tokenized
  data are cached in ``<output-dir>/data`` and shared by every run.
- **Paired seeds.** Seed ``s`` fixes, for every variant, (a) the data order (``Trainer``'s ``data_seed``) and (b) the
  initial weights of everything the variants of a family share: the family's base model is built under seed ``s``
  and its weights are copied into each dense variant built under seed ``s``, so a dense variant starts as its base
  plus its (seeded) gates and norms. Dropout is 0, so nothing else draws random numbers.
- **Equal tokens**: every run takes ``--steps`` optimizer steps of ``--batch-size`` x ``--block-size`` tokens (less
  than one pass over the training text at the defaults: no token is seen twice), with one optimizer recipe (the main
  job's small-preset recipe: AdamW, peak 4e-3, cosine decay after 20% warm-up, weight decay 0.1, betas (0.9, 0.95),
  clipping 1.0) for every variant.
- **Similar size per family.** The dense variants add only their gates (and DenseRetNet's k/v norms) to the base; the
  script builds every model before training, prints the parameter counts and refuses to run if a dense variant's
  count is more than ``MAX_PARAMETER_GAP`` (3%) away from its base's.
- **Held-out evaluation** every ``--eval-every`` steps (and before training) on the same fixed sample of held-out
  blocks for every run.

What it reports (printed, and in ``<output-dir>/results.json``): per variant the parameter count, the final held-out
loss (nats/token) mean +- std over seeds and per seed, seconds per optimizer step (evaluation excluded); per family
the paired dense-minus-base differences (and DenseMamba state-minus-input): mean, std, per seed, standard error and a
95% t-interval; and, plainly, whether this budget resolves a 0.03-nat difference (the size of the paper's dense-vs-base
effects, Tables 5 and 7). ``<output-dir>/held_out_loss.png`` plots the held-out curves (mean over seeds, with the
seeds' min-max band) and the paired differences.

Budget of the default run (hidden 256, 4 layers, vocabulary 8192, 160 steps of 8 x 256 tokens, 3 seeds), measured
on a 2-core Intel Xeon VM that other jobs were sharing, so as single-thread CPU time per optimizer step: Mamba 1.85 s,
DenseMamba input 1.9 s, DenseMamba state 3.35 s, RetNet 0.84 s, DenseRetNet 0.95 s, i.e. 8.9 s for the five variants;
x 160 steps x 3 seeds = 71 min, plus 6 held-out evaluations of 128 blocks per run (about 13 min) and data and set-up
(about 2 min): about 86 min if the second core gave nothing, so the margin is what it gives. Each run trains on 328k
tokens, an eighth of the training text.

Run it from the repository root::

    python examples/compare.py                 # the full experiment: 5 variants x 3 seeds, about 90 min on 2 cores
    python examples/compare.py --quick         # every configuration for a few steps on a slice: plumbing only
    python examples/compare.py --seeds 5 --steps 2000 --hidden-size 512 --device cuda   # more time or a GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from matplotlib.figure import Figure  # without pyplot: rendered by the Agg backend, no display needed
from transformers import (
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    PrinterCallback,
    default_data_collator,
    set_seed,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # corpus.py, also when this file is imported by path
import corpus  # noqa: E402

import hf_densessm  # noqa: E402,F401  (registers the DenseSSM models with the Auto classes)
from hf_densessm import DenseMambaConfig, DenseRetNetConfig  # noqa: E402

#: name -> (family, config overrides). The family's base is the variant with ``dense_layers=0``.
VARIANTS = {
    "mamba": ("densemamba", dict(dense_layers=0)),
    "dm-input": ("densemamba", dict(dense_layers=4, dense_target="input")),
    "dm-state": ("densemamba", dict(dense_layers=4, dense_target="state")),
    "retnet": ("denseretnet", dict(dense_layers=0)),
    "denseretnet": ("denseretnet", dict(dense_layers=2)),
    "denseretnet-m1": ("denseretnet", dict(dense_layers=1)),
    "denseretnet-m4": ("denseretnet", dict(dense_layers=4)),
}
DEFAULT_VARIANTS = ["mamba", "dm-input", "dm-state", "retnet", "denseretnet"]
BASES = {"densemamba": "mamba", "denseretnet": "retnet"}
#: Paired differences reported besides each dense variant minus its base: (a, b) means a - b.
EXTRA_DIFFERENCES = [("dm-state", "dm-input")]
MAX_PARAMETER_GAP = 0.03  # a dense variant's parameter count may differ from its base's by at most 3%
TARGET_NATS = 0.03  # the effect size the budget should resolve (paper Tables 5 and 7: 0.02-0.05 nats)
#: Optimizer recipe for every variant: the main job's small-preset recipe (examples/pretrain.py).
OPTIMIZER = dict(
    learning_rate=4e-3, lr_scheduler_type="cosine", warmup_steps=0.2, weight_decay=0.1, adam_beta2=0.95,
    max_grad_norm=1.0,
)
#: Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (beyond 30: 1.96).
T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]

#: Settings of ``--quick``: tiny models, a slice of the corpus, a few steps (checks the plumbing, not the result).
QUICK = dict(
    steps=4, seeds=2, hidden_size=32, layers=4, block_size=32, batch_size=4, vocab_size=300,
    eval_blocks=8, corpus_chars=200_000, tokenizer_chars=100_000,
)


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Paired, seeded comparison of Mamba, DenseMamba (input and state modes), RetNet and DenseRetNet "
        "on Python's standard-library text: held-out loss per variant, paired dense-minus-base differences, a JSON "
        "and a PNG.",
    )
    add = parser.add_argument
    add("--output-dir", type=Path, default=Path("outputs/compare"),
        help="results, plot and data cache (default: %(default)s)")
    add("--quick", action="store_true", help="every configuration for a few steps on a slice of the corpus: checks the "
        "plumbing (JSON, PNG), not the result; options given explicitly still apply")
    add("--seeds", type=int_at_least(2), help="number of seeds, 0..N-1 (default: 3; --quick: 2)")
    add("--steps", type=int_at_least(1), help="optimizer steps per run (default: 160; --quick: 4)")
    add("--eval-every", type=int_at_least(1), help="steps between held-out evaluations (default: steps // 5; "
        "--quick: steps // 2)")
    add("--eval-blocks", type=int_at_least(1), help="held-out blocks evaluated, the same fixed sample for every run "
        "(default: 128; --quick: 8)")
    add("--batch-size", type=int_at_least(1), help="sequences per optimizer step (default: 8)")
    add("--block-size", type=int_at_least(8), help="tokens per sequence (default: 256)")
    add("--hidden-size", type=int_at_least(8), help="hidden size of every model, a multiple of 8 (default: 256)")
    add("--layers", type=int_at_least(2), help="layers of every model (default: 4)")
    add("--vocab-size", type=int_at_least(corpus.MIN_VOCAB_SIZE), help="BPE vocabulary, special tokens included "
        "(default: 8192)")
    add("--variants", nargs="+", choices=list(VARIANTS), metavar="NAME",
        help=f"variants to train, of {', '.join(VARIANTS)} (default: {' '.join(DEFAULT_VARIANTS)}); "
        "a dense variant needs its family's base for the paired difference")
    add("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to train: 'auto' = CUDA if available "
        "(default: %(default)s)")
    args = parser.parse_args(argv)

    defaults = dict(
        seeds=3, steps=160, eval_blocks=128, batch_size=8, block_size=256, hidden_size=256, layers=4, vocab_size=8192,
        corpus_chars=None, tokenizer_chars=3_000_000,
    )
    if args.quick:
        defaults.update(QUICK)
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 2) if args.quick else max(1, args.steps // 5)
    args.variants = args.variants or list(DEFAULT_VARIANTS)
    if len(set(args.variants)) != len(args.variants):
        parser.error("argument --variants: a variant is named twice")
    for name in args.variants:
        base = BASES[VARIANTS[name][0]]
        if base not in args.variants:
            parser.error(f"argument --variants: {name!r} needs its base {base!r} (the paired difference is against it)")
    if args.hidden_size % 8:
        parser.error(f"argument --hidden-size: must be a multiple of 8, got {args.hidden_size}")
    if args.eval_every > args.steps:
        parser.error(f"argument --eval-every: {args.eval_every} is more than --steps {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: 'cuda' asked for, but torch sees no CUDA device")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.output_dir.exists() and not args.output_dir.is_dir():
        parser.error(f"argument --output-dir: {str(args.output_dir)!r} exists and is not a folder")
    return args


# ----------------------------------------------------------------------------------------------------
# Data (cached in the output folder, shared by every run)
# ----------------------------------------------------------------------------------------------------


def data_key(args: argparse.Namespace) -> dict:
    """Everything the tokenized data depend on; its hash names the cache folder."""
    return dict(
        python=sys.version.split()[0], stdlib=str(corpus.stdlib_root()), vocab_size=args.vocab_size,
        block_size=args.block_size, corpus_chars=args.corpus_chars, tokenizer_chars=args.tokenizer_chars,
        held_out_every=corpus.HELD_OUT_EVERY, format=1,
    )


def prepare_data(args: argparse.Namespace) -> tuple[PreTrainedTokenizerFast, Dataset, Dataset, dict]:
    """The tokenizer, the packed training blocks and the packed held-out blocks: loaded from the cache when an
    earlier run made them with the same settings, else made (corpus, split, BPE, tokenize, pack) and cached."""
    key = data_key(args)
    folder = args.output_dir / "data" / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    if (folder / "key.json").is_file():
        print(f"data: cached in {folder}")
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
        info = json.loads((folder / "key.json").read_text())["info"]
        return tokenizer, Dataset.load_from_disk(folder / "train"), Dataset.load_from_disk(folder / "held_out"), info
    documents = corpus.stdlib_documents()
    train_texts, held_out_texts = corpus.split_documents(documents)
    if args.corpus_chars is not None:  # --quick: whole files, a hashed sample of each side
        train_texts = corpus.sample_texts(train_texts, args.corpus_chars)
        held_out_texts = corpus.sample_texts(held_out_texts, args.corpus_chars // 4)
    tokenizer = corpus.train_tokenizer(corpus.sample_texts(train_texts, args.tokenizer_chars), args.vocab_size)
    train = corpus.pack_blocks(train_texts, tokenizer, args.block_size)
    held_out = corpus.pack_blocks(held_out_texts, tokenizer, args.block_size)
    info = dict(
        corpus=corpus.corpus_description(),
        documents=len(documents),
        train_documents=len(train_texts), held_out_documents=len(held_out_texts),
        train_characters=sum(map(len, train_texts)), held_out_characters=sum(map(len, held_out_texts)),
        train_tokens=len(train) * args.block_size, held_out_tokens=len(held_out) * args.block_size,
        vocab_size=len(tokenizer),
    )
    staging = folder.with_name(folder.name + ".tmp")
    tokenizer.save_pretrained(staging / "tokenizer")
    train.save_to_disk(staging / "train")
    held_out.save_to_disk(staging / "held_out")
    (staging / "key.json").write_text(json.dumps(dict(key=key, info=info), indent=2))
    if folder.exists():  # an interrupted earlier write without key.json
        import shutil

        shutil.rmtree(folder)
    staging.rename(folder)
    return tokenizer, train, held_out, info


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------


def make_config(name: str, args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast):
    """The config of variant ``name`` at the chosen size: the ``*-tiny`` presets' shapes (DenseRetNet: 2 heads,
    query/key size hidden / 2, v_factor 2) at ``--hidden-size`` and ``--layers``, dropout 0."""
    family, overrides = VARIANTS[name]
    common = dict(
        hidden_size=args.hidden_size, num_hidden_layers=args.layers, vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    if family == "densemamba":
        return DenseMambaConfig.from_preset("densemamba-tiny", **common, **overrides)
    return DenseRetNetConfig.from_preset(
        "denseretnet-tiny", **common, query_key_dim=args.hidden_size // 2, dropout=0.0, **overrides
    )


def build_model(name: str, seed: int, args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast):
    """Variant ``name`` initialized under ``seed``, with the weights it shares with its family's base copied from the
    base built under the same seed. Returns the model and the fraction of its parameters that came from the base."""
    family = VARIANTS[name][0]
    set_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(name, args, tokenizer))
    base_name = BASES[family]
    if name == base_name:
        return model, 1.0
    set_seed(seed)
    base_state = AutoModelForCausalLM.from_config(make_config(base_name, args, tokenizer)).state_dict()
    own = model.state_dict()
    shared = {k: v for k, v in base_state.items() if k in own and own[k].shape == v.shape}
    missing = set(base_state) - set(shared)
    if missing:
        raise RuntimeError(f"{name}: the base's parameters {sorted(missing)[:5]} have no counterpart")
    model.load_state_dict(shared, strict=False)
    parameters = dict(model.named_parameters())
    shared_count = sum(v.numel() for k, v in shared.items() if k in parameters)
    return model, shared_count / model.num_parameters()


def parameter_counts(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """Parameters of every variant (built once, before training), checked against its base's: within 3%."""
    counts = {}
    for name in args.variants:
        with torch.device("meta"):
            counts[name] = AutoModelForCausalLM.from_config(make_config(name, args, tokenizer)).num_parameters()
    for name, count in counts.items():
        base = counts[BASES[VARIANTS[name][0]]]
        if abs(count / base - 1) > MAX_PARAMETER_GAP:
            raise ValueError(
                f"{name} has {count:,} parameters, {count / base - 1:+.1%} against its base's {base:,}: more than "
                f"{MAX_PARAMETER_GAP:.0%} apart, so the comparison would not be at similar size. Choose a larger "
                "--hidden-size (the gates grow more slowly than the layers)."
            )
    return counts


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (forward, backward, clipping, optimizer), evaluation excluded."""

    def __init__(self):
        self.seconds: list[float] = []
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._start)


def train_one(name: str, seed: int, args, tokenizer, train: Dataset, held_out: Dataset) -> dict:
    """Train variant ``name`` under ``seed``; its held-out curve (step 0 included), final loss and step times."""
    model, shared_fraction = build_model(name, seed, args, tokenizer)
    timer = StepTimer()
    training_args = TrainingArguments(
        output_dir=str(args.output_dir / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=2 * args.batch_size,
        **OPTIMIZER,
        eval_strategy="steps",
        eval_steps=args.eval_every,
        logging_steps=args.eval_every,
        save_strategy="no",
        report_to="none",
        seed=seed,
        data_seed=seed,
        dataloader_drop_last=True,
        disable_tqdm=True,
        use_cpu=args.device == "cpu",
    )
    trainer = Trainer(
        model=model, args=training_args, data_collator=default_data_collator, train_dataset=train,
        eval_dataset=held_out, callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # one summary line per run instead of every log dict
    curve = [(0, trainer.evaluate()["eval_loss"])]
    trainer.train()
    curve += [(entry["step"], entry["eval_loss"]) for entry in trainer.state.log_history if "eval_loss" in entry]
    if curve[-1][0] != args.steps:
        curve.append((args.steps, trainer.evaluate()["eval_loss"]))
    training_loss = [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    return dict(
        final_loss=curve[-1][1],
        curve=curve,
        training_loss=training_loss,
        seconds_per_step=statistics.median(timer.seconds),
        train_seconds=sum(timer.seconds),
        shared_init_fraction=shared_fraction,
    )


# ----------------------------------------------------------------------------------------------------
# Statistics, report, plot
# ----------------------------------------------------------------------------------------------------


def summarize(values: list[float]) -> dict:
    """Mean, sample std, standard error of the mean, and the half-width of a two-sided 95% t-interval."""
    n = len(values)
    std = statistics.stdev(values) if n > 1 else float("nan")
    stderr = std / math.sqrt(n)
    t = T_975[n - 2] if 2 <= n <= len(T_975) + 1 else 1.96
    return dict(mean=statistics.fmean(values), std=std, stderr=stderr, ci95_half_width=t * stderr, n=n)


def paired_differences(results: dict, seeds: list[int], variants: list[str]) -> dict:
    """Per pair (a, b): a - b per seed (same seed = same data order and shared init), and its summary."""
    pairs = [(name, BASES[VARIANTS[name][0]]) for name in variants if name not in BASES.values()]
    pairs += [(a, b) for a, b in EXTRA_DIFFERENCES if a in variants and b in variants]
    out = {}
    for a, b in pairs:
        per_seed = {str(s): results[a][s]["final_loss"] - results[b][s]["final_loss"] for s in seeds}
        summary = summarize(list(per_seed.values()))
        half = summary["ci95_half_width"]
        summary.update(
            per_seed=per_seed,
            resolves_target=bool(half <= TARGET_NATS),
            verdict=(
                f"{a} - {b}: {summary['mean']:+.4f} nats, 95% interval +-{half:.4f}: "
                + ("beyond seed noise" if abs(summary["mean"]) > half else "within seed noise")
            ),
        )
        out[f"{a} - {b}"] = summary
    return out


def plot(results: dict, differences: dict, variants: list[str], path: Path, title: str) -> None:
    """Held-out loss curves per family (mean over seeds, band = the seeds' min-max) and the paired differences."""
    families = [f for f in BASES if any(VARIANTS[v][0] == f for v in variants)]
    fig = Figure(figsize=(5.2 * (len(families) + 1), 4.6))
    axes = fig.subplots(1, len(families) + 1)

    def band(ax, runs: list[list[tuple[int, float]]], label: str):
        steps = [step for step, _ in runs[0]]
        columns = list(zip(*[[loss for _, loss in run] for run in runs]))
        mean = [statistics.fmean(c) for c in columns]
        line, = ax.plot(steps, mean, "o-", markersize=3, label=label)
        ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=line.get_color(), alpha=0.2)

    for ax, family in zip(axes, families):
        for name in (v for v in variants if VARIANTS[v][0] == family):
            runs = [run["curve"] for run in results[name].values()]
            band(ax, [run[1:] for run in runs], f"{name} ({statistics.fmean(r[-1][1] for r in runs):.3f})")
        ax.set_title(f"{family}: held-out loss (mean, seeds' min-max)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats / token)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[-1]
    for label in differences:
        a, b = label.split(" - ")
        runs = [
            [(sa, la - lb) for (sa, la), (_, lb) in zip(results[a][s]["curve"], results[b][s]["curve"])]
            for s in results[a]
        ]
        band(ax, [run[1:] for run in runs], label)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_title("paired differences (same seed), mean and min-max")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out loss difference (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    job_start = time.perf_counter()
    if args.quick:
        torch.set_num_threads(1)  # tiny models: a second thread only adds synchronization, worst on a busy machine
    args.output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, train, held_out_all, data_info = prepare_data(args)
    held_out = corpus.evaluation_subset(held_out_all, args.eval_blocks)
    tokens_per_run = args.steps * args.batch_size * args.block_size
    if len(train) < args.batch_size or len(held_out) == 0:
        raise ValueError(
            f"too little text for --block-size {args.block_size} and --batch-size {args.batch_size}: {len(train)} "
            f"training and {len(held_out)} held-out blocks"
        )
    print(
        f"data: {data_info['train_documents']} training / {data_info['held_out_documents']} held-out files, "
        f"{data_info['train_tokens']:,} / {data_info['held_out_tokens']:,} tokens; vocabulary {len(tokenizer)}; "
        f"each run trains on {tokens_per_run:,} tokens ({tokens_per_run / data_info['train_tokens']:.2f} passes) and "
        f"evaluates {len(held_out) * args.block_size:,} held-out tokens"
    )
    counts = parameter_counts(args, tokenizer)
    for name in args.variants:
        base = BASES[VARIANTS[name][0]]
        print(f"  {name:15s} {counts[name]:>11,} parameters ({counts[name] / counts[base] - 1:+.2%} vs {base})")

    seeds = list(range(args.seeds))
    results: dict[str, dict[int, dict]] = {name: {} for name in args.variants}
    runs_dir = args.output_dir / "runs"  # each finished run, so an interrupted experiment resumes where it stopped
    runs_dir.mkdir(exist_ok=True)
    for seed in seeds:  # seed-major: a partial run (interrupted) has every variant for its first seeds
        for name in args.variants:
            start = time.perf_counter()
            key = dict(
                variant=name, seed=seed, steps=args.steps, batch_size=args.batch_size, block_size=args.block_size,
                hidden_size=args.hidden_size, layers=args.layers, vocab_size=len(tokenizer),
                eval_every=args.eval_every, eval_blocks=len(held_out), quick=args.quick, data=data_info,
            )
            saved = runs_dir / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16] + ".json")
            if saved.is_file():
                run = json.loads(saved.read_text())["run"]
                print(f"seed {seed} {name:15s} reused {saved.name} (same settings)", flush=True)
            else:
                run = train_one(name, seed, args, tokenizer, train, held_out)
                partial = saved.with_suffix(".tmp")
                partial.write_text(json.dumps(dict(key=key, run=run)))
                os.replace(partial, saved)
            results[name][seed] = run
            print(
                f"seed {seed} {name:15s} held-out {run['curve'][0][1]:.4f} -> {run['final_loss']:.4f}  "
                f"{run['seconds_per_step']:.3f} s/step  ({time.perf_counter() - start:.0f} s with evaluation)",
                flush=True,
            )

    differences = paired_differences(results, seeds, args.variants)
    variants_out = {}
    for name in args.variants:
        finals = [results[name][s]["final_loss"] for s in seeds]
        family = VARIANTS[name][0]
        variants_out[name] = dict(
            family=family,
            config_overrides=VARIANTS[name][1],
            parameters=counts[name],
            parameters_vs_base=counts[name] / counts[BASES[family]] - 1,
            shared_init_fraction=statistics.fmean(results[name][s]["shared_init_fraction"] for s in seeds),
            held_out_loss=dict(summarize(finals), per_seed={str(s): results[name][s]["final_loss"] for s in seeds}),
            seconds_per_step=dict(
                mean=statistics.fmean(results[name][s]["seconds_per_step"] for s in seeds),
                per_seed={str(s): results[name][s]["seconds_per_step"] for s in seeds},
            ),
            curves={str(s): results[name][s]["curve"] for s in seeds},
            training_loss={str(s): results[name][s]["training_loss"] for s in seeds},
        )
    resolved = all(d["resolves_target"] for d in differences.values())
    widest = max(d["ci95_half_width"] for d in differences.values())
    resolution = (
        f"this budget {'resolves' if resolved else 'does NOT resolve'} a {TARGET_NATS} nat difference: the widest "
        f"95% interval of a paired difference is +-{widest:.4f} nats over {len(seeds)} seeds"
        + ("" if resolved else " (more seeds or steps would narrow it)")
    )
    png = args.output_dir / "held_out_loss.png"
    title = (
        f"{'QUICK (plumbing only) ' if args.quick else ''}hidden {args.hidden_size}, {args.layers} layers, "
        f"{args.steps} steps x {args.batch_size} x {args.block_size} tokens, {len(seeds)} seeds"
    )
    plot(results, differences, args.variants, png, title)
    report = dict(
        quick=args.quick,
        settings=dict(
            seeds=seeds, steps=args.steps, batch_size=args.batch_size, block_size=args.block_size,
            tokens_per_run=tokens_per_run, hidden_size=args.hidden_size, layers=args.layers,
            vocab_size=len(tokenizer), eval_every=args.eval_every, eval_blocks=len(held_out),
            eval_tokens=len(held_out) * args.block_size, device=args.device, optimizer=OPTIMIZER,
            torch=torch.__version__, threads=torch.get_num_threads(),
        ),
        data=data_info,
        variants=variants_out,
        paired_differences=differences,
        target_nats=TARGET_NATS,
        resolves_target=resolved,
        resolution=resolution,
        png=png.name,
        wall_seconds=time.perf_counter() - job_start,
    )
    json_path = args.output_dir / "results.json"
    json_path.write_text(json.dumps(report, indent=2))

    lines = ["", "=" * 100, title, "",
             "| variant | parameters | held-out loss (mean +- std) | per seed | s/step |", "|---|---|---|---|---|"]
    for name, v in variants_out.items():
        loss = v["held_out_loss"]
        lines.append(
            f"| {name} | {v['parameters']:,} ({v['parameters_vs_base']:+.2%}) | "
            f"{loss['mean']:.4f} +- {loss['std']:.4f} | "
            f"{', '.join(f'{x:.4f}' for x in loss['per_seed'].values())} | {v['seconds_per_step']['mean']:.3f} |"
        )
    lines += ["", "| paired difference | mean +- std | per seed | 95% interval |", "|---|---|---|---|"]
    for label, d in differences.items():
        lines.append(
            f"| {label} | {d['mean']:+.4f} +- {d['std']:.4f} | {', '.join(f'{x:+.4f}' for x in d['per_seed'].values())}"
            f" | +-{d['ci95_half_width']:.4f} |"
        )
    lines += ["", *(d["verdict"] for d in differences.values()), "", resolution,
              f"results {json_path}, plot {png}, total {report['wall_seconds']:.0f} s", "=" * 100]
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
