"""The whole model, forward and backward, through the Triton kernels (under TRITON_INTERPRET=1 on the CPU)
equals the PyTorch reference path; and so do prefill + decode through the Triton decode-step kernels."""

import pytest
import torch

from helpers import FAMILIES, micro_model, output_cache, random_ids


# float64 models; the kernels keep some cross-tile partial sums in float32, so agreement is to float32 rounding.
TOL = dict(atol=1e-6, rtol=1e-5)


def _run(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_model_forward_and_backward_through_triton_equal_reference(family):
    model = micro_model(family).double().train()
    ids = random_ids(2, 19)
    model.config.kernel_backend = "torch"
    ref_logits, ref_grads = _run(model, ids)
    model.config.kernel_backend = "triton"
    logits, grads = _run(model, ids)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert grads.keys() == ref_grads.keys() and any(".dense_" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_through_triton_equal_reference(family):
    model = micro_model(family).double()
    ids = random_ids(2, 9)
    results = []
    for backend in ("torch", "triton"):
        model.config.kernel_backend = backend
        with torch.no_grad():
            out = model(ids[:, :6], use_cache=True)
            logits, cache = [out.logits], output_cache(out)
            for t in range(6, 9):
                out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
                logits.append(out.logits)
        results.append(torch.cat(logits, dim=1))
    torch.testing.assert_close(results[1], results[0], **TOL)
