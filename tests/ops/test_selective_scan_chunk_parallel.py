"""The chunk-parallel Triton selective scan (``ops/selective_scan/chunk_parallel.py``, issue 26).

- Under the interpreter (``TRITON_INTERPRET=1``, see ``tests/conftest.py``): forward, last state, chunk states and
  every gradient against the float64 token loop (``naive.py``), over several chunks and a length under one chunk,
  with packed-sequence resets at chunk edges, inside chunks, at ``t = 0`` and one-token documents, with and
  without the optional inputs, in float64, float32 (non-contiguous ``B``, ``C``) and bfloat16.
- Compiled for sm_80, sm_86, sm_89 and sm_90 (no GPU needed, ``kernel_compile.py``'s machinery, in a worker
  process since the kernels must be defined without the interpreter): no spills, shared memory within each
  architecture's limit; the registers / occupancy table is printed at the end of the module.

Run this file as a script (``TRITON_INTERPRET=0``) to compile jobs read as JSON from stdin (the worker).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernel_compile  # noqa: E402

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

ARCH_NAMES = ("sm_80", "sm_86", "sm_89", "sm_90")
COMPILE_SHAPES = {"DenseMamba-360M": dict(dim=2048, state=16), "small": dict(dim=64, state=4)}
ALL_FLAGS = ("gate", "softplus", "grad", "reset")


def _small_config(**changes):
    """A test configuration: 16-token chunks (several chunks at lengths 40 and 80), channel tiles smaller than the
    tests' dims, several tiles per program."""
    from hf_densessm.ops.selective_scan.chunk_parallel import ChunkParallelScanConfig

    base = dict(chunk=16, fwd_block_d=4, fwd_d_steps=2, bwd_block_d=2, bwd_d_steps=2, carry_block=32)
    return ChunkParallelScanConfig(**dict(base, **changes))


def chunk_parallel(config=None):
    """A differentiable scan through ``chunk_parallel``'s forward and backward functions with an explicit
    configuration, called as :func:`selective_scan_naive` is (with ``return_last_state``)."""
    from hf_densessm.ops.selective_scan.chunk_parallel import selective_scan_triton_bwd, selective_scan_triton_fwd

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, reset):
            y, last, states = selective_scan_triton_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                                        initial_state, reset, save_states=True, config=config)
            ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, states)
            ctx.delta_softplus = delta_softplus
            return y, last

        @staticmethod
        def backward(ctx, dy, dlast):
            *inputs, reset, states = ctx.saved_tensors
            u, delta, A, B, C, D, z, delta_bias, initial_state = inputs
            grads = selective_scan_triton_bwd(dy, dlast, u, delta, A, B, C, D, z, delta_bias, ctx.delta_softplus,
                                              initial_state, reset, states, config=config)
            return (*(g if t is not None else None for g, t in zip(grads, inputs)), None, None)

    def run(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None, reset=None,
            return_last_state=False):
        y, last = Fn.apply(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, reset)
        return (y, last) if return_last_state else y

    return run


def _reset(batch, length, starts):
    """(batch, length) bool, True at ``starts[b]``."""
    reset = torch.zeros(batch, length, dtype=torch.bool)
    for b, positions in enumerate(starts):
        reset[b, list(positions)] = True
    return reset


def _check_against_naive(kw, config, rtol, rtol_grad=None):
    from test_selective_scan import assert_close, grads_of, seq_fn

    y, last, grads = grads_of(chunk_parallel(config), kw)
    y0, last0, grads0 = grads_of(seq_fn, kw)
    assert y.dtype == kw["u"].dtype
    assert_close(y, y0, rtol, "y")
    assert_close(last, last0, rtol, "last_state")
    assert grads.keys() == grads0.keys()
    for k in grads0:
        assert grads[k].dtype == kw[k].dtype, k
        assert_close(grads[k], grads0[k], rtol_grad or rtol, f"d{k}")


# resets with 16-token chunks: at chunk edges (16, 32), inside chunks, at t = 0, one-token documents (5, 6 and 31, 32)
RESETS_40 = [(0, 16, 20, 39), (5, 6, 31, 32)]


@pytest.mark.parametrize(
    "batch,dim,state,length,drop,starts",
    [
        (2, 12, 3, 40, (), RESETS_40),  # every input, 3 chunks, masked channels and states
        (2, 12, 3, 40, ("D", "z", "delta_bias", "delta_softplus", "initial_state"), RESETS_40),
        (1, 8, 4, 80, (), None),  # 5 chunks, no reset
        (2, 8, 4, 80, ("z", "delta_softplus"), [(0, 1, 47, 48, 79), (64,)]),  # initial state dropped at t = 0
        (2, 6, 4, 7, (), [(3,), ()]),  # one partial chunk
        (1, 5, 2, 1, (), None),  # one token
        (2, 16, 4, 33, ("D", "initial_state"), [(15, 16, 17), (32,)]),  # a one-token last chunk
    ],
)
def test_forward_and_gradients_match_naive_float64(batch, dim, state, length, drop, starts):
    from test_selective_scan import make_inputs

    kw = make_inputs(batch, dim, state, length, seed=length)
    for name in drop:
        kw[name] = False if name == "delta_softplus" else None
    if "delta_softplus" in drop:
        kw["delta"] = kw["delta"].abs()  # keep dt >= 0 without softplus
    kw = {k: v for k, v in kw.items() if v is not None}
    if starts is not None:
        kw["reset"] = _reset(batch, length, starts)
    _check_against_naive(kw, _small_config(), 1e-10)


@pytest.mark.parametrize("state", [4, 16])
def test_default_config_matches_naive_float64(state):
    """The configuration ``chunk_parallel_scan_config`` picks (64-token chunks), over 2 chunks, with resets."""
    from test_selective_scan import make_inputs

    kw = make_inputs(1, 16, state, 80, seed=state)
    kw["reset"] = _reset(1, 80, [(0, 30, 64, 65)])
    _check_against_naive(kw, None, 1e-10)


def test_chunk_states_are_the_states_entering_each_chunk():
    from hf_densessm.ops.selective_scan.chunk_parallel import selective_scan_triton_fwd
    from hf_densessm.ops.selective_scan.naive import selective_scan_naive
    from test_selective_scan import assert_close, make_inputs

    kw = make_inputs(2, 6, 3, 40, seed=3)
    kw["reset"] = _reset(2, 40, RESETS_40)
    config = _small_config()
    y, last, states = selective_scan_triton_fwd(**kw, config=config)
    assert states.shape == (2, 3, 6, 3) and states.dtype == torch.float64 and states.is_contiguous()
    assert_close(states[:, 0], kw["initial_state"], 1e-12, "chunk 0")
    for c in (1, 2):
        prefix = {k: (v[..., :16 * c] if k in ("u", "delta", "z", "B", "C", "reset") else v) for k, v in kw.items()}
        assert_close(states[:, c], selective_scan_naive(**prefix)[1], 1e-10, f"chunk {c}")
    y2, last2, none = selective_scan_triton_fwd(**kw, save_states=False, config=config)
    assert none.shape == (2, 0, 6, 3)
    assert torch.equal(y, y2) and torch.equal(last, last2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_non_contiguous(dtype):
    """bfloat16 / float32 inputs, u, z, B and C sliced and transposed out of projections as in the Mamba block (not
    contiguous), resets: y in the input dtype, states float32, gradients in their inputs' dtypes."""
    from test_selective_scan import make_inputs

    batch, dim, state, length = 2, 8, 4, 40
    kw = make_inputs(batch, dim, state, length, dtype=dtype, seed=7)
    g = torch.Generator().manual_seed(8)
    xz = torch.randn(batch, length, 2 * dim, generator=g).to(dtype)
    bc = torch.randn(batch, length, 2 * state, generator=g).to(dtype)
    kw.update(u=xz[..., :dim].transpose(1, 2), z=xz[..., dim:].transpose(1, 2), B=bc[..., :state].transpose(1, 2),
              C=bc[..., state:].transpose(1, 2))
    assert not kw["B"].is_contiguous() and not kw["u"].is_contiguous()
    kw["reset"] = _reset(batch, length, RESETS_40)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    _check_against_naive(kw, _small_config(), tol, 2 * tol)


def test_bad_config_and_chunk_states():
    from hf_densessm.ops.selective_scan.chunk_parallel import selective_scan_triton_bwd, selective_scan_triton_fwd
    from test_selective_scan import make_inputs

    kw = make_inputs(1, 4, 2, 20)
    with pytest.raises(ValueError, match="chunk must be a power of 2"):
        selective_scan_triton_fwd(**kw, config=_small_config(chunk=24))
    y, last, _ = selective_scan_triton_fwd(**kw, save_states=False, config=_small_config())
    with pytest.raises(ValueError, match="chunk_states must hold the 2 chunk states"):
        selective_scan_triton_bwd(torch.ones_like(y), None, **kw, chunk_states=torch.zeros(1, 0, 4, 2),
                                  config=_small_config())


def test_grid_has_several_programs_per_sm_on_h100():
    """With the sm_90 choice at state 16, batch 1 x 2048 channels x 2048 tokens: several programs per SM of an
    H100 (132 SMs) in every per-chunk kernel."""
    from hf_densessm.ops.backend import ARCHS
    from hf_densessm.ops.selective_scan.chunk_parallel import _grid, chunk_parallel_scan_config

    config = chunk_parallel_scan_config(ARCHS["sm_90"], torch.bfloat16, 16)
    n_chunks = 2048 // config.chunk
    for block_d, d_steps in ((config.fwd_block_d, config.fwd_d_steps), (config.bwd_block_d, config.bwd_d_steps)):
        programs = 1
        for size in _grid(1, 2048, n_chunks, block_d, d_steps):
            programs *= size
        assert programs >= 8 * 132, programs


# ----------------------------------------------------------------------------------------------- compiling


def compile_jobs() -> list[dict]:
    """Every architecture x (bfloat16, float32) x shape with every optional input on, and sm_90 bfloat16 at the
    360M shape with none (other constexprs)."""
    out = [dict(arch=arch, dtype=dtype, shape=shape, flags=list(ALL_FLAGS))
           for arch in ARCH_NAMES for dtype in ("bfloat16", "float32") for shape in COMPILE_SHAPES]
    out.append(dict(arch="sm_90", dtype="bfloat16", shape="DenseMamba-360M", flags=["grad"]))
    return out


def compile_job_id(job):
    return "-".join([job["shape"], job["dtype"], job["arch"], "+".join(job["flags"])])


def _record_launches(job):
    """The launches (kernel, args, kwargs) the forward and backward functions make for ``job``, recorded instead of
    run (as ``kernel_compile._record_launches`` does for ``chunk.py``)."""
    from triton.runtime.jit import JITFunction

    from hf_densessm.ops.backend import ARCHS
    from hf_densessm.ops.selective_scan.chunk_parallel import (
        chunk_parallel_scan_config,
        selective_scan_triton_bwd,
        selective_scan_triton_fwd,
    )

    arch, dtype = ARCHS[job["arch"]], kernel_compile.DTYPES[job["dtype"]]
    dim, n, length = COMPILE_SHAPES[job["shape"]]["dim"], COMPILE_SHAPES[job["shape"]]["state"], 256
    flags = set(job["flags"])
    xz = torch.randn(1, length, 2 * dim, dtype=dtype)  # the layouts DenseMamba passes
    u, z = (t.transpose(1, 2) for t in xz.chunk(2, dim=-1))
    delta = torch.randn(1, length, dim, dtype=dtype).transpose(1, 2)
    x_dbl = torch.randn(1, length, 64 + 2 * n, dtype=dtype)
    B, C = x_dbl[..., 64:64 + n].transpose(1, 2), x_dbl[..., 64 + n:].transpose(1, 2)
    config = chunk_parallel_scan_config(arch, dtype, n)
    args = dict(D=torch.randn(dim), z=z if "gate" in flags else None, delta_bias=torch.randn(dim),
                delta_softplus="softplus" in flags, initial_state=torch.randn(1, dim, n),
                reset=_reset(1, length, [(0, length // 3)]) if "reset" in flags else None, config=config)
    A = -torch.rand(dim, n)
    launches = []
    original = JITFunction.run

    def record(self, *a, grid, warmup, **kwargs):
        launches.append((self, a, kwargs))

    JITFunction.run = record
    try:
        y, last, _ = selective_scan_triton_fwd(u, delta, A, B, C, save_states=True, **args)
        if "grad" in flags:
            states = torch.zeros(1, triton.cdiv(length, config.chunk), dim, n)
            selective_scan_triton_bwd(torch.randn(1, dim, length), torch.randn(1, dim, n), u, delta, A, B, C,
                                      chunk_states=states, **args)
    finally:
        JITFunction.run = original
    return launches


def _compile_job(job):
    """One dict per distinct compiled kernel: registers, shared memory, stack and local memory, occupancy."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_densessm.ops.backend import ARCHS

    arch = ARCHS[job["arch"]]
    target = GPUTarget("cuda", arch.capability[0] * 10 + arch.capability[1], 32)
    results, seen = [], set()
    for fn, args, kwargs in _record_launches(job):
        signature, constexprs, attrs, options = kernel_compile._specialize(fn, args, dict(kwargs))
        key = (fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items())), repr(options))
        if key in seen:
            continue
        seen.add(key)
        record = dict(kernel=fn.__name__, constexprs=kernel_compile._constexpr_text(fn, constexprs),
                      num_warps=options.get("num_warps", 4), num_stages=options.get("num_stages", 3))
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=target,
                                      options=options)
            record.update(kernel_compile._resources(compiled.asm["cubin"]))
        except Exception as error:  # reported, and failed, by the test
            record["error"] = f"{type(error).__name__}: {error}"[:2000]
            results.append(record)
            continue
        record["shared"] = compiled.metadata.shared + record["static_shared"]
        record["occupancy"] = arch.occupancy(record["registers"], record["num_warps"], record["shared"])
        results.append(record)
    return results


@pytest.fixture(scope="module")
def compiled(request):
    reason = kernel_compile.compile_api_problem()
    if reason:
        pytest.skip(f"cannot compile for CUDA here: {reason}")
    env = dict(os.environ, TRITON_INTERPRET="0")
    probe = subprocess.run([sys.executable, str(Path(kernel_compile.__file__)), "--probe"], capture_output=True,
                           text=True, env=env, timeout=600)
    lines = [line for line in probe.stdout.splitlines() if line.startswith("{")]
    problem = json.loads(lines[-1])["problem"] if lines else probe.stderr[-1000:]
    if problem:
        pytest.skip(f"cannot compile a Triton kernel for CUDA on this machine: {problem}")
    jobs = compile_jobs()
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(jobs), capture_output=True, text=True, env=env,
                          timeout=1800)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["id"]] = record["results"]
    for job in jobs:
        results.setdefault(compile_job_id(job), [dict(kernel="?", error=proc.stderr[-3000:])])
    yield results
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        rows = [(job, r) for job in jobs for r in results[compile_job_id(job)]]
        with capture.global_and_fixture_disabled():
            reporter.write_line("\nChunk-parallel scan kernels compiled for CUDA:")
            reporter.write_line(kernel_compile.format_table(rows))


@pytest.mark.parametrize("job", compile_jobs(), ids=compile_job_id)
def test_kernels_compile_within_the_architecture_limits(compiled, job):
    from hf_densessm.ops.backend import ARCHS

    arch = ARCHS[job["arch"]]
    results = compiled[compile_job_id(job)]
    expected = {"_chunk_state_kernel", "_carry_kernel", "_chunk_output_kernel"}
    if "grad" in job["flags"]:
        expected |= {"_chunk_adjoint_kernel", "_chunk_bwd_kernel"}
    assert {r["kernel"] for r in results} == expected, results
    for r in results:
        assert "error" not in r, f"{r['kernel']} {r.get('constexprs', '')}: {r['error']}"
        name = f"{r['kernel']} ({r['constexprs']}, {r['num_warps']} warps)"
        assert r["shared"] <= arch.shared_per_block, f"{name}: {r['shared']} B of shared memory on {arch.name}"
        assert r["stack"] == 0 and r["local"] == 0, (
            f"{name} spills: {r['stack']} B stack frame, {r['local']} B local memory ({r['registers']} registers)"
        )
        assert r["occupancy"] > 0, f"{name}: no block fits on an SM of {arch.name}"


if __name__ == "__main__":  # the compile worker: JSON jobs on stdin, one JSON result line per job
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):
        sys.exit("run with TRITON_INTERPRET=0: the interpreter's kernels cannot be compiled")
    for job in json.load(sys.stdin):
        print(json.dumps(dict(id=compile_job_id(job), results=_compile_job(job))), flush=True)
