"""``pipeline("text-generation", model=folder)`` and ``TextIteratorStreamer`` work for both families (issue 10,
item 13), with a byte-level BPE tokenizer trained here on local text (nothing is downloaded)."""

import threading

import pydoc_data.topics
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, TextIteratorStreamer, pipeline

from helpers import FAMILIES, micro_model


@pytest.fixture(scope="module")
def tokenizer():
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=97, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(pydoc_data.topics.topics.values())[:50], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("family", FAMILIES)
def test_text_generation_pipeline_from_a_saved_folder(family, tokenizer, tmp_path):
    model = micro_model(family, vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    prompt = "The for statement"
    out = generator(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0]["generated_text"]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out == tokenizer.decode(expected[0], skip_special_tokens=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_text_iterator_streamer(family, tokenizer):
    model = micro_model(family, vocab_size=len(tokenizer))
    ids = tokenizer("The with statement", return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, streamer=streamer)
    thread = threading.Thread(target=model.generate, kwargs=kwargs)
    thread.start()
    pieces = list(streamer)
    thread.join()
    assert "".join(pieces) == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
