"""Which implementation of an op runs: one ordered table per op (:data:`TABLES`, filled by each op's module and by
:func:`register`), the user's ``backend`` (:data:`BACKENDS`, :func:`use_backend`), and :func:`choose`, called once
per call of a public op function; the op and its backward run the implementation named. docs/kernels.md, "The
dispatch table"; docs/contributing.md, "Adding a kernel". Imports no ``triton``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["BACKENDS", "Implementation", "TABLES", "check_backend", "choose", "chosen_backend", "implementation",
           "interpreting", "register", "triton_available", "triton_entry", "triton_missing", "use_backend"]

#: The values of every op's ``backend`` argument and of the models' ``config.kernel_backend``: ``"auto"`` (the first
#: implementation of the table for the device), ``"triton"`` (the Triton kernels), ``"torch"`` (no Triton).
BACKENDS = ("auto", "triton", "torch")


def check_backend(backend) -> str:
    """``backend`` if one of :data:`BACKENDS`, else ``ValueError``."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    return backend


_active_backend = "auto"  # what an op given no backend runs (use_backend); module state that Dynamo guards on


@contextlib.contextmanager
def use_backend(backend: str):
    """``with use_backend(backend):`` ops called without a ``backend`` inside the block run ``backend`` (one of
    :data:`BACKENDS`, else ``ValueError``), as ``torch.nn.attention.sdpa_kernel`` chooses attention kernels
    (docs/kernels.md, "The dispatch table"). Nests; restored on exit; a compiled graph guards on it. Process-wide."""
    global _active_backend
    previous, _active_backend = _active_backend, check_backend(backend)
    try:
        yield
    finally:
        _active_backend = previous


def chosen_backend(backend: str | None) -> str:
    """``backend`` checked (:func:`check_backend`), or for ``None`` the one of the innermost :func:`use_backend`
    block (``"auto"`` outside any)."""
    return _active_backend if backend is None else check_backend(backend)


def triton_available() -> bool:
    """Whether the ``triton`` package imports (it is imported once, then cached by Python)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is ``1``, ``true``, ``yes`` or ``on`` (any case), as Triton reads it when a kernel
    file is first imported."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@torch.compiler.assume_constant_result
def _triton_state() -> str:
    """``"missing"``, ``"interpreting"`` or ``"installed"``: read once per call, a constant while Dynamo traces."""
    return "missing" if not triton_available() else "interpreting" if interpreting() else "installed"


def triton_missing(device: torch.device, **facts) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (``None`` when they can): the package is not installed, or a
    non-CUDA device without the interpreter (:func:`interpreting`). The ``missing`` of every Triton entry."""
    state = _triton_state()
    if state == "missing":
        return "needs the triton package, which is not installed"
    if device.type != "cuda" and state != "interpreting":
        return (f"on {device.type} tensors needs the Triton interpreter: set the environment variable "
                "TRITON_INTERPRET=1 before triton kernels are defined (before a kernel file of this package is first "
                "imported)")
    return None


@dataclass(frozen=True)
class Implementation:
    """One implementation of an op, an entry of its table in :data:`TABLES` (docs/kernels.md, "The dispatch table"):
    ``name`` (unique in the table), the :data:`BACKENDS` that may choose it, the device types ``"auto"`` takes it on
    (``auto_devices``; empty: every type), ``missing(device, **facts)`` (``None`` when it runs the call, else why not;
    traced by Dynamo, so what it reads besides its arguments goes through ``torch.compiler.assume_constant_result``),
    whether ``torch.compile`` traces its functions (else they run in an opaque op) and its functions by role
    (``calls``; contracts in the op's module)."""

    name: str
    backends: tuple[str, ...]
    auto_devices: tuple[str, ...] = ()
    missing: Callable[..., str | None] = lambda device, **facts: None
    traced: bool = False
    calls: dict[str, Callable] = field(default_factory=dict)


def triton_entry(**calls: Callable) -> Implementation:
    """The ``"triton"`` entry of an op's table: ``calls`` traced, taken by ``"auto"`` on CUDA, :func:`triton_missing`
    its ``missing``."""
    return Implementation("triton", ("auto", "triton"), ("cuda",), triton_missing, True, calls)


#: ``{op name: [Implementation, ...]}``, in the order :func:`choose` tries them; the last is the op's PyTorch path.
TABLES: dict[str, list[Implementation]] = {}


def register(op: str, entry: Implementation, before: str | None = None) -> None:
    """Add ``entry`` to ``op``'s table before the entry named ``before``, by default before the last one (the PyTorch
    path stays last); an entry of the same name is replaced in place. ``ValueError``: an ``op`` not in :data:`TABLES`,
    a backend not in :data:`BACKENDS`, or no entry ``before`` in the table."""
    if op not in TABLES:
        raise ValueError(f"op must be one of {sorted(TABLES)}, got {op!r}")
    for backend in entry.backends:
        check_backend(backend)
    table = TABLES[op]
    names = [e.name for e in table]
    before = names[-1] if before is None else before
    if entry.name in names:
        table[names.index(entry.name)] = entry
    elif before in names:
        table.insert(names.index(before), entry)
    else:
        raise ValueError(f"before must name an implementation of {op} ({names}), got {before!r}")


def implementation(op: str, name: str) -> Implementation:
    """The entry ``name`` of ``op``'s table; for a name this copy of the package lacks (another copy chose it, in a
    process running several: docs/kernels.md, "The dispatch table"), the table's last entry (the PyTorch path).
    ``KeyError`` for an unknown ``op``."""
    table = TABLES[op]
    return next((entry for entry in table if entry.name == name), table[-1])


def choose(op: str, device: torch.device, backend: str | None = None, **facts) -> str:
    """The name of the first entry of ``op``'s table that ``backend`` (``None``: :func:`chosen_backend`'s) selects
    on ``device`` and whose :attr:`~Implementation.missing` finds nothing missing for ``facts``. ``ValueError``: a
    ``backend`` not in :data:`BACKENDS`; ``RuntimeError``: no entry runs it, with each candidate's reason (e.g.
    ``backend="triton"`` without the triton package, or on CPU tensors without ``TRITON_INTERPRET=1``)."""
    backend = chosen_backend(backend)
    reasons = []
    for entry in TABLES[op]:
        if backend not in entry.backends or (backend == "auto" and entry.auto_devices
                                             and device.type not in entry.auto_devices):
            continue
        if (why := entry.missing(device, **facts)) is None:
            return entry.name
        reasons.append(f"{entry.name} {why}")
    raise RuntimeError(f"{op}: backend={backend!r} has no implementation for {device.type} tensors "
                       f"({'; '.join(reasons) or 'none registered'}); use backend='torch'")
