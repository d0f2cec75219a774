"""Multi-scale retention: parallel, chunked and recurrent references against each other, the PyTorch path's written-out
backward against autograd, the Triton kernels against the references (under ``TRITON_INTERPRET=1`` on the CPU, set
by ``tests/conftest.py``; a float64 quadratic reference with initial and final states and packed documents), and
the three ``torch.library`` ops (``hf_densessm::chunk_retention``, ``hf_densessm::chunk_retention_backward``,
``hf_densessm::retention_state_update``) under ``opcheck`` and ``torch.compile``."""

import logging
import os

import pytest
import torch
import torch.nn.functional as F

from hf_densessm.ops import dispatch
from hf_densessm.ops.retention import _ops as retention_ops
from hf_densessm.ops.retention import chunk_retention, retention_gamma, retention_state_update
from hf_densessm.ops.retention.chunked_torch import (
    chunk_retention_torch,
    chunk_retention_torch_backward,
    retention_state_update_torch,
)
from hf_densessm.ops.retention.naive import chunk_retention_naive, retention_log2_gamma

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# The interpreter runs the kernels in float64; on a GPU they are compared in float32 (exact "ieee" products).
KERNEL_DTYPE = torch.float32 if ON_CUDA else torch.float64
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or not (ON_CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="the Triton kernels need triton and either a GPU or TRITON_INTERPRET=1",
)


def _inputs(batch, length, heads, key_dim, value_dim, dtype=torch.float64, initial_state=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(batch, length, heads, d, generator=gen, dtype=torch.float64) for d in (key_dim, key_dim, value_dim)
    )
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    s0 = torch.randn(batch, heads, key_dim, value_dim, generator=gen, dtype=torch.float64) if initial_state else None
    q, k, v = (x.to(DEVICE, dtype) for x in (q, k, v))
    return q, k, v, (None if s0 is None else s0.to(DEVICE, state_dtype))


def _reset(batch, length, starts):
    """``(batch, length)`` bool, True at the tokens ``starts[b]`` of row ``b``."""
    reset = torch.zeros(batch, length, dtype=torch.bool)
    for row, tokens in enumerate(starts):
        reset[row, list(tokens)] = True
    return reset.to(DEVICE)


def _recurrent(q, k, v, initial_state=None, scale=None, backend="torch"):
    """Token-by-token loop over :func:`retention_state_update`: o (B, L, H, V) and the final state."""
    batch, length, heads, key_dim = q.shape
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    if initial_state is None:
        state = q.new_zeros(batch, heads, key_dim, v.shape[-1], dtype=dtype)
    else:
        state = initial_state.clone()
    outputs = [
        retention_state_update(state, q[:, t], k[:, t], v[:, t], scale=scale, backend=backend) for t in range(length)
    ]
    return torch.stack(outputs, dim=1), state


def _rel_err(a, b):
    if b.numel() == 0:
        return 0.0
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def _assert_matches(got, expected, name="", rel=3e-3):
    """Exact to 1e-10 in float64; elsewhere a largest error below ``rel`` of the largest entry."""
    assert got.dtype == expected.dtype, name
    if got.dtype == torch.float64:
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    else:
        assert _rel_err(got, expected) < rel, f"{name}: relative error {_rel_err(got, expected):.2e}"


# ----------------------------------------------------------------------------------------------- references


def test_gamma_per_head():
    expected = torch.tensor([1 - 2.0**-5, 1 - 2.0**-6, 1 - 2.0**-7, 1 - 2.0**-8], dtype=torch.float64)
    assert torch.equal(retention_gamma(4, dtype=torch.float64), expected)


@pytest.mark.parametrize("length", [1, 7, 64, 131])
@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_chunked_matches_parallel(length, chunk_size):
    q, k, v, _ = _inputs(2, length, 3, 8, 12)
    expected = chunk_retention_naive(q, k, v, scale=0.7)
    o, final_state = chunk_retention_torch(q, k, v, scale=0.7, chunk_size=chunk_size)
    assert final_state is None
    torch.testing.assert_close(o, expected, rtol=1e-10, atol=1e-10)


def test_parallel_matches_eq24_sum():
    """Eq. 24 written out as a double loop on a tiny input: o_t = scale sum_{s<=t} gamma^(t-s) (q_t . k_s) v_s."""
    q, k, v, _ = _inputs(1, 6, 2, 3, 4)
    gamma = retention_gamma(2, dtype=torch.float64).to(q.device)
    expected = torch.zeros_like(v)
    for t in range(6):
        for s in range(t + 1):
            weight = gamma ** (t - s) * (q[0, t] * k[0, s]).sum(-1)  # (H,)
            expected[0, t] += 3**-0.5 * weight[:, None] * v[0, s]
    torch.testing.assert_close(chunk_retention_naive(q, k, v), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [1, 4, 7])
@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("cpu_kernel", ["0", "1"])
def test_crop_state_after_the_first_tokens_is_eq18_unrolled(monkeypatch, n, initial_state, cpu_kernel):
    """DenseRetNet ``crop``'s state after the first ``n`` tokens (the op's final state over them, ``k`` for ``q``;
    on the CPU the C++ entry or the chunked path) against Eq. 18 as a loop, S_t = gamma S_{t-1} + k_t^T v_t."""
    from hf_densessm.modeling.modeling_denseretnet import _state_after

    monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", cpu_kernel)
    _, k, v, s0 = _inputs(2, 7, 3, 4, 5, initial_state=initial_state)
    gamma = retention_gamma(3, dtype=torch.float64).to(k.device)[:, None, None]
    expected = torch.zeros(2, 3, 4, 5, dtype=torch.float64, device=k.device) if s0 is None else s0.clone()
    for t in range(n):
        expected = gamma * expected + k[:, t, :, :, None] * v[:, t, :, None, :]
    with torch.no_grad():
        state = _state_after(k, v, s0, n)
    assert state.dtype == torch.float64 and state.shape == (2, 3, 4, 5)
    torch.testing.assert_close(state, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("length", [1, 5, 70])
@pytest.mark.parametrize("initial_state", [False, True])
def test_chunked_matches_recurrent(length, initial_state):
    q, k, v, s0 = _inputs(2, length, 3, 8, 12, initial_state=initial_state)
    o, final_state = chunk_retention(q, k, v, initial_state=s0, output_final_state=True, backend="torch")
    o_rec, state_rec = _recurrent(q, k, v, s0)
    torch.testing.assert_close(o, o_rec, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final_state, state_rec, rtol=1e-10, atol=1e-10)


def test_chunked_gradients_match_parallel():
    q, k, v, _ = _inputs(2, 100, 2, 8, 12)
    grad_out = torch.randn_like(v)
    grads = []
    for fn in (lambda *x: chunk_retention_naive(*x), lambda *x: chunk_retention(*x, backend="torch")[0]):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        (fn(*leaves) * grad_out).sum().backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_initial_state_gradient_torch():
    q, k, v, s0 = _inputs(1, 20, 2, 4, 5, initial_state=True)
    s0.requires_grad_()
    assert torch.autograd.gradcheck(lambda s: chunk_retention_torch(q, k, v, initial_state=s, chunk_size=8)[0], (s0,))


@pytest.mark.parametrize("length, chunk_size", [(1, 8), (37, 8), (37, 16), (64, 64), (70, 64)])
@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_torch_backward_matches_autograd(length, chunk_size, packed):
    """The PyTorch path's written-out backward (the ``backend="torch"`` branch of ``chunk_retention_backward``)
    against autograd through its forward, with and without a gradient of the final state, across chunk edges and
    document boundaries (at a chunk's last token, at a chunk edge, one-token documents)."""
    q, k, v, s0 = _inputs(2, length, 2, 8, 12, initial_state=True)
    starts = [(0, 7, 8, 15, 16, 17, 36), (3,)]
    reset = _reset(2, length, [[t for t in row if t < length] for row in starts]) if packed else None
    gen = torch.Generator().manual_seed(3)
    d_o = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    d_final = torch.randn(s0.shape, generator=gen, dtype=torch.float64)
    for d_final_state in (d_final, None):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
        o, final_state = chunk_retention_torch(*leaves[:3], 0.6, leaves[3], True, chunk_size=chunk_size, reset=reset)
        loss = (o * d_o).sum() + (0 if d_final_state is None else (final_state * d_final_state).sum())
        loss.backward()
        got = chunk_retention_torch_backward(d_o, d_final_state, q, k, v, 0.6, s0, chunk_size=chunk_size, reset=reset)
        for name, a, b in zip(["dq", "dk", "dv", "d_initial_state"], got, leaves):
            torch.testing.assert_close(a, b.grad, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_copies_each_input_once_and_writes_token_major(dtype):
    """The PyTorch path's forward and backward over 2 full chunks and a remainder: q, k, v (and ``d_o``) copied
    once into the compute layout, never again by a batched product (which copies a strided operand at every use:
    14 copies per call at the 30M shapes before issue 35's fix), and ``o``, ``dq``, ``dk``, ``dv`` returned
    contiguous in the ``(batch, length, heads, dim)`` layout the model reads (elements copied, by a dispatch
    mode; the only other copies are of the 2 heads' decays)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    copied = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten._to_copy, torch.ops.aten.copy_):
                copied.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    q, k, v = (x.to(dtype) for x in _inputs(1, 140, 2, 16, 24)[:3])
    d_o = torch.randn(v.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    with Count():
        o, _ = chunk_retention_torch(q, k, v, 0.5, None, True, chunk_size=64)
    cast = dtype != torch.float32  # the results computed in float32 are cast back once
    assert sum(n for n in copied if n > 2) == q.numel() + k.numel() + v.numel() * (1 + cast), copied
    copied.clear()
    with Count():
        grads = chunk_retention_torch_backward(d_o, None, q, k, v, 0.5, chunk_size=64)
    assert sum(n for n in copied if n > 2) == (q.numel() + k.numel() + v.numel()) * (1 + cast) + d_o.numel(), copied
    for x in (o, *grads[:3]):
        assert x.is_contiguous() and x.dtype == dtype


def test_torch_backward_matches_parallel_with_resets():
    """Through the public op (``backend="torch"``, so the written-out backward): output and gradients equal the
    quadratic form's (Eq. 24 with a same-document mask), which autograd differentiates."""
    q, k, v, _ = _inputs(2, 70, 2, 8, 12)
    reset = _reset(2, 70, [(0, 5, 63, 64, 69), (40,)])
    grad_out = torch.randn_like(v)
    results = []
    for fn in (chunk_retention_naive, lambda *x, **kw: chunk_retention(*x, **kw, backend="torch")[0]):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = fn(*leaves, scale=0.6, reset=reset)
        (o * grad_out).sum().backward()
        results.append([o] + [x.grad for x in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gradient_through_the_final_state_only():
    """A loss of the final state alone: the op's backward gets no gradient of ``o`` (None, made zeros)."""
    q, k, v, s0 = _inputs(1, 20, 2, 4, 5, initial_state=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    chunk_retention(*leaves[:3], initial_state=leaves[3], output_final_state=True, backend="torch")[1].sum().backward()
    expected = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    chunk_retention_torch(*expected[:3], None, expected[3], True, chunk_size=8)[1].sum().backward()
    assert expected[0].grad is None  # q does not reach the final state: the op returns zeros for it
    torch.testing.assert_close(leaves[0].grad, torch.zeros_like(q), rtol=0, atol=0)
    for a, b in zip(leaves[1:], expected[1:]):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)


def test_state_update_is_in_place():
    q, k, v, s0 = _inputs(2, 1, 3, 8, 12, initial_state=True)
    state = s0.clone()
    pointer = state.data_ptr()
    retention_state_update_torch(state, q[:, 0], k[:, 0], v[:, 0])
    assert state.data_ptr() == pointer and not torch.equal(state, s0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_low_precision_dtypes(dtype):
    q, k, v, s0 = _inputs(2, 70, 2, 8, 12, initial_state=True)
    expected, expected_state = chunk_retention(q, k, v, initial_state=s0, output_final_state=True, backend="torch")
    q, k, v = (x.to(dtype) for x in (q, k, v))
    o, state = chunk_retention(q, k, v, initial_state=s0.float(), output_final_state=True, backend="torch")
    assert o.dtype == dtype and state.dtype == torch.float32
    assert _rel_err(o, expected) < (1e-5 if dtype == torch.float32 else 3e-2)
    assert _rel_err(state, expected_state) < (1e-5 if dtype == torch.float32 else 3e-2)


# --------------------------------------------------------------------------------------------------- Triton

SCALE = 0.6
NAMES = ["o", "final_state", "dq", "dk", "dv", "d_initial_state"]

TRITON_CASES = [
    # batch, length, heads, key_dim, value_dim, initial_state
    (1, 1, 1, 8, 8, False),
    (2, 5, 3, 16, 32, True),
    (2, 37, 2, 12, 24, False),  # non-power-of-two key_dim and value_dim
    (1, 64, 4, 16, 16, True),  # exactly one chunk
    (2, 67, 2, 8, 16, True),  # one chunk and a prime remainder
    (1, 131, 3, 16, 8, False),  # prime, three chunks
    (1, 67, 2, 80, 72, True),  # two key tiles and two value tiles, both masked (as key 320 of the 1.3B preset)
]


@needs_triton
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "B{}-L{}-H{}-K{}-V{}".format(*c) + ("-s0" if c[5] else ""))
def test_triton_matches_reference(case):
    batch, length, heads, key_dim, value_dim, initial_state = case
    q, k, v, s0 = _inputs(batch, length, heads, key_dim, value_dim, dtype=KERNEL_DTYPE, initial_state=initial_state)
    leaves = [q, k, v] + ([s0] if initial_state else [])
    grad_out = torch.randn_like(v)
    grad_state = torch.randn(batch, heads, key_dim, value_dim, dtype=KERNEL_DTYPE, device=DEVICE)
    results = {}
    for backend in ("torch", "triton"):
        inputs = [x.clone().requires_grad_() for x in leaves]
        s0_leaf = inputs[3] if initial_state else None
        o, final_state = chunk_retention(
            *inputs[:3], scale=0.6, initial_state=s0_leaf, output_final_state=True, backend=backend
        )
        ((o * grad_out).sum() + (final_state * grad_state).sum()).backward()
        results[backend] = [o, final_state] + [x.grad for x in inputs]
    for name, got, expected in zip(NAMES, results["triton"], results["torch"]):
        _assert_matches(got, expected, name)


@needs_triton
def test_triton_many_small_tiles(monkeypatch):
    """Through the op, chunks of 16 and tiles of 16 on key 40 / value 24: five chunks, three key tiles and two value
    tiles per reduction loop."""
    from hf_densessm.ops.retention import chunk

    monkeypatch.setattr(chunk, "chunk_retention_config", lambda *args: _small_config())
    test_triton_matches_reference((2, 70, 2, 40, 24, True))


def _small_config(block=16):
    """Chunks of 16 tokens and ``block``-wide tiles: several chunks at lengths 40 and 80, and key 20 / value 24 split
    in two masked tiles each, so every loop over the reduction axis runs more than once."""
    from hf_densessm.ops.retention.chunk import ChunkRetentionConfig, StateTiles

    tiles = StateTiles(block, block, 4)
    return ChunkRetentionConfig(16, tiles, tiles, tiles, tiles, tiles)


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


def _check_kernels(case_inputs, reset=None, with_d_final=True, config=None):
    """The Triton forward and backward (called directly, with ``config``, by default :func:`_small_config`)
    against :func:`_expected`: dtypes, shapes, values."""
    from hf_densessm.ops.retention.chunk import chunk_retention_bwd_triton, chunk_retention_fwd_triton

    q, k, v, s0 = case_inputs
    config = _small_config() if config is None else config
    gen = torch.Generator().manual_seed(7)
    d_o = torch.randn(v.shape, generator=gen, dtype=torch.float64).to(DEVICE, v.dtype)
    state_dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    d_final = torch.randn(q.shape[0], q.shape[2], q.shape[3], v.shape[3], generator=gen, dtype=torch.float64)
    d_final = d_final.to(DEVICE, state_dtype) if with_d_final else None
    o, final_state = chunk_retention_fwd_triton(q, k, v, SCALE, s0, reset, config=config)
    got = [o, final_state, *chunk_retention_bwd_triton(d_o, d_final, q, k, v, SCALE, s0, reset, config=config)]
    expected = _expected(q, k, v, s0, reset, d_o, d_final)
    for name, a, b, dtype in zip(NAMES, got, expected, [v.dtype, state_dtype, q.dtype, k.dtype, v.dtype, state_dtype]):
        assert a.dtype == dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.shape)
        _assert_matches(a, b.to(dtype), f"{name} {config}")


def test_reference_matches_the_chunked_torch_path():
    """The plain reference above, with an initial state and resets, against ``chunked_torch.py``."""
    q, k, v, s0 = _inputs(2, 37, 2, 6, 5, initial_state=True)
    reset = _reset(2, 37, [(0, 9, 10), (20,)])
    for r in (None, reset):
        o, final_state = _reference(q, k, v, SCALE, s0, r)
        o_ref, final_ref = chunk_retention_torch(q, k, v, SCALE, s0, True, chunk_size=8, reset=r)
        torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final_state, final_ref, rtol=1e-10, atol=1e-10)


@needs_triton
@pytest.mark.parametrize("initial_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("length", [0, 7, 40, 80])  # empty; under one chunk; 2.5 chunks; 5 whole chunks
def test_triton_kernels_match_reference(length, initial_state):
    _check_kernels(_inputs(2, length, 2, 20, 24, dtype=KERNEL_DTYPE, initial_state=initial_state))


@needs_triton
def test_triton_kernels_without_final_state_gradient():
    _check_kernels(_inputs(1, 40, 2, 20, 24, dtype=KERNEL_DTYPE, initial_state=True), with_d_final=False)


@needs_triton
@pytest.mark.parametrize("length", [40, 80])
def test_triton_kernels_packed_documents(length):
    """Documents starting at t = 0 (the initial state is dropped: its gradient is 0 in that row), inside a chunk,
    at a chunk's last token and at the next chunk's first (one-token documents 15 and 16), at 32 (a chunk edge),
    and at the last token; the second row keeps its initial state for 20 tokens."""
    starts = [(0, 5, 15, 16, 17, 32, 47, 48, 79), (20, 64)]
    reset = _reset(2, length, [[t for t in row if t < length] for row in starts])
    _check_kernels(_inputs(2, length, 2, 20, 24, dtype=KERNEL_DTYPE, initial_state=True), reset=reset)


@needs_triton
def test_triton_every_config_choice():
    """32-wide tiles (one masked key tile of 20, one masked value tile of 24), then every configuration
    ``chunk_retention_config`` chooses over the architectures and dtypes, run in float64 (chunks of 64: two chunks
    at length 80), with packed documents."""
    from hf_densessm.ops.backend import ARCHS
    from hf_densessm.ops.retention.chunk import chunk_retention_config

    inputs = _inputs(1, 80, 2, 20, 24, dtype=KERNEL_DTYPE, initial_state=True)
    reset = _reset(1, 80, [(3, 64)])
    configs = {chunk_retention_config(arch, dtype, 20, 24) for arch in ARCHS.values()
               for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    assert len(configs) >= 2  # half precision and float32 differ
    for config in [_small_config(32)] + sorted(configs, key=repr):
        _check_kernels(inputs, reset=reset, config=config)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_low_precision(dtype):
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("the Triton interpreter computes bfloat16 tl.dot and arithmetic wrongly (numpy has no bfloat16)")
    q, k, v, s0 = _inputs(2, 70, 2, 16, 32, initial_state=True)
    reset = _reset(2, 70, [(0, 17), (64,)])
    grad_out = torch.randn_like(v)
    leaves64 = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    o64, state64 = chunk_retention(*leaves64[:3], initial_state=leaves64[3], output_final_state=True, backend="torch",
                                   reset=reset)
    (o64 * grad_out).sum().backward()
    leaves = [x.to(dtype).detach().requires_grad_() for x in (q, k, v)] + [s0.float().requires_grad_()]
    o, state = chunk_retention(*leaves[:3], initial_state=leaves[3], output_final_state=True, backend="triton",
                               reset=reset)
    (o * grad_out.to(dtype)).sum().backward()
    assert o.dtype == dtype and state.dtype == torch.float32
    tolerance = 3e-3 if dtype == torch.float32 else 2e-2
    got_all, expected_all = [o, state] + [x.grad for x in leaves], [o64, state64] + [x.grad for x in leaves64]
    for name, got, expected in zip(NAMES, got_all, expected_all):
        assert _rel_err(got, expected) < tolerance, name


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_triton_stores_chunk_states_in_the_input_dtype(monkeypatch, dtype):
    """The per-chunk states ``h`` and their gradients ``dh`` are stored in the inputs' dtype (half the state traffic
    of float32 ones in half precision), and the output kernels read those buffers."""
    from hf_densessm.ops.retention import chunk

    launches, launch = {}, chunk._launch

    def record(kernel, grid, block_t, tiles, key_dim, value_dim, *args, **meta):
        launches[kernel.__name__] = args
        return launch(kernel, grid, block_t, tiles, key_dim, value_dim, *args, **meta)

    monkeypatch.setattr(chunk, "_launch", record)
    q, k, v, s0 = _inputs(1, 40, 2, 16, 32, dtype=dtype, initial_state=True)
    o, final_state = chunk.chunk_retention_fwd_triton(q, k, v, SCALE, s0, config=_small_config())
    chunk.chunk_retention_bwd_triton(torch.ones_like(o), final_state, q, k, v, SCALE, s0, config=_small_config())
    h, dh = launches["_retention_chunk_h_kernel"][2], launches["_retention_chunk_dh_kernel"][2]
    assert h.dtype == dh.dtype == dtype and h.shape == dh.shape == (1, 2, 3, 16, 32)
    assert launches["_retention_chunk_o_kernel"][3].dtype == dtype
    assert launches["_retention_chunk_dqk_kernel"][4] is h and launches["_retention_chunk_dqk_kernel"][5] is dh
    assert launches["_retention_chunk_dv_kernel"][3] is dh
    assert final_state.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def _init_scale_inputs(length, heads, key_dim, value_dim):
    """float64 ``q``, ``k``, ``v`` as DenseRetNet's retention receives them at the published init: SiLU of
    projections of RMS-normed hidden states by normal(0, 0.02) weights (width 1536: std 0.02 sqrt(1536) = 0.78), ``k``
    times ``key_dim ** -0.5``; the model calls the op with ``scale=1``. All positive on average, so the states grow to
    about ``1 / (1 - gamma)`` tokens' worth: the case where rounding the stored states matters most."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (F.silu(0.78 * torch.randn(1, length, heads, d, generator=gen, dtype=torch.float64))
               for d in (key_dim, key_dim, value_dim))
    return q, k * key_dim**-0.5, v


#: Largest error, relative to the largest entry, of the Triton kernels' o, final state and gradients against float64
#: on the same (rounded) inputs, at the init scale and 2048 tokens (docs/kernels.md, "States in the input dtype").
HALF_BOUNDS = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision_at_init_scale_and_2048_tokens(dtype):
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("the Triton interpreter computes bfloat16 tl.dot and arithmetic wrongly (numpy has no bfloat16)")
    from hf_densessm.ops.retention.chunk import chunk_retention_bwd_triton, chunk_retention_fwd_triton

    q, k, v = (x.to(dtype).to(DEVICE) for x in _init_scale_inputs(2048, 2, 16, 32))
    gen = torch.Generator().manual_seed(1)
    d_o = torch.randn(v.shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    d_final = torch.randn(1, 2, 16, 32, generator=gen, dtype=torch.float64).to(DEVICE)
    o, final_state = chunk_retention_fwd_triton(q, k, v, 1.0)
    got = [o, final_state, *chunk_retention_bwd_triton(d_o, d_final.float(), q, k, v, 1.0)]
    args = [x.double() for x in (q, k, v)]
    expected = [*chunk_retention_torch(*args, 1.0, None, True),
                *chunk_retention_torch_backward(d_o.double(), d_final, *args, 1.0, None)]
    for name, a, b in zip(NAMES, got, expected):
        assert _rel_err(a, b) < HALF_BOUNDS[dtype], f"{name}: relative error {_rel_err(a, b):.2e}"


@needs_triton
def test_triton_without_final_state_and_partial_grads():
    q, k, v, s0 = _inputs(1, 20, 2, 8, 8, dtype=KERNEL_DTYPE, initial_state=True)
    v.requires_grad_()
    o, final_state = chunk_retention(q, k, v, initial_state=s0, backend="triton")
    assert final_state is None
    o.sum().backward()
    v_ref = v.detach().clone().requires_grad_()
    chunk_retention(q, k, v_ref, initial_state=s0, backend="torch")[0].sum().backward()
    _assert_matches(v.grad, v_ref.grad)


# --------------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("key_dim, value_dim", [(8, 12), (80, 72)])
def test_state_update_matches_chunked(backend, key_dim, value_dim):
    dtype = KERNEL_DTYPE if backend == "triton" else torch.float64
    q, k, v, s0 = _inputs(2, 9, 3, key_dim, value_dim, dtype=dtype, initial_state=True)
    o, final_state = chunk_retention(q, k, v, initial_state=s0, output_final_state=True, backend="torch")
    o_rec, state_rec = _recurrent(q, k, v, s0, backend=backend)
    _assert_matches(o_rec, o, "o")
    _assert_matches(state_rec, final_state, "state")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_update_triton_low_precision(dtype):
    q, k, v, s0 = _inputs(2, 1, 3, 12, 20, dtype=dtype, initial_state=True)
    state_ref, state = s0.clone(), s0.clone().transpose(-1, -2).contiguous().transpose(-1, -2)  # non-contiguous
    expected = retention_state_update(state_ref, q[:, 0], k[:, 0], v[:, 0], backend="torch")
    o = retention_state_update(state, q[:, 0], k[:, 0], v[:, 0], backend="triton")
    assert o.dtype == dtype
    assert _rel_err(o, expected) < 3e-3 and _rel_err(state, state_ref) < 1e-6


def test_prefill_then_decode_continues_the_sequence():
    q, k, v, _ = _inputs(1, 30, 2, 8, 12)
    o_full, _ = chunk_retention(q, k, v, backend="torch")
    _, state = chunk_retention(q[:, :25], k[:, :25], v[:, :25], output_final_state=True, backend="torch")
    o_next, _ = _recurrent(q[:, 25:], k[:, 25:], v[:, 25:], state)
    torch.testing.assert_close(o_next, o_full[:, 25:], rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------------- bad inputs

_Q, _K, _V, _S = _inputs(2, 5, 3, 8, 12, dtype=torch.float32, initial_state=True)

_Q1, _K1, _V1 = _Q[:, 0], _K[:, 0], _V[:, 0]
BAD_CALLS = [
    ("rank", lambda: chunk_retention(_Q[0], _K, _V), ValueError, r"q must have shape \(batch, length, heads, key_dim\)"),
    ("batch", lambda: chunk_retention(_Q, _K, _V[:1]), ValueError, "v must match q"),
    ("length", lambda: chunk_retention(_Q, _K[:, :4], _V), ValueError, "q and k must have the same shape"),
    ("heads", lambda: chunk_retention(_Q, _K, _V[:, :, :2]), ValueError, "v must match q"),
    ("key_dim", lambda: chunk_retention(_Q, _K[..., :4], _V), ValueError, "q and k must have the same shape"),
    ("int dtype", lambda: chunk_retention(_Q.int(), _K.int(), _V.int()), TypeError, "q must be float16, bfloat16"),
    ("mixed dtype", lambda: chunk_retention(_Q, _K.half(), _V), TypeError, "one dtype"),
    ("not a tensor", lambda: chunk_retention(_Q.tolist(), _K, _V), TypeError, "q must be a torch.Tensor"),
    ("mixed device", lambda: chunk_retention(_Q, _K, _V.to("meta")), ValueError, "one device"),
    ("state shape", lambda: chunk_retention(_Q, _K, _V, initial_state=_S[:, :2]), ValueError, "initial_state must have"),
    ("state dtype", lambda: chunk_retention(_Q, _K, _V, initial_state=_S.half()), TypeError, "initial_state must be"),
    ("scale zero", lambda: chunk_retention(_Q, _K, _V, scale=0.0), ValueError, "scale must be a positive"),
    ("scale nan", lambda: chunk_retention(_Q, _K, _V, scale=float("nan")), ValueError, "scale must be a positive"),
    ("backend", lambda: chunk_retention(_Q, _K, _V, backend="cuda"), ValueError, "backend must be one of"),
    ("backend cpu", lambda: chunk_retention(_Q, _K, _V, backend="cpu"), ValueError, "backend must be one of"),
    ("step rank", lambda: retention_state_update(_S, _Q, _K, _V), ValueError, r"q must have shape \(batch, heads, key_dim\)"),
    ("step state", lambda: retention_state_update(_S[..., :4], _Q1, _K1, _V1), ValueError, "state must have shape"),
    ("step state dtype", lambda: retention_state_update(_S.double(), _Q1, _K1, _V1), TypeError, "state must be float32"),
    ("step scale", lambda: retention_state_update(_S, _Q1, _K1, _V1, scale=-1), ValueError, "scale must be a positive"),
    ("step backend", lambda: retention_state_update(_S, _Q1, _K1, _V1, backend="numpy"), ValueError, "backend must be one"),
]


@pytest.mark.parametrize("name, call, error, match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_inputs_raise_at_entry(name, call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(ON_CUDA, reason="CPU tensors only")
def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        chunk_retention(_Q, _K, _V, backend="triton")


def test_missing_triton(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        chunk_retention(_Q, _K, _V, backend="triton")
    o, _ = chunk_retention(_Q, _K, _V, backend="auto")  # falls back to the PyTorch reference
    torch.testing.assert_close(o, chunk_retention(_Q, _K, _V, backend="torch")[0])


def test_state_update_decay_is_the_definition():
    """The step computes ``gamma_h = 1 - 2**(-5 - h)`` itself (no cached tensor): from a zero state, one step with
    ``k = v = 1`` then one with ``k = v = 0`` leaves ``gamma_h`` in every entry of head ``h``."""
    state = torch.zeros(1, 7, 2, 3, dtype=torch.float64)
    ones, zeros = torch.ones(1, 7, 2, dtype=torch.float64), torch.zeros(1, 7, 3, dtype=torch.float64)
    retention_state_update(state, ones, ones, torch.ones(1, 7, 3, dtype=torch.float64), backend="torch")
    retention_state_update(state, ones, ones * 0, zeros, backend="torch")
    expected = retention_gamma(7, dtype=torch.float64)[None, :, None, None].expand_as(state)
    torch.testing.assert_close(state, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- the torch.library ops


@pytest.fixture
def traceable_interpreter(monkeypatch):
    """Make the interpreter's kernels traceable by ``torch.compile`` / ``opcheck``, as real ones are on a GPU.

    ``torch.library.wrap_triton`` hands an interpreted kernel (``TRITON_INTERPRET=1`` turns ``@triton.jit`` into
    an ``InterpretedFunction``) back unwrapped, so FakeTensors would reach the interpreter. Here it wraps it like a
    ``JITFunction`` (the one torch's Triton higher-order op takes) whose ``run`` is the interpreter's: tracing then
    records the kernel in the graph exactly as on CUDA, and running the graph interprets it. Only the kernels'
    read/write analysis (it compiles the kernel for the current GPU) cannot run; torch then treats every tensor
    argument as written, and says so in a warning, silenced here.
    """
    if not HAS_TRITON or ON_CUDA:
        return
    from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper
    from torch._library.triton import is_wrap_triton_enabled
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    original, jitted = torch.library.wrap_triton, {}

    def wrap_triton(kernel):
        if not isinstance(kernel, InterpretedFunction) or not is_wrap_triton_enabled():
            return original(kernel)
        if kernel not in jitted:
            jitted[kernel] = JITFunction(kernel.fn)
            jitted[kernel].run = kernel.run
            # its source hash would visit the helpers it calls, interpreted functions that a JITFunction rejects
            jitted[kernel].hash = f"interpreted:{kernel.fn.__module__}.{kernel.fn.__qualname__}"
        return TraceableTritonKernelWrapper(jitted[kernel], None, None)

    monkeypatch.setattr(torch.library, "wrap_triton", wrap_triton)
    logger = logging.getLogger("torch._higher_order_ops.triton_kernel_wrap")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def _op_args(backend, length=20, initial_state=True, packed=True, dtype=None):
    dtype = dtype or (KERNEL_DTYPE if backend == "triton" else torch.float32)
    q, k, v, s0 = _inputs(2, length, 2, 8, 16, dtype=dtype, initial_state=initial_state)
    reset = _reset(2, length, [(0, 7), (12,)]) if packed else None
    return q, k, v, s0, reset


OPCHECK_CASES = [
    # backend, initial state, packed documents
    ("torch", True, True),
    ("torch", False, False),
    pytest.param("triton", True, True, marks=needs_triton),
    pytest.param("triton", False, False, marks=needs_triton),
]


@pytest.mark.parametrize("backend, initial_state, packed", OPCHECK_CASES)
def test_opcheck_chunk_retention(traceable_interpreter, backend, initial_state, packed):
    """``torch.library.opcheck`` (schema, fake tensors, autograd registration, AOT dispatch with dynamic shapes)
    on the forward and the backward op."""
    q, k, v, s0, reset = _op_args(backend, initial_state=initial_state, packed=packed)
    leaves = [x.requires_grad_() for x in (q, k, v)] + [None if s0 is None else s0.requires_grad_()]
    torch.library.opcheck(retention_ops.chunk_retention, (*leaves[:3], 0.6, leaves[3], reset, backend))
    d_o, d_final = torch.randn_like(v), torch.randn(2, 2, 8, 16, dtype=s0.dtype if initial_state else v.dtype)
    for d_final_state in (d_final, None):
        args = (d_o, d_final_state, *(x.detach() for x in (q, k, v)), 0.6, None if s0 is None else s0.detach(),
                reset, backend)
        torch.library.opcheck(retention_ops.chunk_retention_backward, args)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_opcheck_retention_state_update(traceable_interpreter, backend):
    dtype = KERNEL_DTYPE if backend == "triton" else torch.float32
    q, k, v, s0 = _inputs(2, 1, 3, 8, 12, dtype=dtype, initial_state=True)
    torch.library.opcheck(retention_ops.retention_state_update, (s0, q[:, 0], k[:, 0], v[:, 0], 0.6, backend))


def _training_fn(backend, initial_state, output_final_state=True):
    def fn(q, k, v, s0, reset):
        o, final_state = chunk_retention(q, k, v, scale=0.6, initial_state=s0 if initial_state else None,
                                         output_final_state=output_final_state, backend=backend, reset=reset)
        loss = (o * o.detach().cos()).sum()
        if output_final_state:
            loss = loss + final_state.square().sum()
        return loss, o

    return fn


def _run_with_grads(fn, args):
    leaves = [x.detach().clone().requires_grad_() for x in args[:4]]
    loss, o = fn(*leaves, args[4])
    loss.backward()
    return [loss, o] + [x.grad for x in leaves]


@pytest.mark.parametrize("initial_state, output_final_state", [(True, True), (False, False)])
def test_compile_fullgraph_inductor_training(initial_state, output_final_state):
    """``torch.compile(fullgraph=True)`` (Inductor, CPU, float32) of a function that calls the public op (packed
    documents, lengths across chunk edges) and backpropagates: the loss, ``o`` and every gradient as in eager."""
    torch._dynamo.reset()
    q, k, v, s0, reset = _op_args("torch", length=70)
    fn = _training_fn("torch", initial_state, output_final_state)
    expected = _run_with_grads(fn, (q, k, v, s0, reset))
    got = _run_with_grads(torch.compile(fn, fullgraph=True), (q, k, v, s0, reset))
    names = ["loss", "o", "dq", "dk", "dv", "d_initial_state"]
    for name, a, b in zip(names, got, expected):
        if b is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_compile_dynamic_length_serves_every_length_without_recompiling():
    """One graph traced over a dynamic length (17 tokens, ``dynamic=True``) serves 64, 65 and 128 tokens (chunk
    multiples, and past them) in training as eager does, without recompiling (issue 33, item 8: the fakes' chunk
    split put ``length % 64`` in a divisor of the graph's guards). ``aot_eager``: the guards come from tracing."""
    torch._dynamo.reset()
    fn = _training_fn("torch", True)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    try:
        for length in (17, 64, 65, 128):
            args = _op_args("torch", length=length)
            for a, b in zip(_run_with_grads(compiled, args), _run_with_grads(fn, args)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            torch.compiler.set_stance("fail_on_recompile")
    finally:
        torch.compiler.set_stance("default")


def test_compile_fullgraph_inductor_decoding_steps():
    """Several decoding steps through one compiled function (Inductor, CPU): the outputs and states of eager, and
    no recompilation after the first step."""
    torch._dynamo.reset()
    q, k, v, s0 = _inputs(2, 5, 3, 8, 12, dtype=torch.float32, initial_state=True)

    def step(state, q, k, v):
        return retention_state_update(state, q, k, v, scale=0.6, backend="torch") * 2

    compiled = torch.compile(step, fullgraph=True)
    state_eager, state_compiled = s0.clone(), s0.clone()
    for t in range(5):
        expected = step(state_eager, q[:, t], k[:, t], v[:, t])
        if t == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            got = compiled(state_compiled, q[:, t], k[:, t], v[:, t])
        finally:
            torch.compiler.set_stance("default")
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state_compiled, state_eager, rtol=1e-5, atol=1e-5)


@needs_triton
def test_compile_aot_eager_traces_the_triton_branch(traceable_interpreter):
    """``torch.compile(fullgraph=True, backend="aot_eager")`` with ``backend="triton"``: the forward and backward
    graphs hold the Triton kernels (``wrap_triton``'s higher-order op), and running them gives eager's results;
    then three decoding steps through the Triton step kernel, in place, without recompiling."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    q, k, v, s0, reset = _op_args("triton", length=37)
    fn = _training_fn("triton", True)
    expected = _run_with_grads(fn, (q, k, v, s0, reset))
    recorder = AotEagerAndRecordGraphs()
    got = _run_with_grads(torch.compile(fn, fullgraph=True, backend=recorder), (q, k, v, s0, reset))
    for a, b in zip(got, expected):
        _assert_matches(a, b)
    forward, backward = recorder.fw_graphs[0].code, recorder.bw_graphs[0].code
    assert forward.count("higher_order.triton_kernel_wrapper") == 2, forward  # the states, then the outputs
    assert backward.count("higher_order.triton_kernel_wrapper") == 4, backward  # states, their gradients, dq/dk, dv

    torch._dynamo.reset()
    recorder = AotEagerAndRecordGraphs()
    q, k, v, s0 = _inputs(2, 3, 3, 8, 12, dtype=KERNEL_DTYPE, initial_state=True)

    def step(state, q, k, v):
        return retention_state_update(state, q, k, v, scale=0.6, backend="triton")

    compiled = torch.compile(step, fullgraph=True, backend=recorder)
    state_eager, state_compiled = s0.clone(), s0.clone()
    for t in range(3):
        expected = step(state_eager, q[:, t], k[:, t], v[:, t])
        if t == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            got = compiled(state_compiled, q[:, t], k[:, t], v[:, t])
        finally:
            torch.compiler.set_stance("default")
        _assert_matches(got, expected)
        _assert_matches(state_compiled, state_eager)
    assert "higher_order.triton_kernel_wrapper" in recorder.fw_graphs[0].code
