"""The C++ CPU kernel of the selective scan (``csrc/selective_scan_cpu.cpp``, loaded by ``ops/cpu_kernel.py``)
against the float64 token loop (``naive.py``): through the public ``selective_scan(..., backend="torch")`` and
through its ops directly; every gradient, float32 / float64 / bfloat16, lengths across checkpoints, packed
documents, strided inputs and the token-major views the model passes (read in place: no copy, token-major
outputs); ``opcheck`` on its ops; the fallback to the chunked PyTorch path; the build key."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from hf_densessm.ops import cpu_kernel
from hf_densessm.ops.dispatch import choose
from hf_densessm.ops.selective_scan import _ops as scan_ops
from hf_densessm.ops.selective_scan import selective_scan
from hf_densessm.ops.selective_scan.chunked_torch import selective_scan_torch_fwd
from hf_densessm.ops.selective_scan.naive import selective_scan_naive

from test_selective_scan import assert_close, grads_of, make_inputs, seq_fn

K = cpu_kernel.CHECKPOINT


@pytest.fixture(scope="module")
def kernel():
    """Skip without a compiler or ninja; build (or load from the cache) the kernel once."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the CPU kernel cannot be built (the PyTorch path runs)")
    if shutil.which("ninja") is None:
        pytest.skip("no ninja: torch.utils.cpp_extension cannot build the CPU kernel")
    if not cpu_kernel.SOURCE.is_file():
        pytest.skip("the kernel's source is not installed")
    if not cpu_kernel.load_kernel():
        pytest.fail("the C++ kernel failed to build (see the warning)")
    return True


@pytest.fixture
def enabled(kernel, monkeypatch):
    monkeypatch.delenv("HF_DENSESSM_CPU_KERNEL", raising=False)
    return kernel


def public(**kw):
    return selective_scan(**kw, backend="torch")


def packed(kw, rows):
    """``kw`` with a reset tensor, True at the given (row, positions)."""
    batch, _, length = kw["u"].shape
    reset = torch.zeros(batch, length, dtype=torch.bool)
    for row, pos in rows.items():
        reset[row, pos] = True
    return dict(kw, reset=reset)


def check_all(kw, tol_y=1e-10, tol_g=1e-10):
    y, last, grads = grads_of(public, kw)
    y0, last0, grads0 = grads_of(seq_fn, kw)
    assert y.dtype == kw["u"].dtype
    assert_close(y, y0, tol_y, "y")
    assert_close(last, last0, tol_y, "last_state")
    assert grads.keys() == grads0.keys()
    for k in grads0:
        assert grads[k].dtype == kw[k].dtype, k
        assert_close(grads[k], grads0[k], tol_g, f"d{k}")


# ------------------------------------------------------------------------------------------ against naive


@pytest.mark.parametrize("length", [1, 7, K - 1, K, K + 1, 2 * K + 5])
@pytest.mark.parametrize("full", [True, False])
def test_kernel_every_gradient_float64(enabled, length, full):
    check_all(make_inputs(2, 6, 5, length, full=full, seed=length))


@pytest.mark.parametrize("state", [1, 16, 17, 33])
def test_kernel_state_sizes(enabled, state):
    """State sizes below, at and above one vector (padded lanes must stay zero)."""
    check_all(make_inputs(1, 3, state, 70, seed=state))


def test_kernel_packed_documents(enabled):
    """Resets at t = 0, at checkpoint edges (K-1, K, K+1), one-token documents (consecutive resets), the end."""
    L = 2 * K + 9
    kw = packed(make_inputs(3, 5, 4, L, seed=5),
                {0: [0, K - 1, K, K + 1, L - 1], 1: [3, 4, 5, 2 * K], 2: list(range(0, L, 7))})
    check_all(kw)


def test_kernel_with_and_without_each_option(enabled):
    base = make_inputs(2, 4, 6, K + 3, seed=9)
    for drop in ("D", "z", "delta_bias", "initial_state"):
        kw = dict(base)
        kw.pop(drop)
        check_all(kw)
    kw = dict(base, delta_softplus=False, delta=base["delta"].abs())
    kw.pop("delta_bias")
    check_all(kw)


def test_kernel_non_contiguous_inputs(enabled):
    """B and C sliced out of one projection and transposed (as the model does), u and z strided too."""
    batch, dim, n, L = 2, 6, 5, K + 11
    kw = make_inputs(batch, dim, n, L, seed=4)
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(batch, L, 2 * n + 3, generator=g, dtype=torch.float64)
    kw["B"] = proj[:, :, 3:3 + n].transpose(1, 2)
    kw["C"] = proj[:, :, 3 + n:].transpose(1, 2)
    kw["u"] = torch.randn(batch, L, dim, generator=g, dtype=torch.float64).transpose(1, 2)
    kw["z"] = torch.randn(batch, dim, 2 * L, generator=g, dtype=torch.float64)[:, :, ::2]
    assert not (kw["B"].is_contiguous() or kw["C"].is_contiguous() or kw["u"].is_contiguous())
    check_all(kw)


def _token_major(kw, seed=0):
    """``kw`` with u, delta, z given as the model passes them: (batch, dim, length) views of token-major tensors
    (channel stride 1; z a slice of a wider projection, token stride 2 * dim), B and C slices of one projection."""
    batch, dim, L = kw["u"].shape
    n = kw["A"].shape[1]
    g = torch.Generator().manual_seed(seed)
    out = dict(kw)
    for name in ("u", "delta"):
        out[name] = kw[name].transpose(1, 2).contiguous().transpose(1, 2)
    if kw.get("z") is not None:
        wide = torch.randn(batch, L, 2 * dim, generator=g, dtype=torch.float64).to(kw["z"].dtype)
        wide[:, :, dim:] = kw["z"].transpose(1, 2)
        out["z"] = wide.chunk(2, dim=-1)[1].transpose(1, 2)
    proj = torch.randn(batch, L, 2 * n + 3, generator=g, dtype=torch.float64).to(kw["B"].dtype)
    proj[:, :, 3:3 + n] = kw["B"].transpose(1, 2)
    proj[:, :, 3 + n:] = kw["C"].transpose(1, 2)
    out["B"], out["C"] = proj[:, :, 3:3 + n].transpose(1, 2), proj[:, :, 3 + n:].transpose(1, 2)
    for name in ("u", "delta", "z", "B", "C"):
        if out.get(name) is not None:
            assert torch.equal(out[name], kw[name]) and out[name].stride(1) == 1, name
    return out


@pytest.mark.parametrize("dim,state,dtype", [(6, 5, torch.float64), (21, 16, torch.float64),
                                             (40, 16, torch.float32), (19, 33, torch.float32)])
def test_kernel_token_major_inputs(enabled, dim, state, dtype):
    """Token-major views (read in place by the kernel) give the results of contiguous inputs, across channel
    blocks, partial last blocks and padded state sizes; with packed documents."""
    kw = packed(make_inputs(2, dim, state, K + 9, dtype=dtype, seed=dim), {0: [0, 5], 1: [K]})
    tol = (1e-10, 1e-10) if dtype == torch.float64 else (1e-5, 1e-4)
    check_all(_token_major(kw, seed=dim), *tol)
    y, last, grads = grads_of(public, _token_major(kw, seed=dim))
    y1, last1, grads1 = grads_of(public, kw)
    assert_close(y, y1, 1e-12 if dtype == torch.float64 else 1e-6, "y")
    for k in grads1:
        assert_close(grads[k], grads1[k], 1e-12 if dtype == torch.float64 else 1e-6, f"d{k}")


@pytest.mark.parametrize("batch,threads", [(1, 3), (2, 2), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_tiles_and_tasks(enabled, batch, threads, dtype):
    """Several tiles of channel blocks per task and several tasks per batch row (the kernel splits a row into about
    2 * threads / batch slices of whole tiles of 256 bytes of channels), the last tile and block partial, the
    last chunk short, packed documents: every gradient against the float64 token loop, and the same results on
    every thread count."""
    dim = 75 if dtype == torch.float64 else 150  # 2.3 tiles on AVX-512 and AVX2
    kw = packed(make_inputs(batch, dim, 16, 2 * K + 9, dtype=dtype, seed=batch), {batch - 1: [0, 7, K, K + 1]})
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y, last, grads = grads_of(public, kw)
        if dtype == torch.float64:
            check_all(kw)
        torch.set_num_threads(1)
        y1, last1, grads1 = grads_of(public, kw)
    finally:
        torch.set_num_threads(old)
    assert_close(y, y1, 1e-12, "y")
    assert_close(last, last1, 1e-12, "last_state")
    for k in grads1:
        assert_close(grads[k], grads1[k], 1e-12 if dtype == torch.float64 else 1e-6, f"d{k}")


def _raw_inputs(dtype, token_major, b=2, d=24, n=16, L=K + 7, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    def seq(channels):  # (b, channels, L)
        return r(b, L, channels).transpose(1, 2) if token_major else r(b, channels, L)

    A = -torch.rand(d, n, generator=g, dtype=dtype) - 0.1
    reset = torch.zeros(b, L, dtype=torch.bool)
    reset[1, 3] = True
    fwd = (seq(d), seq(d), A, seq(n), seq(n), r(d), seq(d), r(d), True, r(b, d, n), reset)
    return fwd, (seq(d), r(b, d, n))


def test_kernel_outputs_are_token_major_and_strided_dy(enabled):
    """y, du, ddelta, dz, dB, dC are (batch, channels, length) views of contiguous token-major tensors; a token-major
    dy gives the gradients of a contiguous one."""
    b, d, n, L = 2, 24, 16, K + 7
    fwd, (dy, dlast) = _raw_inputs(torch.float64, token_major=True)
    y, last, states = torch.ops.hf_densessm.selective_scan_cpu_fwd(*fwd)
    assert y.stride() == (L * d, 1, d) and y.transpose(1, 2).is_contiguous()
    assert last.is_contiguous() and states.is_contiguous()
    grads = torch.ops.hf_densessm.selective_scan_cpu_bwd(dy, dlast, *fwd, states)
    for i in (0, 1, 3, 4, 6):
        assert grads[i].transpose(1, 2).is_contiguous(), i
    contiguous = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in fwd)
    y1, _, states1 = torch.ops.hf_densessm.selective_scan_cpu_fwd(*contiguous)
    grads1 = torch.ops.hf_densessm.selective_scan_cpu_bwd(dy.contiguous(), dlast, *contiguous, states1)
    assert torch.equal(y, y1) and torch.equal(states, states1)
    for a, a1 in zip(grads, grads1):
        assert torch.equal(a, a1)


def _large_copies(fn, numel):
    """The aten::copy_ calls of ``fn()`` on a tensor of at least ``numel`` elements."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    found = []
    for e in prof.events():
        if e.name == "aten::copy_":
            sizes = [s for s in e.input_shapes if s]
            if any(torch.Size(s).numel() >= numel for s in sizes):
                found.append(sizes)
    return found


def test_kernel_makes_no_copy_of_token_major_inputs(enabled):
    """Token-major u, delta, z, dy and sliced B, C: no full-size copy in either op (the layout conversions around
    the kernel are gone); contiguous (batch, dim, length) inputs are copied (to the token-major layout)."""
    b, d, n, L = 2, 48, 16, 2 * K
    fwd, (dy, dlast) = _raw_inputs(torch.float32, token_major=True, b=b, d=d, n=n, L=L)
    states = torch.ops.hf_densessm.selective_scan_cpu_fwd(*fwd)[2]
    assert _large_copies(lambda: torch.ops.hf_densessm.selective_scan_cpu_fwd(*fwd), b * n * L) == []
    assert _large_copies(lambda: torch.ops.hf_densessm.selective_scan_cpu_bwd(dy, dlast, *fwd, states),
                         b * n * L) == []
    contiguous = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in fwd)
    assert len(_large_copies(lambda: torch.ops.hf_densessm.selective_scan_cpu_fwd(*contiguous), b * d * L)) == 3


def test_kernel_float32(enabled):
    kw = packed(make_inputs(2, 8, 16, 2 * K + 3, dtype=torch.float32, seed=2), {1: [0, K]})
    y, last, grads = grads_of(public, kw)
    y0, last0, grads0 = grads_of(seq_fn, kw)
    assert y.dtype == torch.float32 and last.dtype == torch.float32
    assert_close(y, y0, 1e-5, "y")
    assert_close(last, last0, 1e-5, "last_state")
    for k in grads0:
        assert grads[k].dtype == kw[k].dtype
        assert_close(grads[k], grads0[k], 1e-4, f"d{k}")


def test_kernel_bfloat16(enabled):
    """bfloat16 inputs: computed in float32, y and the gradients back in bfloat16, last_state float32."""
    kw = make_inputs(2, 8, 4, K + 5, dtype=torch.bfloat16, seed=8)
    y, last, grads = grads_of(public, kw)
    y0, last0, grads0 = grads_of(seq_fn, kw)
    assert y.dtype == torch.bfloat16 and last.dtype == torch.float32
    assert_close(y, y0, 2e-2, "y")
    assert_close(last, last0, 1e-4, "last_state")
    for k in grads0:
        assert grads[k].dtype == kw[k].dtype
        assert_close(grads[k], grads0[k], 3e-2, f"d{k}")


def test_kernel_matches_chunked_path_forward(enabled):
    kw = packed(make_inputs(2, 6, 5, 3 * K, seed=12), {0: [K]})
    y, last, states = cpu_kernel.scan_fwd(**kw)
    y0, last0, _ = selective_scan_torch_fwd(**kw)
    assert_close(y, y0, 1e-12, "y")
    assert_close(last, last0, 1e-12, "last")
    assert states.shape == (2, 6, 3, 5)


# ---------------------------------------------------------------------------------------------- the ops


def _op_inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    b, d, n, L = 2, 4, 3, K + 5

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    A = -torch.rand(d, n, generator=g, dtype=dtype) - 0.1
    reset = torch.zeros(b, L, dtype=torch.bool)
    reset[0, 2] = reset[1, K] = True
    fwd = (r(b, d, L), r(b, d, L), A, r(b, n, L), r(b, n, L), r(d), r(b, d, L), r(d), True, r(b, d, n), reset)
    y, last, states = torch.ops.hf_densessm.selective_scan_cpu_fwd(*fwd)
    bwd = (r(*y.shape), r(*last.shape)) + fwd + (states,)
    return fwd, bwd


def test_opcheck_cpu_kernel_ops(enabled):
    fwd, bwd = _op_inputs()
    torch.library.opcheck(torch.ops.hf_densessm.selective_scan_cpu_fwd.default, fwd)
    torch.library.opcheck(torch.ops.hf_densessm.selective_scan_cpu_bwd.default, bwd)
    # token-major inputs (read in place), dy included
    fwd_tm, (dy, dlast) = _raw_inputs(torch.float32, token_major=True)
    torch.library.opcheck(torch.ops.hf_densessm.selective_scan_cpu_fwd.default, fwd_tm)
    states = torch.ops.hf_densessm.selective_scan_cpu_fwd(*fwd_tm)[2]
    torch.library.opcheck(torch.ops.hf_densessm.selective_scan_cpu_bwd.default, (dy, dlast) + fwd_tm + (states,))
    # optional arguments absent
    none_fwd = fwd[:5] + (None, None, None, False, None, None)
    torch.library.opcheck(torch.ops.hf_densessm.selective_scan_cpu_fwd.default, none_fwd)
    states = torch.ops.hf_densessm.selective_scan_cpu_fwd(*none_fwd)[2]
    torch.library.opcheck(torch.ops.hf_densessm.selective_scan_cpu_bwd.default,
                          (None, None) + none_fwd + (states,))


def test_ops_directly_against_naive(enabled):
    """The raw ops in float64: outputs and gradients (vector-Jacobian products) against the naive's autograd."""
    fwd, _ = _op_inputs(seed=3, dtype=torch.float64)
    fwd = tuple(a.abs().neg() if i == 2 else a for i, a in enumerate(fwd))
    y, last, states = torch.ops.hf_densessm.selective_scan_cpu_fwd(*fwd)
    names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "initial_state", "reset")
    kw = dict(zip(names, fwd))
    leaves = {k: v.clone().requires_grad_() for k, v in kw.items() if k not in ("reset", "delta_softplus")}
    y0, last0 = selective_scan_naive(**dict(kw, **leaves))
    assert_close(y, y0, 1e-12, "y")
    assert_close(last, last0, 1e-12, "last")
    gy, gl = torch.randn_like(y), torch.randn_like(last)
    grads = torch.ops.hf_densessm.selective_scan_cpu_bwd(gy, gl, *fwd, states)
    want = torch.autograd.grad((y0 * gy).sum() + (last0 * gl).sum(), list(leaves.values()))
    order = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
    for name, got, ref in zip(order, grads, [want[list(leaves).index(k)] for k in order]):
        assert_close(got, ref, 1e-10, f"d{name}")


def test_bad_inputs_are_refused(enabled):
    fwd, bwd = _op_inputs()
    with pytest.raises(RuntimeError, match="B must have shape"):
        torch.ops.hf_densessm.selective_scan_cpu_fwd(*fwd[:3], fwd[3][:, :, :-1], *fwd[4:])
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.hf_densessm.selective_scan_cpu_fwd(fwd[0].double(), *fwd[1:])
    with pytest.raises(RuntimeError, match="chunk_states"):
        torch.ops.hf_densessm.selective_scan_cpu_bwd(*bwd[:-1], bwd[-1].transpose(2, 3))
    # the chunked path's states (batch, n_chunks, state, dim) are refused by the Python wrapper
    torch_states = selective_scan_torch_fwd(*fwd)[2]
    with pytest.raises(ValueError, match="another path"):
        cpu_kernel.scan_bwd(*bwd[:-1], chunk_states=torch_states)


# ------------------------------------------------------------------------------------ fallback and build key


def test_env_var_disables_kernel(kernel, monkeypatch):
    """``HF_DENSESSM_CPU_KERNEL=0``: the scan's table chooses the chunked PyTorch path (its saved layout), and the
    results agree with the kernel's."""
    kw = make_inputs(2, 6, 5, 2 * K + 3, seed=1)
    args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"], True,
            kw["initial_state"], None, True)
    cpu = torch.device("cpu")
    monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", "0")
    assert choose("selective_scan", cpu, "torch", state_size=5) == "torch"
    y_t, _, states_t = scan_ops.selective_scan(*args, "torch")
    assert states_t.shape == selective_scan_torch_fwd(*args[:-1])[2].flatten(2).shape  # handed out 3-D
    y0, last0, grads0 = grads_of(public, kw)
    monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", "1")
    assert choose("selective_scan", cpu, "torch", state_size=5) == "cpp"
    y_k, _, states_k = scan_ops.selective_scan(*args, "cpp")
    assert states_k.shape == (2, 6, 3 * 5)  # (batch, dim, n_chunks * state): handed out 3-D
    y1, last1, grads1 = grads_of(public, kw)
    assert_close(y_k, y_t, 1e-12)
    assert_close(y1, y0, 1e-12)
    for k in grads0:
        assert_close(grads1[k], grads0[k], 1e-10, k)


def test_failed_load_falls_back_to_chunked_path(monkeypatch):
    """A kernel that did not load (``load_kernel`` False): the public function runs ``chunked_torch.py`` and still
    matches the naive loop, gradients included."""
    monkeypatch.delenv("HF_DENSESSM_CPU_KERNEL", raising=False)
    monkeypatch.setattr(cpu_kernel, "load_kernel", lambda: False)
    kw = packed(make_inputs(2, 6, 5, K + 3, seed=6), {0: [0, 9]})
    assert choose("selective_scan", kw["u"].device, "torch", state_size=5) == "torch"
    assert cpu_kernel.missing(kw["u"].device, state_size=5) == "is not available (see the build warning)"
    check_all(kw)


def test_build_without_source_is_silent_and_broken_source_warns(monkeypatch, tmp_path, recwarn):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert cpu_kernel._build(tmp_path / "absent.cpp") is False
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja")
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    with pytest.warns(RuntimeWarning, match="PyTorch path runs instead"):
        assert cpu_kernel._build(broken) is False


def test_build_name_depends_on_capability_torch_and_source():
    src = "int x;"
    flags = {c: cpu_kernel.capability_flags(c) for c in ("AVX512", "AVX2", "DEFAULT")}
    names = {c: cpu_kernel.extension_name(src, c, "2.13.0", f) for c, f in flags.items()}
    assert len(set(names.values())) == 3
    assert names["AVX512"].startswith("hf_densessm_scan_cpu_avx512_")
    assert names["AVX2"].startswith("hf_densessm_scan_cpu_avx2_")
    assert cpu_kernel.extension_name(src, "AVX2", "2.13.0", flags["AVX2"]) == names["AVX2"]  # deterministic
    assert cpu_kernel.extension_name(src, "AVX2", "2.12.0", flags["AVX2"]) != names["AVX2"]
    assert cpu_kernel.extension_name(src + " ", "AVX2", "2.13.0", flags["AVX2"]) != names["AVX2"]
    assert cpu_kernel.extension_name(src, "NO AVX", "2.13.0", flags["DEFAULT"]).startswith(
        "hf_densessm_scan_cpu_no_avx_")
    assert "-DCPU_CAPABILITY_AVX512" in flags["AVX512"] and "-mavx512f" in flags["AVX512"]
    assert "-DCPU_CAPABILITY_AVX2" in flags["AVX2"] and "-mavx2" in flags["AVX2"]
    assert not any(f.startswith("-m") for f in flags["DEFAULT"])
    assert not any("native" in f for fl in flags.values() for f in fl)


def test_kernel_tasks_run_on_torch_openmp_threads(enabled):
    """``at::parallel_for`` is a header template: built without ``-fopenmp`` (as before issue 35) its tasks ran on
    the calling thread only, whatever ``torch.set_num_threads`` said. Where ATen's backend is OpenMP on Linux, the
    library must hold an OpenMP parallel region and share PyTorch's one ``libgomp`` (one thread pool)."""
    if not cpu_kernel.openmp_flags():
        pytest.skip("ATen's parallel backend is not OpenMP on Linux: at::parallel_for needs no flag")
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()  # the library load_kernel published in the cache
    flags = cpu_kernel.capability_flags(capability) + cpu_kernel.openmp_flags()
    name = cpu_kernel.extension_name(cpu_kernel.SOURCE.read_text(), capability, torch.__version__, flags)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    library = Path(root) / name / f"{name}{cpp_extension.LIB_EXT}"
    assert library.is_file() and b"GOMP_parallel" in library.read_bytes()
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if os.path.basename(line.split()[-1]).startswith(("libgomp", "libiomp", "libomp"))}
    assert len(mapped) == 1, mapped
