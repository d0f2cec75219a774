"""Which form of an op runs: the one dispatch shared by every op of :mod:`hf_densessm.ops`.

Every op is a ``torch.library`` op whose body starts with :func:`resolve_backend` and then runs one of its forms: the
Triton kernels (launched through ``torch.library.wrap_triton``, so that ``torch.compile`` sees them) or the PyTorch
path (``chunked_torch.py`` of each op, which ``torch.compile`` traces and fuses). Every op takes
``backend="auto" | "triton" | "torch"`` (the models pass their runtime setting ``config.kernel_backend``):

- ``"auto"`` runs the Triton kernel on CUDA tensors when ``triton`` is installed, the PyTorch path otherwise;
- ``"torch"`` always runs the PyTorch path, e.g. for debugging;
- ``"triton"`` always runs the kernel: on CUDA tensors, or on CPU tensors under the Triton interpreter
  (``TRITON_INTERPRET=1``, also ``true``/``yes``/``on``; how the tests run the kernels without a GPU).

It also describes the GPUs the kernels are built for (:class:`GPUArch`, :data:`ARCHS`, :func:`device_arch`): each
kernel family picks its tiles, warps and stages from these limits at launch time (``*_config`` functions in the
kernel files), and ``tests/ops/test_compile.py`` compiles every choice for every architecture here.

This module does not import ``triton``: the kernel files are imported only when :func:`use_triton` said yes, so
the package and its PyTorch path work where triton is not installed.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import torch

__all__ = [
    "ARCHS", "BACKENDS", "GPUArch", "device_arch", "interpreting", "own_precision", "resolve_backend",
    "triton_available", "use_triton",
]

#: The values of every op's ``backend`` argument (and of the models' ``config.kernel_backend``).
BACKENDS = ("auto", "triton", "torch")


def own_precision(device: torch.device):
    """A context in which the PyTorch path of an op computes in the precision it chooses, as its kernels do.

    ``torch.autocast`` runs matrix products in bfloat16 / float16 even where an op has cast its inputs to float32
    on purpose (the chunked references accumulate states and decays in float32). The Triton kernels are outside
    autocast's reach; inside this context the PyTorch path is too, so every backend computes
    the same function under autocast, and its gradients run in the dtypes of its forward pass. On the DenseRetNet
    micro model of ``tests/training/test_training.py::test_bfloat16_autocast_training_step`` (PyTorch path) the cosine
    similarity of the autocast gradients with float64 ones went from 0.981 to 0.988.

    Args:
        device: the device of the op's tensors.

    Returns:
        ``torch.autocast(device.type, enabled=False)`` while autocast is on for that device type, else a
        ``contextlib.nullcontext()`` (nothing to enter on the decoding path).
    """
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def triton_available() -> bool:
    """Whether the ``triton`` package imports (it is imported once, then cached by Python)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether the Triton interpreter is on: ``TRITON_INTERPRET`` is ``1``, ``true``, ``yes`` or ``on`` (any case),
    the spellings Triton itself accepts. Triton reads the variable when a kernel is defined, i.e. when a kernel file
    is first imported, so it must be set before that."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def use_triton(backend: str, device: torch.device) -> bool:
    """Resolve an op's ``backend`` argument for tensors on ``device``: True runs the Triton kernel, False the
    PyTorch path.

    Args:
        backend: one of :data:`BACKENDS`.
        device: the device of the op's tensors.

    Returns:
        ``backend == "triton"``, or ``backend == "auto"`` with a CUDA ``device`` and triton installed.

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
        RuntimeError: ``backend="triton"`` without the triton package, or on non-CUDA tensors without the
            interpreter (:func:`interpreting`).
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package, which is not installed; use backend='torch'")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"backend='triton' on {device.type} tensors needs the Triton interpreter: set the environment variable "
            "TRITON_INTERPRET=1 before triton kernels are defined (before a kernel file of this package is first "
            "imported), or use backend='torch'"
        )
    return True


@dataclass(frozen=True)
class GPUArch:
    """Per-block and per-SM limits of one CUDA compute capability, as the kernels' tile choices and the compile
    test use them (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability").

    Attributes:
        name: ``"sm_80"`` etc. capability: ``(major, minor)``.
        shared_per_block: largest shared memory one block may use (the opt-in maximum), bytes.
        shared_per_sm: shared memory of one SM, bytes (1 KB of it is reserved per resident block).
        max_threads_per_sm, max_blocks_per_sm: resident threads and blocks per SM.
        registers_per_sm: 32-bit registers per SM (65536 on every architecture here).
    """

    name: str
    capability: tuple[int, int]
    shared_per_block: int
    shared_per_sm: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int = 65536

    def occupancy(self, registers: int, num_warps: int, shared: int) -> float:
        """Theoretical occupancy: resident warps per SM over the most the SM holds, for blocks of ``num_warps``
        warps that use ``registers`` registers per thread and ``shared`` bytes of shared memory (the CUDA
        occupancy calculator's rules: registers allocated per warp in units of 256; 1 KB of shared memory
        reserved per block). 0 if one block does not fit."""
        regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
        by_registers = self.registers_per_sm // (regs_per_warp * num_warps)
        by_shared = self.shared_per_sm // (shared + 1024) if shared <= self.shared_per_block else 0
        by_threads = self.max_threads_per_sm // (32 * num_warps)
        blocks = min(by_registers, by_shared, by_threads, self.max_blocks_per_sm)
        return blocks * num_warps * 32 / self.max_threads_per_sm


_KB = 1024
#: The architectures the kernels are built for: A100 (sm_80), consumer Ampere such as RTX 3090 / A10 (sm_86),
#: Ada such as RTX 4090 / L4 / L40 (sm_89), Hopper H100 / H200 (sm_90).
ARCHS = {
    "sm_80": GPUArch("sm_80", (8, 0), 163 * _KB, 164 * _KB, 2048, 32),
    "sm_86": GPUArch("sm_86", (8, 6), 99 * _KB, 100 * _KB, 1536, 16),
    "sm_89": GPUArch("sm_89", (8, 9), 99 * _KB, 100 * _KB, 1536, 24),
    "sm_90": GPUArch("sm_90", (9, 0), 227 * _KB, 228 * _KB, 2048, 32),
}


def device_arch(device: torch.device) -> GPUArch:
    """The limits of the GPU that holds ``device``, for the kernels' tile choices.

    On a CUDA device: the table entry of the nearest architecture at or below its compute capability (sm_80 for an
    unknown older one), with the shared memory per block the driver reports. On any other device (the Triton
    interpreter on the CPU, which has no limits): ``ARCHS["sm_90"]``, the most generous entry, so that the
    interpreter runs the largest tiles; the tests run the other choices explicitly.

    Args:
        device: a ``torch.device``.

    Returns:
        A :class:`GPUArch`.
    """
    if device.type != "cuda":
        return ARCHS["sm_90"]
    props = torch.cuda.get_device_properties(device)
    capability = (props.major, props.minor)
    known = [arch for arch in ARCHS.values() if arch.capability <= capability]
    arch = max(known, key=lambda a: a.capability) if known else ARCHS["sm_80"]
    shared = getattr(props, "shared_memory_per_block_optin", None)
    return replace(arch, shared_per_block=shared) if shared else arch


def resolve_backend(backend: str, device: torch.device) -> str:
    """Which form of an op runs on tensors on ``device``: ``"triton"`` where :func:`use_triton` says so, else
    ``"torch"``.

    Raises:
        ValueError, RuntimeError: as :func:`use_triton`.
    """
    return "triton" if use_triton(backend, device) else "torch"
