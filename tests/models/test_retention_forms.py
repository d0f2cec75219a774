"""DenseRetNet's parallel, chunked and recurrent forms agree. With a tiny RMSNorm eps (1e-12) the per-head norm
also cancels any positive per-row rescaling, such as the published parallel form's: that is why tests with large
weights never saw the missing 1/sqrt(s_t) normalization; tests/models/test_published_denseretnet.py checks the published
function at the authors' init scale (docs/design.md §3)."""

import pytest
import torch

import hf_densessm.modeling.modeling_denseretnet as retnet_module
from hf_densessm.ops.retention.naive import chunk_retention_naive as parallel_retention, retention_gamma
from helpers import micro_model, output_cache, random_ids


def published_parallel_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, backend=None,
                                 reset=None):
    """The published RetNet parallel form: decay-mask rows divided by the square root of their sums, and each row
    of ``(q k^T) * D`` divided by ``max(1, sum |.|)`` (torchscale's MultiScaleRetention), then ``@ v``."""
    assert initial_state is None and reset is None
    batch, length, heads, key_dim = q.shape
    scale = key_dim**-0.5 if scale is None else scale
    q, k, v = (x.transpose(1, 2).double() for x in (q, k, v))
    pos = torch.arange(length)
    distance = (pos[:, None] - pos[None, :]).double()
    gamma = retention_gamma(heads, dtype=torch.float64)
    mask = torch.where(distance >= 0, gamma[:, None, None] ** distance.clamp(min=0), torch.zeros(()))
    mask = mask / mask.sum(-1, keepdim=True).sqrt()
    scores = (scale * q) @ k.transpose(-1, -2) * mask
    scores = scores / scores.abs().sum(-1, keepdim=True).clamp(min=1)
    o = (scores @ v).transpose(1, 2).to(torch.float32)
    return o, None


def plain_parallel_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, backend=None,
                             reset=None):
    assert initial_state is None and reset is None
    return parallel_retention(q, k, v, scale=scale), None


@pytest.mark.parametrize("dense_layers", [0, 2])
def test_parallel_chunked_and_recurrent_forms_agree(monkeypatch, dense_layers):
    model = micro_model("denseretnet", dense_layers=dense_layers, rms_norm_eps=1e-12)
    ids = random_ids(2, 23)
    with torch.no_grad():
        chunked = model(ids, use_cache=False).logits
        # recurrent: one token at a time through the decode step
        out = model(ids[:, :1], use_cache=True)
        steps, cache = [out.logits], output_cache(out)
        for t in range(1, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
        recurrent = torch.cat(steps, dim=1)
        monkeypatch.setattr(retnet_module, "chunk_retention", plain_parallel_retention)
        parallel = model(ids, use_cache=False).logits
        monkeypatch.setattr(retnet_module, "chunk_retention", published_parallel_retention)
        published = model(ids, use_cache=False).logits
    torch.testing.assert_close(recurrent, chunked, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(parallel, chunked, atol=1e-4, rtol=1e-4)
    # the published row rescalings are positive per row and head: the per-head RMSNorm removes them
    torch.testing.assert_close(published, chunked, atol=1e-3, rtol=1e-3)
