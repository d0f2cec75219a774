"""No output of an op depends on a later position, whatever that position holds (issue 33, item 6;
docs/kernels.md, "Non-finite values"): a NaN or an inf at token 5 leaves every output before it bit-identical, on
every backend (the PyTorch path, the C++ kernel of the scan on the CPU, the Triton kernels under
``TRITON_INTERPRET=1``) and in float32 and bfloat16; and the value still reaches the outputs from token 5 on (and the
final state) as the recurrence carries it, so a non-finite input is never hidden.

Under the Triton interpreter a bfloat16 ``tl.dot`` drops NaN and inf (numpy has no bfloat16: a product with one NaN
operand comes out finite), so there the bfloat16 cases check the earlier outputs only; on a GPU they check both.
"""

import os

import pytest
import torch

from hf_densessm.ops.causal_conv1d import causal_conv1d
from hf_densessm.ops.cpu_kernel import load_kernel
from hf_densessm.ops.dispatch import triton_available
from hf_densessm.ops.retention import STEP_TOKENS, chunk_retention
from hf_densessm.ops.selective_scan import selective_scan

HAS_TRITON = triton_available()

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or not (ON_CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="the Triton kernels need triton and either a GPU or TRITON_INTERPRET=1",
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
DTYPES = [torch.float32, torch.bfloat16]
VALUES = [float("nan"), float("inf")]
LENGTH, AT = 20, 5  # one chunk of every path: the later token sits in the earlier tokens' chunk


def _spoiled(tensors, name, value, dim):
    """A copy of ``tensors`` (a dict) where ``tensors[name]`` holds ``value`` at position ``AT`` of ``dim``."""
    out = {k: v.clone() for k, v in tensors.items()}
    out[name].select(dim, AT).fill_(value)
    return out


def _interpreted_half(backend, dtype):
    return backend == "triton" and not ON_CUDA and dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("length", [LENGTH, pytest.param(STEP_TOKENS, id="few_tokens")])  # few: the C++ entry on CPU
def test_retention_later_token_never_reaches_earlier_ones(backend, dtype, value, name, length):
    g = torch.Generator().manual_seed(0)
    clean = {x: torch.randn(2, length, 2, 16, generator=g).to(DEVICE, dtype) for x in "qkv"}
    state = None if length == LENGTH else torch.zeros(2, 2, 16, 16, device=DEVICE)  # few tokens: the C++ entry

    def run(t):
        return chunk_retention(t["q"], t["k"], t["v"], initial_state=state, output_final_state=True, backend=backend)

    o_clean, _ = run(clean)
    o, final_state = run(_spoiled(clean, name, value, 1))
    assert torch.equal(o[:, :AT], o_clean[:, :AT])
    if _interpreted_half(backend, dtype):
        return
    later = o[:, AT:] if name != "q" else o[:, AT : AT + 1]  # q_t reads the state at t only
    assert (~later.isfinite()).any(-1).all(), "a non-finite input must reach the later outputs"
    assert (~final_state.isfinite()).any() == (name != "q")


SCAN_FORMS = [
    pytest.param("torch", "0", id="torch"),
    pytest.param("torch", "1", id="cpu_kernel", marks=pytest.mark.skipif(
        ON_CUDA or not load_kernel(), reason="the C++ kernel runs on CPU tensors, once built")),
    pytest.param("triton", "1", id="triton", marks=needs_triton),
]


@pytest.mark.parametrize("backend, cpu_kernel", SCAN_FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("name", ["u", "delta", "B", "C", "z"])
def test_selective_scan_later_token_never_reaches_earlier_ones(monkeypatch, backend, cpu_kernel, dtype, value, name):
    monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", cpu_kernel)
    g = torch.Generator().manual_seed(1)
    batch, dim, n = 2, 6, 4
    clean = dict(u=torch.randn(batch, dim, LENGTH, generator=g), delta=torch.randn(batch, dim, LENGTH, generator=g),
                 B=torch.randn(batch, n, LENGTH, generator=g), C=torch.randn(batch, n, LENGTH, generator=g),
                 z=torch.randn(batch, dim, LENGTH, generator=g))
    clean = {k: v.to(DEVICE, dtype) for k, v in clean.items()}
    A = (-torch.rand(dim, n, generator=g) - 0.1).to(DEVICE)

    def run(t):
        return selective_scan(t["u"], t["delta"], A, t["B"], t["C"], D=torch.ones(dim, device=DEVICE), z=t["z"],
                              delta_softplus=True, return_last_state=True, backend=backend)

    y_clean, _ = run(clean)
    y, last_state = run(_spoiled(clean, name, value, 2))
    assert torch.equal(y[..., :AT], y_clean[..., :AT])
    if _interpreted_half(backend, dtype):
        return
    assert (~y[..., AT].isfinite()).any()
    if name in ("u", "delta", "B"):  # what enters the state
        assert (~y[..., AT:].isfinite()).any(1).all() and (~last_state.isfinite()).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", VALUES)
def test_causal_conv1d_later_token_never_reaches_earlier_ones(dtype, value):
    g = torch.Generator().manual_seed(2)
    clean = {"x": torch.randn(2, LENGTH, 6, generator=g).to(dtype)}
    weight, bias = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    out_clean = causal_conv1d(clean["x"], weight, bias, activation="silu")
    out = causal_conv1d(_spoiled(clean, "x", value, 1)["x"], weight, bias, activation="silu")
    assert torch.equal(out[:, :AT], out_clean[:, :AT])
    assert (~out[:, AT : AT + 4].isfinite()).all()  # the kernel's 4 taps read token 5
    assert torch.equal(out[:, AT + 4 :], out_clean[:, AT + 4 :])
