"""Sequence classification (issue 10, item 12): ``AutoModelForSequenceClassification`` builds both families'
heads, ``Trainer`` fine-tunes one on a small real labelled task built from local text, and left- and right-padded
batches give the same logits."""

import inspect
import json
import random
import textwrap

import pydoc_data.topics
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

from helpers import FAMILIES, micro_config, random_ids

LENGTH = 48
PAD = 0


def encode(text: str) -> list[int]:
    """Bytes as token ids (3 .. 258); 0 is padding."""
    return [b + 3 for b in text.encode("utf-8")[:LENGTH]]


def code_vs_prose(count: int, seed: int) -> Dataset:
    """Label 1: a window of Python source (the standard library's ``json`` and ``textwrap`` modules); label 0: a
    window of English documentation (``pydoc_data.topics``). Windows of ``LENGTH`` bytes; ragged tails are padded."""
    rng = random.Random(seed)
    code = "\n".join(inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap))
    code_lines = [line for line in code.splitlines() if line.strip() and not line.strip().startswith(("#", '"'))]
    prose = " ".join(pydoc_data.topics.topics.values()).split()
    rows = []
    for i in range(count):
        if i % 2:
            start = rng.randrange(len(code_lines) - 4)
            text = "\n".join(code_lines[start : start + 4])
        else:
            start = rng.randrange(len(prose) - 12)
            text = " ".join(prose[start : start + 12])
        ids = encode(text)[: rng.randrange(LENGTH // 2, LENGTH + 1)]
        rows.append({"input_ids": ids + [PAD] * (LENGTH - len(ids)), "attention_mask": [1] * len(ids) + [0] * (LENGTH - len(ids)),
                     "labels": i % 2})
    return Dataset.from_list(rows)


def classifier(family, **overrides):
    torch.manual_seed(0)
    kwargs = dict(vocab_size=259, num_labels=2, pad_token_id=PAD)
    kwargs.update(overrides)
    return AutoModelForSequenceClassification.from_config(micro_config(family, **kwargs))


@pytest.mark.parametrize("family", FAMILIES)
def test_left_and_right_padding_give_the_same_logits(family):
    model = classifier(family).eval()
    long, short = random_ids(1, 7, seed=3)[0], random_ids(1, 4, seed=4)[0]
    pads = torch.full((3,), PAD)
    left = torch.stack([long, torch.cat([pads, short])])
    right = torch.stack([long, torch.cat([short, pads])])
    out_left = model(left, attention_mask=(left != PAD).long()).logits
    out_right = model(right, attention_mask=(right != PAD).long()).logits
    alone = model(short[None]).logits
    torch.testing.assert_close(out_left, out_right, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out_left[1], alone[0], atol=1e-6, rtol=1e-5)


def test_batches_need_a_pad_token():
    model = classifier("densemamba", pad_token_id=None).eval()
    with pytest.raises(ValueError, match="padding token"):
        model(random_ids(2, 5))


def test_trainer_fine_tunes_a_classifier_on_real_text(tmp_path):
    train, test = code_vs_prose(512, seed=0), code_vs_prose(128, seed=1)
    model = classifier("denseretnet")
    args = TrainingArguments(
        tmp_path, max_steps=100, per_device_train_batch_size=16, learning_rate=1e-2, warmup_steps=10,
        report_to=[], save_strategy="no", logging_steps=1000, seed=0, use_cpu=True, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train)
    before = trainer.predict(test)
    trainer.train()
    after = trainer.predict(test)
    accuracy = (after.predictions.argmax(-1) == after.label_ids).mean()
    assert after.metrics["test_loss"] < before.metrics["test_loss"] - 0.2, (before.metrics, after.metrics)
    assert accuracy > 0.8, accuracy
