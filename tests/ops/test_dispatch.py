"""The dispatch tables (``hf_densessm/ops/dispatch.py``; docs/kernels.md, "The dispatch table"): how ``backend``
chooses an implementation, that the backward runs what the forward ran (issue 34's reproduction: the C++ kernel's
forward, then ``HF_DENSESSM_CPU_KERNEL=0``, then the backward), every registered implementation of every op forward
and backward against float64 references, a peer implementation registered in one call; and the import rule of the
kernel files: the package and its PyTorch path import without triton, a kernel file says that it needs triton."""

import subprocess
from dataclasses import replace
import sys

import pytest
import torch

from hf_densessm.ops import (causal_conv1d, chunk_retention, cpu_kernel, dispatch, retention_state_update,
                             selective_scan, selective_state_update)
from hf_densessm.ops.causal_conv1d.naive import causal_conv1d_naive
from hf_densessm.ops.dispatch import TABLES, Implementation, choose
from hf_densessm.ops.retention.naive import chunk_retention_naive, retention_gamma
from hf_densessm.ops.selective_scan.chunked_torch import selective_scan_torch_bwd, selective_scan_torch_fwd
from hf_densessm.ops.selective_scan.naive import selective_scan_naive

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " On "])
def test_interpreter_spellings_are_accepted(monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert dispatch.interpreting()


@pytest.mark.parametrize("value", ["0", "false", "no", "off", ""])
def test_interpreter_off(monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert not dispatch.interpreting()


def test_choose_by_backend_and_device(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for op in ("chunk_retention", "causal_conv1d", "retention_state_update", "selective_state_update"):
        assert choose(op, CUDA, state_size=4) == "triton" and choose(op, CPU, state_size=4) == "torch"
        assert choose(op, CUDA, "torch", state_size=4) == "torch" and choose(op, CUDA, "triton", state_size=4)
        with pytest.raises(RuntimeError, match=f"{op}: backend='triton' has no .* TRITON_INTERPRET=1"):
            choose(op, CPU, "triton", state_size=4)
    assert choose("selective_scan", CUDA, state_size=4) == "triton"
    assert choose("selective_scan", CPU, "torch", state_size=2 * cpu_kernel.MAX_STATE) == "torch"  # beyond the C++
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    assert choose("chunk_retention", CPU, "triton") == "triton" and choose("chunk_retention", CPU) == "torch"
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert choose("chunk_retention", CUDA) == "torch"
    with pytest.raises(RuntimeError, match="needs the triton package"):
        choose("chunk_retention", CUDA, "triton")
    for bad in ("cuda", "Triton", "cpu", "cpp", 1):  # "cpu": the retired C kernels; "cpp" is an implementation
        with pytest.raises(ValueError, match="backend must be one of"):
            choose("chunk_retention", CPU, bad)
    with dispatch.use_backend("torch"):
        assert choose("chunk_retention", CUDA) == "torch"


def test_every_op_shares_the_switch(monkeypatch):
    """The same spelling of the interpreter variable is accepted, or refused, by every op alike."""
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "off")
    u = torch.randn(1, 2, 3)
    q = torch.randn(1, 3, 1, 4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        selective_scan(u, u.abs(), -torch.ones(2, 2), torch.randn(1, 2, 3), torch.randn(1, 2, 3), backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        chunk_retention(q, q, q, backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        causal_conv1d(q[:, :, 0], torch.randn(4, 3), backend="triton")


def _scan_inputs(batch, dim, state, length, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return dict(u=r(batch, dim, length), delta=r(batch, dim, length) * 0.5, A=-(torch.rand(dim, state, generator=g,
                dtype=torch.float64) + 0.2).to(dtype), B=r(batch, state, length), C=r(batch, state, length),
                D=r(dim), z=r(batch, dim, length), delta_bias=r(dim) * 0.5, delta_softplus=True,
                initial_state=r(batch, dim, state))


def _grads(fn, kw, outputs=lambda out: out, between=lambda: None):
    """``fn(**kw)``'s outputs and the gradients of ``sum(out * cotangent)`` in every floating input (``between()`` is
    called after the forward, before the backward)."""
    kw = {k: v.detach().clone().requires_grad_() if torch.is_tensor(v) and v.is_floating_point() else v
          for k, v in kw.items()}
    out = [o for o in outputs(fn(**kw)) if o is not None]
    between()
    g = torch.Generator().manual_seed(1)
    sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in out).backward()
    return [o.detach() for o in out], {k: v.grad for k, v in kw.items() if torch.is_tensor(v) and v.requires_grad}


def test_the_backward_runs_what_the_forward_ran(monkeypatch):
    """Issue 34's reproduction: the scan's forward through the C++ kernel, then ``HF_DENSESSM_CPU_KERNEL=0``, then the
    backward. At dim 64, length 4096 the kernel's saved checkpoints and the chunked path's states have one shape, so
    a backward that chose its path again ran the other's on them (0.33 relative error, no error raised); eager and
    compiled."""
    if not cpu_kernel.load_kernel():
        pytest.skip("the C++ kernel is not built here")
    monkeypatch.delenv("HF_DENSESSM_CPU_KERNEL", raising=False)
    kw = _scan_inputs(1, 64, 2, 4096, torch.float32)
    cpu_saved = cpu_kernel.IMPLEMENTATION.calls["saved"](kw["u"], kw["A"], torch.float32)
    assert cpu_saved.shape == (1, 64, 64 * 2) == (1, round(4096 ** 0.5), 2 * 64)  # the chunked path's, too
    expected = _grads(selective_scan, kw)

    for fn in (selective_scan, torch.compile(selective_scan, backend="aot_eager", fullgraph=True)):
        monkeypatch.delenv("HF_DENSESSM_CPU_KERNEL", raising=False)
        got = _grads(fn, kw, between=lambda: monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", "0"))
        for name, grad in expected[1].items():
            torch.testing.assert_close(got[1][name], grad, rtol=1e-5, atol=1e-5, msg=name)


def _forced(monkeypatch, name):
    """Leave in every op's table only its entry ``name`` (if it has one), taken by every backend on every device."""
    for op, table in TABLES.items():
        monkeypatch.setitem(TABLES, op, [replace(e, backends=dispatch.BACKENDS, auto_devices=()) for e in table
                                         if e.name == name] or table)


def _runnable(op, **facts):
    return [e.name for e in TABLES[op] if e.missing(CPU, **facts) is None]


@pytest.mark.parametrize("impl", _runnable("selective_scan", state_size=3))
def test_every_scan_implementation_forward_and_backward(monkeypatch, impl):
    """Each implementation of the scan and of its decoding step that runs here (the Triton kernels under the
    interpreter, the C++ kernel, the chunked path) against Algorithm 2 in float64, every gradient, across a chunk
    boundary of each."""
    kw = _scan_inputs(2, 5, 3, 70)
    expected = _grads(selective_scan_naive, kw, lambda out: out)
    _forced(monkeypatch, impl)
    got = _grads(lambda **kw: selective_scan(**kw, return_last_state=True), kw)
    for a, b in zip(got[0], expected[0]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-9, atol=1e-9, msg=name)
    if impl in _runnable("selective_state_update", state_size=3):
        state = kw["initial_state"].clone()
        y = selective_state_update(state, *(kw[k][..., 0] for k in ("u", "delta")), kw["A"], kw["B"][..., 0],
                                   kw["C"][..., 0], kw["D"], kw["z"][..., 0], kw["delta_bias"], True)
        one = {k: v[..., :1] if k in ("u", "delta", "B", "C", "z") else v for k, v in kw.items()}
        y1, last1 = selective_scan_naive(**one)
        torch.testing.assert_close(y, y1[..., 0])
        torch.testing.assert_close(state, last1)


@pytest.mark.parametrize("impl", _runnable("chunk_retention"))
def test_every_retention_implementation_forward_and_backward(monkeypatch, impl):
    """Each implementation of retention and of its decoding step that runs here against Eq. 18, 19 in float64."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 70, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    expected = _grads(chunk_retention_naive, dict(q=q, k=k, v=v), lambda o: [o])
    _forced(monkeypatch, impl)
    got = _grads(chunk_retention, dict(q=q, k=k, v=v), lambda out: out[:1])
    torch.testing.assert_close(got[0][0], expected[0][0])
    for name in "qkv":
        torch.testing.assert_close(got[1][name], expected[1][name], msg=name)
    if impl in _runnable("retention_state_update"):
        state = torch.randn(2, 2, 4, 4, generator=g, dtype=torch.float64)
        gamma = retention_gamma(2, dtype=torch.float64)[None, :, None, None]
        after = gamma * state + k[:, 0, :, :, None] * v[:, 0, :, None, :]
        o = retention_state_update(state, q[:, 0], k[:, 0], v[:, 0])
        torch.testing.assert_close(state, after)
        torch.testing.assert_close(o, torch.einsum("bhk,bhkv->bhv", q[:, 0] * 4**-0.5, after))


@pytest.mark.parametrize("impl", _runnable("causal_conv1d"))
def test_every_conv_implementation_forward_and_backward(monkeypatch, impl):
    g = torch.Generator().manual_seed(0)
    kw = dict(x=torch.randn(2, 40, 6, generator=g, dtype=torch.float64), weight=torch.randn(6, 4, generator=g,
              dtype=torch.float64), bias=torch.randn(6, generator=g, dtype=torch.float64),
              window=torch.randn(2, 6, 4, generator=g, dtype=torch.float64), activation="silu")
    expected = _grads(causal_conv1d_naive, kw, lambda y: [y])
    _forced(monkeypatch, impl)
    got = _grads(causal_conv1d, kw, lambda y: [y])
    torch.testing.assert_close(got[0][0], expected[0][0])
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, msg=name)


@pytest.fixture
def peer():
    """A peer implementation of the scan registered in one call (:func:`dispatch.register`), first for CPU tensors
    under ``"auto"``: the chunked PyTorch path at a fixed chunk of 4 tokens, with its own saved layout (batch,
    ceil(length / 4), state * dim), which its "saved" gives the opaque op's fake; the table is restored after."""
    calls = []

    def forward(*args):
        calls.append("forward")
        y, last, states = selective_scan_torch_fwd(*args[:-1], chunk_size=4)
        return y, last, states.flatten(2)

    def backward(*args):
        calls.append("backward")
        *args, saved = args
        return selective_scan_torch_bwd(*args, saved.unflatten(2, (args[4].shape[1], -1)), chunk_size=4)

    def saved(u, A, dtype):
        return u.new_empty(u.shape[0], (u.shape[2] + 3) // 4, A.shape[1] * u.shape[1], dtype=dtype)

    table = TABLES["selective_scan"][:]
    dispatch.register("selective_scan", Implementation(
        "chunk4", ("auto", "torch"), ("cpu",), lambda device, **facts: None if device.type == "cpu" else "cpu only",
        calls=dict(forward=forward, backward=backward, saved=saved)), before=TABLES["selective_scan"][1].name)
    yield calls
    TABLES["selective_scan"][:] = table


def test_a_peer_registers_in_one_call(peer):
    """Registered before the C++ entry, the peer runs every scan on CPU tensors, forward and backward, eager and
    compiled (fullgraph: its fake is its "saved"), and gives Algorithm 2's gradients."""
    assert choose("selective_scan", CPU, state_size=3) == "chunk4"
    assert choose("selective_scan", CUDA, state_size=3) != "chunk4"
    kw = _scan_inputs(1, 3, 2, 9)
    expected = _grads(selective_scan_naive, kw)
    for fn in (selective_scan, torch.compile(selective_scan, backend="aot_eager", fullgraph=True)):
        peer.clear()
        got = _grads(lambda **kw: fn(**kw, return_last_state=True), kw)
        assert peer == ["forward", "backward"]
        for name, grad in expected[1].items():
            torch.testing.assert_close(got[1][name], grad, msg=name)
    with pytest.raises(ValueError, match="before must name an implementation"):
        dispatch.register("selective_scan", Implementation("other", ("torch",)), before="absent")
    with pytest.raises(ValueError, match="op must be one of"):
        dispatch.register("selective_scans", Implementation("other", ("torch",)))
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.register("selective_scan", Implementation("other", ("cpp",)))


NO_TRITON = """
import sys
sys.modules["triton"] = None  # as on a machine without triton
import torch
from hf_densessm.ops import (causal_conv1d, chunk_retention, retention_state_update, selective_scan,
                             selective_state_update)
from hf_densessm.ops.dispatch import triton_available
assert not triton_available()
u = torch.randn(1, 2, 5)
y = selective_scan(u, u.abs(), -torch.ones(2, 3), torch.randn(1, 3, 5), torch.randn(1, 3, 5))
q = torch.randn(1, 5, 2, 4)
o, _ = chunk_retention(q, q, q)
c = causal_conv1d(u.transpose(1, 2), torch.randn(2, 4), activation="silu")
for name in ("selective_scan.chunk", "selective_scan.fused_recurrent", "retention.chunk", "retention.fused_recurrent",
             "causal_conv1d.chunk", "triton_utils"):
    try:
        __import__("hf_densessm.ops." + name)
    except ImportError as error:
        assert "holds Triton kernels and needs the `triton` package" in str(error), error
    else:
        raise SystemExit(name + " imported without triton")
print("ok")
"""


def test_pytorch_path_imports_and_runs_without_triton():
    result = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_ops_compute_in_their_own_precision_under_autocast():
    """``torch.autocast`` does not reach into the ops: their PyTorch paths (which cast to float32 on purpose) give
    under bfloat16 autocast bit for bit what they give without it, values and gradients, as the kernels do. Without
    ``own_precision`` (ops/backend.py) autocast ran the references' matrix products in bfloat16 (errors of about 1e-2)."""
    from hf_densessm.ops import retention_state_update, selective_state_update

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 2, 16, generator=gen, requires_grad=True) for _ in range(3))
    u, delta, z = (torch.randn(2, 8, 40, generator=gen, requires_grad=True) for _ in range(3))
    A, B, C = -torch.rand(8, 4, generator=gen) - 0.5, torch.randn(2, 4, 40, generator=gen), torch.randn(2, 4, 40)
    state0, scan_state0 = torch.randn(2, 2, 16, 16, generator=gen), torch.randn(2, 8, 4, generator=gen)

    def run():
        retention_backend = form = "torch"
        o, final = chunk_retention(q, k, v, initial_state=state0, output_final_state=True, backend=retention_backend)
        y, last = selective_scan(u, delta, A, B, C, z=z, delta_softplus=True, initial_state=scan_state0,
                                 return_last_state=True, backend=form)
        state, scan_state = state0.clone(), scan_state0.clone()
        step_o = retention_state_update(state, q[:, 0].detach(), k[:, 0].detach(), v[:, 0].detach(),
                                        backend=retention_backend)
        step_y = selective_state_update(scan_state, u[..., 0].detach(), delta[..., 0].detach(), A, B[..., 0],
                                        C[..., 0], z=z[..., 0].detach(), dt_softplus=True, backend=form)
        return [o, final, y, last, step_o, state, step_y, scan_state]

    def with_grads(outputs):  # the backward pass outside autocast, as in a training loop
        return outputs + list(torch.autograd.grad(outputs[0].square().sum() + outputs[2].square().sum(),
                                                  (q, k, v, u, delta, z)))

    plain = with_grads(run())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = run()
    for i, (a, b) in enumerate(zip(with_grads(autocast), plain)):
        assert a.dtype == b.dtype and torch.equal(a, b), i
