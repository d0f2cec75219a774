"""The PyTorch path of the causal depthwise convolution, token-major: ``K`` shifted multiply-adds each way (in place
eager, out of place while ``torch.compile`` traces), the backward by hand, taps masked to packed documents.
Formulas: docs/kernels.md, "Causal convolution". Static-shape branches only.
"""

from __future__ import annotations

import torch

from ..backend import compute_dtype
from ..packing import document_positions

__all__ = ["causal_conv1d_backward_torch", "causal_conv1d_torch"]


def _masks(reset: torch.Tensor | None, kernel: int, cdt: torch.dtype) -> dict | None:
    """Per shift ``s`` (1 .. K-1), the ``(batch, seq_len, 1)`` 0/1 mask of tokens whose tap at distance ``s`` counts
    (same document, or the window before the row's first document); ``None`` without ``reset``."""
    if reset is None:
        return None
    first_document = ~reset.cummax(dim=1).values  # no reset at or before t: every tap counts
    position = torch.where(first_document, kernel, document_positions(reset))
    return {s: (position >= s).to(cdt)[..., None] for s in range(1, kernel)}


def _padded(x, taps, window, kernel, cdt) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled form's operands: ``(batch, K - 1 + seq_len, channels)``, the window's newest ``K - 1`` inputs (or
    zeros) then ``x``, and a ``(K, channels)`` copy of ``taps`` materialized via ``as_strided`` (docs/kernels.md)."""
    padded = (torch.nn.functional.pad(x.to(cdt), (0, 0, kernel - 1, 0)) if window is None
              else torch.cat([window[:, :, 1:].to(cdt).transpose(1, 2), x.to(cdt)], dim=1))
    rows = taps.to(cdt).t().contiguous()
    return padded, rows.as_strided(rows.shape, rows.stride())


def _pre_activation(x, taps, bias, window, reset, cdt) -> torch.Tensor:
    """``pre`` ``(batch, seq_len, channels)`` contiguous in ``cdt``: in place eager, out of place while compiling."""
    length, kernel = x.shape[1], int(taps.shape[1])  # the taps unrolled: K is static (specialized under compile)
    masks = _masks(reset, kernel, cdt)
    if torch.compiler.is_compiling():
        padded, rows = _padded(x, taps, window, kernel, cdt)
        pre = padded[:, kernel - 1 :] * rows[kernel - 1]
        if bias is not None:
            pre = pre + bias.to(cdt)
        for k in range(kernel - 1):
            term = padded[:, k : k + length] * rows[k]
            pre = pre + (term if masks is None else term * masks[kernel - 1 - k])
        return pre
    x = x.to(cdt)
    taps = taps.to(cdt).t().contiguous().t()  # each tap's column unit-strided: the vectorized loops
    pre = torch.mul(x, taps[:, kernel - 1]) if bias is None else torch.addcmul(bias.to(cdt), x, taps[:, kernel - 1])
    pre = pre.contiguous()  # tap K - 1 (shift 0); a copy only where x's layout is channel-major
    for k, s, tokens, read, source, _ in _shifts(x, window, length, kernel, cdt):
        source = source[:, read] if masks is None else source[:, read] * masks[s][:, tokens]
        pre[:, tokens].addcmul_(source, taps[:, k])
    return pre


def _shifts(x, window, length, kernel, cdt):
    """The eager forms' shifted reads, ``(k, s, tokens, read, source, index of the source)`` per tap ``k < K - 1``
    (shift ``s = K - 1 - k``) and source (``x``, then the window's newest ``K - 1`` inputs, if any, as ``(batch,
    K - 1, channels)`` in ``cdt``): ``tokens`` (``t``) and ``read`` (``t - s``) slice the tokens reading it."""
    sources = [(x, 0)] + ([] if window is None else [(window[:, :, 1:].to(cdt).transpose(1, 2), 1 - kernel)])
    for k in range(kernel - 1):
        s = kernel - 1 - k
        for i, (source, start) in enumerate(sources):
            t0, t1 = max(0, start + s), min(length, start + source.shape[1] + s)
            if t0 < t1:
                yield k, s, slice(t0, t1), slice(t0 - s - start, t1 - s - start), source, i


def causal_conv1d_torch(x, taps, bias=None, window=None, reset=None, silu=False) -> torch.Tensor:
    """The forward pass of :func:`hf_densessm.ops.causal_conv1d`, no checks: ``taps`` ``(channels, K)``, ``reset``
    bool or ``None``, ``silu`` a bool, the rest as there. Returns ``(batch, seq_len, channels)`` contiguous in ``x``'s
    dtype, computed in float32 (float64 for float64 ``x``)."""
    pre = _pre_activation(x, taps, bias, window, reset, compute_dtype(x.dtype))
    if silu:
        torch.nn.functional.silu(pre, inplace=True)
    return pre.to(x.dtype)


def causal_conv1d_backward_torch(grad_out, x, taps, bias=None, window=None, reset=None, silu=False):
    """The backward pass of :func:`causal_conv1d_torch` given ``grad_out`` ``(batch, seq_len, channels)`` (any strides)
    and its arguments; recomputes ``pre`` when ``silu``.

    Returns:
        ``(grad_x, grad_taps, grad_bias, grad_window)``: ``(batch, seq_len, channels)`` in ``x``'s dtype,
        ``(channels, K)`` in ``taps``' dtype, ``(channels,)`` in ``bias``' dtype (an empty ``(0,)`` tensor without a
        bias), ``(batch, channels, K)`` in ``window``'s dtype (column 0 zero; an empty ``(0,)`` tensor without a
        window). Computed in float32 (float64 for float64 ``x``).
    """
    length, kernel = x.shape[1], int(taps.shape[1])
    cdt = compute_dtype(x.dtype)
    g = grad_out.to(cdt)
    if silu:
        g = torch.ops.aten.silu_backward(g, _pre_activation(x, taps, bias, window, reset, cdt))
    masks = _masks(reset, kernel, cdt)
    if torch.compiler.is_compiling():  # out of place, for Inductor (as in _pre_activation)
        padded, rows = _padded(x, taps, window, kernel, cdt)
        grad_padded = torch.nn.functional.pad(g * rows[kernel - 1], (0, 0, kernel - 1, 0))
        columns = [None] * kernel
        columns[kernel - 1] = (g * padded[:, kernel - 1 :]).sum((0, 1))
        for k in range(kernel - 1):  # tap k of token t reads padded index t + k
            gs = g if masks is None else g * masks[kernel - 1 - k]
            grad_padded = grad_padded + torch.nn.functional.pad(gs * rows[k], (0, 0, k, kernel - 1 - k))
            columns[k] = (gs * padded[:, k : k + length]).sum((0, 1))
        grad_context, grad_x = grad_padded.split([kernel - 1, length], dim=1)
    else:  # in place: g_t flows to source t - s
        xc, tc = x.to(cdt), taps.to(cdt).t().contiguous().t()  # each tap's column unit-strided
        grad_context = None if window is None else g.new_zeros((x.shape[0], kernel - 1, x.shape[2]))
        grad_x = torch.mul(g, tc[:, kernel - 1]).contiguous()  # tap K - 1 (shift 0)
        columns = [g.new_zeros((x.shape[2],)) for _ in range(kernel - 1)] + [(g * xc).sum((0, 1))]
        for k, s, tokens, read, source, i in _shifts(xc, window, length, kernel, cdt):
            gs = g[:, tokens] if masks is None else g[:, tokens] * masks[s][:, tokens]
            (grad_context if i else grad_x)[:, read].addcmul_(gs, tc[:, k])
            columns[k] = columns[k] + (gs * source[:, read]).sum((0, 1))
    grad_taps = torch.stack(columns, dim=1).to(taps.dtype)
    grad_bias = g.sum((0, 1)).to(bias.dtype) if bias is not None else x.new_empty((0,))
    grad_window = x.new_empty((0,)) if window is None else (  # column 0 (zero) is never read
        torch.nn.functional.pad(grad_context, (0, 0, 1, 0)).transpose(1, 2).contiguous().to(window.dtype))
    return grad_x.contiguous().to(x.dtype), grad_taps, grad_bias, grad_window
