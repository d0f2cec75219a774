"""The compiled CPU selective scan (``ops/selective_scan/cpu.py``) against the plain token loop (``naive.py``), in
float64 at 1e-10: values, final state and every gradient, with channel counts that are not a multiple of the
kernel's lanes, state sizes on both sides of the specialized 16, lengths across the backward pass's segments, packed
documents; float32 at the models' init scale; bfloat16 inputs; the decode step; the backend switch and the build's
fallbacks."""

import os
import subprocess
import sys

import pytest
import torch

from hf_densessm.ops import cpu_build
from hf_densessm.ops.selective_scan import cpu as cpu_scan
from hf_densessm.ops.selective_scan import selective_scan, selective_state_update
from hf_densessm.ops.selective_scan.naive import selective_scan_naive

from test_selective_scan import assert_close, grads_of, make_inputs, seq_fn  # tests/ops is on sys.path (pytest)

pytestmark = pytest.mark.skipif(not cpu_scan.cpu_kernel_available(), reason="no C compiler: the kernel cannot be built")
SEG = cpu_scan.SEGMENT


def cpu_fn(**kw):
    return selective_scan(**kw, backend="cpu")


def packed_reset(batch, length, seed=3):
    g = torch.Generator().manual_seed(seed)
    reset = torch.rand(batch, length, generator=g) < 0.15
    reset[:, min(SEG, length - 1)] = True  # a document starting on a segment's first token
    return reset


@pytest.mark.parametrize(
    "batch,dim,state,length",
    [(1, 1, 1, 1), (2, 5, 3, 7), (2, 37, 16, SEG - 1), (1, 16, 16, SEG), (2, 19, 16, SEG + 1), (3, 9, 17, 2 * SEG + 5),
     # several tiles of TILE channel groups per worker and a ragged last tile (300 channels = 38 groups of 8 lanes)
     (2, 300, 16, SEG + 3), (1, 300, 5, 9)],
)
@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_cpu_kernel_matches_token_loop_float64(batch, dim, state, length, full, packed):
    kw = make_inputs(batch, dim, state, length, full=full)
    reset = packed_reset(batch, length) if packed else None
    y, last, grads = grads_of(lambda **a: cpu_fn(**a, reset=reset), kw)
    y0, last0, grads0 = grads_of(lambda **a: seq_fn(**a, reset=reset), kw)
    assert y.dtype == torch.float64 and last.dtype == torch.float64
    assert_close(y, y0, 1e-10, "y")
    assert_close(last, last0, 1e-10, "last_state")
    for name, g0 in grads0.items():
        assert_close(grads[name], g0, 1e-10, f"d{name}")


def test_cpu_kernel_without_gradients_saves_nothing_and_agrees():
    kw = make_inputs(2, 21, 16, 70)
    with torch.no_grad():
        y, last = selective_scan(**kw, return_last_state=True, backend="cpu")
    y0, last0 = selective_scan_naive(**kw)
    assert_close(y, y0, 1e-10, "y")
    assert_close(last, last0, 1e-10, "last_state")


def test_cpu_kernel_float32_at_model_scale():
    """float32 inputs at the scale of a freshly initialized DenseMamba (dt ~ softplus(-4.6), u and B, C ~ 1) over a
    long sequence, against the float64 loop: relative 1e-5 on values and gradients."""
    batch, dim, state, length = 2, 40, 16, 300
    g = torch.Generator().manual_seed(0)
    kw = dict(
        u=torch.randn(batch, dim, length, generator=g), delta=torch.randn(batch, dim, length, generator=g) * 0.1,
        A=-torch.arange(1, state + 1, dtype=torch.float32).repeat(dim, 1),
        B=torch.randn(batch, state, length, generator=g), C=torch.randn(batch, state, length, generator=g),
        D=torch.ones(dim), z=torch.randn(batch, dim, length, generator=g),
        delta_bias=torch.log(torch.expm1(torch.rand(dim, generator=g) * 0.099 + 0.001)), delta_softplus=True,
    )
    y, last, grads = grads_of(cpu_fn, kw)
    kw64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    y0, last0, grads0 = grads_of(seq_fn, kw64)
    assert y.dtype == torch.float32
    assert_close(y, y0, 1e-5, "y")
    assert_close(last, last0, 1e-5, "last_state")
    for name, g0 in grads0.items():
        assert_close(grads[name], g0, 1e-5, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_half_precision_inputs(dtype):
    kw = make_inputs(2, 12, 16, 40, dtype=dtype)
    y, last, grads = grads_of(cpu_fn, kw)
    assert y.dtype == dtype and last.dtype == torch.float32
    assert all(grads[k].dtype == kw[k].dtype for k in ("u", "delta", "B", "C", "z"))
    y0, last0 = selective_scan_naive(**kw)
    assert_close(y, y0, 3e-2, "y")
    assert_close(last, last0, 1e-2, "last_state")


def test_cpu_kernel_takes_any_layout():
    """Inputs as the model passes them (transposed views of token-major tensors, B and C sliced out of one
    projection) and as plain contiguous (batch, dim, length) tensors give the same result."""
    batch, dim, state, length = 2, 24, 16, 50
    kw = make_inputs(batch, dim, state, length)
    token_major = dict(kw)
    for name in ("u", "delta", "z"):
        token_major[name] = kw[name].transpose(1, 2).contiguous().transpose(1, 2)
    proj = torch.cat([kw["B"], kw["C"]], dim=1).transpose(1, 2).contiguous()  # (batch, length, 2 state)
    token_major["B"], token_major["C"] = proj[..., :state].transpose(1, 2), proj[..., state:].transpose(1, 2)
    a = selective_scan(**kw, backend="cpu")
    b = selective_scan(**token_major, backend="cpu")
    assert torch.equal(a, b)


def test_cpu_kernel_threads_agree():
    kw = make_inputs(2, 70, 16, 45)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1, _, g1 = grads_of(cpu_fn, kw)
        torch.set_num_threads(3)  # more workers than this machine may have cores: still one slice each
        y3, _, g3 = grads_of(cpu_fn, kw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y1, y3)
    for name in g1:
        assert_close(g3[name], g1[name], 1e-13, f"d{name}")


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("state", [5, 16, 20])
def test_cpu_decode_steps_match_scan(full, state):
    batch, dim, length = 2, 21, 6
    kw = make_inputs(batch, dim, state, length, full=full)
    y_scan, last_scan = selective_scan_naive(**kw)
    h = kw["initial_state"].clone() if full else torch.zeros(batch, dim, state, dtype=torch.float64)
    for t in range(length):
        y_t = selective_state_update(
            h, kw["u"][:, :, t], kw["delta"][:, :, t], kw["A"], kw["B"][:, :, t], kw["C"][:, :, t],
            D=kw.get("D"), z=None if kw.get("z") is None else kw["z"][:, :, t], dt_bias=kw.get("delta_bias"),
            dt_softplus=kw.get("delta_softplus", False), backend="cpu",
        )
        assert_close(y_t, y_scan[:, :, t], 1e-10, f"y[{t}]")
    assert_close(h, last_scan, 1e-10, "state")


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-14), (torch.float32, 4e-7)])
def test_cpu_decode_step_softplus_across_its_range(dtype, rtol):
    """The step's vectorized softplus (``vsoftplus``: ``max(x, 0) + 2 atanh(t / (2 + t))``, threshold 20) against
    PyTorch's: with ``A = 0``, ``B = C = x = 1`` and one state, ``y`` is ``softplus(dt)`` itself."""
    dt = torch.cat([torch.linspace(-60, 60, 4001, dtype=torch.float64),
                    torch.tensor([20.0, 20.0 + 1e-6, 20.0 - 1e-6, -20.0, 0.0, 1e-8, -1e-8], dtype=torch.float64)])
    dt = dt.to(dtype)[None]
    dim = dt.shape[1]
    state = torch.zeros(1, dim, 1, dtype=dtype)
    ones = torch.ones(1, dim, dtype=dtype)
    y = cpu_scan.selective_state_update_cpu(state, ones, dt, torch.zeros(dim, 1, dtype=dtype),
                                            torch.ones(1, 1, dtype=dtype), torch.ones(1, 1, dtype=dtype),
                                            dt_softplus=True)
    want = torch.nn.functional.softplus(dt.double())
    assert ((y.double() - want).abs() / want).max().item() <= rtol


def test_cpu_decode_step_float32_state_bfloat16_inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 8, 16, generator=g)
    x, dt, z = (torch.randn(2, 8, generator=g).bfloat16() for _ in range(3))
    B, C = (torch.randn(2, 16, generator=g).bfloat16() for _ in range(2))
    A = -torch.rand(8, 16, generator=g)
    h0 = h.clone()
    y = selective_state_update(h, x, dt, A, B, C, z=z, dt_softplus=True, backend="cpu")
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    y0, h1 = selective_scan_naive(x[..., None], dt[..., None], A, B[..., None], C[..., None], z=z[..., None],
                                  delta_softplus=True, initial_state=h0)
    assert_close(h, h1, 1e-5)
    assert_close(y, y0[..., 0], 1e-2)


# ---------------------------------------------------------------------------------------------- the switch


def test_auto_runs_the_kernel_on_cpu(monkeypatch):
    calls = []
    real = cpu_scan.SelectiveScanCPUFn.apply
    monkeypatch.setattr(cpu_scan.SelectiveScanCPUFn, "apply", lambda *a: calls.append(1) or real(*a))
    kw = make_inputs(1, 4, 3, 5)
    selective_scan(**kw)
    assert calls, "backend='auto' on CPU tensors did not run the compiled kernel"
    selective_scan(**kw, backend="torch")
    assert len(calls) == 1


def test_auto_falls_back_and_cpu_refuses_without_the_kernel(monkeypatch):
    package = sys.modules["hf_densessm.ops.selective_scan"]
    monkeypatch.setattr(package, "cpu_kernel_available", lambda: False)
    kw = make_inputs(1, 4, 3, 5)
    y0, _ = selective_scan_naive(**kw)
    assert_close(selective_scan(**kw), y0, 1e-10, "auto without the kernel")
    with pytest.raises(RuntimeError, match="backend='cpu'.*cannot be built"):
        selective_scan(**kw, backend="cpu")


def test_cpu_backend_state_size_limit():
    kw = make_inputs(1, 2, cpu_scan.MAX_STATE + 1, 3, full=False)
    with pytest.raises(ValueError, match="backend='cpu' takes state sizes <= 256"):
        selective_scan(**kw, backend="cpu")
    y0, _ = selective_scan_naive(**kw)
    assert_close(selective_scan(**kw), y0, 1e-10, "auto with a large state runs the PyTorch path")


NO_COMPILER = """
import warnings
import torch
from hf_densessm.ops.selective_scan import selective_scan
from hf_densessm.ops.selective_scan.cpu import cpu_kernel_available, why_unavailable
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert not cpu_kernel_available()
assert "no C compiler" in why_unavailable(), why_unavailable()
assert any("PyTorch path runs instead" in str(w.message) for w in caught)
u = torch.randn(1, 2, 5)
selective_scan(u, u.abs(), -torch.ones(2, 3), torch.randn(1, 3, 5), torch.randn(1, 3, 5))
print("ok")
"""


def test_without_a_compiler_the_pytorch_path_runs(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path), CC="", HF_DENSESSM_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", NO_COMPILER], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_build_leaves_one_library_and_no_temporary_files():
    folder = cpu_build.cache_dir()
    names = [p.name for p in folder.iterdir()]
    assert any(n.startswith("selective_scan-") and n.endswith(".so") for n in names), names
    assert all(n.endswith(".so") for n in names), names  # the temporary build folders are gone


def test_an_unwritable_cache_falls_back_with_a_warning(tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")  # the cache path lies under a file: it cannot be created
    env = dict(os.environ, HF_DENSESSM_CACHE=str(blocker))
    script = NO_COMPILER.replace('"no C compiler" in why_unavailable()', '"Error" in why_unavailable()')
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


FORKED = """
import multiprocessing as mp
import torch
from hf_densessm.ops.selective_scan import selective_scan

def run(_=None):
    torch.manual_seed(0)
    u = torch.randn(2, 40, 30)
    return selective_scan(u, u.abs(), -torch.ones(40, 16), torch.randn(2, 16, 30), torch.randn(2, 16, 30), backend="cpu")

torch.set_num_threads(2)
parent = run()  # the pool exists before the fork
with mp.get_context("fork").Pool(1) as pool:
    child = pool.apply_async(run).get(timeout=120)
assert torch.equal(parent, child)
print("ok")
"""


def test_the_kernels_run_in_a_forked_child():
    result = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
