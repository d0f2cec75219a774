"""Which form of an op runs: the backend switch shared by every op of :mod:`hf_densessm.ops`.

Every public op takes ``backend="auto" | "triton" | "torch"``:

- ``"auto"`` (the models' ``config.kernel_backend`` default) runs the Triton kernel on CUDA tensors when
  ``triton`` is installed, and the PyTorch path otherwise;
- ``"torch"`` always runs the PyTorch path (``chunked_torch.py`` of each op), e.g. for debugging;
- ``"triton"`` always runs the kernel: on CUDA tensors, or on CPU tensors under the Triton interpreter
  (``TRITON_INTERPRET=1``, also ``true``/``yes``/``on``; how the tests run the kernels without a GPU).

This module does not import ``triton``: the kernel files are imported only when :func:`use_triton` said yes, so
the package and its PyTorch path work where triton is not installed.
"""

from __future__ import annotations

import os

import torch

__all__ = ["BACKENDS", "interpreting", "triton_available", "use_triton"]

#: The values of every op's ``backend`` argument (and of the models' ``config.kernel_backend``).
BACKENDS = ("auto", "triton", "torch")


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
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (:data:`BACKENDS`).
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
