"""Evaluate a saved DenseSSM model with lm-eval's standard ``hf`` model type, on two local tasks, on the CPU.

No wrapper class: ``lm_eval.simple_evaluate(model="hf", ...)`` loads the saved folder with
``AutoModelForCausalLM`` / ``AutoTokenizer`` as it would any transformers model. ``import hf_densessm``
registers the model types with the Auto classes; a folder saved with remote code loads with
``trust_remote_code=True`` instead (the ``lm_eval`` command line, see ``docs/evaluation.md``).

What it does, top to bottom:

1. Model: the folder given with ``--model-dir``; without it, the folder written by ``examples/pretrain.py``
   (``outputs/densemamba-tiny``) if it exists, else an untrained ``--model`` (DenseMamba by default) with a
   byte-level BPE tokenizer, built and saved into ``<output-dir>/<model>-untrained`` (scores at chance level:
   it only shows the route).
2. Tasks: two lm-eval task YAMLs with local JSONL data, written to ``<output-dir>/tasks``, both built from
   the paragraphs of Python's documentation (``pydoc_data.topics``) that ``examples/pretrain.py`` holds out
   (CRC32 divisible by 10), so a model trained by it is scored on text it did not see:

   - ``pydoc_perplexity`` (``output_type: loglikelihood_rolling``): word/byte perplexity and bits per byte
     of whole paragraphs, as lm-eval's ``wikitext`` task;
   - ``pydoc_continuation`` (``output_type: multiple_choice``): the first half of a paragraph, and four
     candidate second halves (the true one and three from other paragraphs); accuracy and length-normalized
     accuracy, as HellaSwag is scored.
3. Evaluation: ``lm_eval.simple_evaluate`` with ``model="hf"``; the results table is printed and the
   results (without per-sample logs) are written to ``<output-dir>/results.json``.

Run it from the repository root::

    python examples/evaluate_lm_eval.py                                    # ~1 minute on 2 CPU cores
    python examples/evaluate_lm_eval.py --model-dir outputs/denseretnet-tiny
    python examples/evaluate_lm_eval.py --model denseretnet --limit 20
    python examples/evaluate_lm_eval.py --help
"""

from __future__ import annotations

import argparse
import json
import re
import zlib
from pathlib import Path

import sys

from transformers import AutoModelForCausalLM, set_seed

import hf_densessm  # noqa: F401  (registers "densemamba" and "denseretnet" with the Auto classes)
from hf_densessm import DenseMambaConfig, DenseRetNetConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # corpus.py, also when this file is imported by path
from corpus import train_tokenizer  # noqa: E402  (the byte-level BPE the main job trains)

CONFIGS = {"densemamba": DenseMambaConfig, "denseretnet": DenseRetNetConfig}
PRETRAINED_DEFAULT = Path("outputs/densemamba-tiny")  # what `python examples/pretrain.py` writes
HELD_OUT_EVERY = 10  # the held-out rule of examples/pretrain.py: crc32(paragraph) % 10 == 0
TASKS = ("pydoc_perplexity", "pydoc_continuation")
NUM_CHOICES = 4

PERPLEXITY_YAML = """\
# Perplexity of held-out paragraphs of Python's documentation, scored as lm-eval scores `wikitext`.
task: pydoc_perplexity
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""

CONTINUATION_YAML = """\
# Which of four second halves continues the first half of a held-out paragraph (scored as HellaSwag).
task: pydoc_continuation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


# ----------------------------------------------------------------------------------------------------
# Text and tasks
# ----------------------------------------------------------------------------------------------------


def pydoc_paragraphs() -> list[tuple[str, bool]]:
    """Every paragraph of Python's documentation (topics sorted by name, paragraphs separated by blank lines),
    with ``True`` when ``examples/pretrain.py`` holds it out of training (``crc32 % 10 == 0``)."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n[ \t]*\n", topics[name]):
            paragraph = paragraph.strip("\n")
            if paragraph.strip():
                paragraphs.append((paragraph, zlib.crc32(paragraph.encode("utf-8")) % HELD_OUT_EVERY == 0))
    return paragraphs


def prose(paragraph: str, min_words: int = 24, max_chars: int = 1200) -> bool:
    """A paragraph of running text (not code or a table) of a useful length for the local tasks."""
    words = paragraph.split()
    return (
        len(words) >= min_words
        and len(paragraph) <= max_chars
        and not paragraph.startswith((" ", ">>>", "+", "="))
        and sum(w.isalpha() for w in words) >= 0.6 * len(words)
    )


def split_in_half(paragraph: str) -> tuple[str, str]:
    """``(first half, second half)`` of a paragraph, cut at the whitespace nearest its middle; neither part has
    leading or trailing whitespace (lm-eval joins context and choice with one space)."""
    middle = len(paragraph) // 2
    cuts = [m.start() for m in re.finditer(r"\s+", paragraph)]
    cut = min(cuts, key=lambda i: abs(i - middle))
    return paragraph[:cut].rstrip(), paragraph[cut:].lstrip()


def write_tasks(task_dir: Path, max_docs: int = 24, max_chars: int = 1200) -> dict[str, Path]:
    """Write the two local tasks (YAML + JSONL data) into ``task_dir`` and return ``{task name: data file}``.

    Both use the first ``max_docs`` held-out prose paragraphs of at most ``max_chars`` characters (see
    :func:`pydoc_paragraphs`, :func:`prose`).
    ``pydoc_continuation`` rows are ``{"context", "endings" (4 strings), "label" (index of the true ending)}``;
    the three wrong endings are the second halves of the next three paragraphs, and the true ending's position
    is the paragraph's CRC32 modulo 4, so the data are the same on every run.
    """
    paragraphs = [p for p, held_out in pydoc_paragraphs() if held_out and prose(p, max_chars=max_chars)][:max_docs]
    if len(paragraphs) < NUM_CHOICES:
        raise ValueError(f"need at least {NUM_CHOICES} paragraphs for the multiple-choice task, got {len(paragraphs)}")
    task_dir.mkdir(parents=True, exist_ok=True)
    halves = [split_in_half(p) for p in paragraphs]
    perplexity_rows = [{"text": p} for p in paragraphs]
    continuation_rows = []
    for i, (paragraph, (context, ending)) in enumerate(zip(paragraphs, halves)):
        wrong = [halves[(i + j) % len(halves)][1] for j in range(1, NUM_CHOICES)]
        label = zlib.crc32(paragraph.encode("utf-8")) % NUM_CHOICES
        continuation_rows.append({"context": context, "endings": wrong[:label] + [ending] + wrong[label:], "label": label})

    files = {}
    for task, template, rows in (
        ("pydoc_perplexity", PERPLEXITY_YAML, perplexity_rows),
        ("pydoc_continuation", CONTINUATION_YAML, continuation_rows),
    ):
        data_file = (task_dir / f"{task}.jsonl").resolve()
        data_file.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        # A JSON string is a valid YAML scalar: any path is quoted correctly.
        (task_dir / f"{task}.yaml").write_text(template.format(data_file=json.dumps(str(data_file))), encoding="utf-8")
        files[task] = data_file
    return files


# ----------------------------------------------------------------------------------------------------
# A small model to evaluate when none is given
# ----------------------------------------------------------------------------------------------------


def build_untrained_model(
    folder: Path, family: str = "densemamba", vocab_size: int = 1024, seed: int = 0, **config_overrides
) -> Path:
    """Save an untrained ``family`` model (the ``<family>-tiny`` preset, changed by ``config_overrides``) and a
    byte-level BPE tokenizer trained on the non-held-out documentation paragraphs into ``folder``; return it."""
    set_seed(seed)
    tokenizer = train_tokenizer([p for p, held_out in pydoc_paragraphs() if not held_out], vocab_size)
    config = CONFIGS[family].from_preset(
        f"{family}-tiny",
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **config_overrides,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------


def evaluate(
    model_dir: Path,
    task_dir: Path,
    tasks: tuple[str, ...] = TASKS,
    batch_size: int = 4,
    limit: int | None = None,
    log_samples: bool = False,
) -> dict:
    """Run lm-eval's ``hf`` model on ``tasks`` (YAMLs found in ``task_dir``) on the CPU in float32 and return
    ``simple_evaluate``'s result dictionary (``"results"`` per task, ``"samples"`` when ``log_samples``)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={Path(model_dir).resolve()},dtype=float32",
        tasks=list(tasks),
        # Only the tasks in task_dir: indexing lm-eval's thousands of built-in tasks takes ~10 s.
        task_manager=TaskManager(include_path=str(Path(task_dir).resolve()), include_defaults=False),
        batch_size=batch_size,
        device="cpu",
        limit=limit,
        log_samples=log_samples,
        bootstrap_iters=0,  # no standard errors: they would cost more than the evaluation itself here
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description="Evaluate a saved DenseSSM model with lm-eval's `hf` model type on two local tasks built from "
        "Python's documentation (perplexity and multiple-choice continuation).",
    )
    add = parser.add_argument
    add(
        "--model-dir", type=Path,
        help=f"saved model folder (default: {PRETRAINED_DEFAULT} if it exists, else an untrained model built here)",
    )
    add("--model", choices=sorted(CONFIGS), default="densemamba", help="family of the untrained model (default: %(default)s)")
    add("--output-dir", type=Path, default=Path("outputs/lm-eval"), help="tasks, results (default: %(default)s)")
    add("--max-docs", type=int, default=24, help="paragraphs per task (default: %(default)s)")
    add("--limit", type=int, help="evaluate only the first LIMIT documents of each task")
    add("--batch-size", type=int, default=4, help="lm-eval batch size (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Build the tasks, find or build the model, evaluate it and print and save the results."""
    from lm_eval.utils import make_table

    args = parse_args(argv)
    model_dir = args.model_dir
    if model_dir is None and (PRETRAINED_DEFAULT / "config.json").is_file():
        model_dir = PRETRAINED_DEFAULT
    if model_dir is None:
        model_dir = args.output_dir / f"{args.model}-untrained"
        print(f"no --model-dir and no {PRETRAINED_DEFAULT}: evaluating an untrained {args.model} saved to {model_dir}")
        build_untrained_model(model_dir, args.model)
    task_dir = args.output_dir / "tasks"
    write_tasks(task_dir, args.max_docs)

    results = evaluate(model_dir, task_dir, batch_size=args.batch_size, limit=args.limit)
    print(make_table(results))
    results_file = args.output_dir / "results.json"
    results_file.write_text(json.dumps(results["results"], indent=2, default=str), encoding="utf-8")
    print(f"results written to {results_file}")
    print(
        "the same from the command line (a folder saved with remote code):\n"
        f"  lm_eval --model hf --model_args pretrained={model_dir},trust_remote_code=True,dtype=float32 "
        f"--device cpu --include_path {task_dir} --tasks {','.join(TASKS)}"
    )
    return results


if __name__ == "__main__":
    main()
