"""Mamba's causal depthwise convolution in token-major order (``ops/causal_conv1d/``): the float64 token loop
(``naive.py``) against ``F.conv1d`` (channels first, left zero padding; packed documents run one by one), the op
(``hf_densessm::causal_conv1d``, its PyTorch path and hand-written backward) against the token loop: values and the
gradients of ``x``, ``weight``, ``bias`` and ``window``; cached windows, packed documents and both at once; half
precision; argument checks; ``torch.library.opcheck``; ``torch.compile(fullgraph=True)`` against eager. The fused
Triton kernels (``chunk.py``, under the interpreter) against the token loop in every dtype, across token blocks,
with every optional input; that ``backend`` picks them; their trace on fake CUDA tensors."""

import os
import subprocess
import sys

import pytest
import torch
import torch._inductor.config
import torch.nn.functional as F

from hf_densessm.ops.dispatch import triton_available
from hf_densessm.ops.causal_conv1d import _ops as conv_ops
from hf_densessm.ops.causal_conv1d import causal_conv1d
from hf_densessm.ops.causal_conv1d.naive import causal_conv1d_naive

ACTIVATIONS = [None, "silu"]


def conv1d_reference(x, weight, bias, window=None, reset=None, activation=None):
    """F.conv1d over (batch, channels, length), each packed document alone; the window's last kernel - 1 inputs
    stand before the row's first document (zeros before the others)."""
    kernel = weight.shape[-1]
    rows = []
    for b in range(x.shape[0]):
        starts = [0] + ([] if reset is None else [t for t in range(1, x.shape[1]) if reset[b, t]]) + [x.shape[1]]
        first_reads_window = window is not None and (reset is None or not reset[b, 0])
        pieces = []
        for s, e in zip(starts[:-1], starts[1:]):
            seq = x[b : b + 1, s:e].transpose(1, 2)
            if s == 0 and first_reads_window:
                left = window[b : b + 1, :, 1:]
            else:
                left = seq.new_zeros(1, seq.shape[1], kernel - 1)
            pieces.append(F.conv1d(torch.cat([left, seq], -1), weight, bias, groups=weight.shape[0]).transpose(1, 2))
        rows.append(torch.cat(pieces, 1))
    out = torch.cat(rows, 0)
    return F.silu(out) if activation == "silu" else out


def make_inputs(shape, mode, dtype=torch.float64, seed=None):
    """x as a strided view (the in_proj's output, as in the model), weight (dim, 1, K), bias, and per ``mode``
    ("plain", "window", "packed", "window+packed") a window (differentiable) and a reset."""
    batch, length, dim, kernel = shape
    g = torch.Generator().manual_seed(length * dim * kernel if seed is None else seed)
    proj = torch.randn(batch, length, 2 * dim, generator=g, dtype=dtype)
    x = proj[..., :dim].detach().requires_grad_()
    weight = torch.randn(dim, 1, kernel, generator=g, dtype=dtype, requires_grad=True)
    bias = torch.randn(dim, generator=g, dtype=dtype, requires_grad=True)
    window = None
    if "window" in mode:
        window = torch.randn(batch, dim, kernel, generator=g, dtype=dtype, requires_grad=True)
    reset = None
    if "packed" in mode:
        reset = torch.rand(batch, length, generator=g) < 0.25
        reset[0, 0] = False  # the window (if any) reaches row 0's first document
        if batch > 1:
            reset[1, 0] = True  # and not row 1's
    return x, weight, bias, window, reset


SHAPES = [(1, 1, 1, 4), (2, 7, 5, 4), (3, 40, 37, 4), (2, 33, 20, 3), (1, 5, 16, 2), (2, 6, 3, 1), (2, 2, 4, 4)]
MODES = ["plain", "window", "packed", "window+packed"]


@pytest.mark.parametrize("shape", [(2, 7, 5, 4), (3, 40, 37, 4), (2, 2, 4, 4)])
@pytest.mark.parametrize("mode", MODES)
def test_naive_matches_conv1d(shape, mode):
    x, weight, bias, window, reset = make_inputs(shape, mode)
    torch.testing.assert_close(
        causal_conv1d_naive(x, weight, bias, window, reset, "silu"),
        conv1d_reference(x, weight, bias, window, reset, "silu"),
        atol=1e-13, rtol=1e-13,
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_naive_float64(shape, mode, activation, with_bias):
    """Values and every gradient (x, weight, bias, window) against the token loop, in float64."""
    x, weight, bias, window, reset = make_inputs(shape, mode)
    bias = bias if with_bias else None
    out = causal_conv1d(x, weight, bias, window, reset, activation)
    ref = causal_conv1d_naive(x, weight, bias, window, reset, activation)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    assert out.is_contiguous()
    leaves = [t for t in (x, weight, bias, window) if t is not None]
    go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((out * go).sum(), leaves)
    refs = torch.autograd.grad((ref * go).sum(), leaves, allow_unused=True)  # K = 1 reads no window
    refs = [torch.zeros_like(t) if r is None else r for t, r in zip(leaves, refs)]
    for name, a, b in zip(("x", "weight", "bias", "window"), grads, refs):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11, msg=lambda m: f"{name}: {m}")


def test_gradcheck():
    """The registered backward against finite differences (float64), expanded output gradient included."""
    x, weight, bias, window, reset = make_inputs((2, 9, 3, 4), "window+packed")
    torch.autograd.gradcheck(
        lambda x, w, b, win: causal_conv1d(x, w, b, win, reset, "silu"), (x, weight, bias, window)
    )
    out = causal_conv1d(x, weight, bias, window, reset, "silu")
    (gx,) = torch.autograd.grad(out.sum(), x)  # sum's gradient is an expanded (stride 0) tensor
    (rx,) = torch.autograd.grad(causal_conv1d_naive(x, weight, bias, window, reset, "silu").sum(), x)
    torch.testing.assert_close(gx, rx, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("mode", ["plain", "window+packed"])
def test_float32_at_model_scale(mode):
    x, weight, bias, window, reset = make_inputs((2, 64, 48, 4), mode, dtype=torch.float32)
    out = causal_conv1d(x, weight, bias, window, reset, "silu")
    ref = causal_conv1d_naive(x, weight, bias, window, reset, "silu")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_and_no_bias():
    x = torch.randn(2, 9, 24).bfloat16().requires_grad_()
    weight = torch.randn(24, 1, 4).bfloat16().requires_grad_()
    out = causal_conv1d(x, weight, None, activation="silu")
    assert out.dtype == torch.bfloat16
    ref = causal_conv1d_naive(x, weight, None, activation="silu")
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    gx, gw = torch.autograd.grad(out.float().sum(), (x, weight))
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16 and gw.shape == weight.shape


def test_autocast_keeps_its_precision():
    """Under CPU autocast the op computes in float32 as without it (its body has no autocast-listed op, and it
    runs with autocast off)."""
    x, weight, bias, window, reset = make_inputs((1, 12, 8, 4), "window", dtype=torch.float32)
    plain = causal_conv1d(x, weight, bias, window, None, "silu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = causal_conv1d(x, weight, bias, window, None, "silu")
    assert auto.dtype == torch.float32
    torch.testing.assert_close(auto, plain, atol=0, rtol=0)


def test_window_is_read_not_kept():
    """The window is a cache the caller updates in place right after: the backward pass must use the values of the
    call (the gradient of the window itself flows to the tensor passed)."""
    x, weight, _, window, _ = make_inputs((1, 6, 16, 4), "window")
    out = causal_conv1d(x, weight, None, window)
    ref = causal_conv1d_naive(x, weight, None, window)
    g_ref = torch.autograd.grad(ref.sum(), (weight, window))
    with torch.no_grad():
        window.zero_()
    g = torch.autograd.grad(out.sum(), (weight, window))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)
    assert g[1][:, :, 0].abs().max() == 0  # column 0 (the oldest input) is never read


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(x=torch.randn(2, 3)), ValueError, "x must have shape \\(batch, seq_len, channels\\)"),
        (dict(x=torch.ones(1, 3, 4, dtype=torch.long)), TypeError, "x must be a floating-point tensor"),
        (dict(weight=torch.randn(5, 1, 4)), ValueError, "weight must have shape \\(4, 1, kernel\\)"),
        (dict(weight=torch.ones(4, 1, 4, dtype=torch.long)), TypeError, "weight must be a floating-point tensor"),
        (dict(weight=None), TypeError, "weight must be a floating-point tensor, got None"),
        (dict(bias=torch.randn(3)), ValueError, "bias must have shape \\(4,\\)"),
        (dict(window=torch.randn(1, 4, 3)), ValueError, "window must have shape"),
        (dict(activation="gelu"), ValueError, "activation must be one of"),
        (dict(reset=torch.zeros(1, 4, dtype=torch.bool)), ValueError, "reset must have shape"),
        (dict(reset=torch.zeros(1, 3)), TypeError, "reset must be a bool"),
        (dict(reset=torch.full((1, 3), 2)), ValueError, "reset must hold only 0 and 1"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
        (dict(weight=torch.randn(4, 1, 4, device="meta")), ValueError, "weight is on meta but x is on cpu"),
        (dict(bias=torch.randn(4, device="meta")), ValueError, "bias is on meta but x is on cpu"),
    ],
)
def test_bad_inputs(kwargs, error, match):
    args = dict(x=torch.randn(1, 3, 4), weight=torch.randn(4, 1, 4), bias=None)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        causal_conv1d(**args)


def _op_args(mode, with_bias=True):
    x, weight, bias, window, reset = make_inputs((2, 7, 5, 4), mode, dtype=torch.float32)
    return x, weight.detach().reshape(5, 4).requires_grad_(), bias if with_bias else None, window, reset


# under the interpreter (tests/conftest.py) opcheck runs the schema and autograd checks only on the Triton branch:
# wrap_triton hands back the interpreted kernel, which cannot run on fake tensors (test_triton_branch_traces...)
OPCHECK = [("torch", None)] + ([("triton", ("test_schema", "test_autograd_registration"))] if triton_available()
                               else [])


@pytest.mark.parametrize("backend,utils", OPCHECK)
@pytest.mark.parametrize("mode,with_bias", [("plain", False), ("window+packed", True)])
def test_opcheck_forward(mode, with_bias, backend, utils):
    x, taps, bias, window, reset = _op_args(mode, with_bias)
    torch.library.opcheck(conv_ops.causal_conv1d.default, (x, taps, bias, window, reset, True, backend),
                          **({} if utils is None else dict(test_utils=utils)))


@pytest.mark.parametrize("backend,utils", OPCHECK)
@pytest.mark.parametrize("mode,with_bias", [("plain", False), ("window+packed", True)])
def test_opcheck_backward(mode, with_bias, backend, utils):
    x, taps, bias, window, reset = _op_args(mode, with_bias)
    grad = torch.randn(x.shape)
    detached = [None if t is None else t.detach() for t in (x, taps, bias, window)]
    torch.library.opcheck(conv_ops.causal_conv1d_backward.default,
                          (grad, *detached, reset, True, backend), **({} if utils is None else dict(test_utils=utils)))


@pytest.mark.parametrize("mode", ["plain", "window+packed"])
def test_inductor_fuses_the_conv_with_its_silu_into_one_kernel_each_way(mode):
    """Under torch.compile on the CPU, the PyTorch path (a traced entry: its shifted reads, taps, bias and SiLU) is one
    generated kernel forward and one backward (two with a window and resets), with no library call (issue 35, item
    3: the eager path keeps more passes, Inductor fuses them); counted in the code Inductor generates."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    x, weight, bias, window, reset = make_inputs((2, 37, 24, 4), mode, dtype=torch.float32)
    leaves = [t for t in (x, weight, bias, window) if t is not None]
    fn = torch.compile(lambda *args: causal_conv1d(*args, "silu"), fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True):
        _, codes = run_and_get_code(lambda: torch.autograd.grad(fn(x, weight, bias, window, reset).sum(), leaves))
    assert len(codes) == 2  # the forward graph and the backward graph
    for code in codes:
        kernels = set(re.findall(r"\bcpp_fused_\w+", code))
        assert len(kernels) <= (1 if mode == "plain" else 2), kernels  # (packed: one more, over the reset mask)
        assert not re.search(r"extern_kernels\.\w+\(", code)


@pytest.mark.parametrize("mode", ["plain", "window+packed"])
def test_compile_fullgraph_matches_eager(mode):
    """torch.compile(fullgraph=True) with Inductor on CPU tensors (the op decomposed into its out-of-place form):
    the output and every gradient as in eager, float32."""
    torch._dynamo.reset()
    x, weight, bias, window, reset = make_inputs((2, 37, 24, 4), mode, dtype=torch.float32)
    leaves = [t for t in (x, weight, bias, window) if t is not None]

    def loss_fn(x, weight, bias, window, reset):
        out = causal_conv1d(x, weight, bias, window, reset, "silu")
        return out, (out * torch.linspace(-1, 1, out.shape[-1])).square().sum()

    def run(fn):
        out, loss = fn(x, weight, bias, window, reset)
        return [out.detach(), *torch.autograd.grad(loss, leaves)]

    eager = run(loss_fn)
    # caches off: their keys hold the graph, where the op is one call, not the body it decomposes into
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = run(torch.compile(loss_fn, fullgraph=True))
    for a, b in zip(compiled, eager):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, atol=1e-5 * max(scale, 1.0), rtol=1e-5)


# ------------------------------------------------------------------------------------------- the Triton kernels

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _kernels_and_naive(x, weight, bias, window, reset, activation, block_t):
    """``[out, grad_x, grad_weight, grad_bias, grad_window]`` of the Triton forms called with ``block_t`` tokens per
    program, and of the token loop (zeros for the gradients of absent inputs)."""
    from hf_densessm.ops.causal_conv1d.chunk import causal_conv1d_triton_bwd, causal_conv1d_triton_fwd

    taps = weight.detach().reshape(weight.shape[0], -1)
    args = [None if t is None else t.detach() for t in (x, bias, window)]
    out = causal_conv1d_triton_fwd(args[0], taps, args[1], args[2], reset, activation == "silu", block_t=block_t)
    ref = causal_conv1d_naive(x, weight, bias, window, reset, activation)
    go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    gx, gw, gb, gwin = causal_conv1d_triton_bwd(go.to(x.dtype), args[0], taps, args[1], args[2], reset,
                                                activation == "silu", block_t=block_t)
    leaves = [t for t in (x, weight, bias, window) if t is not None]
    refs = iter(torch.autograd.grad((ref * go).sum(), leaves, allow_unused=True))  # K = 1 reads no window
    refs = [None if t is None else next(refs) for t in (x, weight, bias, window)]
    refs = [torch.zeros_like(t) if r is None and t is not None else r for t, r in zip((x, weight, bias, window), refs)]
    mine = [out, gx, gw.reshape(weight.shape), gb if bias is not None else None, gwin if window is not None else None]
    return mine, [ref] + refs


KERNEL_SHAPES = [(2, 19, 5, 4), (1, 17, 20, 3), (2, 9, 3, 2), (2, 6, 3, 1), (2, 2, 4, 4)]


@needs_triton
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("activation,with_bias", [("silu", True), (None, False)])
def test_triton_kernels_match_naive_float64(shape, mode, activation, with_bias):
    """The kernels in float64 against the token loop, 8-token blocks (the lengths cross 1-2 block boundaries, the
    last shape is shorter than the window): the output and every gradient."""
    x, weight, bias, window, reset = make_inputs(shape, mode)
    mine, refs = _kernels_and_naive(x, weight, bias if with_bias else None, window, reset, activation, 8)
    for name, a, b in zip(("out", "x", "weight", "bias", "window"), mine, refs):
        if b is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, name
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m: f"{name}: {m}")


@needs_triton
@pytest.mark.parametrize("block_t", [1, 2, 4])
def test_triton_kernels_blocks_shorter_than_the_window(block_t):
    """Blocks of 1, 2, 4 tokens with 4 taps: a block's taps and gradients reach up to three blocks back, into the
    window, and its backward walk runs past the next blocks."""
    x, weight, bias, window, reset = make_inputs((2, 9, 6, 4), "window+packed")
    mine, refs = _kernels_and_naive(x, weight, bias, window, reset, "silu", block_t)
    for name, a, b in zip(("out", "x", "weight", "bias", "window"), mine, refs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m: f"{name}: {m}")


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 4e-3)])
def test_triton_op_dtypes(dtype, tol):
    """``backend="triton"`` through the op, its own tiles (40 tokens cross a 32-token block), window, packed
    documents, SiLU and bias: the output and every gradient in the inputs' dtypes, against the token loop on the
    same (rounded) inputs, within ``tol`` of each tensor's scale."""
    x, weight, bias, window, reset = make_inputs((2, 40, 24, 4), "window+packed", dtype=dtype)
    out = causal_conv1d(x, weight, bias, window, reset, "silu", backend="triton")
    ref = causal_conv1d_naive(x, weight, bias, window, reset, "silu")
    go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, (x, weight, bias, window), go.to(dtype))
    refs = torch.autograd.grad((ref * go.to(dtype).double()).sum(), (x, weight, bias, window))
    assert out.dtype == dtype and out.is_contiguous()
    for name, a, b in zip(("out", "x", "weight", "bias", "window"), (out, *grads), (ref, *refs)):
        assert a.dtype == dtype and a.shape == b.shape, name
        scale = b.abs().max().item()
        torch.testing.assert_close(a.double(), b.double(), atol=tol * scale, rtol=tol, msg=lambda m: f"{name}: {m}")


@needs_triton
def test_triton_channel_major_input_and_expanded_gradient():
    """An ``x`` whose channels are not unit-strided (a transposed ``(batch, channels, seq_len)`` tensor) and the
    stride-0 output gradient of ``out.sum()``: the same values and gradients as the token loop."""
    x = torch.randn(2, 6, 35, dtype=torch.float64).transpose(1, 2).requires_grad_()
    weight = torch.randn(6, 1, 3, dtype=torch.float64, requires_grad=True)
    out = causal_conv1d(x, weight, None, activation="silu", backend="triton")
    ref = causal_conv1d_naive(x, weight, None, activation="silu")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for a, b in zip(torch.autograd.grad(out.sum(), (x, weight)), torch.autograd.grad(ref.sum(), (x, weight))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@needs_triton
def test_backend_picks_the_kernels(monkeypatch):
    """``backend="triton"`` runs the Triton forms, forward and backward; ``"torch"`` and ``"auto"`` (CPU tensors)
    the PyTorch path, bit for bit alike; the two paths agree."""
    import importlib

    chunk = importlib.import_module("hf_densessm.ops.causal_conv1d.chunk")
    calls = []
    for name in ("causal_conv1d_triton_fwd", "causal_conv1d_triton_bwd"):
        monkeypatch.setattr(chunk, name, lambda *a, _f=getattr(chunk, name), _n=name: calls.append(_n) or _f(*a))
    x, weight, bias, window, reset = make_inputs((2, 10, 6, 4), "window+packed", dtype=torch.float32)
    results = {}
    for backend in ("torch", "auto", "triton"):
        calls.clear()
        out = causal_conv1d(x, weight, bias, window, reset, "silu", backend=backend)
        results[backend] = [out, *torch.autograd.grad(out.square().sum(), (x, weight, bias, window))]
        assert calls == (["causal_conv1d_triton_fwd", "causal_conv1d_triton_bwd"] if backend == "triton" else [])
    for a, b, c in zip(results["auto"], results["torch"], results["triton"]):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, b, atol=1e-5, rtol=1e-5)


TRACE = """
import sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
sys.path.insert(0, sys.argv[1])
from scan_trace_worker import traced_kernels
from hf_densessm.ops.causal_conv1d import _ops as conv_ops
from hf_densessm.ops.causal_conv1d import causal_conv1d

with FakeTensorMode():
    x, w, b, win = (torch.randn(*s, device="cuda") for s in ((2, 40, 64), (64, 1, 4), (64,), (2, 64, 4)))
    reset = torch.zeros(2, 40, dtype=torch.bool, device="cuda")
    print("kernels", *traced_kernels(lambda *a: causal_conv1d(*a, "silu", "triton"), x, w, b, win, reset))
    print("kernels", *traced_kernels(lambda *a: conv_ops.causal_conv1d_backward(*a, True, "triton"),
                                     x, x, w.reshape(64, 4), b, win, reset))
"""


@needs_triton
def test_triton_branch_traces_on_fake_cuda_tensors():
    """Without a GPU: AOTAutograd (what ``torch.compile`` runs) traces both ops with ``backend="triton"`` on fake
    CUDA tensors down to their kernels (``wrap_triton``), in a subprocess with ``TRITON_INTERPRET=0``."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", TRACE, os.path.dirname(__file__)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("kernels ")]
    assert lines == ["kernels _causal_conv1d_fwd_kernel", "kernels _causal_conv1d_bwd_kernel"], done.stdout
