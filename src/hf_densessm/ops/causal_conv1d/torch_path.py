"""The PyTorch path of the causal depthwise convolution: forward and hand-written backward, token-major.

The convolution is linear in each of its inputs and has ``K`` taps (``conv_kernel``, 4 in the models), so both
passes are ``K`` shifted multiply-adds over ``(batch, seq_len, channels)`` tensors. In eager mode each is an
in-place ``addcmul_`` into one buffer (one pass over memory per tap, no padded copy of ``x``, no transposes); while
``torch.compile`` traces, the same sums are written out of place over a padded copy, which Inductor fuses into a
loop or two (it would turn in-place updates of slices into chains of scatters). With the shift
``s = K - 1 - k`` of tap ``k`` (Mamba paper §3.4; the notation of :mod:`.naive`)::

    pre_t    = bias + sum_k w_k * x_{t - s_k}                    (x_p, p < 0: the window's newest K - 1 inputs)
    out_t    = silu(pre_t)  or  pre_t
    g_t      = dL/dpre_t = silu'(pre_t) * dL/dout_t              (pre recomputed, never stored)
    dL/dx_p  = sum_k w_k * g_{p + s_k}                           (p + s_k < seq_len)
    dL/dw_k  = sum_{b, t} g_t * x_{t - s_k},   dL/dbias = sum_{b, t} g_t
    dL/dwindow[:, :, K + p] = sum_k w_k * g_{p + s_k}            (p = -(K - 1) .. -1; column 0 is never read)

Packed documents (``reset``): tap ``k`` of token ``t`` counts only when ``x_{t - s_k}`` lies in ``t``'s document,
i.e. ``position_t >= s_k`` (:func:`~hf_densessm.ops.packing.document_positions`); the window is read only by the
row's first document (the tokens before its first reset), as the selective scan reads its initial state. The
backward pass applies the same masks to ``g``.

These functions are the bodies of the ``hf_densessm::causal_conv1d`` ops (``__init__.py``) and, as such, are
traced by ``torch.compile`` with FakeTensors: only static-shape Python branches (``K`` is specialized), no
data-dependent ones.
"""

from __future__ import annotations

import torch

from ..packing import document_positions

__all__ = ["causal_conv1d_backward_torch", "causal_conv1d_torch"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _masks(reset: torch.Tensor | None, kernel: int, cdt: torch.dtype) -> dict | None:
    """Per shift ``s`` (1 .. K-1), the ``(batch, seq_len, 1)`` 0/1 mask of the tokens whose tap at distance ``s``
    counts: ``x_{t - s}`` lies in ``t``'s document, or ``t - s < 0`` and ``t`` is in the row's first document (the
    window precedes it); ``None`` without ``reset``."""
    if reset is None:
        return None
    first_document = ~reset.cummax(dim=1).values  # no reset at or before t: every tap counts
    position = torch.where(first_document, kernel, document_positions(reset))
    return {s: (position >= s).to(cdt)[..., None] for s in range(1, kernel)}


def _padded(x, window, kernel, cdt) -> torch.Tensor:
    """``(batch, K - 1 + seq_len, channels)``: the window's newest ``K - 1`` inputs (or zeros), then ``x``."""
    if window is None:
        return torch.nn.functional.pad(x.to(cdt), (0, 0, kernel - 1, 0))
    return torch.cat([window[:, :, 1:].to(cdt).transpose(1, 2), x.to(cdt)], dim=1)


def _tap_rows(taps: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """``(K, channels)`` contiguous copy of ``taps`` for the compiled form. The ``as_strided`` view makes Inductor
    write the copy to memory (its lowering of ``as_strided`` realizes the input) instead of inlining the transpose
    into the loops, where a stride-``K`` load of each tap keeps the C++ backend from vectorizing them (measured at
    batch 2, seq 1024, dim 1024, K 4: about 10x slower)."""
    rows = taps.to(cdt).t().contiguous()
    return rows.as_strided(rows.shape, rows.stride())


def _pre_activation(x, taps, bias, window, reset, cdt) -> torch.Tensor:
    """``pre`` of the module docstring: ``(batch, seq_len, channels)`` contiguous, in ``cdt``.

    Eager: one buffer, the taps added in place (one pass over memory per tap). While ``torch.compile`` traces (the
    op decomposed into this body): the same sum written out of place over a padded copy, which Inductor fuses into
    one loop (it turns in-place updates of slices into chains of scatters instead)."""
    length, kernel = x.shape[1], int(taps.shape[1])  # the taps unrolled: K is static (specialized under compile)
    masks = _masks(reset, kernel, cdt)
    if torch.compiler.is_compiling():
        padded, rows = _padded(x, window, kernel, cdt), _tap_rows(taps, cdt)
        pre = padded[:, kernel - 1 :] * rows[kernel - 1]
        if bias is not None:
            pre = pre + bias.to(cdt)
        for k in range(kernel - 1):
            term = padded[:, k : k + length] * rows[k]
            pre = pre + (term if masks is None else term * masks[kernel - 1 - k])
        return pre
    x = x.to(cdt)
    taps = taps.to(cdt).t().contiguous().t()  # each tap's column unit-strided: the vectorized loops
    if bias is not None:
        pre = torch.addcmul(bias.to(cdt), x, taps[:, kernel - 1])  # tap K - 1 (shift 0)
    else:
        pre = torch.mul(x, taps[:, kernel - 1])
    pre = pre.contiguous()  # a copy only where x's layout is channel-major
    context = None if window is None else window[:, :, 1:].to(cdt).transpose(1, 2)  # (batch, K - 1, channels)
    for k in range(kernel - 1):
        s = kernel - 1 - k
        if s < length:  # tokens t >= s read x_{t - s}
            source = x[:, : length - s]
            if masks is not None:
                source = source * masks[s][:, s:]
            pre[:, s:].addcmul_(source, taps[:, k])
        if context is not None:  # tokens t < s read the window's input t - s
            n = min(s, length)
            source = context[:, kernel - 1 - s : kernel - 1 - s + n]
            if masks is not None:
                source = source * masks[s][:, :n]
            pre[:, :n].addcmul_(source, taps[:, k])
    return pre


def causal_conv1d_torch(x, taps, bias=None, window=None, reset=None, silu=False) -> torch.Tensor:
    """The forward pass of :func:`hf_densessm.ops.causal_conv1d` (module docstring), no checks.

    Args:
        x: ``(batch, seq_len, channels)`` float, any strides. taps: ``(channels, K)``. bias: ``(channels,)`` or
            ``None``. window: ``(batch, channels, K)`` or ``None``. reset: ``(batch, seq_len)`` bool or ``None``.
        silu: apply SiLU.

    Returns:
        ``(batch, seq_len, channels)`` contiguous in ``x``'s dtype, computed in float32 (float64 for float64 ``x``).
        Plain PyTorch operations: autograd can differentiate it too, but the op uses
        :func:`causal_conv1d_backward_torch`.
    """
    cdt = _compute_dtype(x.dtype)
    pre = _pre_activation(x, taps, bias, window, reset, cdt)
    if silu:
        torch.nn.functional.silu(pre, inplace=True)
    return pre.to(x.dtype)


def causal_conv1d_backward_torch(grad_out, x, taps, bias=None, window=None, reset=None, silu=False):
    """The backward pass of :func:`causal_conv1d_torch` (module docstring); recomputes ``pre`` when ``silu``.

    Args:
        grad_out: ``(batch, seq_len, channels)``, any strides (an expanded gradient is fine).
        x, taps, bias, window, reset, silu: as in :func:`causal_conv1d_torch`.

    Returns:
        ``(grad_x, grad_taps, grad_bias, grad_window)``: ``(batch, seq_len, channels)`` in ``x``'s dtype,
        ``(channels, K)`` in ``taps``' dtype, ``(channels,)`` in ``bias``' dtype (an empty ``(0,)`` tensor without a
        bias), ``(batch, channels, K)`` in ``window``'s dtype (column 0 zero; an empty ``(0,)`` tensor without a
        window). Computed in float32 (float64 for float64 ``x``).
    """
    batch, length, channels = x.shape
    kernel = int(taps.shape[1])
    cdt = _compute_dtype(x.dtype)
    if silu:
        pre = _pre_activation(x, taps, bias, window, reset, cdt)
        g = torch.ops.aten.silu_backward(grad_out.to(cdt), pre)
    else:
        g = grad_out.to(cdt)
    masks = _masks(reset, kernel, cdt)
    if torch.compiler.is_compiling():  # out of place, for Inductor (as in _pre_activation)
        padded, rows = _padded(x, window, kernel, cdt), _tap_rows(taps, cdt)
        grad_padded = g * rows[kernel - 1]
        grad_padded = torch.nn.functional.pad(grad_padded, (0, 0, kernel - 1, 0))
        columns = [None] * kernel
        columns[kernel - 1] = (g * padded[:, kernel - 1 :]).sum((0, 1))
        for k in range(kernel - 1):  # tap k of token t reads padded index t + k
            gs = g if masks is None else g * masks[kernel - 1 - k]
            grad_padded = grad_padded + torch.nn.functional.pad(gs * rows[k], (0, 0, k, kernel - 1 - k))
            columns[k] = (gs * padded[:, k : k + length]).sum((0, 1))
        grad_x = grad_padded[:, kernel - 1 :]
        grad_context = grad_padded[:, : kernel - 1]
    else:
        grad_x, grad_context, columns = _backward_in_place(g, x, taps, window, masks, cdt)
    grad_taps = torch.stack(columns, dim=1).to(taps.dtype)
    grad_bias = g.sum((0, 1)).to(bias.dtype) if bias is not None else x.new_empty((0,))
    if window is not None:
        grad_window = torch.cat([grad_context.new_zeros(batch, 1, channels), grad_context], 1)
        grad_window = grad_window.transpose(1, 2).contiguous().to(window.dtype)  # column 0 is never read
    else:
        grad_window = x.new_empty((0,))
    return grad_x.contiguous().to(x.dtype), grad_taps, grad_bias, grad_window


def _backward_in_place(g, x, taps, window, masks, cdt):
    """Eager backward: ``grad_x`` (one buffer, the taps added in place), the window's ``(batch, K - 1, channels)``
    gradient (or ``None``) and the ``K`` columns of the taps' gradient, each ``(channels,)``."""
    batch, length, channels = x.shape
    kernel = int(taps.shape[1])
    xc, tc = x.to(cdt), taps.to(cdt).t().contiguous().t()  # each tap's column unit-strided
    context = None if window is None else window[:, :, 1:].to(cdt).transpose(1, 2)  # (batch, K - 1, channels)
    grad_context = None if window is None else torch.zeros((batch, kernel - 1, channels), dtype=cdt, device=x.device)
    grad_x = torch.mul(g, tc[:, kernel - 1]).contiguous()  # tap K - 1 (shift 0)
    columns = [None] * kernel
    columns[kernel - 1] = (g * xc).sum((0, 1))
    for k in range(kernel - 1):
        s = kernel - 1 - k
        column = torch.zeros((channels,), dtype=cdt, device=x.device)
        if s < length:  # g_t, t >= s, flows to x_{t - s}
            gs = g[:, s:] if masks is None else g[:, s:] * masks[s][:, s:]
            grad_x[:, : length - s].addcmul_(gs, tc[:, k])
            column = column + (gs * xc[:, : length - s]).sum((0, 1))
        if context is not None:  # g_t, t < s, flows to the window's input t - s
            n = min(s, length)
            gs = g[:, :n] if masks is None else g[:, :n] * masks[s][:, :n]
            grad_context[:, kernel - 1 - s : kernel - 1 - s + n].addcmul_(gs, tc[:, k])
            column = column + (gs * context[:, kernel - 1 - s : kernel - 1 - s + n]).sum((0, 1))
        columns[k] = column
    return grad_x, grad_context, columns
