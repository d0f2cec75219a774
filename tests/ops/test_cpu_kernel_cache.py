"""The build cache of the C++ CPU kernel (``ops/cpu_kernel.py``; docs/kernels.md, "The C++ CPU kernel"): after a
build killed mid-way (its lock files left behind) the next process builds without waiting; a cached library
truncated to half its size or without its hash file is never loaded (no SIGBUS: a rebuild, or the PyTorch path with
one warning naming the folder to delete); a first scan traced by ``torch.compile`` builds it; the one-time build message; the
spellings of ``HF_DENSESSM_CPU_KERNEL``. Each cache case runs in a subprocess with its own ``TORCH_EXTENSIONS_DIR``
(the real cache is untouched) and a timeout (a hang fails the test); two builds in all (about 40 s each)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from hf_densessm.ops import cpu_kernel
from hf_densessm.ops.selective_scan import selective_scan

TIMEOUT = 300  # seconds for one subprocess, a build included
BUILDING = "building the C++ CPU kernel"
FAILED = "could not be built or loaded"

# one forward of the public function on CPU tensors (eager, or traced by torch.compile with "compile"); prints
# whether the kernel is loaded and the largest difference from the chunked PyTorch path
SCRIPT = """
import json, sys, torch
from hf_densessm.ops import cpu_kernel
from hf_densessm.ops.selective_scan import selective_scan
from hf_densessm.ops.selective_scan.chunked_torch import selective_scan_torch_fwd
g = torch.Generator().manual_seed(0)
u, delta, B, C = (torch.randn(1, n, 70, generator=g) for n in (4, 4, 3, 3))
A, delta = -torch.rand(4, 3, generator=g), delta.abs()
fn = lambda *a: selective_scan(*a, backend="torch")
if sys.argv[1:] == ["compile"]:
    fn = torch.compile(fn, backend="eager", fullgraph=True)
y = fn(u, delta, A, B, C)
err = (y - selective_scan_torch_fwd(u, delta, A, B, C)[0]).abs().max().item()
print(json.dumps({"kernel": cpu_kernel.load_kernel(), "err": err}))
"""


def extension():
    capability = torch.backends.cpu.get_cpu_capability()
    flags = cpu_kernel.capability_flags(capability) + cpu_kernel.openmp_flags()  # as cpu_kernel._build
    return cpu_kernel.extension_name(cpu_kernel.SOURCE.read_text(), capability, torch.__version__, flags)


def run(cache, *args, **env):
    """Run :data:`SCRIPT` with ``cache`` as ``TORCH_EXTENSIONS_DIR``; its JSON line and its stderr."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache), PYTHONPATH=os.pathsep.join(sys.path), **env)
    env.pop("HF_DENSESSM_CPU_KERNEL", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, f"exit status {proc.returncode} (-7: SIGBUS)\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["err"] < 1e-4
    return out, proc.stderr


def verified(folder, name):
    digest = (folder / f"{name}.sha256").read_text().strip()
    return hashlib.sha256((folder / f"{name}.so").read_bytes()).hexdigest() == digest


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache in which a build was killed (cpp_extension's lock and a truncated library in ``<name>/``, a private
    build folder with its lock), then one process built the kernel, its first scan traced by torch.compile (the
    choice of the kernel is an argument of the graph's op, so a build while tracing is safe): ``(cache, name, output,
    stderr)``."""
    if shutil.which("c++") is None or shutil.which("ninja") is None or not cpu_kernel.SOURCE.is_file():
        pytest.skip("no C++ compiler, ninja or kernel source: the CPU kernel cannot be built")
    cache, name = tmp_path_factory.mktemp("cache"), extension()
    (cache / name / ".build-killed").mkdir(parents=True)
    for lock in (cache / name / "lock", cache / name / ".build-killed" / "lock"):
        lock.touch()
    (cache / name / f"{name}.so").write_bytes(b"\x7fELF" + bytes(1000))
    return (cache, name, *run(cache, "compile"))


def copy(built, tmp_path):
    cache, name = built[:2]
    shutil.copytree(cache, tmp_path / "cache")
    return tmp_path / "cache", tmp_path / "cache" / name, name


def test_build_after_a_killed_build_says_so_once_and_publishes_a_verified_library(built):
    cache, name, out, err = built
    assert out["kernel"]
    assert err.count(BUILDING) == 1 and "usually" in err and str(cache / name) in err
    assert FAILED not in err
    assert verified(cache / name, name)
    assert sorted(p.name for p in (cache / name).glob(".build-*")) == [".build-killed"]  # its own folder is gone


def test_verified_library_loads_without_a_build(built, tmp_path):
    cache, folder, name = copy(built, tmp_path)
    out, err = run(cache)
    assert out["kernel"] and BUILDING not in err and FAILED not in err


def test_truncated_library_is_never_loaded(built, tmp_path):
    """The library truncated to half its size: with a failing compiler the PyTorch path runs with one warning naming
    the folder to delete (no SIGBUS); with a working one it is rebuilt."""
    cache, folder, name = copy(built, tmp_path)
    library = folder / f"{name}.so"
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])
    out, err = run(cache, CXX="false")
    assert not out["kernel"]
    assert err.count(FAILED) == 1 and f"delete {folder} to rebuild it" in err
    out, err = run(cache)
    assert out["kernel"] and err.count(BUILDING) == 1 and FAILED not in err
    assert verified(folder, name)


def test_library_without_hash_file_is_never_loaded(built, tmp_path):
    cache, folder, name = copy(built, tmp_path)
    (folder / f"{name}.sha256").unlink()
    out, err = run(cache, CXX="false")
    assert not out["kernel"] and err.count(FAILED) == 1


@pytest.mark.parametrize("value, on", [("0", False), ("false", False), (" OFF ", False), ("No", False), ("1", True),
                                       ("TRUE", True), ("yes", True), ("on", True), ("", True), (None, True)])
def test_env_var_spellings(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("HF_DENSESSM_CPU_KERNEL", raising=False)
    else:
        monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", value)
    assert cpu_kernel.kernel_enabled() is on


@pytest.mark.parametrize("value", ["0.0", "2", "disable", "n"])
def test_env_var_other_values_raise(monkeypatch, value):
    monkeypatch.setenv("HF_DENSESSM_CPU_KERNEL", value)
    with pytest.raises(ValueError, match=r"HF_DENSESSM_CPU_KERNEL must be one of 1, true, yes, on, 0, false, no"):
        cpu_kernel.kernel_enabled()
    with pytest.raises(ValueError, match=repr(value)):  # before any build: the scan raises it on CPU tensors
        selective_scan(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), -torch.ones(1, 1), torch.zeros(1, 1, 1),
                       torch.zeros(1, 1, 1))
