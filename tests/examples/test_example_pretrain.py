"""Smoke test of ``examples/pretrain.py``: the whole job, with tiny settings, for both model families.

Each run trains a tokenizer and a tiny model for a few steps on a slice of Python's documentation written to a
text file (``--train-files``; the default corpus, the standard library's ~10 MB, takes too long to tokenize for a
smoke test), saves the Hub-ready folder, reloads it with the Auto classes and generates. The checks: the folder's
files, the PNG, the reload, and that the held-out loss fell. The default corpus (``examples/corpus.py``, shared with
``examples/compare.py``) and its whole-file split, the paragraph split of ``--train-files``, and the option checks
are tested on their own without training.
"""

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_densessm  # noqa: F401  (registers the model types)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPT = EXAMPLES / "pretrain.py"
EXPECTED_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
    "loss_curves.png",
}
TINY = ["--max-steps", "4", "--block-size", "32", "--batch-size", "8", "--vocab-size", "512", "--learning-rate", "1e-2"]


@pytest.fixture(scope="module")
def pretrain():
    spec = importlib.util.spec_from_file_location("pretrain_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus_module(pretrain):
    """``examples/corpus.py``, as ``pretrain.py`` imported it."""
    return sys.modules["corpus"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 20 kB of Python's documentation as one UTF-8 file."""
    from pydoc_data.topics import topics

    documents = [topics[name] for name in sorted(topics)]
    path = tmp_path_factory.mktemp("corpus") / "pydoc_slice.txt"
    path.write_text("\n\n".join(documents[:12])[:20_000], encoding="utf-8")
    return path


@pytest.mark.parametrize("model_type", ["densemamba", "denseretnet"])
def test_pretrain_end_to_end(pretrain, corpus, tmp_path, model_type):
    output_dir = tmp_path / "out" / model_type
    output_dir.mkdir(parents=True)  # an earlier run's output folder is replaced as a whole
    (output_dir / "config.json").write_text("{}")
    (output_dir / "stale.txt").write_text("from an earlier run")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = pretrain.main(
            ["--model", model_type, "--train-files", str(corpus), "--output-dir", str(output_dir), *TINY]
        )
    assert not [w for w in caught if "pin_memory" in str(w.message)]  # no accelerator: memory is not pinned

    assert result["output_dir"] == output_dir
    assert EXPECTED_FILES <= {p.name for p in output_dir.iterdir()}  # plus the remote code of the hub mixin
    assert not (output_dir / "stale.txt").exists()
    assert [p.name for p in output_dir.parent.iterdir()] == [model_type], "staging folder left behind"
    assert result["png"] == output_dir / "loss_curves.png"
    assert result["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the plot names the model and its final held-out loss, not the output folder
    assert result["plot_title"].startswith(f"{model_type}-tiny (") and f"-> {result['loss_after']:.3f}" in result["plot_title"]
    assert result["loss_after"] < result["loss_before"]
    assert result["loss_reloaded"] == pytest.approx(result["loss_after"], rel=1e-4)
    prompt = pretrain.parse_args([]).prompt
    assert result["generated"].startswith(prompt) and len(result["generated"]) > len(prompt)

    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert model.config.model_type == model_type
    assert model.config.vocab_size == len(tokenizer) == 512
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    assert tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id == model.config.bos_token_id


def test_default_corpus_is_the_standard_library_with_whole_files_held_out(pretrain, corpus_module):
    from pydoc_data.topics import topics

    documents = corpus_module.stdlib_documents()
    names = list(documents)
    assert names == sorted(names)
    assert "stdlib/json/decoder.py" in documents and "stdlib/pydoc_data/topics.py" not in documents
    assert documents["pydoc_data.topics/for"] == topics["for"]
    assert not [n for n in names if {"test", "tests", "idlelib", "site-packages"} & set(n.split("/")[:-1])]
    assert sum(map(len, documents.values())) > 5_000_000  # enough that the default run never repeats a token

    train, held_out = corpus_module.split_documents(documents)
    assert pretrain.load_texts(None) == (train, held_out)
    held_out_names = [n for n in names if corpus_module.is_held_out(n)]
    assert held_out == [documents[n] for n in held_out_names]  # whole files, chosen by name
    assert train == [documents[n] for n in names if n not in held_out_names]
    reversed_documents = dict(reversed(documents.items()))
    assert corpus_module.split_documents(reversed_documents) == (train[::-1], held_out[::-1])  # order-independent
    fraction = sum(map(len, held_out)) / (sum(map(len, train)) + sum(map(len, held_out)))
    assert 0.04 < fraction < 0.25


def test_train_files_hold_out_paragraphs(pretrain, corpus, corpus_module):
    text = corpus.read_text(encoding="utf-8")
    train, held_out = pretrain.load_texts([corpus])
    assert (train, held_out) == corpus_module.split_paragraphs([text])
    train_paragraphs = {p for t in train for p in t.split("\n\n")}
    held_out_paragraphs = {p for t in held_out for p in t.split("\n\n")}
    assert held_out_paragraphs and not train_paragraphs & held_out_paragraphs


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-steps", "0"],
        ["--block-size", "abc"],
        ["--learning-rate", "-1"],
        ["--vocab-size", "100"],
        ["--eval-blocks", "0"],
        ["--model", "transformer"],
        ["--model", "denseretnet", "--preset", "densemamba-tiny"],
        ["--train-files", "/nonexistent/file.txt"],
        ["--output-dir", str(Path(__file__).parent)],  # exists and is not a model folder: never replaced
    ],
)
def test_bad_options_are_argparse_errors(pretrain, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pretrain.parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {argv[-2]}" in capsys.readouterr().err


def test_too_little_text_names_the_options(pretrain, tmp_path):
    text_file = tmp_path / "short.txt"
    text_file.write_text("Only one short paragraph.", encoding="utf-8")
    with pytest.raises(ValueError, match="--train-files.*--block-size"):
        pretrain.main(["--train-files", str(text_file), "--output-dir", str(tmp_path / "out")])


def test_packed_blocks_restart_positions_at_each_document(corpus_module):
    texts = ["first document here", "a second one", "third"]
    tokenizer = corpus_module.train_tokenizer(texts * 20, 300)
    plain = corpus_module.pack_blocks(texts, tokenizer, 4)
    packed = corpus_module.pack_blocks(texts, tokenizer, 4, document_positions=True)
    assert "position_ids" not in plain.column_names and plain["input_ids"] == packed["input_ids"]
    for ids, positions, labels in zip(packed["input_ids"], packed["position_ids"], packed["labels"]):
        assert positions[0] == 0
        for j in range(1, len(ids)):  # a document starts at <s>: position 0, nothing predicts it
            assert positions[j] == (0 if ids[j] == tokenizer.bos_token_id else positions[j - 1] + 1)
        assert all((label == -100) == (p == 0) for label, p in zip(labels, positions))
