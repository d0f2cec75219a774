"""The C++ decoding step (``csrc/selective_scan_cpu.cpp``: ``selective_state_update_cpu``,
``causal_conv1d_step_cpu``, and ``chunk_retention_cpu`` for a few tokens; the ``"cpp"`` entries of the three ops'
tables, called by the public functions without a Python op in between): against the PyTorch path and the float64
token loop, in place, strided inputs, every option; chosen only for an eager, decoding-sized call; ``opcheck``."""

import pytest
import torch

from hf_densessm.ops import cpu_kernel
from hf_densessm.ops.causal_conv1d import causal_conv1d
from hf_densessm.ops.causal_conv1d.torch_path import causal_conv1d_torch
from hf_densessm.ops.dispatch import choose
from hf_densessm.ops.retention import STEP_TOKENS, chunk_retention, retention_gamma
from hf_densessm.ops.retention.chunked_torch import chunk_retention_torch
from hf_densessm.ops.selective_scan import selective_state_update
from hf_densessm.ops.selective_scan.chunked_torch import selective_state_update_torch
from hf_densessm.ops.selective_scan.naive import selective_scan_naive

from test_selective_scan import assert_close
from test_selective_scan_cpu_kernel import enabled, kernel  # noqa: F401 (fixtures)

CPU = torch.device("cpu")


def _step_inputs(batch, dim, n, dtype, state_dtype, seed=0):
    """Inputs as the model passes them: rows of wider tensors (unit stride along the channels only)."""
    g = torch.Generator().manual_seed(seed)

    def rows(width, dt=dtype):
        return torch.randn(batch, 2 * width + 3, generator=g, dtype=torch.float64).to(dt)[:, 1:width + 1]

    state = torch.randn(batch, dim, n, generator=g, dtype=torch.float64).to(state_dtype)
    A = -torch.rand(dim, n, generator=g, dtype=torch.float64).to(state_dtype) - 0.1
    return dict(state=state, x=rows(dim), dt=rows(dim), A=A, B=rows(n), C=rows(n), D=rows(dim, state_dtype)[0],
                z=rows(dim), dt_bias=0.1 * rows(dim, state_dtype)[0])


@pytest.mark.parametrize("dtype,state_dtype,tol", [(torch.float64, torch.float64, 1e-12),
                                                   (torch.float32, torch.float32, 2e-6),
                                                   (torch.bfloat16, torch.float32, 1e-2)])
@pytest.mark.parametrize("n", [1, 5, 16, 64])
@pytest.mark.parametrize("options", [True, False])
def test_state_update_matches_torch_step_and_token_loop(enabled, dtype, state_dtype, tol, n, options):
    kw = _step_inputs(3, 37, n, dtype, state_dtype, seed=n)
    if not options:
        kw.update(D=None, z=None, dt_bias=None)
    assert choose("selective_state_update", CPU, None, state_size=n, step=True) == "cpp"
    state, ref_state = kw.pop("state"), None
    ref_state, h = state.clone(), state.clone()
    address = state.data_ptr()
    with torch.no_grad():
        y = selective_state_update(state, **kw, dt_softplus=options)
        y_torch = selective_state_update_torch(ref_state, **kw, dt_softplus=options)
    assert state.data_ptr() == address and y.dtype == dtype and y.shape == (3, 37)
    assert_close(y.double(), y_torch.double(), tol, "y vs the PyTorch step")
    assert_close(state, ref_state, tol, "state vs the PyTorch step")
    delta = kw["dt"].double() + (0 if kw["dt_bias"] is None else kw["dt_bias"].double())
    y0, h1 = selective_scan_naive(
        kw["x"].double()[..., None], delta[..., None], kw["A"].double(), kw["B"].double()[..., None],
        kw["C"].double()[..., None], D=None if kw["D"] is None else kw["D"].double(),
        z=None if kw["z"] is None else kw["z"].double()[..., None], delta_softplus=options,
        initial_state=h.double())
    assert_close(state.double(), h1, max(tol, 1e-6 if dtype != torch.float64 else tol), "state vs float64 loop")
    assert_close(y.double(), y0[..., 0], max(tol, 1e-5 if dtype != torch.float64 else tol), "y vs float64 loop")


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("kernel_size", [2, 4])
@pytest.mark.parametrize("bias,silu", [(True, True), (False, False)])
def test_conv_step_matches_torch_path(enabled, dtype, tol, kernel_size, bias, silu):
    g = torch.Generator().manual_seed(kernel_size)
    batch, channels = 3, 45
    x = torch.randn(batch, 1, 2 * channels, generator=g).to(dtype)[..., :channels]  # in_proj's chunk: strided
    weight = torch.randn(channels, 1, kernel_size, generator=g).to(dtype)
    b = torch.randn(channels, generator=g).to(dtype) if bias else None
    window = torch.randn(batch, channels, kernel_size, generator=g).to(dtype)
    assert choose("causal_conv1d", CPU, None, step=True) == "cpp"
    with torch.no_grad():
        out = causal_conv1d(x, weight, b, window, activation="silu" if silu else None)
    ref = causal_conv1d_torch(x, weight.reshape(channels, kernel_size), b, window, None, silu)
    assert out.dtype == dtype and out.shape == (batch, 1, channels) and out.is_contiguous()
    assert_close(out.double(), ref.double(), tol)


def test_step_entries_only_for_eager_steps(enabled, monkeypatch):
    """The conv's step entry only for one token over a window, no reset, nothing to differentiate; the state
    update's only for a contiguous float32 / float64 state; neither while torch.compile traces or with the switch
    off."""
    assert choose("causal_conv1d", CPU, None, step=False) == "torch"
    assert choose("selective_state_update", CPU, None, state_size=16, step=False) == "torch"
    calls = []
    original = torch.ops.hf_densessm.causal_conv1d_step_cpu.default

    def counting(*args):
        calls.append(1)
        return original(*args)

    x, w, window = torch.randn(1, 2, 8), torch.randn(8, 1, 4), torch.randn(1, 8, 4)
    from hf_densessm.ops import cpu_kernel

    monkeypatch.setitem(cpu_kernel.CONV_STEP.calls, "direct", lambda x, t, b, win, r, s: counting(x, t, b, win, s))
    with torch.no_grad():
        causal_conv1d(x[:, :1], w, None, window)  # a step
        causal_conv1d(x, w, None, window)  # two tokens
        causal_conv1d(x[:, :1], w, None, window, reset=torch.ones(1, 1, dtype=torch.bool))
    causal_conv1d(x[:, :1], w.requires_grad_(), None, window)  # gradients
    assert len(calls) == 1
    state = torch.randn(1, 16, 8).transpose(1, 2)  # (1, 8, 16), not contiguous: the PyTorch step, no C++ error
    with torch.no_grad():
        args = (torch.randn(1, 8), torch.randn(1, 8), -torch.rand(8, 16), torch.randn(1, 16), torch.randn(1, 16))
        selective_state_update(state, *args)
    monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", "0")
    assert choose("causal_conv1d", CPU, None, step=True) == "torch"
    assert choose("selective_state_update", CPU, None, state_size=16, step=True) == "torch"


def test_compiled_step_traces_the_torch_step(enabled):
    """Under torch.compile the step is the traced PyTorch step (Inductor fuses it): no C++ call in the graph."""
    kw = _step_inputs(2, 16, 4, torch.float32, torch.float32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm

    def step(state, x, dt, A, B, C, D, z, dt_bias):
        return selective_state_update(state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=True)

    state = kw.pop("state")
    eager_state = state.clone()
    with torch.no_grad():
        y = torch.compile(step, backend=backend, fullgraph=True)(state, **kw)
        y_eager = step(eager_state, **kw)
    assert graphs and not any("_cpu" in code for code in graphs)
    assert_close(y, y_eager, 1e-6)
    assert_close(state, eager_state, 1e-6)


def test_opcheck_step_ops(enabled):
    kw = _step_inputs(2, 16, 4, torch.float32, torch.float32)
    torch.library.opcheck(torch.ops.hf_densessm.selective_state_update_cpu.default,
                          (kw["state"], kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["dt_bias"],
                           True))
    x, taps, window = torch.randn(2, 1, 8), torch.randn(8, 4), torch.randn(2, 8, 4)
    torch.library.opcheck(torch.ops.hf_densessm.causal_conv1d_step_cpu.default, (x, taps, None, window, True))


def _retention_loop(q, k, v, scale, state):
    """Eq. 18, 19 token by token in float64 (independent of both paths): ``S = gamma S + k^T v``, ``o = scale q S``."""
    gamma = retention_gamma(q.shape[2], dtype=torch.float64)[None, :, None, None]
    state = torch.zeros(*q.shape[::2], q.shape[3], v.shape[3], dtype=torch.float64) if state is None else state.double()
    outputs = []
    for t in range(q.shape[1]):
        state = gamma * state + k[:, t, :, :, None].double() * v[:, t, :, None, :].double()
        outputs.append(scale * (q[:, t, :, None, :].double() @ state)[:, :, 0])
    return torch.stack(outputs, 1), state


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("length", [1, 5, STEP_TOKENS])
@pytest.mark.parametrize("with_state", [True, False])
def test_retention_few_tokens_matches_float64_loop_and_torch_path(enabled, dtype, tol, length, with_state):
    """Inputs as the model passes them (v a slice of a wider tensor), at the published init's scale (unit-variance
    q, k, v, scale head_dim^-0.5) and a float32 state (float64 with float64 inputs), or none: outputs and final state
    against the loop and the chunked path."""
    g = torch.Generator().manual_seed(length)
    batch, heads, key_dim, value_dim = 2, 3, 16, 24
    q, k = (torch.randn(batch, length, heads, key_dim, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(batch, length, heads, 2 * value_dim, generator=g).to(dtype)[..., :value_dim]
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    state = torch.randn(batch, heads, key_dim, value_dim, generator=g).to(state_dtype) if with_state else None
    assert choose("chunk_retention", CPU, None, step=True) == "cpp"
    with torch.no_grad():  # the entry itself, with and without a state (the choice: below)
        o, final = cpu_kernel.RETENTION_STEP.calls["direct"](q, k, v, key_dim**-0.5, state, None)
        o_torch, final_torch = chunk_retention_torch(q, k, v, key_dim**-0.5, state, output_final_state=True)
    o_ref, final_ref = _retention_loop(q, k, v, key_dim**-0.5, state)
    assert o.dtype == dtype and o.shape == (batch, length, heads, value_dim) and o.is_contiguous()
    assert final.dtype == state_dtype and final.shape == (batch, heads, key_dim, value_dim)
    assert state is None or final.data_ptr() != state.data_ptr()  # a new state; the initial one is left as it was
    assert_close(o.double(), o_ref, tol, "o vs the float64 loop")
    assert_close(final.double(), final_ref, max(tol, 1e-6 if dtype != torch.float64 else tol), "state vs the loop")
    assert_close(o.double(), o_torch.double(), tol, "o vs the chunked PyTorch path")
    assert_close(final, final_torch, max(tol, 1e-6 if dtype != torch.float64 else tol), "state vs the chunked path")


def test_retention_entry_only_for_few_tokens_without_resets(enabled, monkeypatch):
    """The C++ retention for an eager call of at most STEP_TOKENS tokens without a reset, with or without a state (a
    reset cache computes as a new one), called directly without gradients and through the op (its autograd the
    chunked path's backward) with them, so that a reentrant checkpointed forward and its recompute agree; a longer
    call, a reset, the switch off: the chunked path."""
    calls = []
    for role in ("forward", "direct"):
        original = cpu_kernel.RETENTION_STEP.calls[role]
        counted = (lambda f, r: lambda *a: calls.append(r) or f(*a))(original, role)
        monkeypatch.setitem(cpu_kernel.RETENTION_STEP.calls, role, counted)
    q, k, v = (torch.randn(1, STEP_TOKENS + 1, 2, 8, dtype=torch.float64) for _ in range(3))
    s = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    few = (q[:, :STEP_TOKENS], k[:, :STEP_TOKENS], v[:, :STEP_TOKENS])
    with torch.no_grad():
        chunk_retention(*few, initial_state=s)
        chunk_retention(*few)  # no state
        chunk_retention(q, k, v, initial_state=s)  # one token too many
        reset = torch.zeros(1, STEP_TOKENS, dtype=torch.bool)
        reset[0, 3] = True
        chunk_retention(*few, initial_state=s, reset=reset)
    assert calls == ["direct", "direct"]
    leaves = [t.clone().requires_grad_() for t in (*few, s)]
    o, final = chunk_retention(*leaves[:3], initial_state=leaves[3], output_final_state=True)
    assert calls == ["direct", "direct", "forward"]
    torch.autograd.backward((o, final), (torch.ones_like(o), torch.ones_like(final)))
    ref = [t.detach().clone().requires_grad_() for t in (*few, s)]
    o_ref, final_ref = chunk_retention_torch(*ref[:3], 8**-0.5, ref[3], output_final_state=True)
    torch.autograd.backward((o_ref, final_ref), (torch.ones_like(o_ref), torch.ones_like(final_ref)))
    for leaf, expected in zip(leaves, ref):
        torch.testing.assert_close(leaf.grad, expected.grad, rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", "0")
    assert choose("chunk_retention", CPU, None, step=True) == "torch"


def test_opcheck_retention_op(enabled):
    q, k, v = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 16)
    torch.library.opcheck(torch.ops.hf_densessm.chunk_retention_cpu.default, (q, k, v, 0.5, torch.randn(2, 2, 8, 16)))
    torch.library.opcheck(torch.ops.hf_densessm.chunk_retention_cpu.default, (q, k, v, 1.0, None))
