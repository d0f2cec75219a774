"""What the ops share besides the dispatch (``dispatch.py``): the PyTorch path's precision under autocast, the value
checks that behave alike in eager and compiled runs (:func:`require`), the GPUs the kernels' tile choices are built
for (:data:`ARCHS`; docs/kernels.md, "Tile, warp and stage choices"), and :class:`OpGroup`, which defines each op once
per process (docs/design.md §8). Imports no ``triton``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import torch

from .dispatch import implementation

__all__ = ["ARCHS", "GPUArch", "OpGroup", "code_digest", "compute_dtype", "device_arch", "flat_saved",
           "in_own_precision", "inputs_compute_dtype", "own_precision", "require", "token_major_like", "tracing"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of the ops for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def inputs_compute_dtype(*tensors) -> torch.dtype:
    """The accumulation dtype of an op over several inputs (``None`` skipped): :func:`compute_dtype` of any float64."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def token_major_like(x: torch.Tensor) -> torch.Tensor:
    """A new tensor like ``x`` (batch, channels, length), a view of a (batch, length, channels) one: the layout of
    the model's tensors."""
    return x.new_empty(x.shape[0], x.shape[2], x.shape[1]).transpose(1, 2)


def flat_saved(forward, backward, sizes) -> dict:
    """The ``"forward"`` and ``"backward"`` of a scan entry from ``forward`` (no ``save_states``) returning ``(y,
    last_state, saved)``, ``saved`` 4-D, and ``backward`` taking it: ``saved`` passed on flattened from dim 2 (a 4-D
    output's channels-last test would guard the length to one chunk), unflattened to ``sizes(A)`` for ``backward``."""
    def flat_forward(*args):
        y, last, saved = forward(*args[:-1])
        return y, last, saved.flatten(2)

    def flat_backward(*args):
        *args, saved = args
        return backward(*args, saved.unflatten(2, sizes(args[4])))
    return dict(forward=flat_forward, backward=flat_backward)


def tracing(device: torch.device) -> bool:
    """Whether checks that read tensor values must be skipped: ``torch.compile`` traces (the values are not known),
    or a CUDA graph is captured on a CUDA ``device`` (a host read would break the capture)."""
    return torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def require(condition: torch.Tensor, message: str, host_read: bool = True) -> None:
    """Refuse an input by a test of its values, alike in eager and compiled runs (docs/design.md §6): a host read of
    the 0-dim bool ``condition`` when not :func:`tracing` (on an accelerator only if ``host_read``), else
    ``torch._assert_async(condition, message)``, which a compiled graph keeps (a device-side assert on an accelerator):
    a False ``condition`` raises ``ValueError`` (eager) or ``RuntimeError`` (traced, or without ``host_read``)."""
    if not tracing(condition.device) and (host_read or condition.device.type == "cpu"):
        if not bool(condition):
            raise ValueError(message)
    else:
        torch._assert_async(condition, message)


def own_precision(device: torch.device):
    """A context in which an op's PyTorch path computes in its own precision, out of autocast's reach as the kernels
    are (docs/training.md, "Mixed precision"): ``torch.autocast(device.type, enabled=False)`` while autocast is on
    for ``device``'s type, else ``contextlib.nullcontext()``."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def in_own_precision(fn):
    """``fn`` called in :func:`own_precision` of its first argument's device (a PyTorch path's table entry)."""
    def call(*args):
        with own_precision(args[0].device):
            return fn(*args)
    return call


@dataclass(frozen=True)
class GPUArch:
    """Per-block and per-SM limits of one CUDA compute capability (CUDA C++ Programming Guide, "Technical
    Specifications per Compute Capability"): ``name`` (``"sm_80"``), ``capability`` ``(major, minor)``, shared memory
    per block (opt-in maximum) and per SM in bytes, resident threads and blocks per SM, 32-bit registers per SM."""

    name: str
    capability: tuple[int, int]
    shared_per_block: int
    shared_per_sm: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int = 65536

    def occupancy(self, registers: int, num_warps: int, shared: int) -> float:
        """Theoretical occupancy (the CUDA occupancy calculator's rules) of blocks of ``num_warps`` warps using
        ``registers`` registers per thread and ``shared`` bytes of shared memory; 0 if one block does not fit."""
        regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
        by_registers = self.registers_per_sm // (regs_per_warp * num_warps)
        by_shared = self.shared_per_sm // (shared + 1024) if shared <= self.shared_per_block else 0
        by_threads = self.max_threads_per_sm // (32 * num_warps)
        blocks = min(by_registers, by_shared, by_threads, self.max_blocks_per_sm)
        return blocks * num_warps * 32 / self.max_threads_per_sm


_KB = 1024
#: The architectures the kernels are built for (docs/kernels.md, "Tile, warp and stage choices").
ARCHS = {
    "sm_80": GPUArch("sm_80", (8, 0), 163 * _KB, 164 * _KB, 2048, 32),
    "sm_86": GPUArch("sm_86", (8, 6), 99 * _KB, 100 * _KB, 1536, 16),
    "sm_89": GPUArch("sm_89", (8, 9), 99 * _KB, 100 * _KB, 1536, 24),
    "sm_90": GPUArch("sm_90", (9, 0), 227 * _KB, 228 * _KB, 2048, 32),
}


def device_arch(device: torch.device) -> GPUArch:
    """The :class:`GPUArch` of ``device``: on CUDA the nearest :data:`ARCHS` entry at or below its capability (sm_80
    for an older one) with the driver's shared memory per block; elsewhere (the interpreter) ``ARCHS["sm_90"]``."""
    if device.type != "cuda":
        return ARCHS["sm_90"]
    props = torch.cuda.get_device_properties(device)
    capability = (props.major, props.minor)
    known = [arch for arch in ARCHS.values() if arch.capability <= capability]
    arch = max(known, key=lambda a: a.capability) if known else ARCHS["sm_80"]
    shared = getattr(props, "shared_memory_per_block_optin", None)
    return replace(arch, shared_per_block=shared) if shared else arch


class OpGroup:
    """The ``torch.library`` ops of one op module, defined once per process whichever copies of the module run in it
    (the installed package's, saved folders' remote code; docs/design.md §8). Record each op with :meth:`custom_op` /
    :meth:`triton_op` (the name without the namespace; an untraced entry's with :meth:`opaque`) and its autograd with
    :meth:`register_autograd`, call :meth:`define` once, then call the ops as the group's attributes
    (``group.selective_scan``, a ``torch.ops`` packet).
    """

    def __init__(self, namespace: str = "hf_densessm"):
        self.namespace = namespace
        self._specs: dict[str, dict] = {}

    def custom_op(self, name: str, fn=None, *, mutates_args=(), fake=None, make=torch.library.custom_op):
        """Record ``fn`` as ``torch.library.custom_op`` ``name`` with the fake implementation ``fake`` (as ``make``,
        e.g. ``torch.library.triton_op``, its own fake); returns ``fn`` (a decorator without ``fn``)."""
        if fn is None:
            return lambda fn: self.custom_op(name, fn, mutates_args=mutates_args, fake=fake, make=make)
        self._specs[name] = dict(make=make, fn=fn, mutates_args=tuple(mutates_args), fake=fake)
        return fn

    def triton_op(self, name: str, fn=None, *, mutates_args=()):
        """Record ``fn`` as ``torch.library.triton_op`` ``name`` (:meth:`custom_op`)."""
        return self.custom_op(name, fn, mutates_args=mutates_args, make=torch.library.triton_op)

    def opaque(self, op: str, role: str, like, *, fake, after=None) -> None:
        """Record the opaque ``torch.library.custom_op`` ``<op>_eager`` (``<op>_eager_<role>`` for a role other than
        ``"forward"``) with ``like``'s schema and the fake ``fake``: ``role`` of the entry of ``op``'s table named by
        its last argument (``impl``) on the others, in :func:`own_precision` of the first tensor's device, its outputs
        through ``after(outputs, *arguments)`` (docs/kernels.md, "The ops")."""
        def eager(*args):
            with own_precision(next(a.device for a in args if isinstance(a, torch.Tensor))):
                out = implementation(op, args[-1]).calls[role](*args[:-1])
            return out if after is None else after(out, *args)
        self.custom_op(f"{op}_eager" + ("" if role == "forward" else f"_{role}"), functools.wraps(like)(eager),
                       fake=fake)

    def run(self, op: str, role: str, *args):
        """``role`` of the entry of ``op``'s table named by the last of ``args`` (``impl``) on the others: a traced
        entry's function itself, another's inside its :meth:`opaque` op."""
        entry = implementation(op, args[-1])
        if entry.traced:
            return entry.calls[role](*args[:-1])
        return getattr(self, f"{op}_eager" + ("" if role == "forward" else f"_{role}"))(*args)

    def register_autograd(self, name: str, backward, *, setup_context) -> None:
        """Record the autograd formula of the recorded op ``name`` (``torch.library.register_autograd``'s)."""
        self._specs[name]["autograd"] = (backward, setup_context)

    def define(self) -> None:
        """Register the recorded ops as ``<namespace>::<name>_<digest>`` unless a copy of the same code did (its ops
        then serve this copy), and set them as attributes; ``<digest>``: 8 hex digits of the SHA-256 of the ops'
        schemas and :func:`code_digest` (why: docs/design.md §8).

        Raises:
            RuntimeError: some but not all of the names are registered (a failed earlier definition).
        """
        schemas = {name: torch.library.infer_schema(spec["fn"], mutates_args=spec["mutates_args"])
                   for name, spec in self._specs.items()}
        code = code_digest([f for spec in self._specs.values() for f in (spec["fn"], spec["fake"]) if f is not None])
        suffix = "_" + hashlib.sha256((repr(sorted(schemas.items())) + code).encode()).hexdigest()[:8]
        namespace = getattr(torch.ops, self.namespace)
        found = [name for name in schemas if hasattr(namespace, name + suffix)]
        if found and len(found) < len(schemas):
            raise RuntimeError(f"{self.namespace}: the ops {list(schemas)} are partly registered as *{suffix}")
        for name, spec in self._specs.items():
            if not found:
                op = spec["make"](f"{self.namespace}::{name}{suffix}", spec["fn"], mutates_args=spec["mutates_args"])
                if spec["fake"] is not None:
                    op.register_fake(spec["fake"])
                if "autograd" in spec:
                    op.register_autograd(spec["autograd"][0], setup_context=spec["autograd"][1])
            setattr(self, name, getattr(namespace, name + suffix))


def code_digest(functions) -> str:
    """The SHA-256 (hex) of the source files of the modules defining ``functions`` and, recursively, of the modules of
    the same top-level package (the installed package, or one folder's remote code) that one of them holds or holds a
    function or class of, at top level: the code of what the ops compute and their fakes (any import order)."""
    top = functions[0].__module__.partition(".")[0]
    todo, seen = [sys.modules[f.__module__] for f in functions], {}
    while todo:
        module = todo.pop()
        if module.__name__ in seen or not getattr(module, "__file__", None):
            continue
        seen[module.__name__] = hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()
        for value in vars(module).values():
            owner = value if isinstance(value, ModuleType) else getattr(value, "__module__", None)
            owner = sys.modules.get(owner) if isinstance(owner, str) else owner
            if isinstance(owner, ModuleType) and owner.__name__.partition(".")[0] == top:
                todo.append(owner)
    return hashlib.sha256("".join(sorted(seen.values())).encode()).hexdigest()
