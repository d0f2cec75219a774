"""The causal depthwise convolution token by token in float64 (Mamba paper §3.4): the ground truth of the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_naive"]


def causal_conv1d_naive(x, weight, bias=None, window=None, reset=None, activation=None):
    """:func:`hf_densessm.ops.causal_conv1d` token by token in float64, no checks (a test reference): ``x_p``,
    ``p < 0``, is ``window[:, :, K + p]`` (zeros without a window); with ``reset`` (bool) a tap reads ``x_p`` only
    when no token after ``p`` up to ``t`` starts a document. Arguments (any float dtype) as there; returns ``(batch,
    seq_len, channels)`` float64, differentiable in ``x``, ``weight``, ``bias`` and ``window``."""
    x = x.double()
    taps = weight.double().reshape(weight.shape[0], weight.shape[-1])
    batch, length, channels = x.shape
    kernel = taps.shape[1]
    zero = x.new_zeros(batch, channels)
    rows = []
    for t in range(length):
        acc = zero if bias is None else zero + bias.double()
        for k in range(kernel):
            p = t - (kernel - 1) + k
            if p >= 0:
                value = x[:, p]
            elif window is not None:
                value = window[:, :, kernel + p].double()
            else:
                continue
            if reset is not None:  # p is in t's document when no token in (p, t] starts one
                same = ~reset[:, max(p + 1, 0) : t + 1].bool().any(dim=1)
                value = value * same.double()[:, None]
            acc = acc + taps[:, k] * value
        rows.append(acc)
    out = torch.stack(rows, dim=1)
    return F.silu(out) if activation == "silu" else out
