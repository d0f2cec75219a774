"""Compile every Triton kernel of ``hf_densessm.ops`` for CUDA GPUs on a machine without one, and read what each
compiled kernel needs: registers, shared memory, spills, theoretical occupancy.

How: the ops' launch code runs on CPU tensors with ``JITFunction.run`` replaced by a recorder, so every launch
it would make (kernel, arguments, constexprs, tiles, warps, stages: the choices of the ``*_config`` functions for
the architecture under test) is captured instead of run; each captured launch is then specialized the way
Triton's launcher specializes it (an integer 1 becomes a constant, pointers and integers divisible by 16 get a
divisibility hint) and compiled with ``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(
"cuda", capability, 32))`` (Triton >= 3.3). ``compiled.metadata.shared`` is the shared memory a launch requests;
``cuobjdump --dump-resource-usage`` (shipped in the triton wheel) gives registers, the stack frame and local
memory of the cubin: a nonzero stack or local size means the kernel spills registers to local memory.

Used by ``test_compile.py``, which runs this file as worker processes (the kernels must be defined with
``TRITON_INTERPRET=0``, while the tests' own process defines them for the interpreter)::

    TRITON_INTERPRET=0 python tests/ops/kernel_compile.py < jobs.json     # one JSON result line per job
    TRITON_INTERPRET=0 python tests/ops/kernel_compile.py --table         # the table of docs/kernels.md
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

#: Head and state sizes compiled: the presets' and a small one (the tests' sizes).
SCAN_SHAPES = {"DenseMamba-360M": dict(dim=2048, state=16), "small": dict(dim=64, state=4)}
RETENTION_SHAPES = {
    "DenseRetNet-350M": dict(heads=2, key_dim=384, value_dim=1536),
    "DenseRetNet-1.3B": dict(heads=4, key_dim=320, value_dim=1280),
    "small": dict(heads=2, key_dim=16, value_dim=32),
}
#: Channels and taps of the causal conv: DenseMamba-360M's (its inner width, 4 taps) and a small one.
CONV_SHAPES = {"DenseMamba-360M": dict(channels=2048, kernel=4), "small": dict(channels=20, kernel=3)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARCH_NAMES = ("sm_80", "sm_86", "sm_89", "sm_90")
#: Optional inputs / outputs whose presence changes a kernel's constexprs; "full" switches all of them on. Packed
#: sequences (``reset``) join them where the op's Triton form takes a ``reset`` argument (see :func:`flags`).
SCAN_FLAGS = ("gate", "softplus", "grad")
RETENTION_FLAGS = ("initial_state", "final_state", "grad")
CONV_FLAGS = ("bias", "window", "silu", "grad", "reset")
SHAPES = {"selective_scan": SCAN_SHAPES, "retention": RETENTION_SHAPES, "causal_conv1d": CONV_SHAPES}
_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
                  torch.int8: "i8", torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
_LENGTH = 64  # tokens of the recorded launches: a runtime argument, any multiple of 16 compiles the same code


def flags(op: str) -> tuple[str, ...]:
    """The optional inputs of ``op`` ("selective_scan", "retention" or "causal_conv1d") that change its kernels'
    constexprs."""
    if op == "causal_conv1d":
        return CONV_FLAGS
    base = SCAN_FLAGS if op == "selective_scan" else RETENTION_FLAGS
    try:
        if op == "selective_scan":
            from hf_densessm.ops.selective_scan.chunk import selective_scan_triton_fwd as triton_form
        else:
            from hf_densessm.ops.retention.chunk import chunk_retention_fwd_triton as triton_form
    except ImportError:  # no triton: the test skips anyway
        return base
    return base + (("reset",) if "reset" in inspect.signature(triton_form).parameters else ())


def jobs() -> list[dict]:
    """What the compile test compiles.

    - Every architecture x dtype x shape, with every optional input on (the variant that does the most work:
      gate, softplus and gradients for the scan; initial and final state and gradients for retention; bias, window,
      SiLU, gradients and packed documents for the conv), forward, backward and decode kernels.
    - Every other combination of the optional inputs (each a distinct set of constexprs the code can launch), for
      sm_90 and bfloat16 at the presets' shapes: they compile to subsets of the full variant's code.
    - Retention's kernels with Python floats typed fp64 (``float_scalars``), as Inductor launches them.
    """
    out = []
    for arch, dtype, op in itertools.product(ARCH_NAMES, DTYPES, SHAPES):
        for shape in SHAPES[op]:
            out.append(dict(op=op, arch=arch, dtype=dtype, shape=shape, flags=list(flags(op))))
    for op, shape in (("selective_scan", "DenseMamba-360M"), ("retention", "DenseRetNet-350M"),
                      ("causal_conv1d", "DenseMamba-360M")):
        names = flags(op)
        for on in itertools.product((False, True), repeat=len(names)):
            if not all(on):
                chosen = [flag for flag, keep in zip(names, on) if keep]
                out.append(dict(op=op, arch="sm_90", dtype="bfloat16", shape=shape, flags=chosen))
    # Python floats (retention's ``scale``) typed fp64, as Inductor's launcher passes them under torch.compile: the
    # kernels cast every scalar to their accumulator dtype (the step kernel once failed on CUDA with "Loop-carried
    # variable o_acc fp32 re-assigned to fp64")
    for dtype in ("float32", "bfloat16"):
        out.append(dict(op="retention", arch="sm_90", dtype=dtype, shape="DenseRetNet-350M",
                        flags=list(flags("retention")), float_scalars="fp64"))
    return out


def _reset(length: int) -> torch.Tensor:
    """A ``(1, length)`` packed-sequence flag: documents start at tokens 0 and ``length // 3``."""
    reset = torch.zeros(1, length, dtype=torch.bool)
    reset[0, [0, length // 3]] = True
    return reset


def job_id(job: dict) -> str:
    """A readable test id: ``retention-DenseRetNet-350M-bfloat16-sm_90-initial_state+grad``."""
    parts = [job["op"], job["shape"], job["dtype"], job["arch"], "+".join(job["flags"]) or "none"]
    return "-".join(parts + (["fp64-scalars"] if job.get("float_scalars") == "fp64" else []))


# ------------------------------------------------------------------------------------------ recording launches


def _record_launches(job: dict) -> list[tuple]:
    """Run the op's Triton launch code on CPU tensors and return its launches ``(JITFunction, args, kwargs)``
    instead of running them (no GPU needed; the launch code's tile choices use ``job["arch"]``)."""
    from triton.runtime.jit import JITFunction

    from hf_densessm.ops.backend import ARCHS

    arch = ARCHS[job["arch"]]
    dtype = DTYPES[job["dtype"]]
    chosen = set(job["flags"])
    launches = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        launcher = dict(selective_scan=_launch_scan, retention=_launch_retention, causal_conv1d=_launch_conv)
        launcher[job["op"]](arch, dtype, SHAPES[job["op"]][job["shape"]], chosen)
    finally:
        JITFunction.run = original
    return launches


def _launch_scan(arch, dtype, shape, flags):
    from hf_densessm.ops.selective_scan.chunk import (
        selective_scan_config,
        selective_scan_triton_bwd,
        selective_scan_triton_fwd,
    )
    from hf_densessm.ops.selective_scan.fused_recurrent import (
        selective_state_update_config,
        selective_state_update_triton,
    )

    dim, n, L = shape["dim"], shape["state"], 4 * _LENGTH  # several chunks of the scan (a count of 1 is a constant)
    grad = "grad" in flags
    # the layouts DenseMamba passes: (batch, dim, length) views of token-major projections
    xz = torch.randn(1, L, 2 * dim, dtype=dtype, requires_grad=grad)
    u, z = (t.transpose(1, 2) for t in xz.chunk(2, dim=-1))
    delta = torch.randn(1, L, dim, dtype=dtype, requires_grad=grad).transpose(1, 2)
    x_dbl = torch.randn(1, L, 64 + 2 * n, dtype=dtype, requires_grad=grad)  # dt_rank 64, then B and C
    B, C = x_dbl[..., 64:64 + n].transpose(1, 2), x_dbl[..., 64 + n:].transpose(1, 2)
    A = -torch.rand(dim, n)
    D, bias, h0 = torch.randn(dim), torch.randn(dim), torch.randn(1, dim, n)
    config = selective_scan_config(arch, dtype, n)
    packed = dict(reset=_reset(L)) if "reset" in flags else {}
    args = dict(D=D, z=z if "gate" in flags else None, delta_bias=bias, delta_softplus="softplus" in flags,
                initial_state=h0, config=config, **packed)
    y, last, chunk_states = selective_scan_triton_fwd(u, delta, A, B, C, save_states=grad, **args)
    if grad:
        selective_scan_triton_bwd(torch.randn_like(y), torch.randn_like(last), u, delta, A, B, C,
                                  chunk_states=chunk_states, **args)
    step_config = selective_state_update_config(arch, n)
    selective_state_update_triton(h0.clone(), u[..., 0].detach(), delta[..., 0].detach(), A, B[..., 0].detach(),
                                  C[..., 0].detach(), D=D, z=z[..., 0] if "gate" in flags else None, dt_bias=bias,
                                  dt_softplus="softplus" in flags, config=step_config)


def _launch_retention(arch, dtype, shape, flags):
    from hf_densessm.ops.retention.chunk import (
        chunk_retention_bwd_triton,
        chunk_retention_config,
        chunk_retention_fwd_triton,
    )
    from hf_densessm.ops.retention.fused_recurrent import (
        retention_state_update_config,
        retention_state_update_triton,
    )

    H, K, V, L = shape["heads"], shape["key_dim"], shape["value_dim"], _LENGTH
    q, k, v = (torch.randn(1, L, H, d, dtype=dtype) for d in (K, K, V))
    s0 = torch.randn(1, H, K, V) if "initial_state" in flags else None
    config = chunk_retention_config(arch, dtype, K, V)
    reset = _reset(L) if "reset" in flags else None
    o, final_state = chunk_retention_fwd_triton(q, k, v, K**-0.5, s0, reset, config=config)
    if "grad" in flags:  # the gradient of the final state reaches the backward kernel only where it was returned
        d_final_state = torch.randn_like(final_state) if "final_state" in flags else None
        chunk_retention_bwd_triton(torch.randn_like(o), d_final_state, q, k, v, K**-0.5, s0, reset, config=config)
    state = torch.zeros(1, H, K, V)
    retention_state_update_triton(state, q[:, 0], k[:, 0], v[:, 0], K**-0.5,
                                  config=retention_state_update_config(arch, K, V))


def _launch_conv(arch, dtype, shape, flags):
    from hf_densessm.ops.causal_conv1d.chunk import causal_conv1d_triton_bwd, causal_conv1d_triton_fwd

    del arch  # one choice of tiles for every architecture
    channels, K, L = shape["channels"], shape["kernel"], 4 * _LENGTH  # several token blocks
    x = torch.randn(1, L, 2 * channels, dtype=dtype)[..., :channels]  # DenseMamba's: a view of the in_proj output
    args = (x, torch.randn(channels, K, dtype=dtype), torch.randn(channels, dtype=dtype) if "bias" in flags else None,
            torch.randn(1, channels, K, dtype=dtype) if "window" in flags else None,
            _reset(L) if "reset" in flags else None, "silu" in flags)
    out = causal_conv1d_triton_fwd(*args)
    if "grad" in flags:
        causal_conv1d_triton_bwd(torch.randn_like(out), *args)


# ----------------------------------------------------------------------------------------------- compiling


def compile_api_problem() -> str | None:
    """Why this Triton cannot compile for CUDA here (None if it can): the ``ASTSource(fn, signature,
    constexprs)`` / ``GPUTarget`` spelling of Triton >= 3.3, and ``cuobjdump`` in the wheel."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource
    except ImportError as error:
        return f"triton's compile API is not importable: {error}"
    if "constexprs" not in inspect.signature(ASTSource.__init__).parameters:
        return f"triton {triton.__version__} spells ASTSource without `constexprs` (Triton >= 3.3 needed)"
    if not os.path.isfile(_cuobjdump()):
        return f"no cuobjdump in the triton wheel ({_cuobjdump()})"
    return None


def probe() -> str | None:
    """Compile a one-line kernel for sm_80 and read its resources: None if that works here, else why not (no
    ptxas for the target, a broken wheel, ...). Separates "cannot compile for CUDA on this machine" (the test
    skips) from a kernel of the package that fails to compile (the test fails)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def _probe_kernel(x_ptr):
        tl.store(x_ptr, 1.0)

    try:
        compiled = triton.compile(ASTSource(_probe_kernel, {"x_ptr": "*fp32"}, constexprs={}),
                                  target=GPUTarget("cuda", 80, 32))
        _resources(compiled.asm["cubin"])
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:1000]
    return None


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _specialize(fn, args, kwargs, float_type="fp32"):
    """``(signature, constexprs, attrs, options)`` of a recorded launch, specialized as Triton's launcher does
    (a Python float as ``float_type``: ``"fp32"`` from Triton's own launcher, ``"fp64"`` from Inductor's, which
    launches the kernels of a ``torch.compile``'d op)."""
    from triton.backends.compiler import BaseBackend

    bound = dict(zip(fn.arg_names, args))
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    bound.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
    parse_attr = getattr(BaseBackend, "parse_attr", None)
    for index, param in enumerate(fn.params):
        value = bound[param.name]
        aligned = False
        if param.is_constexpr or value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                   and value == 1):
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
            continue
        if isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TRITON_DTYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            raise TypeError(f"{fn.__name__}: non-constexpr bool argument {param.name}")
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            aligned = value % 16 == 0
        elif isinstance(value, float):
            signature[param.name] = float_type
        else:
            raise TypeError(f"{fn.__name__}: cannot specialize {param.name}={value!r}")
        if aligned and parse_attr is not None:
            attrs[(index,)] = parse_attr("D")
    return signature, constexprs, attrs, options


def _resources(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if match is None:
        raise RuntimeError(f"cannot read cuobjdump's resource usage:\n{out}")
    return dict(registers=int(match[1]), stack=int(match[2]), static_shared=int(match[3]), local=int(match[4]))


def _constexpr_text(fn, constexprs) -> str:
    """The kernel's own constexpr parameters (flags and tiles), ``NAME=value`` joined by spaces."""
    names = [p.name for p in fn.params if p.is_constexpr]
    values = {fn.arg_names[index[0]]: value for index, value in constexprs.items()}
    return " ".join(f"{name}={getattr(values[name], 'name', values[name])}" for name in names
                    if name not in ("H", "K", "V", "ACC", "PRECISION"))


def run_job(job: dict) -> list[dict]:
    """Compile every launch of one job for its architecture; one dict per distinct compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_densessm.ops.backend import ARCHS

    arch = ARCHS[job["arch"]]
    target = GPUTarget("cuda", arch.capability[0] * 10 + arch.capability[1], 32)
    results, seen = [], set()
    for fn, args, kwargs in _record_launches(job):
        signature, constexprs, attrs, options = _specialize(fn, args, dict(kwargs), job.get("float_scalars", "fp32"))
        key = (fn.__name__, tuple(sorted(signature.items())), repr(sorted(constexprs.items())), repr(options))
        if key in seen:
            continue
        seen.add(key)
        record = dict(kernel=fn.__name__, constexprs=_constexpr_text(fn, constexprs),
                      num_warps=options.get("num_warps", 4), num_stages=options.get("num_stages", 3))
        start = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=target,
                                      options=options)
            record.update(_resources(compiled.asm["cubin"]))
        except Exception as error:  # reported, and failed, by the test
            record["error"] = f"{type(error).__name__}: {error}"[:2000]
            results.append(record)
            continue
        record["seconds"] = round(time.perf_counter() - start, 2)
        record["shared"] = compiled.metadata.shared + record["static_shared"]
        record["occupancy"] = arch.occupancy(record["registers"], record["num_warps"], record["shared"])
        results.append(record)
    return results


def format_table(rows: list[tuple[dict, dict]]) -> str:
    """Markdown table of ``(job, result)`` pairs, one line per compiled kernel."""
    lines = ["| kernel | shape | dtype | arch | tiles (constexprs) | warps | stages | registers | shared KB "
             "| spills (stack + local B) | occupancy |", "|---" * 11 + "|"]
    for job, r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {job['shape']} | {job['dtype']} | {job['arch']} | {r.get('constexprs', '')}"
                         f" | | | | | | error: {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['kernel'].strip('_')} | {job['shape']} | {job['dtype']} | {job['arch']} | {r['constexprs']} "
            f"| {r['num_warps']} | {r['num_stages']} | {r['registers']} | {r['shared'] / 1024:.1f} "
            f"| {r['stack'] + r['local']} | {r['occupancy']:.0%} |"
        )
    return "\n".join(lines)


def format_pivot(rows: list[tuple[dict, dict]]) -> str:
    """Markdown table of ``(job, result)`` pairs with every optional input on: one line per kernel, shape and
    dtype, one column per architecture holding ``registers / shared KB / occupancy``, the tiles beside them."""
    cells, tiles = {}, {}
    for job, r in rows:
        if job["flags"] != list(flags(job["op"])) or "error" in r:
            continue
        key = (r["kernel"].strip("_"), job["shape"], job["dtype"])
        tile_text = " ".join(part for part in r["constexprs"].split() if part.split("=")[0].startswith("B"))
        tiles.setdefault(key, {}).setdefault(f"{tile_text}, {r['num_warps']} warps, {r['num_stages']} st", []).append(
            job["arch"])
        spill = "" if r["stack"] + r["local"] == 0 else f" SPILLS {r['stack'] + r['local']} B"
        cells[key + (job["arch"],)] = f"{r['registers']} / {r['shared'] / 1024:.0f} / {r['occupancy']:.0%}{spill}"
    lines = ["| kernel | shape | dtype | tiles, warps, stages | " + " | ".join(ARCH_NAMES) + " |",
             "|---" * (4 + len(ARCH_NAMES)) + "|"]
    for key, choices in tiles.items():
        if len(choices) == 1:
            text = next(iter(choices))
        else:
            text = "; ".join(f"{', '.join(archs)}: {choice}" for choice, archs in choices.items())
        arch_cells = " | ".join(cells.get(key + (arch,), "") for arch in ARCH_NAMES)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {text} | {arch_cells} |")
    return "\n".join(lines)


def main() -> int:
    if "--probe" in sys.argv:
        print(json.dumps(dict(problem=probe())))
        return 0
    if "--table" in sys.argv:
        selected = [job for job in jobs() if job["flags"] == list(flags(job["op"]))]
        print(format_pivot([(job, r) for job in selected for r in run_job(job)]))
        return 0
    for job in json.load(sys.stdin):
        print(json.dumps(dict(id=job_id(job), results=run_job(job))), flush=True)
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):
        sys.exit("run with TRITON_INTERPRET=0: the interpreter's kernels cannot be compiled")
    sys.exit(main())
