"""Packed sequences (issue 11) in the Triton kernels: the selective scan and the chunkwise retention with a per-token
``reset`` equal the references, outputs, final states and every gradient (initial state included), under
``TRITON_INTERPRET=1`` on the CPU (``tests/conftest.py``), in float64 (both kernels run float64 there; 1e-10).

Document boundaries: one-token documents, documents shorter than a chunk, a reset at the first and at the last token
of a chunk (so exactly at chunk edges) and at the last token of the row, documents spanning chunks, several documents
per row, two rows with different boundaries, every token its own document, and a reset at token 0 only (the initial
state dropped); with and without an initial state. ``reset=None`` and an all-False ``reset`` give the plain op.
Shapes are tiny (the interpreter is slow): the scan runs on chunks of 4 tokens, retention on chunks of 16.
"""

import os

import pytest
import torch

from hf_densessm.ops import chunk_retention, selective_scan
from hf_densessm.ops.retention.chunked_torch import chunk_retention_torch
from hf_densessm.ops.retention.naive import chunk_retention_naive
from hf_densessm.ops.selective_scan.naive import selective_scan_naive

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

pytestmark = pytest.mark.skipif(
    not HAS_TRITON or torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton kernels in float64 under TRITON_INTERPRET=1 (CPU)",
)

F64 = dict(atol=1e-10, rtol=1e-10)


def reset_of(length, *rows):
    """``(len(rows), length)`` bool with True at the listed positions of each row."""
    reset = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, positions in enumerate(rows):
        reset[i, list(positions)] = True
    return reset


def assert_all_close(got, expected, names, tol):
    assert len(got) == len(expected) == len(names)
    for name, a, b in zip(names, got, expected):
        if b is None:
            assert a is None, name
            continue
        assert a is not None, name
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------ selective scan

SCAN_CHUNK = 4
SCAN_LENGTH = 17  # chunks [0, 4), [4, 8), [8, 12), [12, 16), [16, 17)
SCAN_RESETS = {
    # row 0: boundaries at the last token of chunk 0 (3), exactly at the edge of chunk 1 (4), one-token documents
    # (4 and 15), a document from 8 to 13 (two chunks); row 1: one-token document at 0, boundaries at the last
    # token of chunks 1 and 2 (7, 11) and at the row's last token, alone in the last chunk (16)
    "mixed": ((3, 4, 5, 8, 14, 15), (0, 1, 7, 11, 16)),
    "first-token-only": ((0,), ()),  # row 0 drops the initial state, row 1 is one document
    "every-token": (range(SCAN_LENGTH), range(SCAN_LENGTH)),
}


def scan_inputs(length, full, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    batch, dim, n = 2, 4, 4

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    A = -(torch.rand(dim, n, generator=g, dtype=torch.float64) * 2 + 0.1)
    kw = dict(u=r(batch, dim, length), delta=r(batch, dim, length, scale=0.5), A=A.to(dtype),
              B=r(batch, n, length), C=r(batch, n, length))
    if full:
        kw.update(D=r(dim), z=r(batch, dim, length), delta_bias=r(dim, scale=0.5), delta_softplus=True,
                  initial_state=r(batch, dim, n))
    else:
        kw["delta"] = kw["delta"].abs()  # no softplus: keep dt >= 0
    return kw


def scan_run(fn, kw, seed=1):
    """``fn(**kw) -> (y, last_state)``; backprop random cotangents of both; outputs then every gradient."""
    leaves = {k: (v.detach().clone().requires_grad_(True) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    y, last = fn(**leaves)
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    gl = torch.randn(last.shape, generator=g, dtype=torch.float64).to(last.dtype)
    ((y * gy).sum() + (last * gl).sum()).backward()
    names = ["y", "last_state"] + [f"d{k}" for k, v in leaves.items() if isinstance(v, torch.Tensor)]
    values = [y.detach(), last.detach()] + [v.grad for v in leaves.values() if isinstance(v, torch.Tensor)]
    return names, values


def scan_triton(config=None, reset=None):
    from test_selective_scan import explicit  # the Triton forward/backward with an explicit launch configuration

    def fn(**kw):
        return explicit("triton", config=config)(**kw, return_last_state=True, reset=reset)

    return fn


def scan_naive(reset=None):
    return lambda **kw: selective_scan_naive(**kw, reset=reset)


def small_scan_config():
    from hf_densessm.ops.selective_scan.chunk import SelectiveScanConfig

    return SelectiveScanConfig(chunk=SCAN_CHUNK, fwd_block_d=2, fwd_d_steps=1, fwd_warps=1, bwd_block_d=2,
                               bwd_d_steps=1, bwd_warps=1, carry_block=4)


@pytest.mark.parametrize("full", [True, False], ids=["initial-state-gate-softplus", "plain"])
@pytest.mark.parametrize("pattern", list(SCAN_RESETS))
def test_triton_scan_with_reset_equals_reference(pattern, full):
    """Chunks of 4 tokens, 2 channels per program (two programs per row): every boundary case above."""
    kw = scan_inputs(SCAN_LENGTH, full)
    reset = reset_of(SCAN_LENGTH, *SCAN_RESETS[pattern])
    names, got = scan_run(scan_triton(small_scan_config(), reset), kw)
    _, expected = scan_run(scan_naive(reset), kw)
    assert_all_close(got, expected, names, F64)
    if pattern == "mixed" or full:
        # the reset changes the function (guards against a reset that is silently ignored)
        _, plain = scan_run(scan_naive(None), kw)
        assert not torch.allclose(got[0], plain[0])


def test_triton_scan_with_reset_default_config_through_public_op():
    """The public op, its default chunk (64): boundaries at 63, 64 (a chunk edge), the last token, one-token
    documents."""
    length = 70
    kw = scan_inputs(length, full=True, seed=3)
    reset = reset_of(length, (15, 16, 17, 63, 64, 69), (0, 9, 62))

    def public(**k):
        return selective_scan(**k, return_last_state=True, backend="triton", reset=reset)

    names, got = scan_run(public, kw)
    _, expected = scan_run(scan_naive(reset), kw)
    assert_all_close(got, expected, names, F64)


def test_triton_scan_without_reset_unchanged():
    """``reset=None`` is the plain op (against the reference), and an all-False ``reset`` gives the same numbers."""
    kw = scan_inputs(SCAN_LENGTH, full=True, seed=4)
    names, none = scan_run(scan_triton(small_scan_config(), None), kw)
    _, expected = scan_run(scan_naive(None), kw)
    assert_all_close(none, expected, names, F64)
    _, all_false = scan_run(scan_triton(small_scan_config(), torch.zeros(2, SCAN_LENGTH, dtype=torch.bool)), kw)
    assert_all_close(all_false, none, names, dict(atol=0, rtol=0))


def test_triton_scan_with_reset_float32():
    """float32 inputs (the kernel's float32 accumulation) against the float64 reference, float32 tolerances."""
    kw = scan_inputs(SCAN_LENGTH, full=True, seed=5, dtype=torch.float32)
    reset = reset_of(SCAN_LENGTH, *SCAN_RESETS["mixed"])
    names, got = scan_run(scan_triton(small_scan_config(), reset), kw)
    _, expected = scan_run(scan_naive(reset), kw)
    assert_all_close([x.double() for x in got], [x.double() for x in expected], names, dict(atol=1e-5, rtol=1e-4))


# ------------------------------------------------------------------------------------------------------ retention

RET_LENGTH = 37  # chunks of 16: [0, 16), [16, 32), [32, 37)
RET_RESETS = {
    # row 0: boundaries at the last token of chunk 0 (15), at the edge of chunk 1 (16), one-token documents (16,
    # 36), at the last token of chunk 1 (31), at the edge of the last chunk (32), at the row's last token (36);
    # row 1: one-token document at 0, short documents, a document from 5 to 29 (two chunks) and one from 30 to the
    # end (two chunks)
    "mixed": ((15, 16, 17, 20, 31, 32, 36), (0, 1, 5, 30)),
    "first-token-only": ((0,), ()),
    "every-token": (range(RET_LENGTH), range(RET_LENGTH)),
}


def retention_config(block_t=16):
    from hf_densessm.ops.retention.chunk import ChunkRetentionConfig, StateTiles

    # 16 x 16 state tiles on key 16 / value 32: two value tiles
    tiles = StateTiles(16, 16, 1)
    return ChunkRetentionConfig(block_t, tiles, tiles, tiles, tiles, tiles)


def retention_inputs(length, initial_state, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    batch, heads, key_dim, value_dim = 2, 2, 16, 32
    q, k, v = (torch.randn(batch, length, heads, d, generator=g, dtype=torch.float64).to(dtype)
               for d in (key_dim, key_dim, value_dim))
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    s0 = torch.randn(batch, heads, key_dim, value_dim, generator=g, dtype=torch.float64).to(state_dtype)
    return [q, k, v, s0 if initial_state else None]


def retention_run(fn, inputs, seed=1):
    """``fn(q, k, v, s0) -> (o, final_state)``; backprop random cotangents of both; outputs then every gradient."""
    leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in inputs]
    o, final_state = fn(*leaves)
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)
    gs = torch.randn(final_state.shape, generator=g, dtype=torch.float64).to(final_state.dtype)
    ((o * go).sum() + (final_state * gs).sum()).backward()
    return [o.detach(), final_state.detach()] + [None if x is None else x.grad for x in leaves]


RET_NAMES = ["o", "final_state", "dq", "dk", "dv", "d_initial_state"]


def retention_triton_run(config, reset, inputs, seed=1):
    """:func:`retention_run` for the Triton kernels with ``config`` (their forward and backward launched directly:
    the op picks its own tiles), the same cotangents."""
    from hf_densessm.ops.retention.chunk import chunk_retention_bwd_triton, chunk_retention_fwd_triton

    q, k, v, s0 = inputs
    o, final_state = chunk_retention_fwd_triton(q, k, v, 0.6, s0, reset, config=config)
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)
    gs = torch.randn(final_state.shape, generator=g, dtype=torch.float64).to(final_state.dtype)
    dq, dk, dv, d_s0 = chunk_retention_bwd_triton(go, gs, q, k, v, 0.6, s0, reset, config=config)
    return [o, final_state, dq, dk, dv, None if s0 is None else d_s0]


def retention_torch(reset, chunk_size=8):
    return lambda q, k, v, s0: chunk_retention_torch(q, k, v, 0.6, s0, True, chunk_size=chunk_size, reset=reset)


@pytest.mark.parametrize("initial_state", [True, False], ids=["initial-state", "no-initial-state"])
@pytest.mark.parametrize("pattern", list(RET_RESETS))
def test_triton_retention_with_reset_equals_reference(pattern, initial_state):
    """Chunks of 16 tokens (the reference runs chunks of 8, so its chunk edges differ from the kernel's)."""
    inputs = retention_inputs(RET_LENGTH, initial_state)
    reset = reset_of(RET_LENGTH, *RET_RESETS[pattern])
    got = retention_triton_run(retention_config(), reset, inputs)
    expected = retention_run(retention_torch(reset), inputs)
    assert_all_close(got, expected, RET_NAMES, F64)
    if pattern == "mixed" and not initial_state:
        # and the quadratic form (Eq. 24 with a same-document mask; no initial state) agrees on the output
        q, k, v, _ = inputs
        torch.testing.assert_close(got[0], chunk_retention_naive(q, k, v, 0.6, reset=reset), **F64)


def test_triton_retention_with_reset_through_public_op():
    """The public op with its default tiles (32- or 64-token chunks): boundaries at 31, 32, 63, 64 and one-token
    documents; batch 2."""
    length = 70
    inputs = retention_inputs(length, True, seed=2)
    reset = reset_of(length, (3, 31, 32, 33, 63, 64, 69), (0, 40))

    def public(q, k, v, s0):
        return chunk_retention(q, k, v, scale=0.6, initial_state=s0, output_final_state=True, backend="triton",
                               reset=reset)

    got = retention_run(public, inputs)
    expected = retention_run(retention_torch(reset, chunk_size=64), inputs)
    assert_all_close(got, expected, RET_NAMES, F64)


def test_triton_retention_without_reset_unchanged():
    inputs = retention_inputs(RET_LENGTH, True, seed=4)
    none = retention_triton_run(retention_config(), None, inputs)
    assert_all_close(none, retention_run(retention_torch(None), inputs), RET_NAMES, F64)
    all_false = retention_triton_run(retention_config(), torch.zeros(2, RET_LENGTH, dtype=torch.bool), inputs)
    assert_all_close(all_false, none, RET_NAMES, dict(atol=0, rtol=0))


def test_triton_retention_with_reset_float32():
    """float32 inputs (exact float32 products, float32 accumulation) against the float64 reference."""
    inputs = retention_inputs(RET_LENGTH, True, seed=5, dtype=torch.float32)
    reset = reset_of(RET_LENGTH, *RET_RESETS["mixed"])
    got = retention_triton_run(retention_config(), reset, inputs)
    expected = retention_run(retention_torch(reset), [x.double() for x in inputs])
    assert_all_close([x.double() for x in got], expected, RET_NAMES, dict(atol=1e-5, rtol=1e-4))
