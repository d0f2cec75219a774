"""Selective scan: chunked PyTorch path vs the plain token loop (``naive.py``), Triton kernels vs the PyTorch path
(under ``TRITON_INTERPRET=1`` on the CPU, see ``tests/conftest.py``), decode step vs the scan, argument checks; the
ops ``hf_densessm::selective_scan`` / ``selective_scan_backward`` / ``selective_state_update`` under
``torch.library.opcheck`` and ``torch.compile``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_densessm.ops.selective_scan import _ops as scan_ops
from hf_densessm.ops.selective_scan import selective_scan, selective_state_update
from hf_densessm.ops.selective_scan.chunked_torch import selective_scan_torch_bwd, selective_scan_torch_fwd
from hf_densessm.ops.selective_scan.naive import selective_scan_naive

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

if HAS_TRITON:
    import triton.language as tl

    from hf_densessm.ops.triton_utils import softplus

    @triton.jit
    def _softplus_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, softplus(tl.load(x_ptr + offs)))


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
    kw = {k: (v.detach().clone().requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
          for k, v in kw.items()}
    y, last = fn(**kw, return_last_state=True)
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    gl = torch.randn(last.shape, generator=g, dtype=torch.float64).to(last.dtype)
    ((y * gy).sum() + (last * gl).sum()).backward()
    return y.detach(), last.detach(), {k: v.grad for k, v in kw.items() if isinstance(v, torch.Tensor) and v.requires_grad}


def explicit(form, **opts):
    """A differentiable scan through one form's forward and backward functions with explicit launch choices, which
    the op does not take (it picks its own): ``form="torch"`` with ``chunk_size=``, ``form="triton"`` with
    ``config=`` (a :class:`SelectiveScanConfig`). Test harness only (also used by ``test_packing_kernels.py``)."""
    if form == "torch":
        fwd, bwd, extra = selective_scan_torch_fwd, selective_scan_torch_bwd, {}
    else:
        from hf_densessm.ops.selective_scan.chunk import selective_scan_triton_bwd, selective_scan_triton_fwd

        fwd, bwd, extra = selective_scan_triton_fwd, selective_scan_triton_bwd, dict(save_states=True)

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, reset):
            y, last, states = fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reset, **extra,
                                  **opts)
            ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, states)
            ctx.delta_softplus = delta_softplus
            return y, last

        @staticmethod
        def backward(ctx, dy, dlast):
            *inputs, reset, states = ctx.saved_tensors
            u, delta, A, B, C, D, z, delta_bias, initial_state = inputs
            grads = bwd(dy, dlast, u, delta, A, B, C, D, z, delta_bias, ctx.delta_softplus, initial_state, reset,
                        states, **opts)
            return (*(g if t is not None else None for g, t in zip(grads, inputs)), None, None)

    def run(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None, reset=None,
            return_last_state=False):
        y, last = Fn.apply(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, reset)
        return (y, last) if return_last_state else y

    return run


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
    y, last, grads = grads_of(explicit("torch", chunk_size=chunk), kw)
    y0, last0, grads0 = grads_of(seq_fn, kw)
    assert_close(y, y0, 1e-10, "y")
    assert_close(last, last0, 1e-10, "last_state")
    assert grads.keys() == grads0.keys()
    for k in grads0:
        assert_close(grads[k], grads0[k], 1e-10, f"d{k}")


def test_reference_chunk_size_does_not_change_result():
    kw = make_inputs(1, 4, 3, 50)
    outs = [selective_scan_torch_fwd(**kw, chunk_size=c)[:2] for c in (1, 3, 8, 50, 64)]
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
    y, last, _ = selective_scan_torch_fwd(**kw)
    y0, last0 = selective_scan_naive(**kw)
    assert torch.isfinite(y).all()
    assert_close(y, y0, 1e-10)
    assert_close(last, last0, 1e-10)


# ---------------------------------------------------------------------------------------------- Triton


def _small_config(**changes):
    """A test configuration: 16-token chunks (several chunks at lengths 40 and 80), channel tiles smaller than the
    tests' dims, several tiles per program."""
    from hf_densessm.ops.selective_scan.chunk import SelectiveScanConfig

    base = dict(chunk=16, fwd_block_d=4, fwd_d_steps=2, bwd_block_d=2, bwd_d_steps=2, carry_block=32)
    return SelectiveScanConfig(**dict(base, **changes))


def _reset(batch, length, starts):
    """(batch, length) bool, True at ``starts[b]``."""
    reset = torch.zeros(batch, length, dtype=torch.bool)
    for b, positions in enumerate(starts):
        reset[b, list(positions)] = True
    return reset


def _check_triton_against_naive(kw, config, rtol, rtol_grad=None):
    y, last, grads = grads_of(explicit("triton", config=config), kw)
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


@needs_triton
@pytest.mark.parametrize(
    "batch,dim,state,length,drop,starts",
    [
        (2, 12, 3, 40, (), RESETS_40),  # every input, 3 chunks, masked channels and states
        (2, 12, 3, 40, ("D", "z", "delta_bias", "delta_softplus", "initial_state"), RESETS_40),
        (1, 8, 4, 80, (), None),  # 5 chunks, an exact multiple, no reset
        (2, 8, 4, 80, ("z", "delta_softplus"), [(0, 1, 47, 48, 79), (64,)]),  # initial state dropped at t = 0
        (2, 6, 4, 7, (), [(3,), ()]),  # one partial chunk
        (1, 5, 2, 1, (), None),  # one token
        (2, 20, 4, 33, ("D", "initial_state"), [(15, 16, 17), (32,)]),  # a one-token last chunk, 3 programs per row
    ],
)
def test_triton_scan_matches_naive_float64(batch, dim, state, length, drop, starts):
    """Forward, last state and every gradient against the float64 token loop, small chunks (``_small_config``)."""
    kw = make_inputs(batch, dim, state, length, seed=length)
    for name in drop:
        kw[name] = False if name == "delta_softplus" else None
    if "delta_softplus" in drop:
        kw["delta"] = kw["delta"].abs()  # keep dt >= 0 without softplus
    kw = {k: v for k, v in kw.items() if v is not None}
    if starts is not None:
        kw["reset"] = _reset(batch, length, starts)
    _check_triton_against_naive(kw, _small_config(), 1e-10)


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
    float64 token loop (forward and every gradient), over 2 chunks of 64 tokens, with resets."""
    kw = make_inputs(1, 20, state, 80, seed=state)
    kw["reset"] = _reset(1, 80, [(0, 30, 64, 65)])
    for config in _scan_configs():
        _check_triton_against_naive(kw, config, 1e-10)


@needs_triton
def test_triton_chunk_states_are_the_states_entering_each_chunk():
    from hf_densessm.ops.selective_scan.chunk import selective_scan_triton_fwd

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


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_scan_low_precision_non_contiguous(dtype):
    """bfloat16 / float32 inputs, u, z, B and C sliced and transposed out of projections as in the Mamba block (not
    contiguous), resets: y in the input dtype, states float32, gradients in their inputs' dtypes."""
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
    _check_triton_against_naive(kw, _small_config(), tol, 2 * tol)


@needs_triton
def test_triton_scan_bad_config_and_chunk_states():
    from hf_densessm.ops.selective_scan.chunk import selective_scan_triton_bwd, selective_scan_triton_fwd

    kw = make_inputs(1, 4, 2, 20)
    with pytest.raises(ValueError, match="chunk must be a power of 2"):
        selective_scan_triton_fwd(**kw, config=_small_config(chunk=24))
    with pytest.raises(ValueError, match="d_steps"):
        selective_scan_triton_fwd(**kw, config=_small_config(bwd_d_steps=0))
    y, last, _ = selective_scan_triton_fwd(**kw, save_states=False, config=_small_config())
    with pytest.raises(ValueError, match="chunk_states must hold the 2 chunk states"):
        selective_scan_triton_bwd(torch.ones_like(y), None, **kw, chunk_states=torch.zeros(1, 0, 4, 2),
                                  config=_small_config())


@needs_triton
def test_triton_scan_grid_has_several_warps_per_sm_on_h100():
    """With the sm_90 choice at state 16, batch 1 x 2048 channels x 2048 tokens: in every per-chunk kernel, a
    program for every SM of an H100 (132 SMs) and several warps per SM (the backward's programs have 16 warps)."""
    from hf_densessm.ops.backend import ARCHS
    from hf_densessm.ops.selective_scan.chunk import _grid, selective_scan_config

    config = selective_scan_config(ARCHS["sm_90"], torch.bfloat16, 16)
    n_chunks = 2048 // config.chunk
    for block_d, d_steps, warps in ((config.fwd_block_d, config.fwd_d_steps, config.fwd_warps),
                                    (config.bwd_block_d, config.bwd_d_steps, config.bwd_warps)):
        programs = 1
        for size in _grid(1, 2048, n_chunks, block_d, d_steps):
            programs *= size
        assert programs >= 132 and programs * warps >= 8 * 132, (programs, warps)


@needs_triton
def test_triton_scan_two_channels_per_thread_masked_block():
    """A 64-channel block on one warp (two adjacent channels per thread: the tile's columns are permuted) over 40
    channels (a masked block), against the float64 token loop: forward, last state and every gradient, resets."""
    from hf_densessm.ops.selective_scan.chunk import _tiles

    config = _small_config(fwd_block_d=64, fwd_d_steps=1, fwd_warps=1, bwd_block_d=64, bwd_d_steps=1, bwd_warps=1)
    assert _tiles(config, 40, backward=False)["CPT"] == _tiles(config, 40, backward=True)["CPT"] == 2
    kw = make_inputs(1, 40, 3, 37, seed=5)
    kw["reset"] = _reset(1, 37, [(0, 16, 21)])
    _check_triton_against_naive(kw, config, 1e-10)


@needs_triton
def test_triton_scan_backward_several_warps_per_program_masked_block():
    """A 128-channel backward block on four warps (one channel per thread: each warp's own reduce-scatter of the
    dB, dC channel sums) over 72 channels (a masked block), against the float64 token loop, resets."""
    from hf_densessm.ops.selective_scan.chunk import _tiles

    config = _small_config(bwd_block_d=128, bwd_d_steps=1, bwd_warps=4)
    assert _tiles(config, 72, backward=True)["CPT"] == 1 and _tiles(config, 72, backward=True)["num_warps"] == 4
    kw = make_inputs(1, 72, 3, 37, seed=6)
    kw["reset"] = _reset(1, 37, [(0, 5, 30)])
    _check_triton_against_naive(kw, config, 1e-10)


@needs_triton
def test_triton_scan_outputs_token_major_in_input_dtypes():
    """y, du, ddelta, dz come out as (batch, dim, length) views of token-major tensors in their inputs' dtypes, dB
    and dC as (batch, state, length) views of token-major ones: the layout the model consumes, no cast or copy
    after the kernels."""
    from hf_densessm.ops.selective_scan.chunk import selective_scan_triton_bwd, selective_scan_triton_fwd

    kw = make_inputs(1, 8, 4, 20, dtype=torch.bfloat16)
    kw["delta"] = kw["delta"].float()
    y, last, states = selective_scan_triton_fwd(**kw, config=_small_config())
    assert y.dtype == torch.bfloat16 and y.transpose(1, 2).is_contiguous()
    grads = selective_scan_triton_bwd(torch.ones_like(y), None, **kw, chunk_states=states, config=_small_config())
    du, ddelta, _, dB, dC, _, dz = grads[:7]
    assert (du.dtype, ddelta.dtype, dz.dtype, dB.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16,
                                                             torch.bfloat16)
    for g in (du, ddelta, dz, dB, dC):
        assert g.transpose(1, 2).is_contiguous()


@needs_triton
def test_triton_softplus_float32_matches_float64():
    """``triton_utils.softplus`` in float32 (a polynomial log1p) against float64 ``F.softplus`` over the range a
    time step takes and beyond: relative error below 3e-7, plus, for negative inputs, the ``|x| * 2^-23`` that
    rounding ``x log2(e)`` in float32 costs any float32 exponential (tl.exp included)."""
    x = torch.cat([torch.linspace(-60, 40, 4090), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, 87.0])])
    y = torch.empty_like(x)
    _softplus_kernel[(1,)](x, y, BLOCK=x.numel())
    ref = torch.nn.functional.softplus(x.double(), threshold=1e9)
    assert ((y.double() - ref).abs() / ref <= 3e-7 + x.double().clamp(max=0).abs() * 2**-23).all()


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
    kw = make_inputs(1, 8, 4, 19, dtype=dtype)
    kw = {k: (v.requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
          for k, v in kw.items()}
    y, last = selective_scan(**kw, return_last_state=True, backend="triton")
    assert y.dtype == dtype and last.dtype == torch.float32
    y0, last0 = selective_scan(**kw, return_last_state=True, backend="torch")
    assert_close(y, y0, 2e-2, "y")
    assert_close(last, last0, 1e-4, "last_state")
    y.float().sum().backward()
    assert kw["u"].grad.dtype == dtype and torch.isfinite(kw["u"].grad.float()).all()


def _op_args(kw, save_states, backend):
    return (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw.get("D"), kw.get("z"), kw.get("delta_bias"),
            kw.get("delta_softplus", False), kw.get("initial_state"), kw.get("reset"), save_states, backend)


@needs_triton
def test_triton_scan_no_grad_stores_no_chunk_states():
    kw = make_inputs(1, 8, 4, 20)
    y, last, states = scan_ops.selective_scan(*_op_args(kw, False, "triton"))
    assert states.shape == (1, 0, 8, 4)
    y0, last0, _ = selective_scan_torch_fwd(**kw)
    assert_close(y, y0, 1e-10)
    assert_close(last, last0, 1e-10)
    with torch.no_grad():
        assert_close(selective_scan(**kw, backend="triton"), y0, 1e-10)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_op_backward_without_saved_states_recomputes_them(backend):
    """The op run with ``save_states=False`` on inputs that need gradients still backpropagates (the backward
    recomputes the chunk states): the same gradients as the public function, with resets and every input."""
    kw = make_inputs(2, 6, 3, 21, seed=7)
    kw["reset"] = torch.zeros(2, 21, dtype=torch.bool)
    kw["reset"][0, 5] = kw["reset"][1, 17] = True

    def raw(return_last_state=True, **k):
        return scan_ops.selective_scan(*_op_args(k, False, backend))[:2]

    y, last, grads = grads_of(raw, kw)
    y0, last0, grads0 = grads_of(seq_fn, kw)
    assert_close(y, y0, 1e-10, "y")
    assert_close(last, last0, 1e-10, "last_state")
    assert grads.keys() == grads0.keys()
    for k in grads0:
        assert_close(grads[k], grads0[k], 1e-10, f"d{k}")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_public_op_every_gradient_against_naive(backend):
    """The public function (the op and its registered autograd formula) against the float64 token loop: resets,
    an initial state, gate, skip, bias and softplus, several chunks of either form (70 tokens)."""
    kw = make_inputs(2, 6, 5, 70, seed=11)
    kw["reset"] = torch.zeros(2, 70, dtype=torch.bool)
    kw["reset"][0, [9, 16]] = kw["reset"][1, 64] = True
    y, last, grads = grads_of(lambda **k: selective_scan(**k, backend=backend), kw)
    y0, last0, grads0 = grads_of(seq_fn, kw)
    assert_close(y, y0, 1e-10, "y")
    assert_close(last, last0, 1e-10, "last_state")
    assert grads.keys() == grads0.keys() == {"u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state"}
    for k in grads0:
        assert_close(grads[k], grads0[k], 1e-10, f"d{k}")


def test_chunked_path_op_backward_in_channel_blocks(monkeypatch):
    """The chunked PyTorch entry through the op with its backward split into channel blocks (a small
    ``_BWD_BLOCK_ELEMENTS``, as for a large model): the chunk states it saved keep their (state, dim) layout, and
    every gradient matches the float64 token loop (dim != state)."""
    monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", "0")
    monkeypatch.setattr(sys.modules["hf_densessm.ops.selective_scan.chunked_torch"], "_BWD_BLOCK_ELEMENTS", 64)
    kw = make_inputs(2, 6, 5, 40, seed=12)
    y, last, grads = grads_of(lambda **k: selective_scan(**k, backend="torch"), kw)
    y0, last0, grads0 = grads_of(seq_fn, kw)
    assert_close(y, y0, 1e-10, "y")
    for k in grads0:
        assert_close(grads[k], grads0[k], 1e-10, f"d{k}")


# ---------------------------------------------------------------------------------------------- decode step


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("full", [True, False])
def test_decode_steps_match_scan(backend, full):
    batch, dim, state, length = 2, 40, 5, 6  # dim 40: two channel blocks of the step kernel
    kw = make_inputs(batch, dim, state, length, full=full)
    y_scan, last_scan, _ = selective_scan_torch_fwd(**kw)
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


@needs_triton
def test_decode_step_triton_fills_nothing_unused():
    """Issue 36, item 4: an absent ``D`` / ``dt_bias`` is a flag of the Triton step, not a zero-filled tensor (a
    launch whose result adds nothing); the step still matches the PyTorch one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_densessm.ops.selective_scan.fused_recurrent import selective_state_update_triton

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    g, seen = torch.Generator().manual_seed(0), []
    h = torch.randn(2, 8, 4, generator=g)
    x, dt = torch.randn(2, 8, generator=g), torch.rand(2, 8, generator=g)
    A, B, C = -torch.rand(8, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    h0 = h.clone()
    with Ops():
        y = selective_state_update_triton(h, x, dt, A, B, C, dt_softplus=True)  # the op's body: its allocations seen
    assert not [op for op in seen if "zero" in op or "fill" in op], seen
    assert_close(y, selective_state_update(h0, x, dt, A, B, C, dt_softplus=True, backend="torch"), 1e-5)
    assert_close(h, h0, 1e-5)


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


def test_decode_step_refuses_gradients():
    h = torch.zeros(2, 6, 4)
    x = torch.randn(2, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="without gradients"):
        selective_state_update(h, x, torch.rand(2, 6), -torch.rand(6, 4), torch.randn(2, 4), torch.randn(2, 4))
    with torch.no_grad():  # the same call without autograd runs
        selective_state_update(h, x, torch.rand(2, 6), -torch.rand(6, 4), torch.randn(2, 4), torch.randn(2, 4))
    assert h.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- the ops


def _opcheck_inputs(backend, seed=0):
    """Small float32 inputs of the three ops: (forward args, backward args, step args)."""
    g = torch.Generator().manual_seed(seed)
    b, d, n, L = 2, 4, 3, 5

    def r(*shape, grad=True):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    A = (-torch.rand(d, n, generator=g) - 0.1).requires_grad_()
    reset = torch.zeros(b, L, dtype=torch.bool)
    reset[0, 2] = True
    fwd = (r(b, d, L), r(b, d, L), A, r(b, n, L), r(b, n, L), r(d), r(b, d, L), r(d), True, r(b, d, n), reset, True,
           backend)
    y, last, states = scan_ops.selective_scan(*fwd)
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in fwd[:11])
    bwd = (torch.randn(y.shape, generator=g), torch.randn(last.shape, generator=g)) + plain + (states.detach(), backend)
    step = (r(b, d, n, grad=False), r(b, d, grad=False), r(b, d, grad=False), -torch.rand(d, n, generator=g),
            r(b, n, grad=False), r(b, n, grad=False), r(d, grad=False), r(b, d, grad=False), r(d, grad=False), True,
            backend)
    return fwd, bwd, step


@pytest.mark.parametrize("impl", ["torch", "cpp"])
def test_opcheck_torch_backend(impl):
    """``torch.library.opcheck`` (schema, autograd registration, fake tensors, AOT dispatch with dynamic shapes) on
    each op, the chunked PyTorch path and the C++ kernel (the decoding step has no C++ entry: its PyTorch path)."""
    from hf_densessm.ops import cpu_kernel

    if impl == "cpp" and cpu_kernel.missing(torch.device("cpu"), state_size=3):
        pytest.skip(f"the C++ kernel {cpu_kernel.missing(torch.device('cpu'), state_size=3)}")
    fwd, bwd, step = _opcheck_inputs(impl)
    step = step[:-1] + ("torch",)
    torch.library.opcheck(scan_ops.selective_scan.default, fwd)
    torch.library.opcheck(scan_ops.selective_scan_backward.default, bwd)
    torch.library.opcheck(scan_ops.selective_state_update.default, step)


@needs_triton
def test_opcheck_triton_backend_interpreter():
    """``opcheck`` on each op with the Triton kernels under the interpreter: the schema (including the mutation of
    ``state``) and the autograd registration. ``test_faketensor`` and ``test_aot_dispatch_*`` cannot run here:
    under ``TRITON_INTERPRET=1`` ``torch.library.wrap_triton`` hands back the interpreted kernel itself (no
    tracing wrapper), which then runs on FakeTensors; ``test_triton_branch_traces_on_fake_cuda_tensors`` traces
    the Triton branch instead."""
    utils = ("test_schema", "test_autograd_registration")
    fwd, bwd, step = _opcheck_inputs("triton")
    torch.library.opcheck(scan_ops.selective_scan.default, fwd, test_utils=utils)
    torch.library.opcheck(scan_ops.selective_scan_backward.default, bwd, test_utils=utils)
    torch.library.opcheck(scan_ops.selective_state_update.default, step, test_utils=utils)


@needs_triton
def test_triton_branch_traces_on_fake_cuda_tensors():
    """Without a GPU: AOTAutograd (what ``torch.compile`` runs) traces each op with ``backend="triton"`` on fake CUDA
    tensors down to its Triton kernel (``wrap_triton``: a ``triton_kernel_wrapper`` node in the graph). Runs in a
    subprocess with ``TRITON_INTERPRET=0``, so that the kernels are real ``JITFunction``s."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(sys.path))
    script = Path(__file__).with_name("scan_trace_worker.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("kernels ")]
    assert lines == ["kernels selective_scan _selective_scan_chunk_state_kernel _selective_scan_carry_kernel "
                     "_selective_scan_chunk_output_kernel",
                     "kernels selective_scan_backward _selective_scan_chunk_adjoint_kernel _selective_scan_carry_kernel "
                     "_selective_scan_chunk_bwd_kernel",
                     "kernels selective_state_update _selective_state_update_kernel"], done.stdout


def _compile_inputs(length=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, d, n = 2, 6, 4

    def r(*shape):
        return torch.randn(*shape, generator=g)

    kw = dict(u=r(b, d, length), delta=r(b, d, length), A=-torch.rand(d, n, generator=g) - 0.1, B=r(b, n, length),
              C=r(b, n, length), D=r(d), z=r(b, d, length), delta_bias=r(d), initial_state=r(b, d, n))
    reset = torch.zeros(b, length, dtype=torch.bool)
    reset[0, length // 2] = True
    return kw, reset


def _scan_loss(backend):
    def loss(u, delta, A, B, C, D, z, delta_bias, initial_state, reset):
        y, last = selective_scan(u, delta, A, B, C, D, z, delta_bias, True, initial_state, True, backend=backend,
                                 reset=reset)
        return y.sin().sum() + last.cos().sum()

    return loss


def _loss_and_grads(fn, kw, reset):
    leaves = {k: v.clone().requires_grad_() for k, v in kw.items()}
    loss = fn(**leaves, reset=reset)
    loss.backward()
    return [loss.detach()] + [leaves[k].grad for k in kw]


def test_compile_fullgraph_inductor_forward_backward():
    """``torch.compile(fullgraph=True)`` (Inductor, CPU) of a loss through the public op: the same loss and gradients
    as eager (float32, 1e-5), packed documents, initial state, gate, bias and softplus."""
    torch._dynamo.reset()
    kw, reset = _compile_inputs()
    eager = _loss_and_grads(_scan_loss("auto"), kw, reset)
    compiled = _loss_and_grads(torch.compile(_scan_loss("auto"), fullgraph=True), kw, reset)
    for name, a, b in zip(["loss", *kw], compiled, eager):
        assert_close(a, b, 1e-5, name)


@pytest.mark.parametrize("cpu_kernel", ["0", "1"])
def test_compile_dynamic_length_serves_every_length_without_recompiling(monkeypatch, cpu_kernel):
    """One graph traced over a dynamic length (17 tokens, ``dynamic=True``) serves 64, 65 and 128 tokens in training
    as eager does, without recompiling, on the chunked PyTorch path (its chunk count an unbacked size) and the C++
    kernel's (a ceil-division of the length; the saved states 3-D, which no channels-last test guards). ``aot_eager``:
    the guards come from tracing."""
    monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", cpu_kernel)
    torch._dynamo.reset()
    compiled = torch.compile(_scan_loss("auto"), fullgraph=True, dynamic=True, backend="aot_eager")
    try:
        for length in (17, 64, 65, 128):
            kw, reset = _compile_inputs(length)
            for name, a, b in zip(["loss", *kw], _loss_and_grads(compiled, kw, reset),
                                  _loss_and_grads(_scan_loss("auto"), kw, reset)):
                assert_close(a, b, 1e-5, f"{name} at {length}")
            torch.compiler.set_stance("fail_on_recompile")
    finally:
        torch.compiler.set_stance("default")


def test_compile_fullgraph_inductor_decode_steps_no_recompile():
    """Decoding: a compiled step (Inductor, CPU) run several tokens in a row gives the eager states and outputs, and
    does not recompile after the first token."""
    torch._dynamo.reset()
    kw, _ = _compile_inputs(length=5, seed=1)

    def step(state, x, dt, A, B, C, D, z, bias):
        return selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=bias, dt_softplus=True)

    compiled = torch.compile(step, fullgraph=True)
    h_eager, h_comp = kw["initial_state"].clone(), kw["initial_state"].clone()
    with torch.no_grad():
        for t in range(kw["u"].shape[2]):
            args = (kw["u"][..., t], kw["delta"][..., t], kw["A"], kw["B"][..., t], kw["C"][..., t], kw["D"],
                    kw["z"][..., t], kw["delta_bias"])
            y_eager = step(h_eager, *args)
            if t == 0:
                y_comp = compiled(h_comp, *args)
            else:
                with torch.compiler.set_stance("fail_on_recompile"):
                    y_comp = compiled(h_comp, *args)
            assert_close(y_comp, y_eager, 1e-5, f"y[{t}]")
            assert_close(h_comp, h_eager, 1e-5, f"state[{t}]")
