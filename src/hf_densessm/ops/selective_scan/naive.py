"""The selective scan token by token in float64 (Mamba paper Alg. 2): the ground truth of the tests."""

import torch
import torch.nn.functional as F

__all__ = ["selective_scan_naive"]


def selective_scan_naive(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
                         reset=None):
    """Selective scan token by token in float64 (Mamba paper Alg. 2, eq. 2a, 2b, 4: ZOH for ``A``, Euler for ``B``)::

        dt_t = softplus(delta_t + delta_bias)                 (bias and softplus optional)
        h_t  = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t     (h_0 = initial_state or 0)
        y_t  = (sum_n C_{t,n} h_{t,n} + D * u_t) * silu(z_t)  (D and z optional)

    Arguments as :func:`hf_densessm.ops.selective_scan` (any float dtypes; ``reset`` bool or None), unchecked.
    Returns ``(y, last_state)``: (batch, dim, length) and (batch, dim, state), float64, differentiable.
    """
    u, delta, A, B, C = (t.double() for t in (u, delta, A, B, C))
    dt = delta + (delta_bias.double()[:, None] if delta_bias is not None else 0.0)
    dt = F.softplus(dt) if delta_softplus else dt
    batch, dim, length = u.shape
    h = u.new_zeros(batch, dim, A.shape[1]) if initial_state is None else initial_state.double()
    ys = []
    for t in range(length):
        if reset is not None:
            h = h * (~reset[:, t].bool()).double()[:, None, None]
        h = torch.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[:, :, None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + u * D.double()[:, None]
    if z is not None:
        y = y * F.silu(z.double())
    return y, h
