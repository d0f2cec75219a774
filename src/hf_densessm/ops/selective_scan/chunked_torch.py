"""The selective scan in vectorized PyTorch (Mamba paper, Algorithm 2), chunked over the length, with a hand-written
recompute backward, traceable by ``torch.compile`` (docs/kernels.md, "The PyTorch path of the scan").
"""

import math

import torch
import torch.nn.functional as F

from ..backend import compute_dtype, inputs_compute_dtype

__all__ = ["default_chunk_size", "selective_scan_torch_bwd", "selective_scan_torch_fwd", "selective_state_update_torch"]

# Upper bound on the elements of the recomputed-state buffer of the backward pass (64 MiB in float32).
_BWD_BLOCK_ELEMENTS = 1 << 24


def default_chunk_size(length: int) -> int:
    """Tokens per chunk: about ``sqrt(length)`` (balances the in-chunk and across-chunk Python steps), at least 8
    and at most ``length``."""
    return max(1, min(length, max(8, int(round(math.sqrt(length))))))


def _prepare(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, chunk_size):
    """What both passes start from: the compute dtype, ``delta + delta_bias`` in it (before the softplus), the
    chunk length (default :func:`default_chunk_size`) and ``keep`` (:func:`_scan_fwd`)."""
    cdt = inputs_compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    dt = delta.to(cdt) if delta_bias is None else delta.to(cdt) + delta_bias.to(cdt)[:, None]
    keep = None if reset is None else (~reset.bool())[:, None, :].to(cdt)
    return cdt, dt, max(1, min(int(chunk_size or default_chunk_size(u.shape[-1])), u.shape[-1])), keep


def _to_chunks(x: torch.Tensor, chunk_size: int, n_chunks: int, dtype: torch.dtype) -> torch.Tensor:
    """``(batch, k, length)`` -> ``(chunk_size, batch * n_chunks, k)`` view of a token-major buffer (docs/kernels.md)
    in ``dtype``, zero-padded to ``n_chunks * chunk_size`` positions."""
    batch, k, length = x.shape
    out = torch.empty(batch, n_chunks * chunk_size, k, dtype=dtype, device=x.device)
    if x.dtype == dtype and x.stride(2) == 1 and x.stride(1) == length:
        for i in range(batch):  # 2-D transposes take PyTorch's blocked copy
            out[i, :length].copy_(x[i].t())
    else:
        out[:, :length].copy_(x.transpose(1, 2))
    out[:, length:].zero_()
    return out.view(batch * n_chunks, chunk_size, k).transpose(0, 1)


def _from_chunks(x: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Inverse of :func:`_to_chunks`: ``(T, batch * n_chunks, k)`` -> contiguous ``(batch, k, length)``."""
    chunk_size, bc, k = x.shape
    tokens = x.transpose(0, 1).reshape(batch, bc // batch * chunk_size, k)  # a view for token-major buffers
    out = torch.empty(batch, k, length, dtype=x.dtype, device=x.device)
    for i in range(batch):
        out[i].copy_(tokens[i, :length].t())
    return out


def _chunked_inputs(u, dt, A, B, C, keep, T, nc):
    """``dt, dt * u`` (T, bc, dim) and ``B, C`` (T, bc, state) as :func:`_to_chunks` views, ``A^T`` (state, dim) and
    ``keep`` as (T, bc, 1) chunks (padding keeps; None without ``keep``), all in ``dt``'s dtype."""
    return (*(_to_chunks(x, T, nc, dt.dtype) for x in (dt, dt * u, B, C)), A.t().to(dt.dtype).contiguous(),
            None if keep is None else 1 - _to_chunks(1 - keep, T, nc, dt.dtype))


def _decay(dt_c, At, keep_c, t, out):
    """``exp(dt_t A)`` of step ``t`` into ``out`` (bc, state, dim), times ``keep_c`` (T, bc, 1) unless None."""
    torch.mul(dt_c[t][:, None, :], At, out=out).exp_()
    if keep_c is not None:
        out.mul_(keep_c[t][:, :, None])
    return out


def _chunk_decay(dt_c, At, keep_c, batch, nc):
    """``exp(A * sum_c dt)`` per chunk, 0 for a chunk that starts a document anywhere: (batch, nc, state, dim)."""
    decay = torch.exp(dt_c.sum(0)[:, None, :] * At)
    if keep_c is not None:
        decay = decay * keep_c.prod(0)[:, :, None]
    return decay.view(batch, nc, *decay.shape[1:])


def _scan_fwd(u, dt, A, B, C, D, z, initial_state, T, keep=None):
    """:func:`selective_scan_torch_fwd` from ``dt`` discretized and ``keep`` (batch, 1, length), 0 where a document
    starts, or None, ``T`` the chunk length; ``(y, last_state, entry)`` in the compute dtype."""
    batch, dim, length = u.shape
    n, nc = A.shape[1], -(-length // T)
    bc = batch * nc
    kw = dict(dtype=dt.dtype, device=u.device)
    dt_c, dtu_c, B_c, C_c, At, keep_c = _chunked_inputs(u, dt, A, B, C, keep, T, nc)
    decay = torch.empty(bc, n, dim, **kw)  # exp(dt_t A), reused every step
    h = torch.zeros(bc, n, dim, **kw)

    entry = torch.empty(batch, nc, n, dim, **kw)  # the state entering every chunk
    entry[:, 0] = 0 if initial_state is None else initial_state.transpose(1, 2)
    if nc > 1:
        # 1. local recurrence from zero: each chunk's end state
        for t in range(T):
            _decay(dt_c, At, keep_c, t, decay)
            h.mul_(decay).addcmul_(B_c[t][:, :, None], dtu_c[t][:, None, :])
        # 2. across chunks: S_c = exp(A * sum_c dt) * S_{c-1} + local_end_c
        chunk_decay = _chunk_decay(dt_c, At, keep_c, batch, nc)
        local_end = h.view(batch, nc, n, dim)
        for c in range(1, nc):
            torch.addcmul(local_end[:, c - 1], chunk_decay[:, c - 1], entry[:, c - 1], out=entry[:, c])

    # 3. the recurrence again from the true entry states, contracting with C on the way
    h.copy_(entry.view(bc, n, dim))
    y_c, y_t = torch.empty(bc, T, dim, **kw).transpose(0, 1), torch.empty(bc, 1, dim, **kw)  # y_c token-major
    for t in range(T):
        _decay(dt_c, At, keep_c, t, decay)
        h.mul_(decay).addcmul_(B_c[t][:, :, None], dtu_c[t][:, None, :])
        y_c[t].copy_(torch.bmm(C_c[t][:, None, :], h, out=y_t)[:, 0])
    last_state = h.view(batch, nc, n, dim)[:, -1].transpose(1, 2).contiguous()  # padding kept the state
    y = _from_chunks(y_c, batch, length)
    if D is not None:
        y.addcmul_(u, D[:, None])
    if z is not None:
        y.mul_(F.silu(z.to(y.dtype)))
    return y, last_state, entry


def _scan_bwd(u, dt, A, B, C, D, z, entry, gout, glast, T, keep=None):
    """Gradients of :func:`_scan_fwd` for one block of channels from ``gout`` and ``glast`` (None: zero): ``du, ddt,
    dA, dB, dC, dD, dz, dinitial`` in the compute dtype, ``dD``, ``dz`` None without ``D``, ``z``."""
    cdt = dt.dtype
    batch, dim, length = u.shape
    n, nc = A.shape[1], entry.shape[1]
    bc = batch * nc
    kw = dict(dtype=cdt, device=u.device)
    dt_c, dtu_c, B_c, C_c, At, keep_c = _chunked_inputs(u, dt, A, B, C, keep, T, nc)
    u_c = _to_chunks(u, T, nc, cdt)
    entry = entry.reshape(bc, n, dim)
    decay = torch.empty(bc, n, dim, **kw)

    # 1. recompute every state h_t from the chunk entry states
    H = torch.empty(T, bc, n, dim, **kw)
    prev = entry
    for t in range(T):
        _decay(dt_c, At, keep_c, t, decay)
        torch.mul(decay, prev, out=H[t]).addcmul_(B_c[t][:, :, None], dtu_c[t][:, None, :])
        prev = H[t]

    # gradient through the gate and the skip: gy = dL/d(sum_n C h)
    gy_c = torch.zeros(T, bc, dim, **kw) if gout is None else _to_chunks(gout, T, nc, cdt)
    dz = None
    if z is not None:
        z_c = _to_chunks(z, T, nc, cdt)
        y_c = torch.matmul(C_c[:, :, None, :], H)[:, :, 0]  # (T, bc, dim)
        if D is not None:
            y_c.addcmul_(u_c, D.to(cdt))
        sig = torch.sigmoid(z_c)
        # d silu(z)/dz = sig * (1 + z * (1 - sig))
        dz = _from_chunks(gy_c * y_c * sig * (1 + z_c * (1 - sig)), batch, length)
        gy_c.mul_(z_c).mul_(sig)
    dD = None if D is None else (gy_c * u_c).sum((0, 1))
    dC_c = torch.matmul(H, gy_c[..., None])[..., 0]  # (T, bc, n): dC_t = sum_d gy_t h_t

    # 2. local adjoint recurrence (zero at every chunk end): adjoint of each chunk's entry state
    g = torch.zeros(bc, n, dim, **kw)
    if nc > 1:
        for t in reversed(range(T)):
            g.addcmul_(C_c[t][:, :, None], gy_c[t][:, None, :])
            g.mul_(_decay(dt_c, At, keep_c, t, decay))
    # 3. across chunks, in reverse: adjoint arriving at each chunk end
    chunk_decay = _chunk_decay(dt_c, At, keep_c, batch, nc)
    local_entry = g.view(batch, nc, n, dim)
    end_adjoint = torch.empty(batch, nc, n, dim, **kw)
    end_adjoint[:, -1] = 0 if glast is None else glast.transpose(1, 2)
    for c in range(nc - 1, 0, -1):
        torch.addcmul(local_entry[:, c], chunk_decay[:, c], end_adjoint[:, c], out=end_adjoint[:, c - 1])

    # 4. adjoint recurrence with the true adjoints; read off the gradients
    g.copy_(end_adjoint.view(bc, n, dim))  # = exp(dt_{t+1} A) g_{t+1} for the last position of each chunk
    # token-major (T, bc, k) buffers; W = sum_n B_{t,n} g_{t,n}
    W, dB_c, ddt_c = (torch.empty(bc, T, k, **kw).transpose(0, 1) for k in (dim, n, dim))
    W_t, dB_t, tmp = torch.empty(bc, 1, dim, **kw), torch.empty(bc, n, 1, **kw), torch.empty(bc, n, dim, **kw)
    for t in reversed(range(T)):
        g.addcmul_(C_c[t][:, :, None], gy_c[t][:, None, :])  # g_t = dL/dh_t
        W[t].copy_(torch.bmm(B_c[t][:, None, :], g, out=W_t)[:, 0])
        dB_c[t].copy_(torch.bmm(g, dtu_c[t][:, :, None], out=dB_t)[:, :, 0])
        _decay(dt_c, At, keep_c, t, decay)
        X = H[t]  # h_t is no longer needed: reuse its slot for X_t = dL/d(dt_t A) = g_t exp(dt_t A) h_{t-1}
        torch.mul(g, H[t - 1] if t else entry, out=X).mul_(decay)
        torch.sum(torch.mul(X, At, out=tmp), 1, out=ddt_c[t])
        X.mul_(dt_c[t][:, None, :])
        g.mul_(decay)
    dA = H.sum((0, 1)).t()
    dinitial = g.view(batch, nc, n, dim)[:, 0].transpose(1, 2)
    ddt_c.addcmul_(W, u_c)
    du_c = W.mul_(dt_c)
    if D is not None:
        du_c.addcmul_(gy_c, D.to(cdt))
    du, ddt, dB, dC = (_from_chunks(x, batch, length) for x in (du_c, ddt_c, dB_c, dC_c))
    return du, ddt, dA, dB, dC, dD, dz, dinitial


def selective_scan_torch_fwd(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                             initial_state=None, reset=None, chunk_size=None):
    """The PyTorch body of ``hf_densessm::selective_scan``, no checks: arguments as
    :func:`hf_densessm.ops.selective_scan` (any float dtypes; ``reset`` bool or None), plus ``chunk_size``, tokens
    per chunk (default :func:`default_chunk_size`; the backward takes the same). Returns ``(y, last_state, entry)``:
    ``y`` (batch, dim, length) in ``u``'s dtype; ``last_state`` (batch, dim, state) and ``entry``, the state entering
    each chunk, (batch, n_chunks, state, dim), in the compute dtype (float32, float64 when an input is float64). No
    autograd graph (the backward is :func:`selective_scan_torch_bwd`)."""
    _, dt, T, keep = _prepare(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, chunk_size)
    y, last_state, entry = _scan_fwd(u, F.softplus(dt) if delta_softplus else dt, A, B, C, D, z, initial_state, T, keep)
    return y.to(u.dtype), last_state, entry


def selective_scan_torch_bwd(dy, dlast, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                             initial_state=None, reset=None, entry=None, chunk_size=None):
    """The PyTorch body of ``hf_densessm::selective_scan_backward`` (docs/kernels.md) from ``dy`` (batch, dim,
    length) and ``dlast`` (batch, dim, state) (None: zero), the forward pass's arguments and the ``entry`` it returned.
    Returns ``(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state)``, each in its input's dtype (None for an
    absent ``D``, ``z``, ``delta_bias``; the compute dtype for an absent ``initial_state``). Raises ValueError:
    ``entry`` does not have the forward pass's number of chunks for this ``chunk_size``."""
    cdt, dt_raw, T, keep = _prepare(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, chunk_size)
    batch, dim, length = u.shape
    nc = -(-length // T)
    if entry is None or entry.shape[1] != nc:
        raise ValueError(f"entry must hold the {nc} chunk states of the forward pass with chunk_size={T}, "
                         f"got {None if entry is None else tuple(entry.shape)}")
    dt = F.softplus(dt_raw) if delta_softplus else dt_raw
    entry = entry.to(cdt)
    block = max(1, min(dim, _BWD_BLOCK_ELEMENTS // max(1, batch * nc * T * A.shape[1])))
    parts = [_scan_bwd(u[:, s], dt[:, s], A[s], B, C, None if D is None else D[s], None if z is None else z[:, s],
                       entry[..., s], None if dy is None else dy[:, s], None if dlast is None else dlast[:, s], T, keep)
             for s in (slice(d0, d0 + block) for d0 in range(0, dim, block))]
    # per block: du, ddt (dim 1), dA (0), dB, dC (summed), dD (0), dz (1), dinitial (1)
    du, ddt, dA, dB, dC, dD, dz, dinitial = (
        None if p[0] is None else sum(p) if i in (3, 4) else torch.cat(p, 0 if i in (2, 5) else 1)
        for i, p in enumerate(zip(*parts)))
    ddelta = ddt.mul_(torch.sigmoid(dt_raw)) if delta_softplus else ddt  # d softplus(x)/dx = sigmoid(x)
    dbias = None if delta_bias is None else ddelta.sum((0, 2))
    return tuple(g if g is None or like is None else g.to(like.dtype) for g, like in zip(
        (du, ddelta, dA, dB, dC, dD, dz, dbias, dinitial), (u, delta, A, B, C, D, z, delta_bias, initial_state)))


def selective_state_update_torch(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One decode step of the selective SSM (Mamba paper eq. 2a/2b, recurrent mode) in PyTorch, no checks: arguments
    (``state`` updated in place) and ``y`` as :func:`hf_densessm.ops.selective_state_update`."""
    cdt = compute_dtype(state.dtype)
    dt = dt.to(cdt) if dt_bias is None else dt.to(cdt) + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    h = state if state.dtype == cdt else state.to(cdt)  # a float32 (float64) state is updated in place, no copy
    h.mul_(torch.exp(dt[..., None] * A)).addcmul_((dt * x)[..., None], B[:, None, :])
    if h is not state:
        state.copy_(h)
    y = torch.bmm(h, C.to(cdt)[..., None])[..., 0]
    if D is not None:
        y.addcmul_(x, D)
    if z is not None:
        y.mul_(F.silu(z.to(cdt)))
    return y.to(x.dtype)
