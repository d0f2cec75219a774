"""Padding and later tokens never reach a real token, whatever they hold (issue 33, item 6; docs/design.md §5,
"Padding"): NaN or inf in left-padded slots leaves the real tokens' logits bit-identical to those with finite padding
(and close to the tokens alone), in training the loss and every gradient too, and in a decoding step a padded row's
state; a NaN or inf at token 5 leaves the logits before it bit-identical and makes those from it on non-finite. Both
families, every kernel path (the PyTorch path, DenseMamba's C++ scan kernel, DenseRetNet's Triton kernels under the
interpreter), float32 and bfloat16.

Under the Triton interpreter a bfloat16 ``tl.dot`` drops NaN and inf (tests/ops/test_nonfinite.py), so there the
bfloat16 cases do not check that a non-finite value reaches the later tokens.
"""

import os

import pytest
import torch

from helpers import FAMILIES, micro_model, output_cache, random_ids
from hf_densessm.ops.cpu_kernel import load_kernel

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

ON_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or not (ON_CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="the Triton kernels need triton and either a GPU or TRITON_INTERPRET=1",
)
# (family, kernel_backend, HF_DENSESSM_CPU_KERNEL)
PATHS = [
    *(pytest.param(family, "torch", "0", id=f"{family}-torch") for family in FAMILIES),
    pytest.param("densemamba", "torch", "1", id="densemamba-cpu_kernel", marks=pytest.mark.skipif(
        ON_CUDA or not load_kernel(), reason="the C++ kernel runs on CPU tensors, once built")),
    # DenseMamba's interpreted Triton scan takes minutes per model call: tests/ops/test_nonfinite.py runs it
    pytest.param("denseretnet", "triton", "1", id="denseretnet-triton", marks=needs_triton),
]
DTYPES = [torch.float32, torch.bfloat16]
VALUES = [float("nan"), float("inf")]
PAD = 3


@pytest.fixture
def model_on(monkeypatch):
    def build(family, backend, cpu_kernel, dtype):
        monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", cpu_kernel)
        model = micro_model(family, kernel_backend=backend).to(dtype)
        return model, model.get_input_embeddings()(random_ids(2, 10)).detach()

    return build


@pytest.mark.parametrize("family, backend, cpu_kernel", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", VALUES)
def test_padding_never_reaches_real_tokens(model_on, family, backend, cpu_kernel, dtype, value):
    model, embeds = model_on(family, backend, cpu_kernel, dtype)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[:, :PAD] = 0
    finite_padding, spoiled = embeds.clone(), embeds.clone()
    finite_padding[:, :PAD] = torch.randn(2, PAD, embeds.shape[-1], generator=torch.Generator().manual_seed(3))
    spoiled[:, :PAD] = value
    with torch.no_grad():
        expected = model(inputs_embeds=finite_padding, attention_mask=mask).logits[:, PAD:]
        got = model(inputs_embeds=spoiled, attention_mask=mask).logits[:, PAD:]
        alone = model(inputs_embeds=embeds[:, PAD:]).logits
    assert got.isfinite().all() and torch.equal(got, expected)
    if dtype == torch.float32:
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family, backend, cpu_kernel", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", VALUES)
def test_later_token_never_reaches_earlier_ones(model_on, family, backend, cpu_kernel, dtype, value):
    model, embeds = model_on(family, backend, cpu_kernel, dtype)
    spoiled = embeds.clone()
    spoiled[:, 5] = value
    with torch.no_grad():
        expected, got = model(inputs_embeds=embeds).logits, model(inputs_embeds=spoiled).logits
    assert torch.equal(got[:, :5], expected[:, :5])
    if not (backend == "triton" and not ON_CUDA and dtype == torch.bfloat16):
        assert (~got[:, 5:].isfinite()).any(-1).all(), "a non-finite input must reach the later tokens"


def _loss_and_grads(model, embeds, mask, labels):
    model.zero_grad(set_to_none=True)
    loss = model(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family, backend, cpu_kernel", PATHS)
@pytest.mark.parametrize("value", VALUES)
def test_training_on_spoiled_padding_equals_training_on_finite_padding(model_on, family, backend, cpu_kernel, value):
    model, embeds = model_on(family, backend, cpu_kernel, torch.float32)
    model.train()
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :PAD] = 0
    labels = random_ids(2, 10).masked_fill(mask == 0, -100)
    spoiled = embeds.clone()
    spoiled[1, :PAD] = value
    loss, grads = _loss_and_grads(model, spoiled, mask, labels)
    expected_loss, expected_grads = _loss_and_grads(model, embeds, mask, labels)
    assert loss.isfinite() and torch.equal(loss, expected_loss)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert grad.isfinite().all() and torch.equal(grad, expected_grads[name]), name


@pytest.mark.parametrize("family, backend, cpu_kernel", PATHS)
@pytest.mark.parametrize("value", VALUES)
def test_padded_decoding_step_keeps_the_row_state(model_on, family, backend, cpu_kernel, value):
    """A decoding step in which row 1 is padding (its input spoiled) leaves row 1's cache as it was: the next real
    token's logits equal those after a padded step that held finite values."""
    model, embeds = model_on(family, backend, cpu_kernel, torch.float32)
    results = []
    for padding in (embeds[:, 6:7], torch.full_like(embeds[:, 6:7], value)):
        with torch.no_grad():
            cache = output_cache(model(inputs_embeds=embeds[:, :6], use_cache=True))
            step = embeds[:, 6:7].clone()
            step[1] = padding[1]
            model(inputs_embeds=step, attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]]),
                  cache=cache, use_cache=True)
            results.append(model(inputs_embeds=embeds[:, 7:8], cache=cache, use_cache=True).logits)
    assert results[1].isfinite().all() and torch.equal(results[1], results[0])
