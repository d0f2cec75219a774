"""Multi-scale retention in vectorized PyTorch (DenseSSM paper Eq. 18, 19, 24; RetNet): the path the models take
on the CPU (``backend="torch"``).

- :func:`chunk_retention_torch`: RetNet's chunkwise form (training, prefill); the Python loop runs over chunks.
- :func:`retention_state_update_torch`: one decoding step of Eq. 18-19, the state updated in place.

Per head ``h`` with decay ``gamma_h = 1 - 2**(-5 - h)`` (:func:`.naive.retention_gamma`)::

    S_t = gamma * S_{t-1} + k_t^T v_t          (Eq. 18; S_0 = initial_state or 0)
    o_t = (scale * q_t) S_t                     (Eq. 19)
        = scale * sum_{s<=t} gamma^{t-s} (q_t . k_s) v_s + scale * gamma^t q_t S_0     (Eq. 24)

the last line written out as one quadratic product in ``naive.py`` (the ground truth of the tests). Both forms
accumulate in float32 (float64 when the inputs are float64).
"""

import torch
import torch.nn.functional as F

from .naive import retention_log2_gamma

__all__ = ["chunk_retention_torch", "default_chunk_size", "retention_state_update_torch"]


def default_chunk_size(key_dim, value_dim):
    """Chunk length of the chunkwise reference: 64, or 256 for states above 2**18 elements per head.

    Measured (CPU time of forward + backward, float32, 1 thread): 64 is fastest, or within 5% of it, from
    16 x 64 up to key x value = 256 x 1024 per head; above that the per-chunk states dominate and 256 is fastest
    (the 1.3B preset's 320 x 1280: 1061 ms at 64, 813 ms at 128, 745 ms at 256, batch 1, length 2048, 4 heads).
    ``benchmarks/bench_retention.py --device cpu`` measures it again.
    """
    return 64 if key_dim * value_dim <= 2**18 else 256


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_block(q, k, v, state, log2_gamma, segments=None):
    """Chunkwise retention over ``n`` chunks of equal length ``C`` (RetNet chunkwise form).

    Args:
        q, k: ``(B, H, n, C, K)`` (``q`` already scaled); v: ``(B, H, n, C, V)``; all in the compute dtype.
        state: ``(B, H, K, V)``, the state before the first chunk.
        log2_gamma: ``(H,)``.
        segments: ``(B, n, C + 1)`` document index of the token before each chunk, then of each of its tokens, or
            None (one document). Token ``i`` sees token ``j`` (and the carried state) only within its document.

    Returns:
        o ``(B, H, n, C, V)`` and the state after the last chunk ``(B, H, K, V)``.
    """
    C = q.shape[3]
    lg = log2_gamma[:, None]  # (H, 1)
    i = torch.arange(C, device=q.device, dtype=q.dtype)
    distance = i[:, None] - i[None, :]
    intra_decay = torch.exp2(lg[:, :, None] * distance.clamp(min=0)) * (distance >= 0)  # (H, C, C): gamma^(i-j)
    q_decay = torch.exp2(lg * (i + 1))[:, None, :, None]  # (H, 1, C, 1): gamma^(i+1), read of the previous state
    k_decay = torch.exp2(lg * (C - 1 - i))[:, None, :, None]  # (H, 1, C, 1): gamma^(C-1-j), write into the next state
    chunk_decay = torch.exp2(log2_gamma * C)[None, :, None, None, None]  # (1, H, 1, 1, 1): gamma^C

    if segments is not None:  # packed documents: nothing crosses a document boundary
        before, seg = segments[:, :, :1], segments[:, :, 1:]  # (B, n, 1), (B, n, C)
        same = (seg[..., :, None] == seg[..., None, :]).to(q.dtype)[:, None]  # (B, 1, n, C, C)
        intra_decay = intra_decay[:, None] * same  # (B, H, n, C, C)
        q_decay = q_decay * (seg == before).to(q.dtype)[:, None, :, :, None]  # reads the carried state
        k_decay = k_decay * (seg == seg[..., -1:]).to(q.dtype)[:, None, :, :, None]  # writes the next state
        chunk_decay = chunk_decay * (seg[..., -1] == before[..., 0]).to(q.dtype)[:, None, :, None, None]
    else:
        intra_decay = intra_decay[:, None]
        chunk_decay = chunk_decay.expand(-1, -1, q.shape[2], -1, -1)

    # Intra-chunk: ((q k^T) * D) v, for all chunks at once.
    o = (q @ k.transpose(-1, -2) * intra_decay) @ v
    # Each chunk's contribution to the state at its end: sum_j gamma^(C-1-j) k_j^T v_j.
    updates = (k * k_decay).transpose(-1, -2) @ v  # (B, H, n, K, V)
    # Inter-chunk recurrence S_c = gamma^C S_{c-1} + U_c: the only loop, over chunks.
    states = []
    for c, update in enumerate(updates.unbind(2)):  # unbind, not indexing: one backward node for all chunks
        states.append(state)
        state = torch.addcmul(update, state, chunk_decay[:, :, c])
    previous = torch.stack(states, dim=2)  # (B, H, n, K, V): the state before each chunk
    o = o + (q * q_decay) @ previous
    return o, state


def chunk_retention_torch(q, k, v, scale=None, initial_state=None, output_final_state=False, chunk_size=None,
                          reset=None):
    """Chunkwise retention in PyTorch (DenseSSM paper Eq. 18, 19, 24; RetNet chunkwise form).

    Splits the sequence into chunks of ``chunk_size`` tokens: inside a chunk, ``((q k^T) * D) v`` with the
    decay mask ``D[i, j] = gamma^(i-j)``; across chunks, ``gamma^(i+1) q_i S_prev`` with the state carried
    chunk to chunk. The Python loop runs over chunks, never over tokens; everything else is batched over
    batch, heads and chunks. Autograd works through it.

    Args:
        q, k (Tensor): ``(batch, length, heads, key_dim)``.
        v (Tensor): ``(batch, length, heads, value_dim)``.
        scale (float, optional): multiplies ``q``; defaults to ``key_dim ** -0.5``.
        initial_state (Tensor, optional): ``(batch, heads, key_dim, value_dim)``, the state before token 0.
        output_final_state (bool): also return the state after the last token.
        chunk_size (int, optional): tokens per chunk; defaults to :func:`default_chunk_size`.
        reset (Tensor, optional): ``(batch, length)`` bool, True at the first token of each packed document:
            the state before it is dropped (the initial state too at ``t = 0``).

    Returns:
        o (Tensor): ``(batch, length, heads, value_dim)`` in ``v``'s dtype.
        final_state (Tensor or None): ``(batch, heads, key_dim, value_dim)`` float32 (float64 for float64
        inputs), or None unless ``output_final_state``.
    """
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    chunk_size = default_chunk_size(key_dim, value_dim) if chunk_size is None else chunk_size
    v_dtype, cdt = v.dtype, _compute_dtype(v.dtype)
    log2_gamma = retention_log2_gamma(heads, q.device, cdt)
    # (B, H, L, *), contiguous so that the batched matmuls below need no hidden copies
    q, k, v = (x.transpose(1, 2).to(dtype=cdt, memory_format=torch.contiguous_format) for x in (q, k, v))
    q = q * scale
    if initial_state is None:
        state = q.new_zeros(batch, heads, key_dim, value_dim)
    else:
        state = initial_state.to(cdt, copy=True)  # a copy, so that the final state never aliases the initial one

    # document index of every token, 0 for the initial state's document: (B, 1 + L)
    documents = None if reset is None else F.pad(reset.long().cumsum(-1), (1, 0))
    outputs = []
    full = (length // chunk_size) * chunk_size
    # Full chunks, then the remainder as one shorter chunk.
    for start, stop, size in ((0, full, chunk_size), (full, length, length - full)):
        if stop == start:
            continue
        blocks = [x[:, :, start:stop].unflatten(2, (-1, size)) for x in (q, k, v)]
        segments = None
        if documents is not None:
            tokens = documents[:, 1 + start : 1 + stop].unflatten(1, (-1, size))  # (B, n, C)
            segments = torch.cat([documents[:, start:stop:size, None], tokens], dim=-1)
        o, state = _chunk_block(*blocks, state, log2_gamma, segments)
        outputs.append(o.flatten(2, 3))
    o = torch.cat(outputs, dim=2) if outputs else v[:, :, :0]
    o = o.transpose(1, 2).to(v_dtype)
    return o, (state if output_final_state else None)


def retention_state_update_torch(state, q, k, v, scale=None):
    """One decoding step of retention, DenseSSM paper Eq. 18-19: ``S <- gamma S + k^T v``, ``o = (scale q) S``.

    Three operations on the state (a decode step is bound by their count, not by arithmetic): ``S *= gamma``,
    ``S += k^T v`` (one ``baddbmm_``), ``o = q S`` (one ``bmm``); the per-head decay is kept per
    ``(heads, device, dtype)`` (:func:`step_decay`) and ``scale = 1`` multiplies nothing.

    Args:
        state (Tensor): ``(batch, heads, key_dim, value_dim)`` float32 (float64 allowed), updated in place.
        q, k (Tensor): ``(batch, heads, key_dim)``.
        v (Tensor): ``(batch, heads, value_dim)``.
        scale (float, optional): multiplies ``q``; defaults to ``key_dim ** -0.5``.

    Returns:
        o (Tensor): ``(batch, heads, value_dim)`` in ``v``'s dtype.
    """
    batch, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    sdt = state.dtype
    work = state if state.is_contiguous() else state.contiguous()
    flat = work.view(batch * heads, key_dim, value_dim)
    work.mul_(step_decay(heads, state.device, sdt))  # Eq. 18: S <- gamma S ...
    flat.baddbmm_(k.reshape(-1, key_dim, 1).to(sdt), v.reshape(-1, 1, value_dim).to(sdt))  # ... + k^T v
    if work is not state:
        state.copy_(work)
    q = q.reshape(-1, 1, key_dim).to(sdt)
    if scale != 1.0:
        q = q * scale
    o = torch.bmm(q, flat)  # Eq. 19: o = (scale q) S
    return o.view(batch, heads, value_dim).to(v.dtype)


_STEP_DECAYS = {}


def step_decay(heads, device, dtype, log2=False):
    """The decay of a decoding step, built once per ``(heads, device, dtype)``: a decode step runs per layer and
    token, and on a GPU each fresh build is a host-to-device copy, which waits for the host.

    Args:
        heads (int): number of heads ``H``.
        device, dtype: of the returned tensor.
        log2 (bool): ``log2(gamma_h)`` ``(H,)`` (:func:`.naive.retention_log2_gamma`, what the Triton step takes)
            instead of ``gamma_h`` ``(H, 1, 1)`` (what the PyTorch step multiplies the state by).

    Returns:
        A tensor shared by every call with the same arguments: read it, never write to it. It is a plain tensor
        (not an inference tensor), usable in and out of ``torch.inference_mode``.
    """
    key = (heads, device, dtype, log2)
    decay = _STEP_DECAYS.get(key)
    if decay is None:
        with torch.inference_mode(False), torch.no_grad():
            log2_gamma = retention_log2_gamma(heads, device, dtype)
            decay = _STEP_DECAYS[key] = log2_gamma if log2 else torch.exp2(log2_gamma)[:, None, None]
    return decay
