"""Offline efficiency report of every Triton kernel of ``hf_densessm.ops``, read from its compiled code: no GPU needed.

Each kernel variant is compiled for sm_80 and sm_90 without a GPU (``tests/ops/kernel_compile.py`` runs the ops'
launch code on CPU tensors, captures the launches it would make and compiles each with ``triton.compile(...,
target=GPUTarget("cuda", 90, 32))``), disassembled with ``cuobjdump -sass`` (shipped in the triton wheel) and
reported with:

- registers, spills (stack frame + local memory, bytes), shared memory, theoretical occupancy
  (:meth:`hf_densessm.ops.backend.GPUArch.occupancy`);
- **instructions per element in each hot loop**: loops are the backward branches of the SASS (a branch to a lower
  address), their body the instructions from the target to the branch; the hot loops of a kernel are its
  ``loops`` largest innermost loops (its model, :data:`MODELS`), each body divided by the elements one iteration
  handles per thread (the model, from the launch's tiles and warps). A kernel without a hot loop (a decode step)
  is counted whole; so is one whose constant-trip loop the compiler unrolled (retention's output kernels on
  sm_8x: the loop column shows none), over the elements of all its trips. The counts are static: every
  instruction of the body once, branches inside it included;
- **bytes moved per element against the minimum**: the model's bytes the kernel's loads and stores move between
  the SMs and L2 (each program's tiles, re-reads by several programs included) and the least it must move (each
  distinct byte it reads or writes once), both divided by the kernel's elements. One line per op and pass adds up
  its kernels against the op's own minimum (its inputs read once, its outputs written once).

An element is the kernel's unit of work: a (channel, state, token) triple for the selective scan (the decode step:
a (channel, state) pair), a (token, key, value) multiply-add for retention's chunk kernels, a (key, value) state
entry for its decode step, a (token, channel) pair for the causal conv. Targets (issue 36): scan forward <= 15 instructions per element, backward <= 40, no
spills, occupancy >= 25% on sm_90. Usage (the table of docs/kernels.md, "Efficiency from the compiled code")::

    TRITON_INTERPRET=0 python benchmarks/kernel_sass.py                   # sm_80 and sm_90, every dtype, presets
    TRITON_INTERPRET=0 python benchmarks/kernel_sass.py --quick           # sm_90, bfloat16: one variant per kernel
    TRITON_INTERPRET=0 python benchmarks/kernel_sass.py --json out.json   # also the rows as JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ops"))
import kernel_compile  # noqa: E402  (the launch recorder and compiler of the compile test)

ARCHS = ("sm_80", "sm_90")
DTYPES = ("float32", "bfloat16", "float16")
#: (op, shape) pairs reported: the presets' shapes (kernel_compile.SHAPES); the quick mode takes the first three
VARIANTS = (("selective_scan", "DenseMamba-360M"), ("retention", "DenseRetNet-350M"),
            ("causal_conv1d", "DenseMamba-360M"), ("retention", "DenseRetNet-1.3B"))
_BRANCH = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(?:`\()?0x([0-9a-f]+)")
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


# ------------------------------------------------------------------------------------------------ the SASS


def sass_of(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([kernel_compile._cuobjdump(), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def loops_of(sass: str) -> list[dict]:
    """The innermost loops of one kernel's SASS: ``{"start", "end", "instructions"}`` per backward branch whose
    range holds no other backward branch (addresses in bytes, 16 per instruction; the trailing self-branch after
    ``EXIT`` is no loop). ``instructions`` counts the body from the branch target to the branch, NOPs excluded."""
    addresses = {}
    for line in sass.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            addresses[int(match[1], 16)] = match[2]
    loops = []
    for match in _BRANCH.finditer(sass):
        at, target = int(match[1], 16), int(match[2], 16)
        if target < at:
            loops.append((target, at))
    inner = [(s, e) for s, e in loops if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in loops)]
    return [dict(start=s, end=e, instructions=sum(1 for a, op in addresses.items() if s <= a <= e and op != "NOP"))
            for s, e in sorted(set(inner))]


def instructions_of(sass: str) -> int:
    """Every instruction of a kernel but the NOP padding."""
    return sum(1 for line in sass.splitlines() if (m := _INSTRUCTION.match(line)) and m[2] != "NOP")


# -------------------------------------------------------------------------------------------------- models
#
# A model maps one recorded launch (its arguments by name, its constexprs, warps; ``ctx``: the arguments of the
# op's last launch that held its inputs, for a kernel that sees only buffers) to
# ``elements`` (per thread per hot-loop iteration), ``loops`` (hot loops: the largest innermost loops counted),
# ``trips`` (iterations of a hot loop of constant trip count, for when the compiler unrolled it),
# ``total`` (elements of the whole launch), ``moved`` and ``least`` (bytes: what its loads and stores move between
# the SMs and L2, and each distinct byte it touches once). Sizes are read from the recorded tensors.


def _size(t) -> int:
    return t.element_size() if t is not None else 0


def _scan_sizes(a):
    u = next(a[k] for k in ("u_ptr", "x_ptr", "dy_ptr") if a.get(k) is not None)
    batch, dim, length = u.shape
    return batch, dim, length, a["A_ptr"].shape[1], u.element_size()


def _scan_walk(a, c, warps, ctx, kind):
    """The per-chunk kernels of the scan (grid (channel blocks, chunks, batch)): one token loop per walk (the bwd
    kernel has two), ``CPT`` channels x ``NSTATE`` states per thread per token. Bytes, per kernel: the (channel,
    token) tensors in the input dtype (u, delta, z, y, dy, du, ddelta, dz) and the float32 scratch of d delta's
    partial sums (bwd); the float32 (state, token) vectors B, C, read by every channel block, and dB, dC added by
    every warp of a channel block (bwd: each warp's sums are atomic adds of their own); the float32 per-chunk buffers (end states, adjoints, entry states, sums of dt,
    dA / dD / d delta_bias partial sums)."""
    batch, dim, length, n, s = _scan_sizes(a)
    f = 8 if "fp64" in str(c["ACC"]) else 4
    blocks = math.ceil(dim / (c["BLOCK_D"] * c["D_STEPS"]))
    per_channel = dict(state=2 * s, adjoint=(2 + c["HAS_Z"]) * s, output=(3 + c["HAS_Z"]) * s,
                       bwd=(6 + 2 * c["HAS_Z"] + 2 + c["HAS_Z"]) * s + 2 * f)[kind]
    least_channel = per_channel - (3 + c["HAS_Z"]) * s if kind == "bwd" else per_channel
    reads, adds, distinct = dict(state=(1, 0, 1), adjoint=(1, 0, 1), output=(2, 0, 2), bwd=(4, 2, 4))[kind]
    groups = blocks * c["D_STEPS"] * (c["BLOCK_D"] // min(c["BLOCK_D"], 32 * c["CPT"]))  # bwd: B, C twice; dB, dC
    chunk_values, least_chunk = dict(state=(n + 1, n + 1), adjoint=(n + 1, n + 1), output=(n, n),
                                     bwd=(4 * n + 3, 3 * n + 3))[kind]
    tokens, chunks = batch * dim * length, batch * dim * math.ceil(length / c["CHUNK"])
    rows = batch * length * n * f
    return dict(elements=c["CPT"] * c["NSTATE"], loops=2 if kind == "bwd" else 1, total=tokens * n,
                moved=tokens * per_channel + (blocks * reads + groups * adds) * rows + chunks * chunk_values * f,
                least=tokens * least_channel + distinct * rows + chunks * least_chunk * f)


def _carry(a, c, warps, ctx):
    """The scan over chunks: one iteration combines ``BLOCK_C`` chunks of ``BLOCK`` (channel, state) entries, i.e.
    ``BLOCK_C * chunk`` tokens of each; reads each entry's chunk summary and its channel's sum of dt, writes its
    entry state (moved: the sum of dt once per entry, least: once per channel)."""
    batch, dim, length, n, s = _scan_sizes(ctx)
    vals = a["vals_ptr"]
    f = vals.element_size()
    chunk = length / vals.shape[1]
    return dict(elements=c["BLOCK_C"] * c["BLOCK"] * chunk / (32 * warps), loops=1, total=batch * dim * n * length,
                moved=3 * vals.numel() * f, least=2 * vals.numel() * f + vals.numel() // n * f)


def _step(a, c, warps, ctx):
    state = a["state_ptr"]
    return dict(elements=c["BLOCK_D"] * c["BLOCK_N"] / (32 * warps), loops=0, total=state.numel(),
                moved=2 * state.numel() * _size(state), least=2 * state.numel() * _size(state))


def _retention_sizes(a, c):
    q = a.get("q", a.get("k"))
    batch, length = q.shape[0], q.shape[1]
    return batch * c["H"], length, c["K"], c["V"], q.element_size(), math.ceil(length / c["BT"])


def _retention_walk(a, c, warps):
    """``chunk_h`` / ``chunk_dh``: grid (V / BV, K / BK, batch * heads), one loop over the chunks; its (token, K)
    and (token, V) inputs (k, v or q, dO) each read by every program of the other axis."""
    bh, length, K, V, s, nt = _retention_sizes(a, c)
    states = a.get("h", a.get("dh"))
    per_k, per_v = bh * length * K * s, bh * length * V * s
    state = bh * nt * K * V * _size(states)
    return dict(elements=c["BT"] * c["BK"] * c["BV"] / (32 * warps), loops=1, total=bh * length * K * V,
                moved=math.ceil(V / c["BV"]) * per_k + math.ceil(K / c["BK"]) * per_v + state,
                least=per_k + per_v + state)


def _retention_out(a, c, warps, kind):
    """``chunk_o`` / ``chunk_dv`` (grid (V / BV, chunks, batch * heads), a loop over key tiles) and ``chunk_dqk``
    (grid (K / BK, chunks, batch * heads), a loop over value tiles): multiply-adds of the intra-chunk scores and of
    the state products per iteration; q, k (or v, dO) re-read by every tile of the other axis."""
    bh, length, K, V, s, nt = _retention_sizes(a, c)
    bt, bk, bv = c["BT"], c["BK"], c["BV"]
    tk, tv = bh * length * K * s, bh * length * V * s
    state = bh * nt * K * V * _size(a.get("h", a.get("dh")))
    if kind == "dqk":
        macs = bt * bt * bv + 2 * bt * bv * bk
        moved = math.ceil(K / bk) * 2 * tv + 2 * state + 4 * tk
        least = 2 * tv + 2 * state + 4 * tk
    else:
        macs = bt * bt * bk + bt * bk * bv
        moved = math.ceil(V / bv) * 2 * tk + state + 2 * tv
        least = 2 * tk + state + 2 * tv
    trips = math.ceil((V / bv) if kind == "dqk" else (K / bk))
    return dict(elements=macs / (32 * warps), loops=1, trips=trips, total=bh * length * K * V, moved=moved,
                least=least)


def _retention_step(a, c, warps, ctx):
    state = a["state"]
    return dict(elements=c["BK"] * c["BV"] / (32 * warps), loops=1, total=state.numel(),
                moved=2 * state.numel() * _size(state), least=2 * state.numel() * _size(state))


def _conv(a, c, warps, ctx, backward):
    """The causal conv's kernels, grid (batch x token blocks, channel blocks): one token loop, ``UNROLL`` tokens x the
    thread's channels per iteration. Bytes: ``x`` re-read ``K - 1`` tokens before each block (the backward also
    ``K - 1`` after it, with ``dy``), the output (``dx``) once, a reset byte per token per channel block, the taps
    and bias per program, the window (and its gradient) once; the backward's float32 per-block sums of the taps'
    and the bias' gradients (its least: their totals)."""
    x = a["x_ptr"]
    batch, length, channels = x.shape
    s, K, bt, bc = x.element_size(), c["K"], c["BLOCK_T"], c["BLOCK_C"]
    t_blocks, c_blocks = math.ceil(length / bt), math.ceil(channels / bc)
    tokens = batch * length * channels
    halo = (bt + (1 + backward) * (K - 1)) / bt
    params = (K + c["HAS_BIAS"]) * a["w_ptr"].element_size()  # per channel
    window = 0 if a["win_ptr"] is None else (1 + backward) * batch * channels * (K - 1) * a["win_ptr"].element_size()
    resets = batch * length if c["HAS_RESET"] else 0
    sums = batch * t_blocks * channels * (K + c["HAS_BIAS"]) * (8 if "fp64" in str(c["ACC"]) else 4) * backward
    moved = (tokens * s * ((1 + backward) * halo + 1) + batch * t_blocks * c_blocks * bc * params + window
             + resets * halo * c_blocks + sums)
    least = (2 + backward) * tokens * s + (1 + backward) * channels * params + window + resets
    return dict(elements=c["UNROLL"] * bc / (32 * warps), loops=1, total=tokens, moved=moved, least=least)


MODELS = {
    "_selective_scan_chunk_state_kernel": lambda a, c, w, ctx: _scan_walk(a, c, w, ctx, "state"),
    "_selective_scan_chunk_adjoint_kernel": lambda a, c, w, ctx: _scan_walk(a, c, w, ctx, "adjoint"),
    "_selective_scan_chunk_output_kernel": lambda a, c, w, ctx: _scan_walk(a, c, w, ctx, "output"),
    "_selective_scan_chunk_bwd_kernel": lambda a, c, w, ctx: _scan_walk(a, c, w, ctx, "bwd"),
    "_selective_scan_carry_kernel": _carry,
    "_selective_state_update_kernel": _step,
    "_retention_chunk_h_kernel": lambda a, c, w, ctx: _retention_walk(a, c, w),
    "_retention_chunk_dh_kernel": lambda a, c, w, ctx: _retention_walk(a, c, w),
    "_retention_chunk_o_kernel": lambda a, c, w, ctx: _retention_out(a, c, w, "o"),
    "_retention_chunk_dv_kernel": lambda a, c, w, ctx: _retention_out(a, c, w, "dv"),
    "_retention_chunk_dqk_kernel": lambda a, c, w, ctx: _retention_out(a, c, w, "dqk"),
    "_retention_step_kernel": _retention_step,
    "_causal_conv1d_fwd_kernel": lambda a, c, w, ctx: _conv(a, c, w, ctx, False),
    "_causal_conv1d_bwd_kernel": lambda a, c, w, ctx: _conv(a, c, w, ctx, True),
}
#: The kernels of each pass of each op, and the op's least bytes per element of that pass: its inputs read once,
#: its outputs written once, from the recorded launch of ``first`` (sizes as in the models).
PASSES = {
    ("selective_scan", "forward"): ("_selective_scan_chunk_state_kernel", "_selective_scan_carry_kernel",
                                    "_selective_scan_chunk_output_kernel"),
    ("selective_scan", "backward"): ("_selective_scan_chunk_adjoint_kernel", "_selective_scan_carry_kernel",
                                     "_selective_scan_chunk_bwd_kernel"),
    ("retention", "forward"): ("_retention_chunk_h_kernel", "_retention_chunk_o_kernel"),
    ("retention", "backward"): ("_retention_chunk_h_kernel", "_retention_chunk_dh_kernel",
                                "_retention_chunk_dqk_kernel", "_retention_chunk_dv_kernel"),
    ("causal_conv1d", "forward"): ("_causal_conv1d_fwd_kernel",),
    ("causal_conv1d", "backward"): ("_causal_conv1d_bwd_kernel",),
}


def op_least(op: str, direction: str, a) -> float:
    """Least bytes per element of a whole pass: the selective scan's forward reads u, delta, z, B, C and writes y;
    its backward also reads dy and writes du, ddelta, dz, dB, dC (the chunk states it reads are not counted). The
    causal conv's forward reads x and writes out; its backward reads x, dy and writes dx. Retention's forward reads
    q, k, v and writes o; its backward reads q, k, v, dO and writes dq, dk, dv (the states, per sequence, not
    counted)."""
    if op == "causal_conv1d":
        return (2 if direction == "forward" else 3) * a["x_ptr"].element_size()
    if op == "retention":
        K, V = a["k"].shape[-1], a["v"].shape[-1]
        per_token = 2 * K + 2 * V if direction == "forward" else 4 * K + 3 * V
        return per_token * a["k"].element_size() / (K * V)
    batch, dim, length, n, s = _scan_sizes(a)
    per_channel, per_state = (4, 2) if direction == "forward" else (7, 4)
    return (per_channel * batch * dim * length + per_state * batch * n * length) * s / (batch * dim * n * length)


# -------------------------------------------------------------------------------------------------- report


def _constexprs(fn, constexprs) -> dict:
    return {fn.arg_names[index[0]]: value for index, value in constexprs.items()}


def analyze(job: dict) -> list[dict]:
    """Compile every launch of one ``kernel_compile`` job and read its SASS: one row per distinct kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_densessm.ops.backend import ARCHS as GPU_ARCHS

    arch = GPU_ARCHS[job["arch"]]
    target = GPUTarget("cuda", arch.capability[0] * 10 + arch.capability[1], 32)
    rows, seen, ctx = [], set(), {}
    forward, backward = (PASSES.get((job["op"], d), ()) for d in ("forward", "backward"))
    for fn, args, kwargs in kernel_compile._record_launches(job):
        bound = dict(zip(fn.arg_names, args))
        bound.update(kwargs)
        signature, constexprs, attrs, options = kernel_compile._specialize(fn, args, dict(kwargs))
        values = _constexprs(fn, constexprs)
        # a kernel of both passes runs backward if it walks in reverse (the scan's carry) or stores no final state
        # (retention's state walk, rerun by the backward)
        reverse = values.get("REVERSE") or not values.get("STORE_FINAL_STATE", True)
        direction = "backward" if reverse or fn.__name__ in set(backward) - set(forward) else "forward"
        key = (fn.__name__, repr(sorted(constexprs.items())), repr(options), direction)
        if key in seen:
            continue
        seen.add(key)
        warps = options.get("num_warps", 4)
        compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=target,
                                  options=options)
        resources = kernel_compile._resources(compiled.asm["cubin"])
        shared = compiled.metadata.shared + resources["static_shared"]
        sass = sass_of(compiled.asm["cubin"])
        loops = loops_of(sass)
        row = dict(op=job["op"], shape=job["shape"], dtype=job["dtype"], arch=job["arch"], kernel=fn.__name__,
                   direction=direction, constexprs=kernel_compile._constexpr_text(fn, constexprs), warps=warps,
                   registers=resources["registers"], spills=resources["stack"] + resources["local"], shared=shared,
                   occupancy=arch.occupancy(resources["registers"], warps, shared),
                   loop_bodies=[loop["instructions"] for loop in loops], instructions=instructions_of(sass))
        if "A_ptr" in bound and any(bound.get(k) is not None for k in ("u_ptr", "x_ptr", "dy_ptr")):
            ctx = bound
        model = MODELS.get(fn.__name__)
        if model is not None:
            m = model(bound, values, warps, ctx)
            hot = sorted(row["loop_bodies"], reverse=True)[:m["loops"]] if m["loops"] else [row["instructions"]]
            elements = m["elements"]
            if len(hot) < m["loops"]:  # a constant-trip loop the compiler unrolled: the whole kernel, all trips
                hot, elements = [row["instructions"]], elements * m["trips"]
            row.update(elements_per_iteration=elements, hot_loops=hot,
                       per_element=sum(hot) / elements, moved=m["moved"] / m["total"],
                       least=m["least"] / m["total"])
        if fn.__name__ in (forward[:1] if direction == "forward" else backward[:1]):
            row["op_least"] = op_least(job["op"], direction, bound)
        rows.append(row)
    return rows


def variants(quick: bool) -> list[dict]:
    """The jobs reported: every optional input on (gate, softplus, gradients, packed documents for the scan; initial
    and final state, gradients, packed documents for retention; bias, window, SiLU, gradients, packed documents for
    the conv), at the presets' shapes."""
    out = []
    for op, shape in VARIANTS[:3] if quick else VARIANTS:
        for arch in ("sm_90",) if quick else ARCHS:
            for dtype in ("bfloat16",) if quick else DTYPES:
                out.append(dict(op=op, arch=arch, dtype=dtype, shape=shape, flags=list(kernel_compile.flags(op))))
    return out


def pass_totals(rows: list[dict]) -> list[dict]:
    """Per (op, shape, dtype, arch, pass): the sum of its kernels' instructions and bytes per element."""
    totals = {}
    for row in rows:
        names = PASSES.get((row["op"], row["direction"]))
        if not names or row["kernel"] not in names or "per_element" not in row:
            continue
        key = (row["op"], row["shape"], row["dtype"], row["arch"], row["direction"])
        total = totals.setdefault(key, dict(zip(("op", "shape", "dtype", "arch", "direction"), key), kernels=[],
                                            per_element=0.0, moved=0.0, least=None))
        total["least"] = total["least"] or row.get("op_least")
        total["kernels"].append(row["kernel"])
        total["per_element"] += row["per_element"]
        total["moved"] += row["moved"]
    return list(totals.values())


def markdown(rows: list[dict], totals: list[dict]) -> str:
    lines = ["| kernel | dtype | arch | tiles (constexprs), warps | registers | spills B | shared KB | occupancy "
             "| innermost loops (instructions) | hot: elements / iteration | instructions / element "
             "| bytes / element (moved / least) |", "|---" * 12 + "|"]
    for r in rows:
        tiles = " ".join(p for p in r["constexprs"].split() if p.split("=")[0].startswith(("B", "CHUNK", "D_ST")))
        per = f"{r['per_element']:.1f}" if "per_element" in r else "no model"
        elements = f"{r['elements_per_iteration']:g}" if "elements_per_iteration" in r else ""
        moved = f"{r['moved']:.3g} / {r['least']:.3g}" if "moved" in r else ""
        lines.append(f"| {r['kernel'].strip('_')} ({r['shape']}) | {r['dtype']} | {r['arch']} | {tiles}, "
                     f"{r['warps']} warps | {r['registers']} | {r['spills']} | {r['shared'] / 1024:.1f} "
                     f"| {r['occupancy']:.0%} | {', '.join(map(str, r['loop_bodies'])) or 'none'} | {elements} "
                     f"| {per} | {moved} |")
    if totals:
        lines += ["", "| op, pass | dtype | arch | kernels | instructions / element | bytes / element (moved / op "
                      "least) |", "|---" * 6 + "|"]
        for t in totals:
            names = " + ".join(k.strip("_").replace("selective_scan_", "") for k in t["kernels"])
            lines.append(f"| {t['op']} ({t['shape']}) {t['direction']} | {t['dtype']} | {t['arch']} | {names} "
                         f"| {t['per_element']:.1f} | {t['moved']:.3g} / {t['least']:.3g} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sm_90, bfloat16, one variant per kernel (CI)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):
        raise SystemExit("run with TRITON_INTERPRET=0: the interpreter's kernels cannot be compiled")
    problem = kernel_compile.compile_api_problem()
    if problem:
        raise SystemExit(f"cannot compile for CUDA here: {problem}")
    jobs = variants(args.quick)
    with ProcessPoolExecutor(max(1, args.workers)) as pool:
        rows = [row for done in pool.map(analyze, jobs) for row in done]
    report = dict(rows=rows, totals=pass_totals(rows))
    print(markdown(rows, report["totals"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
