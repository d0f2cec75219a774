"""Selective scan: chunked PyTorch path vs the plain token loop (``naive.py``), Triton kernels vs the PyTorch path
(under ``TRITON_INTERPRET=1`` on the CPU, see ``tests/conftest.py``), decode step vs the scan, argument checks."""

import pytest
import torch

from hf_densessm.ops.selective_scan import selective_scan, selective_state_update
from hf_densessm.ops.selective_scan.chunked_torch import selective_scan_torch
from hf_densessm.ops.selective_scan.naive import selective_scan_naive

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def make_inputs(batch, dim, state, length, dtype=torch.float64, full=True, seed=0):
    """Inputs of a Mamba layer: positive-ish time steps after softplus, S4D-real-like negative A."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    A = -(torch.rand(dim, state, generator=g, dtype=torch.float64) * 2 + 0.1)
    kw = dict(u=r(batch, dim, length), delta=r(batch, dim, length, scale=0.5), A=A.to(dtype if dtype == torch.float64
                                                                                        else torch.float32),
              B=r(batch, state, length), C=r(batch, state, length))
    if full:
        kw.update(D=r(dim), z=r(batch, dim, length), delta_bias=r(dim, scale=0.5), delta_softplus=True,
                  initial_state=r(batch, dim, state).float() if dtype != torch.float64 else r(batch, dim, state))
    else:
        kw.update(delta=kw["delta"].abs())  # no softplus: keep dt >= 0
    return kw


def grads_of(fn, kw, seed=1):
    """Run ``fn(**kw, return_last_state=True)``, backprop random cotangents of y and last_state, return all."""
    kw = {k: (v.detach().clone().requires_grad_(True) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    y, last = fn(**kw, return_last_state=True)
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    gl = torch.randn(last.shape, generator=g, dtype=torch.float64).to(last.dtype)
    ((y * gy).sum() + (last * gl).sum()).backward()
    return y.detach(), last.detach(), {k: v.grad for k, v in kw.items() if isinstance(v, torch.Tensor)}


def seq_fn(return_last_state=True, **kw):
    return selective_scan_naive(**kw)


def assert_close(a, b, rtol, name=""):
    a, b = a.double(), b.double()
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    assert err < rtol, f"{name}: relative error {err:.3g} >= {rtol}"


# ---------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("length,chunk", [(1, None), (7, None), (16, 4), (37, 8), (64, None), (100, 7)])
@pytest.mark.parametrize("full", [True, False])
def test_reference_matches_sequential(length, chunk, full):
    kw = make_inputs(2, 6, 5, length, full=full)
    y, last, grads = grads_of(lambda **k: selective_scan_torch(**k, chunk_size=chunk), kw)
    y0, last0, grads0 = grads_of(seq_fn, kw)
    assert_close(y, y0, 1e-10, "y")
    assert_close(last, last0, 1e-10, "last_state")
    assert grads.keys() == grads0.keys()
    for k in grads0:
        assert_close(grads[k], grads0[k], 1e-10, f"d{k}")


def test_reference_chunk_size_does_not_change_result():
    kw = make_inputs(1, 4, 3, 50)
    outs = [selective_scan_torch(**kw, chunk_size=c, return_last_state=True) for c in (1, 3, 8, 50, 64)]
    for y, last in outs[1:]:
        assert_close(y, outs[0][0], 1e-12)
        assert_close(last, outs[0][1], 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_low_precision(dtype):
    kw = make_inputs(2, 8, 4, 33, dtype=dtype)
    y, last = selective_scan(**kw, return_last_state=True, backend="torch")
    assert y.dtype == dtype and last.dtype == torch.float32
    y0, last0 = selective_scan_naive(**kw)
    assert_close(y, y0, 1e-5 if dtype == torch.float32 else 1e-2)
    assert_close(last, last0, 1e-5)


def test_reference_long_decay_is_stable():
    """Large dt * |A| (decays underflow to 0) must give finite, exact results: no division by decays."""
    kw = make_inputs(1, 4, 4, 300, full=False)
    kw["delta"] = kw["delta"] * 50
    kw["A"] = kw["A"] * 20
    y, last = selective_scan_torch(**kw, return_last_state=True)
    y0, last0 = selective_scan_naive(**kw)
    assert torch.isfinite(y).all()
    assert_close(y, y0, 1e-10)
    assert_close(last, last0, 1e-10)


# ---------------------------------------------------------------------------------------------- Triton


@needs_triton
@pytest.mark.parametrize(
    "batch,dim,state,length,chunk,full",
    [
        (2, 8, 4, 1, 8, True),
        (2, 8, 4, 7, 8, False),  # one partial chunk
        (1, 8, 4, 16, 8, True),  # exact multiple of the chunk
        (2, 12, 5, 37, 8, True),  # prime length, masked channels and states
        (2, 8, 4, 23, 16, False),
        (1, 20, 3, 13, 4, True),  # two channel blocks
    ],
)
def test_triton_scan_matches_reference_float64(batch, dim, state, length, chunk, full):
    from hf_densessm.ops.selective_scan.chunk import SelectiveScanConfig, selective_scan_triton

    kw = make_inputs(batch, dim, state, length, full=full, seed=length)
    config = SelectiveScanConfig(chunk=chunk, fwd_block_d=16, bwd_block_d=8)
    y, last, grads = grads_of(lambda **k: selective_scan_triton(**k, config=config), kw)
    y0, last0, grads0 = grads_of(selective_scan_torch, kw)
    assert_close(y, y0, 1e-10, "y")
    assert_close(last, last0, 1e-10, "last_state")
    for k in grads0:
        assert_close(grads[k], grads0[k], 1e-10, f"d{k}")


def _scan_configs():
    """Every launch configuration the code can choose: one per (architecture, dtype, state size) the configs
    depend on, deduplicated."""
    from hf_densessm.ops.backend import ARCHS
    from hf_densessm.ops.selective_scan.chunk import selective_scan_config

    return sorted({selective_scan_config(arch, dtype, n) for arch in ARCHS.values() for n in (4, 16)
                   for dtype in (torch.float32, torch.bfloat16, torch.float16)}, key=repr)


@needs_triton
@pytest.mark.parametrize("state", [4, 16])
def test_triton_scan_every_config_choice(state):
    """The configurations ``selective_scan_config`` picks on each GPU, run under the interpreter against the
    PyTorch path in float64 (forward and every gradient), over several chunks and channel blocks."""
    from hf_densessm.ops.selective_scan.chunk import selective_scan_triton

    kw = make_inputs(2, 20, state, 37, seed=state)
    y0, last0, grads0 = grads_of(selective_scan_torch, kw)
    for config in _scan_configs():
        y, last, grads = grads_of(lambda **k: selective_scan_triton(**k, config=config), kw)
        assert_close(y, y0, 1e-10, f"y {config}")
        assert_close(last, last0, 1e-10, f"last_state {config}")
        for k in grads0:
            assert_close(grads[k], grads0[k], 1e-10, f"d{k} {config}")


@needs_triton
def test_triton_scan_float32_through_public_api():
    """float32, several chunks (default chunk size), initial state without gradient, non-contiguous B and C."""
    kw = make_inputs(2, 8, 4, 70, dtype=torch.float32)
    del kw["B"], kw["C"]
    BC = torch.randn(2, 70, 8)  # B and C sliced and transposed out of one projection, as in the Mamba block

    def run(backend):
        k = {n: (v.clone().requires_grad_(n != "initial_state") if isinstance(v, torch.Tensor) else v)
             for n, v in kw.items()}
        bc = BC.clone().requires_grad_(True)
        B, C = bc[..., :4].transpose(1, 2), bc[..., 4:].transpose(1, 2)
        assert not B.is_contiguous()
        y, last = selective_scan(B=B, C=C, **k, return_last_state=True, backend=backend)
        (y.square().sum() + last.sum()).backward()
        grads = {n: v.grad for n, v in k.items() if isinstance(v, torch.Tensor) and n != "initial_state"}
        return y, last, dict(grads, BC=bc.grad)

    y, last, grads = run("triton")
    y0, last0, grads0 = run("torch")
    assert y.dtype == torch.float32 and last.dtype == torch.float32
    assert_close(y, y0, 1e-3, "y")
    assert_close(last, last0, 1e-3, "last_state")
    for k in grads0:
        assert_close(grads[k], grads0[k], 1e-3, f"d{k}")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_scan_half_precision_smoke(dtype):
    from hf_densessm.ops.selective_scan.chunk import SelectiveScanConfig, selective_scan_triton

    kw = make_inputs(1, 8, 4, 19, dtype=dtype)
    kw = {k: (v.requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
          for k, v in kw.items()}
    y, last = selective_scan_triton(**kw, return_last_state=True, config=SelectiveScanConfig(chunk=8))
    assert y.dtype == dtype and last.dtype == torch.float32
    y0, last0 = selective_scan_torch(**kw, return_last_state=True)
    assert_close(y, y0, 2e-2, "y")
    assert_close(last, last0, 1e-4, "last_state")
    y.float().sum().backward()
    assert kw["u"].grad.dtype == dtype and torch.isfinite(kw["u"].grad.float()).all()


@needs_triton
def test_triton_scan_no_grad_stores_no_chunk_states():
    from hf_densessm.ops.selective_scan.chunk import SelectiveScanConfig, selective_scan_triton

    kw = make_inputs(1, 8, 4, 20)
    with torch.no_grad():
        y = selective_scan_triton(**kw, config=SelectiveScanConfig(chunk=8))
    assert_close(y, selective_scan_torch(**kw), 1e-10)


# ---------------------------------------------------------------------------------------------- decode step


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("full", [True, False])
def test_decode_steps_match_scan(backend, full):
    batch, dim, state, length = 2, 40, 5, 6  # dim 40: two channel blocks of the step kernel
    kw = make_inputs(batch, dim, state, length, full=full)
    y_scan, last_scan = selective_scan_torch(**kw, return_last_state=True)
    h = kw["initial_state"].clone() if full else torch.zeros(batch, dim, state, dtype=torch.float64)
    for t in range(length):
        y_t = selective_state_update(
            h, kw["u"][:, :, t], kw["delta"][:, :, t], kw["A"], kw["B"][:, :, t], kw["C"][:, :, t],
            D=kw.get("D"), z=None if kw.get("z") is None else kw["z"][:, :, t], dt_bias=kw.get("delta_bias"),
            dt_softplus=kw.get("delta_softplus", False), backend=backend,
        )
        assert_close(y_t, y_scan[:, :, t], 1e-10, f"y[{t}]")
    assert_close(h, last_scan, 1e-10, "state")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_decode_step_float32_state_bfloat16_inputs(backend):
    batch, dim, state = 2, 8, 4
    g = torch.Generator().manual_seed(0)
    h = torch.randn(batch, dim, state, generator=g)
    x, dt, z = (torch.randn(batch, dim, generator=g).bfloat16() for _ in range(3))
    B, C = (torch.randn(batch, state, generator=g).bfloat16() for _ in range(2))
    A = -torch.rand(dim, state, generator=g)
    h0 = h.clone()
    y = selective_state_update(h, x, dt, A, B, C, z=z, dt_softplus=True, backend=backend)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    y0, h1 = selective_scan_naive(x[..., None], dt[..., None], A, B[..., None], C[..., None], z=z[..., None],
                             delta_softplus=True, initial_state=h0)
    assert_close(h, h1, 1e-5)
    assert_close(y, y0[..., 0], 1e-2)


# ---------------------------------------------------------------------------------------------- bad inputs


def _scan_kw():
    return make_inputs(2, 6, 4, 5, dtype=torch.float32)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(u=torch.randn(6, 5)), ValueError, "u must have shape"),
        (dict(delta=torch.randn(2, 6, 4)), ValueError, "delta must have shape"),
        (dict(A=torch.randn(5, 4).abs().neg()), ValueError, "A must have shape"),
        (dict(B=torch.randn(2, 3, 5)), ValueError, "B must have shape"),
        (dict(C=torch.randn(2, 4)), ValueError, "C must have shape"),
        (dict(D=torch.randn(7)), ValueError, "D must have shape"),
        (dict(z=torch.randn(2, 6, 6)), ValueError, "z must have shape"),
        (dict(delta_bias=torch.randn(6, 1)), ValueError, "delta_bias must have shape"),
        (dict(initial_state=torch.randn(2, 6, 3)), ValueError, "initial_state must have shape"),
        (dict(u=torch.randn(2, 6, 0), delta=torch.randn(2, 6, 0)), ValueError, "length"),
        (dict(u=torch.randint(0, 3, (2, 6, 5))), TypeError, "u must have dtype"),
        (dict(B=[[0.0]]), TypeError, "B must be a torch.Tensor"),
        (dict(A=torch.rand(6, 4)), ValueError, "A must have entries <= 0"),
        (dict(u=torch.randn(2, 6, 5, device="meta")), ValueError, "one device"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
    ],
)
def test_scan_bad_inputs(change, error, match):
    kw = _scan_kw()
    kw.update(change)
    with pytest.raises(error, match=match):
        selective_scan(**kw)


def test_triton_backend_on_cpu_needs_interpreter(monkeypatch):
    if not HAS_TRITON:
        with pytest.raises(RuntimeError, match="triton package"):
            selective_scan(**_scan_kw(), backend="triton")
        return
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        selective_scan(**_scan_kw(), backend="triton")
    h = torch.zeros(2, 6, 4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        selective_state_update(h, torch.randn(2, 6), torch.rand(2, 6), -torch.rand(6, 4), torch.randn(2, 4),
                               torch.randn(2, 4), backend="triton")


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(state=torch.zeros(6, 4)), ValueError, "state must have shape"),
        (dict(x=torch.randn(2, 7)), ValueError, "x must have shape"),
        (dict(dt=torch.randn(2, 6, 1)), ValueError, "dt must have shape"),
        (dict(A=-torch.rand(6, 3)), ValueError, "A must have shape"),
        (dict(B=torch.randn(2, 5)), ValueError, "B must have shape"),
        (dict(C=torch.randn(1, 4)), ValueError, "C must have shape"),
        (dict(z=torch.randn(2, 5)), ValueError, "z must have shape"),
        (dict(x=torch.randn(2, 6).long()), TypeError, "x must have dtype"),
        (dict(D=torch.randn(2, 6)), ValueError, "D must have shape"),
        (dict(dt_bias=torch.randn(5)), ValueError, "dt_bias must have shape"),
        (dict(x=torch.randn(2, 6, device="meta")), ValueError, "one device"),
        (dict(backend="numpy"), ValueError, "backend must be one of"),
    ],
)
def test_decode_step_bad_inputs(change, error, match):
    kw = dict(state=torch.zeros(2, 6, 4), x=torch.randn(2, 6), dt=torch.rand(2, 6), A=-torch.rand(6, 4),
              B=torch.randn(2, 4), C=torch.randn(2, 4), z=torch.randn(2, 6))
    kw.update(change)
    with pytest.raises(error, match=match):
        selective_state_update(**kw)
