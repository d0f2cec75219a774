"""The backend switch (``hf_densessm/ops/backend.py``) that every op resolves its ``backend`` argument with, and
the import rule of the kernel files: the package and its PyTorch path import without triton, a kernel file says
that it needs triton."""

import subprocess
import sys

import pytest
import torch

from hf_densessm.ops import backend, causal_conv1d, chunk_retention, selective_scan


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " On "])
def test_interpreter_spellings_are_accepted(monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert backend.interpreting()


@pytest.mark.parametrize("value", ["0", "false", "no", "off", ""])
def test_interpreter_off(monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert not backend.interpreting()


def test_use_triton_resolution(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend.use_triton("auto", cuda) and not backend.use_triton("auto", cpu)
    assert not backend.use_triton("torch", cuda)
    assert backend.use_triton("triton", cuda)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.use_triton("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "true")  # one op used to accept this and the other not
    assert backend.use_triton("triton", cpu)
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert not backend.use_triton("auto", cuda)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        backend.use_triton("triton", cuda)
    for bad in ("cuda", None, "Triton", "cpu"):  # "cpu": the retired C kernels
        with pytest.raises(ValueError, match="backend must be one of"):
            backend.use_triton(bad, cpu)


def test_every_op_shares_the_switch(monkeypatch):
    """The same spelling of the interpreter variable is accepted, or refused, by every op alike."""
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "off")
    u = torch.randn(1, 2, 3)
    q = torch.randn(1, 3, 1, 4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        selective_scan(u, u.abs(), -torch.ones(2, 2), torch.randn(1, 2, 3), torch.randn(1, 2, 3), backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        chunk_retention(q, q, q, backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        causal_conv1d(q[:, :, 0], torch.randn(4, 3), backend="triton")


NO_TRITON = """
import sys
sys.modules["triton"] = None  # as on a machine without triton
import torch
from hf_densessm.ops import (causal_conv1d, chunk_retention, retention_state_update, selective_scan,
                             selective_state_update)
from hf_densessm.ops.backend import triton_available
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
    :func:`backend.own_precision` autocast ran the references' matrix products in bfloat16 (errors of about 1e-2)."""
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
