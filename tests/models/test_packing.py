"""Packed-sequence training (issue 11): many documents in one row, every recurrent state reset at each document.

A packed row gives the logits, the loss and every parameter's gradient of the same documents run one by one
(float64, 1e-10), for both families and both of DenseMamba's ``dense_target`` modes, with documents shorter than the
convolution kernel, one-token documents, and boundaries inside and at the edges of the reference's chunks; the three
padding-free inputs of transformers (``cu_seq_lens_q``, ``seq_idx``, ``position_ids``) agree; misuse is refused;
``Trainer`` with ``DataCollatorWithFlattening`` trains both families on real text with the padded batch's loss.
"""

import pydoc_data.topics
import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from helpers import VOCAB, micro_model, output_cache

VARIANTS = [("densemamba", {}), ("densemamba", {"dense_target": "state"}), ("denseretnet", {})]
IDS = ["densemamba-input", "densemamba-state", "denseretnet"]
# 1 + 2 + 5 + 1 + 56 + 9 + 20 = 94 tokens: one-token and shorter-than-the-conv-kernel documents, and a boundary at 64
# (the retention reference's chunk); the selective-scan reference cuts 94 tokens into chunks of 10.
LENGTHS = [1, 2, 5, 1, 55, 10, 20]


def documents(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]


def packed_inputs(docs):
    """What ``DataCollatorWithFlattening`` gives: one row, labels with -100 at each document's first token."""
    ids = torch.cat(docs)[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])[None]
    cu = torch.tensor([0] + [int(x) for x in torch.tensor([len(d) for d in docs]).cumsum(0)], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    seq_idx = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    return ids, labels, cu, position_ids, seq_idx


def next_token_loss_sum(logits, labels):
    """Summed float64 next-token cross-entropy (transformers' loss casts logits to float32)."""
    return F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")


def assert_packed_equals_documents(model, docs, logits_tol, grad_tol):
    """Logits, float64 loss and every parameter's gradient of ``docs`` packed into one row (``position_ids``) equal
    those of the documents run one by one (the loss summed over documents, normalized by all predicted tokens)."""
    ids, labels, _, position_ids, _ = packed_inputs(docs)
    predicted = sum(len(d) - 1 for d in docs)

    out = model(input_ids=ids, labels=labels, position_ids=position_ids)
    packed_loss = next_token_loss_sum(out.logits, labels) / predicted
    packed_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(out.loss.double(), packed_loss.detach(), atol=0, rtol=1e-6)  # transformers' loss

    model.zero_grad()
    logits, alone_loss = [], 0.0
    for d in docs:
        doc_logits = model(d[None]).logits
        logits.append(doc_logits[0].detach())
        loss = next_token_loss_sum(doc_logits, d[None]) / predicted
        loss.backward()
        alone_loss = alone_loss + loss.detach()
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(out.logits[0].detach(), torch.cat(logits), **logits_tol)
    torch.testing.assert_close(packed_loss.detach(), alone_loss, **logits_tol)
    assert packed_grads.keys() == alone_grads.keys() and any(".dense_" in n for n in packed_grads)
    for name in packed_grads:
        torch.testing.assert_close(packed_grads[name], alone_grads[name], **grad_tol, msg=name)


@pytest.mark.parametrize("family, knobs", VARIANTS, ids=IDS)
def test_packed_row_equals_documents_one_by_one(family, knobs):
    model = micro_model(family, **knobs).double().train()
    model.config.dropout = 0.0
    assert_packed_equals_documents(
        model, documents(), logits_tol=dict(atol=1e-10, rtol=1e-10), grad_tol=dict(atol=1e-10, rtol=1e-8)
    )


@pytest.mark.parametrize("family, knobs", VARIANTS, ids=IDS)
def test_the_three_padding_free_inputs_agree(family, knobs):
    model = micro_model(family, **knobs).double()
    ids, _, cu, position_ids, seq_idx = packed_inputs(documents())
    ref = model(ids, position_ids=position_ids).logits
    assert not torch.allclose(ref, model(ids).logits)  # packing changes the function
    torch.testing.assert_close(model(ids, cu_seq_lens_q=cu).logits, ref, atol=0, rtol=0)
    torch.testing.assert_close(model(ids, seq_idx=seq_idx).logits, ref, atol=0, rtol=0)
    both = model(ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=56, max_length_k=56, position_ids=position_ids)
    torch.testing.assert_close(both.logits, ref, atol=0, rtol=0)
    # positions of one document per row (0 .. L-1) are not packing: the model behaves exactly as without them
    plain = model(ids).logits
    torch.testing.assert_close(model(ids, position_ids=torch.arange(ids.shape[1])[None]).logits, plain, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["densemamba", "denseretnet"])
def test_packed_inputs_are_checked(family):
    model = micro_model(family)
    ids, _, cu, position_ids, seq_idx = packed_inputs(documents())
    cases = [
        (dict(cu_seq_lens_q=cu[:-1]), ValueError, "cu_seq_lens_q"),  # does not reach the length
        (dict(cu_seq_lens_q=torch.tensor([0, 3, 3, 94])), ValueError, "cu_seq_lens_q"),  # an empty document
        (dict(cu_seq_lens_q=cu.float()), TypeError, "cu_seq_lens_q"),
        (dict(seq_idx=seq_idx.flip(-1)), ValueError, "seq_idx"),
        (dict(seq_idx=seq_idx[:, :-1]), ValueError, "seq_idx"),
        (dict(position_ids=position_ids + 1), None, None),  # never restarts at 0 past the start: not packing
        (dict(position_ids=torch.cat([position_ids[:, :5], position_ids[:, 6:], torch.zeros(1, 1, dtype=torch.long)], 1)), ValueError, "position_ids"),
        (dict(position_ids=position_ids, seq_idx=torch.zeros_like(seq_idx).index_fill_(1, torch.tensor([50]), 0)), ValueError, "position_ids|seq_idx"),
        (dict(position_ids=position_ids, use_cache=True), ValueError, "decoding"),
        (dict(position_ids=position_ids, attention_mask=torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)), ValueError, "attention_mask"),
    ]
    for kwargs, exc, match in cases:
        if exc is None:
            model(ids, **kwargs)
            continue
        with pytest.raises(exc, match=match):
            model(ids, **kwargs)
    cache = output_cache(model(ids[:, :3], use_cache=True))
    with pytest.raises(ValueError, match="give no `cache`"):
        model(ids, position_ids=position_ids, cache=cache)


def topic_documents(count=12, max_len=200):
    """Real text documents of varied lengths: the first paragraph of pydoc topics, as bytes folded into the vocab."""
    topics = sorted(pydoc_data.topics.topics.items())[:count]
    docs = []
    for _, text in topics:
        paragraph = text.strip().split("\n\n")[0]
        data = torch.tensor(list(paragraph.encode("utf-8")[:max_len]), dtype=torch.long)
        docs.append({"input_ids": (data % (VOCAB - 3) + 3).tolist()})
    return docs


@pytest.mark.parametrize("family", ["densemamba", "denseretnet"])
def test_trainer_with_flattening_collator_matches_padded_loss_and_trains(family, tmp_path):
    docs = topic_documents()
    assert len({len(d["input_ids"]) for d in docs}) > 3  # varied lengths
    model = micro_model(family).double()
    collator = DataCollatorWithFlattening()
    packed = collator(docs)
    assert packed["input_ids"].shape[0] == 1 and "position_ids" in packed
    width = max(len(d["input_ids"]) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    labels = torch.full((len(docs), width), -100)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for i, d in enumerate(docs):
        n = len(d["input_ids"])
        ids[i, :n] = labels[i, :n] = torch.tensor(d["input_ids"])
        mask[i, :n] = 1
    with torch.no_grad():
        packed_loss = model(**packed).loss
        padded_loss = model(ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(packed_loss, padded_loss, atol=0, rtol=1e-6)  # transformers casts logits to float32

    model = micro_model(family).train()
    args = TrainingArguments(tmp_path, max_steps=8, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=docs, data_collator=collator)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("family, knobs", VARIANTS, ids=IDS)
def test_packed_row_equals_documents_one_by_one_through_triton(family, knobs):
    """The same comparison through the Triton kernels (``kernel_backend="triton"``, under TRITON_INTERPRET=1 on the
    CPU). Documents of 1, 7, 7, 1, 16 and 3 tokens start at 0, 1, 8, 15 (a one-token document at the last token of
    a 16-token scan chunk), 16 and 32 (scan chunk edges; 32 is also the edge of the 32-token retention chunk), the
    last one shorter than the conv kernel. The interpreter's associative scan is slow, so DenseMamba is smaller
    here (hidden 16, state 4, 2 layers). The kernels keep some partial sums in float32, so agreement is to float32
    rounding (tests/models/test_kernel_paths.py's tolerance)."""
    pytest.importorskip("triton")
    smaller = dict(hidden_size=16, state_size=4, num_hidden_layers=2) if family == "densemamba" else {}
    model = micro_model(family, **smaller, **knobs).double().train()
    model.config.dropout = 0.0
    model.config.kernel_backend = "triton"
    tol = dict(atol=1e-6, rtol=1e-5)
    assert_packed_equals_documents(model, documents([1, 7, 7, 1, 16, 3]), logits_tol=tol, grad_tol=tol)
