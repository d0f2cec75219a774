"""The state-then-output retention kernels (``hf_densessm/ops/retention/chunk_h.py``): forward and every gradient
against a float64 quadratic reference (Eq. 24 with the initial state's term and the final state written out, then
autograd), under ``TRITON_INTERPRET=1`` on the CPU (``tests/conftest.py``) or on a GPU; and every kernel compiled
for sm_80 / 86 / 89 / 90 at the presets' head sizes and a small one, without register spills and within each
architecture's shared memory (no GPU needed: ``kernel_compile.py``'s machinery, run by this file as a worker
process, ``TRITON_INTERPRET=0 python tests/ops/test_retention_chunk_h.py < jobs.json``).
"""

import inspect
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernel_compile  # noqa: E402
from test_retention import (  # noqa: E402
    DEVICE,
    KERNEL_DTYPE,
    ON_CUDA,
    _assert_matches,
    _inputs,
    _rel_err,
    _reset,
    needs_triton,
)

from hf_densessm.ops.backend import ARCHS  # noqa: E402
from hf_densessm.ops.retention.naive import chunk_retention_naive, retention_log2_gamma  # noqa: E402

SCALE = 0.6
NAMES = ["o", "final_state", "dq", "dk", "dv", "d_initial_state"]


def _chunk_h():
    from hf_densessm.ops.retention import chunk_h

    return chunk_h


def _small_config(block=16):
    """Chunks of 16 tokens and 16 x 16 tiles: several chunks at lengths 40 and 80, and key 20 / value 24 split in
    two masked tiles each, so every loop over the reduction axis runs more than once."""
    chunk_h = _chunk_h()
    tiles = chunk_h.StateTiles(block, block, 4)
    return chunk_h.ChunkHRetentionConfig(16, tiles, tiles, tiles, tiles, tiles)


def _reference(q, k, v, scale, initial_state=None, reset=None):
    """o and the final state in float64, written plainly: the quadratic form (``chunk_retention_naive``, Eq. 24
    with a same-document mask), plus ``scale gamma^(t+1) q_t S_0`` for the tokens of the initial state's document,
    and ``S_L = sum_s gamma^(L-1-s) k_s^T v_s`` over the last document (plus ``gamma^L S_0`` if that is the first).
    Differentiable: autograd through it gives the reference gradients."""
    batch, length, heads, key_dim = q.shape
    o = chunk_retention_naive(q, k, v, scale=scale, reset=reset)
    lg = retention_log2_gamma(heads, q.device, torch.float64)  # (H,)
    pos = torch.arange(length, device=q.device, dtype=torch.float64)
    if reset is None:
        docs = torch.zeros(batch, length, dtype=torch.long, device=q.device)
    else:
        docs = reset.long().cumsum(-1)
    first = (docs == 0).to(torch.float64)  # (B, L): tokens of the initial state's document
    last = (docs == docs[:, -1:]).to(torch.float64) if length else first  # (B, L): tokens of the last document
    write = torch.exp2(lg[None, :, None] * (length - 1 - pos)[None, None, :]) * last[:, None, :]  # (B, H, L)
    final_state = torch.einsum("bhl,blhk,blhv->bhkv", write, k, v)
    if initial_state is not None:
        read = torch.exp2(lg[None, :, None] * (pos + 1)[None, None, :]) * first[:, None, :]  # (B, H, L)
        o = o + scale * torch.einsum("bhl,blhk,bhkv->blhv", read, q, initial_state)
        carries = first[:, -1] if length else torch.ones(batch, dtype=torch.float64, device=q.device)
        final_state = final_state + torch.exp2(lg * length)[None, :, None, None] * carries[:, None, None, None] * \
            initial_state
    return o, final_state


def _expected(q, k, v, s0, reset, d_o, d_final_state):
    """Reference o, final state and the gradients of ``sum(o * d_o) + sum(final_state * d_final_state)``
    (the last of them the initial state's, a zero one where there is none)."""
    leaves = [x.detach().double().clone().requires_grad_() for x in (q, k, v)]
    if s0 is None:  # the op's backward returns the gradient of a zero initial state
        s0 = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=torch.float64)
    s0_leaf = s0.detach().double().clone().requires_grad_()
    o, final_state = _reference(*leaves, SCALE, s0_leaf, reset)
    loss = (o * d_o.double()).sum()
    if d_final_state is not None:
        loss = loss + (final_state * d_final_state.double()).sum()
    loss.backward()
    return [o, final_state] + [x.grad for x in leaves] + [s0_leaf.grad]


def _run(q, k, v, s0, reset, d_o, d_final_state, config):
    chunk_h = _chunk_h()
    o, final_state = chunk_h.chunk_retention_fwd_triton(q, k, v, SCALE, s0, reset, config=config)
    grads = chunk_h.chunk_retention_bwd_triton(d_o, d_final_state, q, k, v, SCALE, s0, reset, config=config)
    return [o, final_state, *grads]


def _check(case_inputs, reset=None, with_d_final=True, config=None, rel=3e-3):
    q, k, v, s0 = case_inputs
    gen = torch.Generator().manual_seed(7)
    d_o = torch.randn(v.shape, generator=gen, dtype=torch.float64).to(DEVICE, v.dtype)
    state_dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    d_final = torch.randn(q.shape[0], q.shape[2], q.shape[3], v.shape[3], generator=gen, dtype=torch.float64)
    d_final = d_final.to(DEVICE, state_dtype) if with_d_final else None
    got = _run(q, k, v, s0, reset, d_o, d_final, _small_config() if config is None else config)
    expected = _expected(q, k, v, s0, reset, d_o, d_final)
    dtypes = [v.dtype, state_dtype, q.dtype, k.dtype, v.dtype, state_dtype]
    for name, a, b, dtype in zip(NAMES, got, expected, dtypes):
        assert a.dtype == dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.shape)
        if dtype == torch.float64:
            _assert_matches(a, b, name)  # to 1e-10
        else:
            assert _rel_err(a, b) < rel, f"{name}: relative error {_rel_err(a, b):.2e}"


# ---------------------------------------------------------------------------------------------------- numerics


def test_reference_matches_the_chunked_torch_path():
    """The test's plain reference, with an initial state and resets, against ``chunked_torch.py``."""
    from hf_densessm.ops.retention.chunked_torch import chunk_retention_torch

    q, k, v, s0 = _inputs(2, 37, 2, 6, 5, initial_state=True)
    reset = _reset(2, 37, [(0, 9, 10), (20,)])
    for r in (None, reset):
        o, final_state = _reference(q, k, v, SCALE, s0, r)
        o_ref, final_ref = chunk_retention_torch(q, k, v, SCALE, s0, True, chunk_size=8, reset=r)
        torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final_state, final_ref, rtol=1e-10, atol=1e-10)


@needs_triton
@pytest.mark.parametrize("initial_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("length", [7, 40, 80])  # under one chunk; 2.5 chunks; 5 whole chunks
def test_matches_reference(length, initial_state):
    _check(_inputs(2, length, 2, 20, 24, dtype=KERNEL_DTYPE, initial_state=initial_state))


@needs_triton
def test_without_final_state_gradient():
    _check(_inputs(1, 40, 2, 20, 24, dtype=KERNEL_DTYPE, initial_state=True), with_d_final=False)


@needs_triton
@pytest.mark.parametrize("length", [40, 80])
def test_packed_documents(length):
    """Documents starting at t = 0 (the initial state is dropped: its gradient is 0 in that row), inside a chunk,
    at a chunk's last token and at the next chunk's first (one-token documents 15 and 16), at 32 (a chunk edge),
    and at the last token; the second row keeps its initial state for 20 tokens."""
    starts = [(0, 5, 15, 16, 17, 32, 47, 48, 79), (20, 64)]
    reset = _reset(2, length, [[t for t in row if t < length] for row in starts])
    _check(_inputs(2, length, 2, 20, 24, dtype=KERNEL_DTYPE, initial_state=True), reset=reset)


@needs_triton
def test_tile_sizes_and_chunk_lengths():
    """32-wide tiles (one masked key tile of 20, one masked value tile of 24) and the chunk and tiles the
    configuration gives every GPU and dtype (chunks of 64: two chunks at length 80)."""
    chunk_h = _chunk_h()
    inputs = _inputs(1, 80, 2, 20, 24, dtype=KERNEL_DTYPE, initial_state=True)
    reset = _reset(1, 80, [(3, 64)])
    _check(inputs, reset=reset, config=_small_config(32))
    configs = {chunk_h.chunk_h_retention_config(arch, dtype, 20, 24) for arch in ARCHS.values()
               for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    assert len(configs) >= 2
    for config in sorted(configs, key=repr):
        _check(inputs, reset=reset, config=config)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("the Triton interpreter computes bfloat16 tl.dot and arithmetic wrongly (numpy has no bfloat16)")
    q, k, v, s0 = _inputs(2, 40, 2, 20, 24, initial_state=True)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    reset = _reset(2, 40, [(0, 17), (32,)])
    _check((q, k, v, s0.float()), reset=reset, rel=3e-3 if dtype == torch.float32 else 2e-2)


@needs_triton
def test_empty_sequence():
    chunk_h = _chunk_h()
    q, k, v, s0 = _inputs(1, 0, 2, 20, 24, dtype=KERNEL_DTYPE, initial_state=True)
    o, final_state = chunk_h.chunk_retention_fwd_triton(q, k, v, SCALE, s0, config=_small_config())
    assert o.shape == v.shape
    torch.testing.assert_close(final_state, s0)
    d_final = torch.randn_like(s0)
    dq, dk, dv, d_s0 = chunk_h.chunk_retention_bwd_triton(torch.zeros_like(v), d_final, q, k, v, SCALE, s0,
                                                          config=_small_config())
    assert dq.shape == q.shape and dv.shape == v.shape
    torch.testing.assert_close(d_s0, d_final)


def test_entry_points_have_chunk_py_signatures():
    """Switching the op's Triton branch to this file is an import change: same names, same parameters."""
    pytest.importorskip("triton")
    from hf_densessm.ops.retention import chunk

    chunk_h = _chunk_h()
    for name in ("chunk_retention_fwd_triton", "chunk_retention_bwd_triton"):
        assert inspect.signature(getattr(chunk_h, name)) == inspect.signature(getattr(chunk, name)), name


# ----------------------------------------------------------------------------------------------------- compile

SHAPES = kernel_compile.RETENTION_SHAPES
KERNELS = {"_chunk_h_kernel", "_chunk_o_kernel", "_chunk_dh_kernel", "_chunk_dqk_kernel", "_chunk_dv_kernel"}


def compile_jobs():
    """Every architecture x shape x (bfloat16, float32) with every optional input on (initial state, gradient of the
    final state, packed documents); at sm_90 and DenseRetNet-350M, bfloat16: without the optional inputs, and with
    Python floats typed fp64 (as Inductor's launcher passes ``scale``)."""
    out = [dict(arch=arch, dtype=dtype, shape=shape, full=True)
           for arch, dtype, shape in itertools.product(kernel_compile.ARCH_NAMES, ("bfloat16", "float32"), SHAPES)]
    out.append(dict(arch="sm_90", dtype="bfloat16", shape="DenseRetNet-350M", full=False))
    out.append(dict(arch="sm_90", dtype="bfloat16", shape="DenseRetNet-350M", full=True, float_scalars="fp64"))
    return out


def _job_id(job):
    return "-".join([job["shape"], job["dtype"], job["arch"], "full" if job["full"] else "plain"]
                    + (["fp64-scalars"] if job.get("float_scalars") else []))


def _record(job):
    """The launches ``(JITFunction, args, kwargs)`` of one forward and one backward call on CPU tensors."""
    from triton.runtime.jit import JITFunction

    chunk_h = _chunk_h()
    arch, dtype = ARCHS[job["arch"]], kernel_compile.DTYPES[job["dtype"]]
    shape = SHAPES[job["shape"]]
    heads, key_dim, value_dim, length = shape["heads"], shape["key_dim"], shape["value_dim"], 64
    q, k, v = (torch.randn(1, length, heads, d, dtype=dtype) for d in (key_dim, key_dim, value_dim))
    s0 = torch.randn(1, heads, key_dim, value_dim) if job["full"] else None
    reset = _reset_row(length) if job["full"] else None
    config = chunk_h.chunk_h_retention_config(arch, dtype, key_dim, value_dim)
    launches, original = [], JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        o, final_state = chunk_h.chunk_retention_fwd_triton(q, k, v, key_dim**-0.5, s0, reset, config=config)
        d_final = torch.randn_like(final_state) if job["full"] else None
        chunk_h.chunk_retention_bwd_triton(torch.randn_like(o), d_final, q, k, v, key_dim**-0.5, s0, reset,
                                           config=config)
    finally:
        JITFunction.run = original
    return launches


def _reset_row(length):
    reset = torch.zeros(1, length, dtype=torch.bool)
    reset[0, [0, length // 3]] = True
    return reset


def run_compile_job(job):
    """Compile the launches of one job for its architecture: one dict per distinct kernel specialization."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    arch = ARCHS[job["arch"]]
    target = GPUTarget("cuda", arch.capability[0] * 10 + arch.capability[1], 32)
    results, seen = [], set()
    for fn, args, kwargs in _record(job):
        signature, constexprs, attrs, options = kernel_compile._specialize(fn, args, dict(kwargs),
                                                                           job.get("float_scalars", "fp32"))
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
    pytest.importorskip("triton")
    problem = kernel_compile.compile_api_problem()
    if problem:
        pytest.skip(f"cannot compile for CUDA here: {problem}")
    env = dict(os.environ, TRITON_INTERPRET="0")
    jobs = compile_jobs()
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(jobs), capture_output=True, text=True,
                          env=env, timeout=1800)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["id"]] = record["results"]
    if not results and "ptxas" in proc.stderr:
        pytest.skip(f"cannot compile a Triton kernel for CUDA on this machine: {proc.stderr[-1000:]}")
    for job in jobs:
        results.setdefault(_job_id(job), [dict(kernel="?", error=proc.stderr[-3000:])])
    yield results
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        rows = [(dict(job, op="retention", flags=["full"] if job["full"] else []), r)
                for job in jobs for r in results[_job_id(job)]]
        with capture.global_and_fixture_disabled():
            reporter.write_line("\nchunk_h.py kernels compiled for CUDA (registers, shared memory, spills, occupancy):")
            reporter.write_line(kernel_compile.format_table(rows))


@pytest.mark.parametrize("job", compile_jobs(), ids=_job_id)
def test_kernels_compile_within_the_architecture_limits(compiled, job):
    results = compiled[_job_id(job)]
    arch = ARCHS[job["arch"]]
    assert {r["kernel"] for r in results} == KERNELS, results
    for r in results:
        assert "error" not in r, f"{r['kernel']} {r.get('constexprs', '')}: {r['error']}"
        name = f"{r['kernel']} ({r['constexprs']}, {r['num_warps']} warps, {r['num_stages']} stages)"
        assert r["shared"] <= arch.shared_per_block, (
            f"{name} needs {r['shared']} B of shared memory, over {arch.name}'s {arch.shared_per_block} B per block"
        )
        assert r["stack"] == 0 and r["local"] == 0, (
            f"{name} spills: {r['stack']} B stack frame, {r['local']} B local memory ({r['registers']} registers)"
        )
        assert r["occupancy"] > 0, f"{name}: no block fits on an SM of {arch.name}"


if __name__ == "__main__":  # the compile worker: jobs as JSON on stdin, one JSON result line per job
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):
        sys.exit("run with TRITON_INTERPRET=0: the interpreter's kernels cannot be compiled")
    for compile_job in json.load(sys.stdin):
        print(json.dumps(dict(id=_job_id(compile_job), results=run_compile_job(compile_job))), flush=True)
