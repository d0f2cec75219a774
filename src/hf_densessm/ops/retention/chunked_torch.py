"""Multi-scale retention in vectorized PyTorch (DenseSSM paper Eq. 18, 19, 24; RetNet chunkwise form): the
``backend="torch"`` path, accumulated in float32 (float64 for float64 inputs). Contracts as
:func:`hf_densessm.ops.retention.chunk_retention` / ``retention_state_update``; docs/kernels.md.
"""

import torch
import torch.nn.functional as F

from ..backend import compute_dtype
from .naive import retention_log2_gamma

__all__ = ["chunk_retention_torch", "chunk_retention_torch_backward", "default_chunk_size",
           "retention_state_update_torch"]


def default_chunk_size(key_dim, value_dim):
    """Chunk length of the PyTorch path: 64, or 256 for states above 2**18 elements per head (docs/benchmarks.md)."""
    return 64 if key_dim * value_dim <= 2**18 else 256


def _block_masks(log2_gamma, C, n, segments, dtype):
    """``(intra, q_decay, k_decay, chunk_decay)`` of ``n`` chunks of ``C`` tokens: ``gamma^(i-j)`` (``j <= i``),
    ``gamma^(i+1)``, ``gamma^(C-1-j)``, ``gamma^C``, masked to documents by ``segments`` ``(B, n, C + 1)`` (the
    document of the token before each chunk, then of its tokens) or None (docs/kernels.md, "Packed sequences")."""
    i = torch.arange(C + 1, device=log2_gamma.device, dtype=dtype)  # gamma^(i-j), j > i: finite (<= gamma_0^-255)
    intra = torch.exp2(log2_gamma.view(-1, 1, 1) * (i[:C, None] - i[:C])).tril()  # (H, C, C), zeroed above
    powers = torch.exp2(log2_gamma[:, None] * i)  # (H, C + 1): gamma^0 .. gamma^C
    q_decay, k_decay = powers[:, 1:].view(-1, 1, C, 1), powers[:, :C].flip(1).view(-1, 1, C, 1)
    chunk_decay = powers[:, C].view(1, -1, 1, 1, 1)
    if segments is None:
        return intra[:, None], q_decay, k_decay, chunk_decay.expand(-1, -1, n, -1, -1)
    before, seg = segments[:, :, :1], segments[:, :, 1:]  # (B, n, 1), (B, n, C)
    same = (seg[..., :, None] == seg[..., None, :]).to(dtype)[:, None]  # (B, 1, n, C, C)
    intra = intra[:, None] * same  # (B, H, n, C, C)
    q_decay = q_decay * (seg == before).to(dtype)[:, None, :, :, None]
    k_decay = k_decay * (seg == seg[..., -1:]).to(dtype)[:, None, :, :, None]
    chunk_decay = chunk_decay * (seg[..., -1] == before[..., 0]).to(dtype)[:, None, :, None, None]
    return intra, q_decay, k_decay, chunk_decay


def _causal(scores, intra):
    """``scores * intra`` where ``intra`` is nonzero (``j <= i`` in one document), else 0, by selection: a NaN or inf
    in a masked entry (a later token's) is not multiplied by 0 (docs/kernels.md, "Non-finite values")."""
    return torch.where(intra > 0, scores * intra, 0)


def _walk(updates, state, decay, reverse=False):
    """``S_c = decay_c S_(c-1) + U_c`` over the chunks of ``updates`` ``(B, H, n, K, V)`` (``reverse``: backward in
    time): the states entering each chunk, ``(B, H, n, K, V)``, and the last state."""
    entering, chunks = [None] * updates.shape[2], range(updates.shape[2])
    for c in reversed(chunks) if reverse else chunks:  # the only loop, over chunks
        entering[c], state = state, torch.addcmul(updates[:, :, c], state, decay[:, :, c])
    return torch.stack(entering, dim=2), state


def _states(k, v, state, masks):
    """The states before each of ``n`` chunks ``(B, H, n, K, V)`` and after the last, from ``k`` ``(B, H, n, C, K)``,
    ``v`` ``(B, H, n, C, V)`` and the state before the first chunk ``(B, H, K, V)``; and ``k * k_decay``."""
    k_decay, chunk_decay = masks[2:]
    k_write = k * k_decay
    return *_walk(k_write.transpose(-1, -2) @ v, state, chunk_decay), k_write  # U_c = sum_j gamma^(C-1-j) k_j^T v_j


def _add_product(acc, a, b):
    """``acc + a @ b`` over the leading dimensions, into ``acc`` (a temporary) by one in-place ``baddbmm``."""
    return acc.flatten(0, -3).baddbmm_(a.flatten(0, -3), b.flatten(0, -3)).view(acc.shape)


def _block_forward(q, k, v, state, masks):
    """Retention over ``n`` chunks of ``C``: ``q`` (scaled), ``k`` ``(B, H, n, C, K)``, ``v`` ``(B, H, n, C, V)``,
    ``state`` ``(B, H, K, V)``; returns ``o`` and the state after the last chunk."""
    intra, q_decay = masks[:2]
    previous, state, _ = _states(k, v, state, masks)
    # ((q k^T) * D) v of all chunks: v's finite part by the product, the rest by a running sum (docs/kernels.md); an
    # eager CPU call skips the sum where v is finite (the check syncs no device; a traced call takes both parts)
    finite = v.device.type == "cpu" and not torch.compiler.is_compiling() and bool(v.isfinite().all())
    finite_v = v if finite else torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    o = (q * q_decay) @ previous
    o = o if finite else o + (v - finite_v).cumsum(-2)
    return _add_product(o, _causal(q @ k.transpose(-1, -2), intra), finite_v), state


def _block_backward(q, k, v, previous, k_write, masks, d_o, d_state):
    """Gradients of :func:`_block_forward` (the formulas of docs/kernels.md, "Chunkwise retention") given the states
    before each chunk and ``k * k_decay`` (:func:`_states`): ``dq`` (of the scaled ``q``), ``dk``, ``dv`` and the
    gradient of the state before the first chunk."""
    intra, q_decay, k_decay, chunk_decay = masks
    read_grads = (q * q_decay).transpose(-1, -2) @ d_o  # (B, H, n, K, V): what o adds to dH_prev of each chunk
    d_after, d_state = _walk(read_grads, d_state, chunk_decay, reverse=True)  # gradient of the state after each chunk
    d_scores = _causal(d_o @ v.transpose(-1, -2), intra)  # (dO v^T) * D
    dq = d_scores @ k + (d_o @ previous.transpose(-1, -2)) * q_decay
    dk = d_scores.transpose(-1, -2) @ q + (v @ d_after.transpose(-1, -2)) * k_decay
    dv = _add_product(k_write @ d_after, _causal(q @ k.transpose(-1, -2), intra).transpose(-1, -2), d_o)
    return dq, dk, dv, d_state


def _blocks(q, k, v, scale, initial_state, reset, chunk_size, d_o=None):
    """The full chunks of ``chunk_size`` (None: :func:`default_chunk_size`) as one block, then the remainder as one
    shorter chunk; returns the blocks, the initial state in the compute dtype (zeros for None; copied for length 0:
    the final state never aliases the initial one) and ``d_o``'s blocks (or None). A block is ``(inputs, masks)``:
    ``q`` (scaled), ``k``, ``v`` as :func:`_block` makes them, and the masks of :func:`_block_masks`."""
    batch, length, heads, key_dim = q.shape
    cdt = compute_dtype(v.dtype)
    chunk_size = default_chunk_size(key_dim, v.shape[-1]) if chunk_size is None else chunk_size
    full = (length // chunk_size) * chunk_size
    spans = [(start, stop, size) for start, stop, size in ((0, full, chunk_size), (full, length, length - full))
             if stop > start]
    log2_gamma = retention_log2_gamma(heads, q.device, cdt)
    documents = None if reset is None else F.pad(reset.long().cumsum(-1), (1, 0))  # 0: the initial state's
    blocks = []
    for start, stop, size in spans:
        q_b, k_b, v_b = (_block(x, start, stop, size, cdt) for x in (q, k, v))
        segments = None if documents is None else torch.cat(  # the document before each chunk, then its tokens'
            [documents[:, start:stop:size, None], documents[:, 1 + start : 1 + stop].unflatten(1, (-1, size))], -1)
        q_b = q_b if scale == 1 else q_b * scale
        blocks.append(((q_b, k_b, v_b), _block_masks(log2_gamma, size, q_b.shape[2], segments, cdt)))
    state = (q.new_zeros(batch, heads, key_dim, v.shape[-1], dtype=cdt) if initial_state is None
             else initial_state.to(cdt, copy=not spans))  # a copy where no chunk computes a new final state
    return blocks, state, None if d_o is None else [_block(d_o, *span, cdt) for span in spans]


def _block(x, start, stop, size, dtype):
    """Tokens ``start:stop`` of ``x`` ``(B, L, H, D)`` as a contiguous ``(B, H, n, size, D)`` tensor in ``dtype``,
    copied once (``to`` keeps a same-dtype transposed view): a batched product copies a strided operand per use."""
    x = x[:, start:stop].transpose(1, 2)
    return x.to(dtype, memory_format=torch.contiguous_format).contiguous().unflatten(2, (-1, size))


def _token_major(parts, like):
    """The ``(B, H, n_i, C_i, D)`` ``parts`` joined along the tokens into a new contiguous ``(B, L, H, D)`` tensor:
    the layout the model reads, so that it copies nothing (``like``: any ``(B, L, H, D)`` tensor, for length 0)."""
    if not parts:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    return torch.cat([x.flatten(2, 3).transpose(1, 2) for x in parts], dim=1)  # cat writes a contiguous result


def chunk_retention_torch(q, k, v, scale=None, initial_state=None, output_final_state=False, chunk_size=None,
                          reset=None):
    """The forward pass of ``hf_densessm::chunk_retention`` with ``backend="torch"``, no checks: arguments and
    returns as :func:`hf_densessm.ops.retention.chunk_retention`, plus ``chunk_size`` (default
    :func:`default_chunk_size`). A Python loop over chunks only; autograd works through it too."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    blocks, state, _ = _blocks(q, k, v, scale, initial_state, reset, chunk_size)
    outputs = []
    for inputs, masks in blocks:
        o, state = _block_forward(*inputs, state, masks)
        outputs.append(o)
    return _token_major(outputs, v).to(v.dtype), (state if output_final_state else None)


def chunk_retention_torch_backward(d_o, d_final_state, q, k, v, scale, initial_state=None, chunk_size=None,
                                   reset=None):
    """Gradients of :func:`chunk_retention_torch` (states recomputed per chunk, then backward in time), given
    ``d_o`` and ``d_final_state`` (None: zero): ``dq, dk, dv`` in the dtypes of q, k, v and the gradient of the
    initial state (of a zero one without ``initial_state``) in the compute dtype."""
    blocks, state, d_o_blocks = _blocks(q, k, v, scale, initial_state, reset, chunk_size, d_o)
    d_state = torch.zeros_like(state) if d_final_state is None else d_final_state.to(state.dtype, copy=True)
    kept = []
    for inputs, masks in blocks:  # the states, recomputed once
        previous, state, k_write = _states(inputs[1], inputs[2], state, masks)
        kept.append((previous, k_write))
    grads = []
    for (inputs, masks), states, d_o_block in reversed(list(zip(blocks, kept, d_o_blocks))):  # backward in time
        dq, dk, dv, d_state = _block_backward(*inputs, *states, masks, d_o_block, d_state)
        grads.append((dq, dk, dv))
    dq, dk, dv = (_token_major([g[i] for g in grads[::-1]], x) for i, x in enumerate((q, k, v)))
    dq.mul_(scale)
    return *(g.to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v))), d_state


def retention_state_update_torch(state, q, k, v, scale=None):
    """``hf_densessm::retention_state_update`` with ``backend="torch"``, no checks: arguments and returns as
    :func:`hf_densessm.ops.retention.retention_state_update`. Three operations on the state; the decay is computed
    on its device from an ``arange`` (exact, no host copy)."""
    (batch, heads, key_dim), value_dim = q.shape, v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    sdt = state.dtype
    gamma = 1.0 - torch.exp2(torch.arange(-5, -5 - heads, -1, device=state.device, dtype=sdt))
    work = state if state.is_contiguous() else state.contiguous()
    flat = work.view(batch * heads, key_dim, value_dim)
    work.mul_(gamma[:, None, None])  # Eq. 18: S <- gamma S ...
    flat.baddbmm_(k.reshape(-1, key_dim, 1).to(sdt), v.reshape(-1, 1, value_dim).to(sdt))  # ... + k^T v
    if work is not state:
        state.copy_(work)
    q = q.reshape(-1, 1, key_dim).to(sdt)
    if scale != 1.0:
        q = q * scale
    return torch.bmm(q, flat).view(batch, heads, value_dim).to(v.dtype)  # Eq. 19: o = (scale q) S
