"""The C++ CPU kernel of the selective scan (``csrc/selective_scan_cpu.cpp``; Mamba paper Alg. 2), its ops
``hf_densessm::selective_scan_cpu_fwd`` / ``_bwd`` and decoding steps built on first use (:func:`load_kernel`), and
their table entries. Build, key, layouts and fallback: docs/kernels.md, "The C++ CPU kernel".
"""

import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from .backend import flat_saved, inputs_compute_dtype
from .dispatch import Implementation, implementation, register

__all__ = ["CHECKPOINT", "CONV_STEP", "IMPLEMENTATION", "MAX_STATE", "RETENTION_STEP", "SOURCE", "STATE_UPDATE",
           "SWITCH", "capability_flags", "extension_name", "kernel_enabled", "load_kernel", "missing", "openmp_flags",
           "scan_bwd", "scan_fwd"]

#: The C++ source; absent from an install that did not ship ``csrc/`` (then the kernel is never built).
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "selective_scan_cpu.cpp"
#: Tokens between the states the forward pass saves (``kCheckpoint`` in the C++ source).
CHECKPOINT = 64
#: Largest state size sent to the kernel (``kMaxState`` in the C++ source).
MAX_STATE = 64


def capability_flags(capability: str) -> list[str]:
    """Compiler flags (a new list) for a ``torch.backends.cpu.get_cpu_capability()``: ATen's ``-m`` flags and
    ``CPU_CAPABILITY_*`` macros for ``"AVX512"`` and ``"AVX2"``, the portable ``DEFAULT`` ones for anything else."""
    isa = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
           "AVX2": ["-mavx2", "-mfma", "-mf16c"]}.get(capability)
    tag = capability if isa else "DEFAULT"
    return ["-O3", *(isa or []), f"-DCPU_CAPABILITY_{tag}", f"-DCPU_CAPABILITY={tag}"]


def openmp_flags() -> list[str]:
    """``["-fopenmp"]`` where ATen's parallel backend is OpenMP on Linux, else ``[]`` (without ``_OPENMP`` the
    header template ``at::parallel_for`` runs on the calling thread; docs/kernels.md)."""
    openmp = "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
    return ["-fopenmp"] if openmp and sys.platform.startswith("linux") else []


def extension_name(source_text: str, capability: str, torch_version: str, flags: list[str]) -> str:
    """The extension's name and build folder, ``hf_densessm_scan_cpu_<capability>_<hash>``, the hash (12 hex digits
    of SHA-256) over the source text, torch version and flags: a stale or foreign build is never loaded."""
    key = "\0".join([source_text, torch_version, capability, *flags])
    tag = "".join(c if c.isalnum() else "_" for c in capability.lower())
    return f"hf_densessm_scan_cpu_{tag}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


#: The spellings of ``HF_DENSESSM_CPU_KERNEL`` (any case, blanks stripped; empty or unset is ``1``).
SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def kernel_enabled() -> bool:
    """Whether ``HF_DENSESSM_CPU_KERNEL`` leaves the kernel on (read once per call of ``selective_scan``); raises
    ``ValueError`` when it is set to anything but a spelling in :data:`SWITCH` or the empty string."""
    value = os.environ.get("HF_DENSESSM_CPU_KERNEL", "").strip().lower() or "1"
    if value not in SWITCH:
        raise ValueError(f"HF_DENSESSM_CPU_KERNEL must be one of {', '.join(SWITCH)} (any case) or unset, got "
                         f"{os.environ['HF_DENSESSM_CPU_KERNEL']!r}")
    return SWITCH[value]


@functools.cache
def load_kernel() -> bool:
    """Load the C++ kernel from the cache, building it there first if needed, once per process: True when its ops
    are registered; False when the source is absent (silently) or the build or load failed (one ``RuntimeWarning``
    with the reason and the cache folder). Never waits on another process; ignores ``HF_DENSESSM_CPU_KERNEL``."""
    return hasattr(torch.ops.hf_densessm, "selective_scan_cpu_fwd") or _build(SOURCE)  # or loaded by another copy


def _build(source: Path) -> bool:
    """:func:`load_kernel`'s work: ``<cache>/<name>/<name>.so`` (:func:`extension_name`) loaded when its SHA-256
    matches the ``.sha256`` beside it, else built in a private folder and published by atomic renames."""
    if not source.is_file():
        return False
    folder = None
    try:
        from torch.utils import cpp_extension

        capability = torch.backends.cpu.get_cpu_capability()
        flags = capability_flags(capability) + openmp_flags()
        name = extension_name(source.read_text(), capability, torch.__version__, flags)
        folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
        library, digest = folder / f"{name}{cpp_extension.LIB_EXT}", folder / f"{name}.sha256"
        if library.is_file() and digest.is_file() and (digest.read_text(errors="replace").strip()
                                                       == hashlib.sha256(library.read_bytes()).hexdigest()):
            torch.ops.load_library(str(library))
        else:
            logging.getLogger(__name__).warning(
                "hf_densessm: building the C++ CPU kernel of the selective scan in %s (once per CPU capability, "
                "torch version and kernel source; usually 15 s to 1 min)", folder)
            folder.mkdir(parents=True, exist_ok=True)
            private = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
            try:  # the private folder's lock and files are this process's own: nothing waits on another build
                built = Path(cpp_extension.load(
                    name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=openmp_flags(),
                    build_directory=str(private), is_python_module=False))
                (private / "sha256").write_text(hashlib.sha256(built.read_bytes()).hexdigest())
                os.replace(private / "sha256", digest)
                os.replace(built, library)
            finally:
                shutil.rmtree(private, ignore_errors=True)
        return True
    except Exception as exc:  # noqa: BLE001 -- any build/load failure leaves the PyTorch path
        lines = str(exc).strip().splitlines()
        warnings.warn(f"hf_densessm: the C++ CPU kernel of the selective scan could not be built or loaded "
                      f"({type(exc).__name__}: {lines[-1] if lines else repr(exc)}); the PyTorch path runs instead ("
                      f"{f'delete {folder} to rebuild it; ' if folder else ''}set HF_DENSESSM_CPU_KERNEL=0 to skip "
                      "the attempt)", RuntimeWarning, stacklevel=3)
        return False


def missing(device: torch.device, state_size: int, **facts) -> str | None:
    """Why the kernel cannot run a scan (``None`` when it can): a non-CPU ``device``, a state size over
    :data:`MAX_STATE`, the switch off (raises :func:`kernel_enabled`'s ``ValueError``) or no :func:`load_kernel`."""
    if device.type != "cpu":
        return "runs on CPU tensors only"
    if state_size > MAX_STATE:
        return f"takes a state size up to {MAX_STATE}"
    return _switch_and_build()


@torch.compiler.assume_constant_result
def _switch_and_build() -> str | None:
    """:func:`missing`'s reading of the switch and the build, a constant while Dynamo traces."""
    if not kernel_enabled():
        return "is off (HF_DENSESSM_CPU_KERNEL)"
    return None if load_kernel() else "is not available (see the build warning)"


def _cast(t, dtype):
    """``t`` in ``dtype``; None for None."""
    return None if t is None else t.to(dtype)


def scan_fwd(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
             reset=None):
    """Forward selective scan through the C++ kernel (Mamba paper Alg. 2, eq. 2a, 2b, 4): arguments (CPU tensors,
    any float dtypes and strides) and ``(y, last_state, chunk_states)`` as ``selective_scan_torch_fwd``, but ``y``
    token-major in memory and ``chunk_states`` (batch, dim, ceil(length / CHECKPOINT), state), contiguous, in the
    compute dtype (float64 if any input is, else float32). Layouts: docs/kernels.md. ``RuntimeError``: the kernel's
    ``TORCH_CHECK`` (a bad shape, a non-CPU tensor, a state size over its limit), or no kernel (:func:`load_kernel`)."""
    cdt = inputs_compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    y, last, states = torch.ops.hf_densessm.selective_scan_cpu_fwd(
        *(_cast(t, cdt) for t in (u, delta, A, B, C, D, z, delta_bias)), bool(delta_softplus),
        _cast(initial_state, cdt), None if reset is None else reset.bool())
    return y.to(u.dtype), last, states


def scan_bwd(dy, dlast, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             initial_state=None, reset=None, chunk_states=None):
    """Backward of :func:`scan_fwd` through the C++ kernel from its ``chunk_states``: arguments and gradients as
    ``selective_scan_torch_bwd``, but ``du``, ``ddelta``, ``dz``, ``dB``, ``dC`` token-major in memory. ``ValueError``:
    ``chunk_states`` is not the forward kernel's ``(batch, dim, n_chunks, state)`` (e.g. the chunked PyTorch path's)."""
    cdt = inputs_compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    want = (*u.shape[:2], (u.shape[2] + CHECKPOINT - 1) // CHECKPOINT, A.shape[1])
    if chunk_states is None or tuple(chunk_states.shape) != want:
        got = None if chunk_states is None else tuple(chunk_states.shape)
        raise ValueError(f"chunk_states must be the C++ kernel's checkpoints {want} (batch, dim, n_chunks, state), "
                         f"got {got}: states saved by another path?")
    grads = torch.ops.hf_densessm.selective_scan_cpu_bwd(
        *(_cast(t, cdt) for t in (dy, dlast, u, delta, A, B, C, D, z, delta_bias)), bool(delta_softplus),
        _cast(initial_state, cdt), None if reset is None else reset.bool(), chunk_states.to(cdt))
    likes = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    return tuple(None if like is None and i in (5, 6, 7) else g if like is None else g.to(like.dtype)
                 for i, (g, like) in enumerate(zip(grads, likes)))


def _saved(u, A, dtype):
    """The entry's "saved" (the fake of its checkpoints): a state every :data:`CHECKPOINT` tokens."""
    return u.new_empty(u.shape[0], u.shape[1], (u.shape[2] + CHECKPOINT - 1) // CHECKPOINT * A.shape[1], dtype=dtype)


def _step_missing(device: torch.device, state_size: int = 1, step: bool = False, **facts) -> str | None:
    """:func:`missing` for the decoding-step entries, which also need ``step`` (the op's facts allow the C++ step: a
    call of decoding size) and an eager call (``torch.compile`` traces the PyTorch path instead)."""
    if not step:
        return "runs decoding-sized calls only (the op's step condition)"
    if torch.compiler.is_compiling():
        return "is not traced by torch.compile (the PyTorch step is)"
    return missing(device, state_size)


def _state_update(*args):
    """The ``"cpp"`` entry of ``selective_state_update`` (its ``"step"`` contract), one C++ operator call."""
    return torch.ops.hf_densessm.selective_state_update_cpu(*args)


def _conv_step(x, taps, bias, window, reset, silu):
    """The ``"cpp"`` entry of ``causal_conv1d`` (its ``"forward"`` contract, for a step), one C++ operator call."""
    return torch.ops.hf_densessm.causal_conv1d_step_cpu(x, taps, bias, window, silu)


def _retention(q, k, v, scale, initial_state, reset):
    """The ``"cpp"`` entry of ``chunk_retention`` (its ``"forward"``, ``reset`` None), one C++ operator call; its
    ``"backward"`` is the chunked PyTorch path's, which recomputes from the inputs."""
    return torch.ops.hf_densessm.chunk_retention_cpu(q, k, v, scale, initial_state)


#: The decoding-sized entries of ``selective_state_update``, ``causal_conv1d``, ``chunk_retention``: eager CPU calls,
#: each one operator dispatched in C++ (``"direct"``: called by the public function with no Python op between).
STATE_UPDATE = Implementation("cpp", ("auto", "torch"), ("cpu",), _step_missing,
                              calls=dict(step=_state_update, direct=_state_update))
CONV_STEP = Implementation("cpp", ("auto", "torch"), ("cpu",), _step_missing,
                           calls=dict(forward=_conv_step, direct=_conv_step))
RETENTION_STEP = Implementation("cpp", ("auto", "torch"), ("cpu",), _step_missing, calls=dict(
    forward=_retention, direct=_retention, backward=implementation("chunk_retention", "torch").calls["backward"]))

#: The selective scan's ``"cpp"`` entry: CPU tensors, taken by ``"auto"`` and ``"torch"`` before the chunked path.
IMPLEMENTATION = Implementation("cpp", ("auto", "torch"), ("cpu",), missing,
                                calls=dict(saved=_saved, **flat_saved(scan_fwd, scan_bwd, lambda A: (-1, A.shape[1]))))
# each entry joins its op's table before the PyTorch path (ops/__init__.py imports this module after the op modules)
for _op, _entry in (("selective_scan", IMPLEMENTATION), ("selective_state_update", STATE_UPDATE),
                    ("causal_conv1d", CONV_STEP), ("chunk_retention", RETENTION_STEP)):
    register(_op, _entry)
