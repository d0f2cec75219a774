"""Where a GPU decoding step's time goes: host time, GPU time, kernel launches, host syncs and copies per token.

At batch 1 a decoding step of a 350M model reads 0.7 GB of weights (about 0.2 ms on an H100), but takes tens of
milliseconds through ``generate()``: the host issues one kernel per small operation. This script counts what one
eager step costs, so that changes to the decoding path can be judged by what they remove::

    python benchmarks/profile_gpu_decode.py --out benchmarks/results/gpu_decode_profile.json

For each preset (DenseMamba-360M, DenseRetNet-350M; random weights, bfloat16) it prefills ``--context`` tokens,
then times ``--steps`` one-token steps through the model's cache (``torch.cuda.synchronize`` around them) and
profiles one more with ``torch.profiler``: GPU kernels run, ``cudaLaunchKernel`` / ``cuLaunchKernel(Ex)`` calls,
``cudaStreamSynchronize`` calls (the host waiting for the GPU), ``cudaMemcpyAsync`` calls, host and GPU time.
``--dry-run`` runs the tiny presets on the CPU (no CUDA counters) to check the plumbing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hf_densessm.modeling.cache_names import output_cache

COUNTED = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaStreamSynchronize", "cudaMemcpyAsync",
           "aten::item")


def profile_model(name, model, context, steps, device):
    """Time ``steps`` eager one-token steps after a ``context``-token prefill, and profile one more."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(0, model.config.vocab_size, (1, context), device=device)
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
        token = ids[:, -1:]

        def step():
            return model(token, use_cache=True, cache=cache)

        for _ in range(3):
            step()
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        ms_per_step = (time.perf_counter() - start) / steps * 1e3
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step()
            sync()
    events = prof.key_averages()
    row = dict(model=name, layers=model.config.num_hidden_layers, context=context, ms_per_step=ms_per_step,
               host_ms=sum(e.self_cpu_time_total for e in events) / 1e3)
    if device.type == "cuda":
        row["gpu_ms"] = sum(e.self_device_time_total for e in events) / 1e3
        row["gpu_kernels"] = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    for key in COUNTED:
        row[key] = sum(e.count for e in events if e.key == key)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the rows")
    parser.add_argument("--context", type=int, default=1024, help="tokens prefilled before the profiled steps")
    parser.add_argument("--steps", type=int, default=20, help="timed one-token steps")
    parser.add_argument("--dry-run", action="store_true", help="tiny presets on the CPU: checks the plumbing only")
    args = parser.parse_args(argv)
    from hf_densessm import DenseMambaConfig, DenseMambaForCausalLM, DenseRetNetConfig, DenseRetNetForCausalLM

    if args.dry_run:
        device, dtype, size = torch.device("cpu"), torch.float32, "tiny"
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: run on a machine with an NVIDIA GPU, or pass --dry-run")
    else:
        device, dtype, size = torch.device("cuda"), torch.bfloat16, None
    presets = [("DenseMamba", DenseMambaForCausalLM, DenseMambaConfig, size or "360m", {}),
               ("DenseRetNet", DenseRetNetForCausalLM, DenseRetNetConfig, size or "350m", {"dropout": 0.0})]
    rows = []
    for family, cls, config_cls, preset, overrides in presets:
        torch.manual_seed(0)
        config = config_cls.from_preset(f"{family.lower()}-{preset}", **overrides)
        model = cls(config).to(device, dtype).eval()
        context, steps = (8, 2) if args.dry_run else (args.context, args.steps)
        rows.append(profile_model(f"{family}-{preset.upper()}", model, context, steps, device))
        print(json.dumps(rows[-1]), flush=True)
        del model
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
                torch=torch.__version__, dtype=str(dtype), dry_run=args.dry_run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
