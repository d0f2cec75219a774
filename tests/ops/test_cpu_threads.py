"""The compiled CPU kernels' threads (:func:`hf_densessm.ops.cpu_build.run_job`): PyTorch's OpenMP runtime where it
is the only one in the process, else the thread pool; both give the same results, bit for bit."""

import os
import subprocess
import sys

import pytest
import torch

from hf_densessm.ops import cpu_build
from hf_densessm.ops.causal_conv1d import causal_conv1d
from hf_densessm.ops.cross_entropy import cross_entropy
from hf_densessm.ops.gated_add import gated_add
from hf_densessm.ops.rms_norm import rms_norm
from hf_densessm.ops.selective_scan import selective_scan
from hf_densessm.ops.selective_scan import cpu as cpu_scan

pytestmark = pytest.mark.skipif(not cpu_scan.cpu_kernel_available(), reason="no C compiler")


def _all_kernels(dtype):
    """Forward and backward of every compiled kernel at sizes that give every thread several slices' worth of
    work (300 channels: 38 groups of 8 float64 lanes; 70 rows); returns the outputs and the gradients."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    u, dt, B, C, z = rand(2, 300, 70), rand(2, 300, 70), rand(2, 16, 70), rand(2, 16, 70), rand(2, 300, 70)
    A = (-torch.rand(300, 16, generator=g, dtype=dtype) - 0.5).requires_grad_()
    y = selective_scan(u, dt, A, B, C, z=z, delta_softplus=True, backend="cpu")
    x, taps = rand(2, 70, 300), rand(300, 4)
    conv = causal_conv1d(x, taps, activation="silu", backend="cpu")
    f, total, total2, gate_in, gate_w = rand(70, 300), rand(70, 300), rand(70, 300), rand(70, 16), rand(300, 16)
    fused = gated_add(f, [total, total2], gate_in, gate_w, backend="cpu")
    normed_in, norm_w = rand(2, 70, 300), rand(150)
    normed = rms_norm(normed_in, norm_w, 1e-6, num_groups=2, backend="cpu")
    logits, target = rand(70, 500), torch.randint(0, 500, (70,), generator=g)
    loss = cross_entropy(logits, target)
    (y.square().sum() + conv.square().sum() + fused.square().sum() + normed.square().sum() + loss).backward()
    leaves = (u, dt, A, B, C, z, x, taps, f, total, total2, gate_in, gate_w, normed_in, norm_w, logits)
    return [t.detach() for t in (y, conv, fused, normed, loss)] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_openmp_and_thread_pool_give_the_same_results(monkeypatch, dtype):
    with_openmp = _all_kernels(dtype)
    monkeypatch.setattr(cpu_build, "USE_OPENMP", False)
    with_pool = _all_kernels(dtype)
    for a, b in zip(with_openmp, with_pool):
        assert torch.equal(a, b)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not torch.backends.openmp.is_available(),
                    reason="the shared OpenMP runtime is checked on Linux builds of PyTorch with OpenMP")
def test_the_kernels_run_on_pytorchs_openmp_threads_here():
    """On this platform (PyTorch's libgomp, a C compiler with -fopenmp) the kernels join PyTorch's OpenMP runtime,
    which stays the only one in the process."""
    library = cpu_scan._library()
    assert library.hfd_openmp() == 1
    assert cpu_build.openmp_ready(library)
    maps = open("/proc/self/maps").read()
    runtimes = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


FORKED = """
import os
import torch
from hf_densessm.ops import cpu_build
from hf_densessm.ops.selective_scan import cpu as cpu_scan, selective_scan
u = torch.randn(2, 40, 30)
B, C = torch.randn(2, 16, 30), torch.randn(2, 16, 30)
run = lambda: selective_scan(u, u.abs(), -torch.ones(40, 16), B, C, backend="cpu")
parent = run()
pid = os.fork()
if pid == 0:  # libgomp's threads do not survive a fork: the child must use the thread pool
    ok = not cpu_build.openmp_ready(cpu_scan._library())
    ok = ok and torch.equal(run(), parent)
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print("ok" if os.waitstatus_to_exitcode(status) == 0 else "child failed")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_the_kernels_on_the_thread_pool():
    result = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
