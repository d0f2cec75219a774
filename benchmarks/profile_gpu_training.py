"""Where a GPU training step's time goes: GPU time per kernel family, the top kernels, and the host's share.

The training step of ``benchmarks/gpu_suite.py`` (AdamW, bfloat16 autocast, batch 4 x 1024 tokens, DenseMamba-360M
and DenseRetNet-350M, random weights) is profiled once with ``torch.profiler`` after warm-up steps::

    python benchmarks/profile_gpu_training.py --out benchmarks/results/gpu_training_profile.json

For each model it records the step's wall time (``torch.cuda.synchronize`` around it), the summed GPU kernel time,
the number of kernels, and the GPU time grouped by what the kernel does, from its name:

- ``selective_scan`` / ``retention``: this package's Triton kernels (forward and backward);
- ``matmul``: cuBLAS / CUTLASS products (the projections and the head);
- ``conv1d``: the causal depthwise convolution;
- ``optimizer``: the fused AdamW kernels;
- ``other``: everything else (elementwise, reductions, norms, copies, the dense connection's small ops).

and the 25 kernels with the most GPU time. ``--dry-run`` runs the tiny presets on the CPU (no CUDA counters) to
check the plumbing; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

#: Kernel families, matched in this order against the lower-cased kernel name.
FAMILIES = (
    ("selective_scan", re.compile(r"selective_scan|selective_state")),
    ("retention", re.compile(r"retention")),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|wgmma")),
    ("conv1d", re.compile(r"conv")),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach")),
)


def family_of(name: str) -> str:
    """The family (see ``FAMILIES``) a kernel's name belongs to, ``"other"`` if none matches."""
    low = name.lower()
    for family, pattern in FAMILIES:
        if pattern.search(low):
            return family
    return "other"


def profile_step(name, model, batch, length, device, warmup=3):
    """Time one AdamW training step (bfloat16 autocast on CUDA) and profile one more."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    step()
    sync()
    step_ms = (time.perf_counter() - start) * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        sync()
    row = dict(model=name, batch=batch, length=length, step_ms=step_ms)
    if not cuda:
        return row
    # GPU-side events, less the ranges that user annotations (the optimizer's ``record_function``) mark there
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    families: dict[str, float] = {}
    for e in kernels:
        families[family_of(e.key)] = families.get(family_of(e.key), 0.0) + e.self_device_time_total
    row.update(
        gpu_ms=gpu_us / 1e3,
        gpu_kernels=sum(e.count for e in kernels),
        gpu_busy_fraction=gpu_us / 1e3 / step_ms,
        families_ms={k: v / 1e3 for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
        top_kernels=[dict(name=e.key[:160], family=family_of(e.key), calls=e.count,
                          ms=e.self_device_time_total / 1e3, share=e.self_device_time_total / gpu_us)
                     for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]],
    )
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the rows")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--dry-run", action="store_true", help="tiny presets on the CPU: checks the plumbing only")
    args = parser.parse_args(argv)
    from hf_densessm import DenseMambaConfig, DenseMambaForCausalLM, DenseRetNetConfig, DenseRetNetForCausalLM

    if args.dry_run:
        device, size, batch, length = torch.device("cpu"), "tiny", 1, 16
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: run on a machine with an NVIDIA GPU, or pass --dry-run")
    else:
        device, size, batch, length = torch.device("cuda"), None, args.batch, args.length
    presets = [("DenseMamba", DenseMambaForCausalLM, DenseMambaConfig, size or "360m", {}),
               ("DenseRetNet", DenseRetNetForCausalLM, DenseRetNetConfig, size or "350m", {})]
    rows = []
    for family, cls, config_cls, preset, overrides in presets:
        torch.manual_seed(0)
        config = config_cls.from_preset(f"{family.lower()}-{preset}", **overrides)
        model = cls(config).to(device).train()
        rows.append(profile_step(f"{family}-{preset.upper()}", model, batch, length, device))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "top_kernels"}), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
                torch=torch.__version__, dry_run=args.dry_run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
