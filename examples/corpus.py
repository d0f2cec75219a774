"""The text corpus, tokenizer and packed blocks shared by the examples (``pretrain.py``, ``compare.py``).

Default text: what ships with every Python install, so nothing is downloaded:

- the standard library's own sources (``sysconfig.get_paths()["stdlib"]``, every ``*.py`` file outside test
  folders, ``idlelib`` and ``site-packages``; about 10 MB of code, docstrings and comments), and
- Python's documentation topics (``pydoc_data.topics``, about 0.5 MB of prose; the file ``pydoc_data/topics.py``
  itself is skipped, as its text comes in decoded).

Each source file and each topic is one *document*, named by its path (``stdlib/json/decoder.py``) or topic
(``pydoc_data.topics/for``). A document is held out, whole, when the CRC32 of its name is divisible by
:data:`HELD_OUT_EVERY`: no block of a held-out file is ever trained on, and the split depends neither on the order
of the files nor on their content. (Your own ``--train-files`` in ``pretrain.py`` are usually one or a few files, so
there paragraphs are held out instead: :func:`split_paragraphs`.)

The tokenizer is a byte-level BPE trained with ``tokenizers`` on training text only; :func:`pack_blocks` tokenizes
with ``datasets`` and packs into fixed-length blocks.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import zlib
from pathlib import Path

from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
HELD_OUT_EVERY = 10  # a document (or, for --train-files, a paragraph) is held out when crc32(...) % 10 == 0
MIN_VOCAB_SIZE = 256 + 3 + 1  # the byte alphabet, the three special tokens, and at least one merge
#: Folders of the standard library that are not part of the corpus: tests (they hold deliberately odd code and
#: data), IDLE, installed third-party packages, bytecode.
SKIPPED_FOLDERS = frozenset({"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__"})


def corpus_description() -> str:
    """One line naming the default corpus and the Python it came from (it differs between Python versions)."""
    return (
        f"Python {sys.version.split()[0]}'s standard-library sources ({stdlib_root()}, tests, idlelib and "
        "site-packages excluded) and pydoc_data.topics"
    )


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents() -> dict[str, str]:
    """The default corpus: ``{name: text}`` for every standard-library source file and every pydoc topic.

    Names are ``stdlib/<relative path>`` and ``pydoc_data.topics/<topic>``; the dict is sorted by name. Files that are
    not UTF-8 are skipped (none are, outside the test folders).
    """
    root = stdlib_root()
    documents = {}
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if name not in SKIPPED_FOLDERS)
        for file_name in sorted(files):
            path = Path(folder) / file_name
            relative = path.relative_to(root).as_posix()
            if not file_name.endswith(".py") or relative == "pydoc_data/topics.py":
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                documents[f"stdlib/{relative}"] = text
    from pydoc_data.topics import topics

    for name in sorted(topics):
        documents[f"pydoc_data.topics/{name}"] = topics[name]
    return dict(sorted(documents.items()))


def is_held_out(key: str) -> bool:
    """Whether the document (or paragraph) ``key`` belongs to the held-out set: CRC32 divisible by HELD_OUT_EVERY."""
    return zlib.crc32(key.encode("utf-8")) % HELD_OUT_EVERY == 0


def split_documents(documents: dict[str, str]) -> tuple[list[str], list[str]]:
    """Whole documents to training or held-out by the CRC32 of their *name*; each list keeps the dict's order."""
    train = [text for name, text in documents.items() if not is_held_out(name)]
    held_out = [text for name, text in documents.items() if is_held_out(name)]
    return train, held_out


def split_paragraphs(texts: list[str]) -> tuple[list[str], list[str]]:
    """For a few user files: split every text into its training and held-out paragraphs (blank-line separated, by
    the CRC32 of the paragraph), so that even a single file gives both sets."""
    train_texts, held_out_texts = [], []
    for text in texts:
        paragraphs = [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
        held_out = [is_held_out(p) for p in paragraphs]
        train_texts.append("\n\n".join(p for p, h in zip(paragraphs, held_out) if not h))
        held_out_texts.append("\n\n".join(p for p, h in zip(paragraphs, held_out) if h))
    return [t for t in train_texts if t], [t for t in held_out_texts if t]


def sample_texts(texts: list[str], max_chars: int | None) -> list[str]:
    """All ``texts``, or whole texts in a fixed, content-hashed order until ``max_chars`` characters: a sample that
    spreads over the whole library, not its alphabetically first folders (tokenizer training, small runs)."""
    if max_chars is None:
        return texts
    sample, total = [], 0
    for text in sorted(texts, key=lambda t: zlib.crc32(t.encode("utf-8", "surrogatepass"))):
        if total >= max_chars:
            break
        sample.append(text)
        total += len(text)
    return sample


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style: any text encodes, nothing is unknown) that prepends ``<s>``.

    Special tokens ``<pad>``, ``<s>``, ``</s>`` get ids 0, 1, 2, as in the paper's LLaMA tokenizer.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def pack_blocks(
    texts: list[str], tokenizer: PreTrainedTokenizerFast, block_size: int, document_positions: bool = False
) -> Dataset:
    """Tokenize each text as ``<s> ... </s>``, concatenate them all in order, and cut into ``block_size`` blocks
    (only the last partial block is dropped). Labels are the inputs: the models shift them themselves.

    With ``document_positions``, each block also gets ``position_ids`` that restart at 0 where a document starts
    (and at the block's first token), transformers' padding-free convention: the models then start every recurrent
    state from zero at each document, as if each ran alone, and the label of a document's first token (which the
    previous document's last token would predict) is -100."""

    def tokenize(batch):
        return {"input_ids": [ids + [tokenizer.eos_token_id] for ids in tokenizer(batch["text"])["input_ids"]]}

    def pack(batch):
        stream = [token for ids in batch["input_ids"] for token in ids]
        blocks = [stream[i : i + block_size] for i in range(0, len(stream) - block_size + 1, block_size)]
        if not document_positions:
            return {"input_ids": blocks, "labels": blocks}
        starts = [position for ids in batch["input_ids"] for position in range(len(ids))]  # 0 at each document
        positions, labels = [], []
        for i in range(0, len(blocks) * block_size, block_size):
            block_positions, position = [], 0
            for j in range(block_size):
                position = 0 if j == 0 or starts[i + j] == 0 else position + 1
                block_positions.append(position)
            positions.append(block_positions)
            labels.append([-100 if p == 0 else t for p, t in zip(block_positions, stream[i : i + block_size])])
        return {"input_ids": blocks, "labels": labels, "position_ids": positions}

    dataset = Dataset.from_dict({"text": texts})
    dataset = dataset.map(tokenize, batched=True, remove_columns=["text"], desc="tokenize")
    # One batch holding every text (batch_size=None), so that nothing but the final partial block is dropped.
    return dataset.map(pack, batched=True, batch_size=None, desc=f"pack into {block_size}-token blocks")


def evaluation_subset(blocks: Dataset, max_blocks: int | None) -> Dataset:
    """At most ``max_blocks`` held-out blocks, drawn with a fixed seed (0) from all held-out files, so that every run
    of a comparison, whatever its own seed, is evaluated on the same tokens; all blocks if ``max_blocks`` is None."""
    if max_blocks is None or len(blocks) <= max_blocks:
        return blocks
    return blocks.shuffle(seed=0).select(range(max_blocks))
