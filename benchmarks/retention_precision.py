"""Accuracy of retention's Triton kernels in half precision against float64, at DenseRetNet's init scale and long
lengths, with the per-chunk states stored in the input dtype (as the kernels do) or exact (as a float32-state
product would be): a float64 emulation of the forward kernels' rounding points (``retention/chunk.py``), no GPU
needed (the Triton interpreter cannot run bfloat16). docs/kernels.md, "States in the input dtype"::

    python benchmarks/retention_precision.py                      # bfloat16 and float16, 350M heads, 2048 / 8192
    python benchmarks/retention_precision.py --heads 2 16 32 --lengths 2048 --dtypes float16

The emulation rounds where the kernels cast: the inputs, the decayed ``k`` entering the state update, the masked
scores entering ``scores @ v``, the stored state entering ``q @ S`` (or not: the exact column), and ``o``; it sums
in float64 where the kernels sum in float32. The float16 row at 16 x 32 heads matches the interpreted kernel
(``tests/ops/test_retention.py``, ``test_triton_half_precision_at_init_scale_and_2048_tokens``).
"""

import argparse

import torch
import torch.nn.functional as F

from hf_densessm.ops.retention.chunked_torch import chunk_retention_torch
from hf_densessm.ops.retention.naive import retention_log2_gamma


def init_scale_inputs(length, heads, key_dim, value_dim, seed=0):
    """q, k, v (float64, ``(1, length, heads, dim)``) at the published init: SiLU of N(0, 0.78^2) projections, k
    times ``key_dim ** -0.5`` (the model's ``key_scale``; the op runs with ``scale=1``)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (F.silu(0.78 * torch.randn(1, length, heads, d, generator=gen, dtype=torch.float64))
               for d in (key_dim, key_dim, value_dim))
    return q, k * key_dim**-0.5, v


def emulate(q, k, v, dtype, round_states, chunk=64):
    """o and the final state of the forward kernels (float64 emulation, ``scale=1``), ``(1, L, H, V)`` and
    ``(1, H, K, V)``; ``round_states``: the stored state rounded to ``dtype`` before ``q @ S``."""
    r = lambda x: x.to(dtype).double()  # noqa: E731
    q, k, v = (r(x)[0].transpose(0, 1) for x in (q, k, v))  # (H, L, dim)
    heads, length, key_dim = q.shape
    lg = retention_log2_gamma(heads, dtype=torch.float64)[:, None, None]
    state = q.new_zeros(heads, key_dim, v.shape[-1])
    out = []
    for start in range(0, length, chunk):
        qc, kc, vc = q[:, start:start + chunk], k[:, start:start + chunk], v[:, start:start + chunk]
        n, i = qc.shape[1], torch.arange(qc.shape[1], dtype=torch.float64)
        distance = i[:, None] - i[None, :]
        intra = torch.where(distance >= 0, torch.exp2(lg * distance.clamp(min=0)), 0)
        read = r(state) if round_states else state
        o = r(qc @ kc.transpose(1, 2) * intra) @ vc + (qc @ read) * torch.exp2(lg * (i + 1)[:, None])
        out.append(r(o))
        state = state * torch.exp2(lg * n) + r(kc * torch.exp2(lg * (n - 1 - i)[:, None])).transpose(1, 2) @ vc
    return torch.cat(out, dim=1).transpose(0, 1)[None], state[None]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, nargs=3, default=(2, 384, 1536), metavar=("H", "K", "V"))
    parser.add_argument("--lengths", type=int, nargs="+", default=(2048, 8192))
    parser.add_argument("--dtypes", nargs="+", default=("bfloat16", "float16"))
    args = parser.parse_args(argv)
    print("| dtype | heads x key x value | tokens | o: states in the dtype | o: exact states | o: float32 path "
          "| final state |\n|---|---|---|---|---|---|---|")
    for length in args.lengths:
        q, k, v = init_scale_inputs(length, *args.heads)
        for name in args.dtypes:
            dtype = getattr(torch, name)
            r = [x.to(dtype).double() for x in (q, k, v)]
            o64, s64 = chunk_retention_torch(*r, 1.0, None, True)  # float64 on the rounded inputs
            o_rounded, s = emulate(q, k, v, dtype, True)
            o_exact, _ = emulate(q, k, v, dtype, False)
            print(f"| {name} | {' x '.join(map(str, args.heads))} | {length} | {rel_err(o_rounded, o64):.2e} "
                  f"| {rel_err(o_exact, o64):.2e} | {rel_err(o64.to(dtype).double(), o64):.2e} "
                  f"| {rel_err(s, s64):.2e} |", flush=True)


if __name__ == "__main__":
    main()
