"""Pretrain a small DenseSSM language model on the CPU, end to end, in a few minutes.

What it does, top to bottom:

1. Text (``corpus.py``, shared with ``compare.py``): what ships with every Python, so nothing is
   downloaded: the standard library's own sources (about 10 MB: code, docstrings, comments) and its
   documentation topics (``pydoc_data.topics``). Whole files are held out for evaluation (those whose
   name's CRC32 is divisible by 10), so no held-out text is ever trained on; the default run sees each
   training token at most once, so its held-out loss keeps falling. With ``--train-files`` (your own
   text), paragraphs are held out instead, so that a single file works.
2. Tokenizer: a byte-level BPE (``tokenizers``) trained on (a 3 MB sample of) the training text only,
   wrapped as a ``transformers.PreTrainedTokenizerFast`` with ``<s>`` (bos), ``</s>`` (eos) and ``<pad>``.
3. Data: tokenized with ``datasets`` and packed into blocks of ``--block-size`` tokens; evaluation uses a
   fixed sample of ``--eval-blocks`` held-out blocks.
4. Model: DenseMamba (or DenseRetNet, ``--model denseretnet``) from a size preset, trained with
   ``transformers.Trainer``: AdamW, linear warmup then cosine decay, periodic held-out evaluation.
5. Results: held-out loss and perplexity before and after training; a Hub-ready folder (config.json,
   model.safetensors, generation_config.json, the bundled modeling code, tokenizer.json,
   tokenizer_config.json, a model card README.md with this run's results, and loss_curves.png), written
   next to its target and renamed into place at the end; the folder reloaded with
   ``AutoModelForCausalLM`` / ``AutoTokenizer`` and checked to give the same held-out loss; and a sampled
   continuation of ``--prompt``.

Run it from the repository root::

    python examples/pretrain.py                          # DenseMamba-tiny, a few minutes on 2 CPU cores
    python examples/pretrain.py --model denseretnet      # DenseRetNet-tiny
    python examples/pretrain.py --train-files notes.txt --max-steps 1000 --output-dir outputs/notes
    python examples/pretrain.py --help

The saved folder loads anywhere ``hf_densessm`` is installed::

    import hf_densessm  # registers "densemamba" and "denseretnet" with the Auto classes
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("outputs/densemamba-tiny")
    tokenizer = AutoTokenizer.from_pretrained("outputs/densemamba-tiny")
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure  # without pyplot: rendered by the Agg backend, no display needed
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # corpus.py, also when this file is imported by path
import corpus  # noqa: E402
from corpus import HELD_OUT_EVERY, MIN_VOCAB_SIZE  # noqa: E402

import hf_densessm  # noqa: E402,F401  (registers the DenseSSM models with the Auto classes)
from hf_densessm import DenseMambaConfig, DenseRetNetConfig, paper_training_arguments  # noqa: E402
from hf_densessm.configuration import DENSEMAMBA_PRESETS, DENSERETNET_PRESETS  # noqa: E402

FAMILIES = {
    "densemamba": (DenseMambaConfig, DENSEMAMBA_PRESETS),
    "denseretnet": (DenseRetNetConfig, DENSERETNET_PRESETS),
}
TOKENIZER_CHARS = 3_000_000  # the BPE is trained on a hashed sample of this many characters of training text


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


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


SMALL_PRESET_OPTIMIZER = dict(
    learning_rate=4e-3, lr_scheduler_type="cosine", warmup_steps=0.2, weight_decay=0.1, adam_beta2=0.95,
    max_grad_norm=1.0,
)


def optimizer_settings(args: argparse.Namespace) -> dict:
    """``TrainingArguments`` keywords of the optimizer: the paper's (Tables 2 and 3, §4.2) for a paper preset, a
    short-run recipe (cosine decay after 20% warm-up) for the small presets; ``--learning-rate`` overrides the peak."""
    try:
        settings = paper_training_arguments(args.preset)
    except ValueError:
        settings = dict(SMALL_PRESET_OPTIMIZER)
    if args.learning_rate is not None:
        settings["learning_rate"] = args.learning_rate
    return settings


def describe_packing(packing: bool) -> str:
    """One line: how documents share a block."""
    if packing:
        return "on (each document in a block starts every recurrent state from zero; position_ids restart at 0)"
    return "off (blocks of concatenated text; state flows across document boundaries)"


def describe_optimizer(settings: dict) -> str:
    """One line for the model card: peak learning rate, schedule, betas, weight decay."""
    return (
        f"peak learning rate {settings['learning_rate']:g}, {settings['lr_scheduler_type']} decay after "
        f"{settings['warmup_steps']:.1%} warm-up, betas ({settings.get('adam_beta1', 0.9)}, {settings['adam_beta2']}), "
        f"weight decay {settings['weight_decay']}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    preset_names = ", ".join(name for _, presets in FAMILIES.values() for name in presets)
    parser = argparse.ArgumentParser(
        description="Train a byte-level BPE tokenizer and a small DenseSSM language model on Python's "
        "standard-library sources and documentation (or your own text files) with transformers.Trainer, report "
        "held-out loss and perplexity before and after, save a Hub-ready folder, reload it and generate text.",
    )
    add = parser.add_argument
    add("--model", choices=sorted(FAMILIES), default="densemamba", help="model family (default: %(default)s)")
    add("--preset", help=f"size preset of the chosen family (default: <model>-tiny); one of: {preset_names}")
    add(
        "--max-steps", type=int_at_least(1), default=120,
        help="optimizer steps (default: %(default)s: about 250k tokens, under a tenth of the default corpus's "
        "~2.9M training tokens, so no token is seen twice)",
    )
    add("--output-dir", type=Path, help="where the trained model goes (default: outputs/<preset>)")
    add(
        "--train-files", type=Path, nargs="+", metavar="FILE",
        help="UTF-8 text files to train on instead of Python's standard library and documentation; "
        f"paragraphs (separated by blank lines) whose CRC32 is divisible by {HELD_OUT_EVERY} are held out",
    )
    add(
        "--eval-blocks", type=int_at_least(1), default=128,
        help="held-out blocks evaluated (a fixed sample of all held-out blocks; default: %(default)s)",
    )
    add("--block-size", type=int_at_least(8), default=256, help="tokens per sequence (default: %(default)s)")
    add("--batch-size", type=int_at_least(1), default=8, help="sequences per optimizer step (default: %(default)s)")
    add(
        "--packing", action=argparse.BooleanOptionalAction, default=True,
        help="packed documents: every recurrent state starts from zero at each document inside a block "
        "(position_ids restart at 0, as transformers' DataCollatorWithFlattening does; 1.45-1.83x the real-token "
        "training throughput of padded batches, benchmarks/bench_packing.py); --no-packing lets state flow across "
        "document boundaries (default: packing)",
    )
    add(
        "--learning-rate", type=positive_float,
        help="peak learning rate (default: the paper's for a paper preset, hf_densessm.paper_training_arguments; "
        "4e-3 for the small presets)",
    )
    add("--seed", type=int_at_least(0), default=0, help="seed of init, data order and sampling (default: %(default)s)")
    add(
        "--vocab-size", type=int_at_least(MIN_VOCAB_SIZE), default=4096,
        help="BPE vocabulary size, special tokens included (default: %(default)s)",
    )
    add("--prompt", default='The "for" statement is used to', help="start of the generated text (default: %(default)r)")
    args = parser.parse_args(argv)

    presets = FAMILIES[args.model][1]
    args.preset = args.preset or f"{args.model}-tiny"
    if args.preset not in presets:
        parser.error(
            f"argument --preset: {args.preset!r} is not a {args.model} preset; choose from {', '.join(presets)}"
        )
    for path in args.train_files or []:
        if not path.is_file():
            parser.error(f"argument --train-files: {str(path)!r} is not a file")
    args.output_dir = args.output_dir or Path("outputs") / args.preset
    if args.output_dir.exists() and not (args.output_dir / "config.json").is_file() and any(args.output_dir.iterdir()):
        parser.error(
            f"argument --output-dir: {str(args.output_dir)!r} is not empty and holds no config.json; this job "
            "replaces its output folder as a whole, so give a new or empty folder, or an earlier run's output"
        )
    return args


# ----------------------------------------------------------------------------------------------------
# Text, tokenizer, packed blocks
# ----------------------------------------------------------------------------------------------------


def load_texts(train_files: list[Path] | None) -> tuple[list[str], list[str]]:
    """Training and held-out texts: the standard library's files and pydoc topics, whole files held out
    (``corpus.stdlib_documents``, ``corpus.split_documents``); or the ``--train-files``, paragraphs held out."""
    if train_files:
        return corpus.split_paragraphs([path.read_text(encoding="utf-8") for path in train_files])
    return corpus.split_documents(corpus.stdlib_documents())


# ----------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------


def plot_losses(log_history: list[dict], loss_before: float, path: Path, title: str) -> None:
    """Training loss (every logging step) and held-out loss (every evaluation, step 0 = before training)."""
    train = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry]
    held_out = [(0, loss_before)] + [(entry["step"], entry["eval_loss"]) for entry in log_history if "eval_loss" in entry]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    ax.plot(*zip(*train), label="training loss", color="tab:blue", alpha=0.8)
    ax.plot(*zip(*held_out), "o-", label="held-out loss", color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_training_report(card: Path, args: argparse.Namespace, loss_before: float, loss_after: float) -> None:
    """Append this run (data, tokenizer, held-out results, loss curves) to the model card ``save_pretrained`` wrote."""
    if args.train_files:
        data = ", ".join(f"`{path.name}`" for path in args.train_files)
        held_out = f"Paragraphs whose CRC32 is divisible by {HELD_OUT_EVERY} were held out."
    else:
        data = corpus.corpus_description().replace(str(corpus.stdlib_root()), "the standard library")
        held_out = f"Whole files whose name's CRC32 is divisible by {HELD_OUT_EVERY} were held out."
    report = f"""
## Training run (`examples/pretrain.py`)

Preset `{args.preset}`, trained from scratch for {args.max_steps} steps of {args.batch_size} x {args.block_size} tokens
(AdamW, {describe_optimizer(optimizer_settings(args))}, seed {args.seed}) on {data},
with a {args.vocab_size}-token byte-level BPE tokenizer (in this folder) trained on the same text. {held_out}
Packing: {describe_packing(args.packing)}. The held-out figures are over {args.eval_blocks} held-out blocks. A demonstration of the pipeline, not a useful
language model.

| held-out | before training | after training |
|---|---|---|
| loss (nats/token) | {loss_before:.4f} | {loss_after:.4f} |
| perplexity | {math.exp(loss_before):.1f} | {math.exp(loss_after):.1f} |

```python
import hf_densessm  # or pass trust_remote_code=True instead
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
inputs = tokenizer({args.prompt!r}, return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs)[0], skip_special_tokens=True))  # generation_config.json: sampling
```

![loss curves](loss_curves.png)
"""
    card_text = card.read_text(encoding="utf-8").rstrip("\n") + "\n" if card.exists() else ""
    card.write_text(card_text + report, encoding="utf-8")


def move_into_place(staging: Path, target: Path) -> None:
    """Replace ``target`` by the finished ``staging`` folder with renames only (same file system)."""
    old = target.with_name(f".{target.name}.old-{os.getpid()}") if target.exists() else None
    if old is not None:
        target.rename(old)
    staging.rename(target)
    if old is not None:
        shutil.rmtree(old)


# ----------------------------------------------------------------------------------------------------
# The job
# ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    job_start = time.perf_counter()
    set_seed(args.seed)

    # 1-3. Text, tokenizer, packed blocks.
    train_texts, held_out_texts = load_texts(args.train_files)
    tokenizer = corpus.train_tokenizer(corpus.sample_texts(train_texts, TOKENIZER_CHARS), args.vocab_size)
    train_blocks = corpus.pack_blocks(train_texts, tokenizer, args.block_size, document_positions=args.packing)
    all_held_out_blocks = corpus.pack_blocks(held_out_texts, tokenizer, args.block_size, document_positions=args.packing)
    held_out_blocks = corpus.evaluation_subset(all_held_out_blocks, args.eval_blocks)
    if len(train_blocks) < args.batch_size or len(held_out_blocks) == 0:
        source = "--train-files" if args.train_files else "the standard library"
        raise ValueError(
            f"{source}: too little text for --block-size {args.block_size} and --batch-size {args.batch_size}: "
            f"{len(train_blocks)} training and {len(held_out_blocks)} held-out blocks (need >= {args.batch_size} and >= 1). "
            "Give more text or smaller --block-size / --batch-size."
        )
    print(
        f"data: {len(train_texts)} training / {len(held_out_texts)} held-out texts -> "
        f"{len(train_blocks)} / {len(all_held_out_blocks)} blocks of {args.block_size} tokens "
        f"({len(held_out_blocks)} held-out blocks evaluated); vocabulary {len(tokenizer)}"
    )
    print(f"packing: {describe_packing(args.packing)}")

    # 4. Model.
    config_class, _ = FAMILIES[args.model]
    config = config_class.from_preset(
        args.preset,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=50,
        do_sample=True,
        temperature=0.7,
        top_k=40,
    )
    n_params = model.num_parameters()
    print(f"model: {args.preset} ({type(model).__name__}), {n_params / 1e6:.2f}M parameters")
    print(f"optimizer: {describe_optimizer(optimizer_settings(args))}")

    # Everything is written into a hidden folder next to the target and renamed into place at the end.
    staging = args.output_dir.with_name(f".{args.output_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        training_args = TrainingArguments(
            output_dir=str(staging),
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=args.batch_size,
            **optimizer_settings(args),
            logging_steps=max(1, args.max_steps // 40),
            logging_first_step=True,
            eval_strategy="steps",
            eval_steps=max(1, args.max_steps // 8),
            save_strategy="no",
            report_to="none",
            seed=args.seed,
            data_seed=args.seed,
            dataloader_drop_last=True,
            dataloader_pin_memory=torch.cuda.is_available(),  # pinning needs an accelerator (torch warns without)
            disable_tqdm=False,
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            data_collator=default_data_collator,
            train_dataset=train_blocks,
            eval_dataset=held_out_blocks,
        )

        # 5. Held-out loss before and after training.
        loss_before = trainer.evaluate()["eval_loss"]
        print(f"held-out before training: loss {loss_before:.4f}, perplexity {math.exp(loss_before):.1f}")
        start = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - start
        loss_after = trainer.evaluate()["eval_loss"]
        print(f"held-out after training:  loss {loss_after:.4f}, perplexity {math.exp(loss_after):.1f}")

        # 6, 8. The Hub-ready folder and the loss curves.
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        plot_title = (
            f"{args.preset} ({type(model).__name__}, {n_params / 1e6:.2f}M parameters): "
            f"held-out loss {loss_before:.3f} -> {loss_after:.3f}"
        )
        plot_losses(trainer.state.log_history, loss_before, staging / "loss_curves.png", title=plot_title)
        add_training_report(staging / "README.md", args, loss_before, loss_after)
        move_into_place(staging, args.output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # only left behind if something above failed

    # 7. Reload with the Auto classes: same held-out loss, then generate.
    reloaded = AutoModelForCausalLM.from_pretrained(args.output_dir)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(args.output_dir)
    loss_reloaded = Trainer(
        model=reloaded,
        args=dataclasses.replace(training_args, output_dir=str(args.output_dir)),  # same batches as before
        data_collator=default_data_collator,
        eval_dataset=held_out_blocks,
    ).evaluate()["eval_loss"]
    if not math.isclose(loss_reloaded, loss_after, rel_tol=1e-4):
        raise RuntimeError(f"the reloaded model's held-out loss {loss_reloaded:.6f} differs from {loss_after:.6f}")
    set_seed(args.seed)
    inputs = reloaded_tokenizer(args.prompt, return_tensors="pt")
    with torch.inference_mode():
        generated = reloaded.generate(**inputs)
    text = reloaded_tokenizer.decode(generated[0], skip_special_tokens=True)

    png = args.output_dir / "loss_curves.png"
    print(
        "\n".join(
            [
                "",
                "=" * 78,
                f"model              {args.preset}: {n_params / 1e6:.2f}M parameters",
                f"training           {args.max_steps} steps x {args.batch_size} x {args.block_size} tokens "
                f"in {train_seconds:.0f} s ({args.max_steps * args.batch_size * args.block_size / train_seconds:.0f} tokens/s)",
                f"held-out loss      {loss_before:.4f} -> {loss_after:.4f} (reloaded: {loss_reloaded:.4f})",
                f"held-out ppl       {math.exp(loss_before):.1f} -> {math.exp(loss_after):.1f}",
                f"saved to           {args.output_dir}",
                f"loss curves        {png}",
                f"total time         {time.perf_counter() - job_start:.0f} s",
                "=" * 78,
                f"generated ({args.prompt!r} + up to {reloaded.generation_config.max_new_tokens} sampled tokens):",
                text,
                "=" * 78,
            ]
        )
    )
    return {
        "output_dir": args.output_dir,
        "png": png,
        "plot_title": plot_title,
        "n_params": n_params,
        "train_seconds": train_seconds,
        "loss_before": loss_before,
        "loss_after": loss_after,
        "loss_reloaded": loss_reloaded,
        "generated": text,
    }


if __name__ == "__main__":
    main()
