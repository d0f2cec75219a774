"""lm-eval end to end: a saved folder of each family through lm-eval's standard ``hf`` model type, on the two
local tasks of ``examples/evaluate_lm_eval.py`` (data built from Python's documentation), on the CPU; in Python
after ``import hf_densessm``, and through the ``lm_eval`` command line with ``trust_remote_code=True``.

lm-eval's numbers are checked against log-likelihoods computed here with the model itself.
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import lm_eval  # noqa: F401  (fail at collection, not in a subprocess, when lm-eval is missing)
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import FAMILIES

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "evaluate_lm_eval.py"
NUM_DOCS = 6
MAX_CHARS = 500  # short paragraphs keep the test fast


def _load_example():
    spec = importlib.util.spec_from_file_location("evaluate_lm_eval", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()


def _micro_overrides(family):
    if family == "densemamba":
        return dict(hidden_size=32, num_hidden_layers=3, state_size=8, dense_layers=2)
    return dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, query_key_dim=16, dense_layers=2)


@torch.no_grad()
def _sum_logprob(model, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) under ``model``, one sequence, no padding."""
    ids = torch.tensor([context + continuation])
    logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
    targets = ids[0, len(context) :]
    return logprobs[len(context) - 1 :].gather(-1, targets[:, None]).sum().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_lm_eval_hf_model_on_local_tasks(family, tmp_path):
    model_dir = example.build_untrained_model(tmp_path / "model", family, vocab_size=512, **_micro_overrides(family))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in model_dir.iterdir()}
    data = example.write_tasks(tmp_path / "tasks", max_docs=NUM_DOCS, max_chars=MAX_CHARS)

    out = example.evaluate(model_dir, tmp_path / "tasks", batch_size=3, log_samples=True)

    results, samples = out["results"], out["samples"]
    assert set(results) == set(example.TASKS)
    assert all(len(samples[task]) == NUM_DOCS for task in example.TASKS)

    # The same numbers from the model itself, loaded with the Auto classes.
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.model_type == family

    # Rolling log-likelihood: every token of the encoded text (which starts with <s>), given lm-eval's prefix <s>.
    total_ll, total_bytes = 0.0, 0
    for sample in samples["pydoc_perplexity"]:
        text = sample["doc"]["text"]
        expected = _sum_logprob(model, [tokenizer.bos_token_id], tokenizer(text)["input_ids"])
        (got,) = sample["filtered_resps"]
        assert math.isclose(float(got), expected, rel_tol=1e-4, abs_tol=1e-3), (got, expected)
        total_ll += expected
        total_bytes += len(text.encode("utf-8"))
    perplexity = results["pydoc_perplexity"]
    assert math.isclose(perplexity["byte_perplexity,none"], math.exp(-total_ll / total_bytes), rel_tol=1e-4)
    assert math.isclose(perplexity["bits_per_byte,none"], -total_ll / total_bytes / math.log(2), rel_tol=1e-4)
    assert perplexity["word_perplexity,none"] > perplexity["byte_perplexity,none"] > 1

    # Multiple choice: log p(" " + ending | context) for each of the four endings; accuracy from their argmax.
    correct = 0
    for sample in samples["pydoc_continuation"]:
        doc = sample["doc"]
        context = tokenizer(doc["context"])["input_ids"]
        lls = []
        for ending, (got, _) in zip(doc["endings"], sample["filtered_resps"]):
            whole = tokenizer(doc["context"] + " " + ending)["input_ids"]
            expected = _sum_logprob(model, context, whole[len(context) :])
            assert math.isclose(float(got), expected, rel_tol=1e-4, abs_tol=1e-3), (got, expected)
            lls.append(expected)
        correct += max(range(len(lls)), key=lls.__getitem__) == doc["label"]
    assert results["pydoc_continuation"]["acc,none"] == pytest.approx(correct / NUM_DOCS)
    assert 0 <= results["pydoc_continuation"]["acc_norm,none"] <= 1

    # The task data are real text and are written deterministically.
    again = example.write_tasks(tmp_path / "again", max_docs=NUM_DOCS, max_chars=MAX_CHARS)
    assert all(data[task].read_text() == again[task].read_text() for task in example.TASKS)


def test_lm_eval_command_line_with_remote_code(tmp_path):
    """The ``lm_eval`` command in a fresh process where ``import hf_densessm`` fails: the saved folder's own code
    (``trust_remote_code=True``) runs the model, and gives the numbers of the package's model."""
    model_dir = example.build_untrained_model(
        tmp_path / "model", "denseretnet", vocab_size=512, **_micro_overrides("denseretnet")
    )
    example.write_tasks(tmp_path / "tasks", max_docs=4, max_chars=MAX_CHARS)
    block_package = "import sys; sys.modules['hf_densessm'] = None; from lm_eval.__main__ import cli_evaluate; cli_evaluate()"
    command = [
        sys.executable, "-c", block_package,
        "--model", "hf", "--model_args", f"pretrained={model_dir},trust_remote_code=True,dtype=float32",
        "--device", "cpu", "--batch_size", "2", "--include_path", str(tmp_path / "tasks"),
        "--tasks", "pydoc_perplexity", "--limit", "2", "--log_samples", "--output_path", str(tmp_path / "results"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "pydoc_perplexity" in result.stdout and "word_perplexity" in result.stdout, result.stdout

    (samples_file,) = (tmp_path / "results").rglob("samples_pydoc_perplexity_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 2
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(model).__module__.startswith("hf_densessm")  # the package's class, here in the test process
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for sample in samples:
        expected = _sum_logprob(model, [tokenizer.bos_token_id], tokenizer(sample["doc"]["text"])["input_ids"])
        (got,) = sample["filtered_resps"]
        assert math.isclose(float(got), expected, rel_tol=1e-4, abs_tol=1e-3), (got, expected)
