"""Eager CPU time of the causal depthwise convolution, forward and forward + backward, at the models' shape:
``hf_densessm::causal_conv1d`` (its PyTorch path, hand-written backward) against the PyTorch path it replaced
(``kernel`` shifted multiply-adds of a padded copy, autograd backward; copied here) and ``F.conv1d`` on transposed
tensors, and the op under ``torch.compile`` (Inductor fuses its decomposed body), interleaved in one process (median
of ``--repeats`` rounds). SiLU and bias as in DenseMamba's mixer.

    PYTHONPATH=src python benchmarks/bench_causal_conv1d.py [--batch 2 --seq-len 1024 --dim 1024 --kernel 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hf_densessm.ops.causal_conv1d import causal_conv1d
from hf_densessm.ops.packing import document_positions


def previous_torch_path(x, weight, bias=None, window=None, reset=None, activation=None):
    """The PyTorch path before the op (``causal_conv1d_torch`` of commit bd2f329), differentiated by autograd."""
    kernel, length = weight.shape[-1], x.shape[1]
    taps = weight.reshape(weight.shape[0], kernel).to(x.dtype)
    if window is not None:
        context = window[..., 1:].transpose(1, 2).to(x.dtype)
    else:
        context = x.new_zeros(x.shape[0], kernel - 1, x.shape[2])
    padded = torch.cat([context, x], dim=1)
    position = None if reset is None else document_positions(reset)
    out = padded[:, kernel - 1 :] * taps[:, kernel - 1]
    if bias is not None:
        out = out + bias.to(x.dtype)
    for k in range(kernel - 1):
        tap = padded[:, k : k + length] * taps[:, k]
        if position is not None:
            tap = tap * (position >= kernel - 1 - k).to(x.dtype)[..., None]
        out = out + tap
    return F.silu(out) if activation == "silu" else out


def conv1d_channels_first(x, weight, bias=None, window=None, reset=None, activation=None):
    """``F.conv1d`` on ``x.transpose(1, 2)``, cut to the sequence, transposed back (no ``reset``, no window)."""
    out = F.conv1d(x.transpose(1, 2), weight, bias, padding=weight.shape[-1] - 1, groups=weight.shape[0])
    out = out[..., : x.shape[1]].transpose(1, 2)
    return F.silu(out) if activation == "silu" else out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--kernel", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--reset", action="store_true", help="packed documents (about 1 reset per 100 tokens)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: PyTorch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    proj = torch.randn(args.batch, args.seq_len, 2 * args.dim, generator=g)
    x = proj[..., : args.dim].requires_grad_(False).clone().requires_grad_()  # contiguous (batch, seq_len, dim)
    weight = (torch.randn(args.dim, 1, args.kernel, generator=g) * 0.5).requires_grad_()
    bias = torch.randn(args.dim, generator=g).requires_grad_()
    reset = (torch.rand(args.batch, args.seq_len, generator=g) < 0.01) if args.reset else None
    grad = torch.randn(args.batch, args.seq_len, args.dim, generator=g)
    forms = {
        "op (hf_densessm::causal_conv1d)": causal_conv1d,
        "previous PyTorch path": previous_torch_path,
    }
    if reset is None:
        forms["F.conv1d channels-first"] = conv1d_channels_first
    forms["op under torch.compile (Inductor)"] = torch.compile(causal_conv1d, fullgraph=True)

    def forward(fn):
        with torch.no_grad():
            fn(x, weight, bias, None, reset, "silu")

    def training(fn):
        out = fn(x, weight, bias, None, reset, "silu")
        torch.autograd.grad(out, (x, weight, bias), grad)

    results = {}
    for phase, run in (("forward", forward), ("forward+backward", training)):
        times = {name: [] for name in forms}
        for name, fn in forms.items():  # warm-up
            run(fn)
        for _ in range(args.repeats):
            for name, fn in forms.items():
                start = time.perf_counter()
                run(fn)
                times[name].append(time.perf_counter() - start)
        results[phase] = {name: statistics.median(t) for name, t in times.items()}
        print(f"{phase} (batch {args.batch}, seq {args.seq_len}, dim {args.dim}, K {args.kernel}, float32, "
              f"{torch.get_num_threads()} threads{', reset' if reset is not None else ''}):")
        for name, median in results[phase].items():
            print(f"  {name:34s} {median * 1e3:8.2f} ms")
    return results


if __name__ == "__main__":
    main()
