"""Build and load the compiled CPU kernels of :mod:`hf_densessm.ops`: C source compiled once per machine with the
system C compiler, loaded with :mod:`ctypes`, run on the threads of PyTorch's OpenMP runtime (or a thread pool).

Why C and not PyTorch for some ops: the selective scan is a sequential recurrence over the length with a tiny
per-token body (Mamba paper §3.3: its cost is memory traffic, not FLOPs). In PyTorch every token step is a pass
over large tensors; a compiled loop keeps the state in registers and reads each input once. The source lives in a
Python string next to the op (e.g. ``ops/selective_scan/cpu.py``), beside that op's PyTorch reference, so a saved
checkpoint's remote code carries it too.

How it is built (:func:`load_library`):

- compiler: ``$CC``, else ``cc``, else ``gcc``; flags ``-O3 -std=c11 -fPIC -shared`` plus ``-fopenmp`` and
  ``-march=native`` (each dropped where the compiler refuses it), never ``-ffast-math`` (which would switch the
  whole process to flush-to-zero arithmetic);
- threads (:func:`run_job`): a kernel's work is cut into one slice per thread (``torch.get_num_threads()``), run in
  an OpenMP parallel region of the library's driver (``hfd_run``) when that region runs on PyTorch's own OpenMP
  threads: the only OpenMP runtime mapped in the process is one ``libgomp`` (the one PyTorch loaded: the library
  links it by name), and this is not a forked child (libgomp's threads do not survive a fork). A second pool next
  to PyTorch's would lose a core to PyTorch's workers, which spin for a while after each parallel region
  (docs/benchmarks.md, run M). Anywhere else the slices run on :func:`thread_pool` through ctypes, which releases
  the GIL during each call; the results are the same;
- cache: ``$HF_DENSESSM_CACHE`` or ``~/.cache/hf_densessm``, subfolder ``cpu_kernels``, one file per hash of the
  source, the flags, the compiler's version and the machine; written to a temporary name and renamed, so two
  processes building at once, or a build killed half-way, never leave a broken library behind;
- failure (no compiler, a compile error, an unwritable cache): :func:`load_library` returns ``None`` once per
  process with a warning naming the reason, and the ops run their PyTorch path (``backend="auto"``) or raise
  (``backend="cpu"``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from math import factorial
from pathlib import Path
from string import Template

import torch

__all__ = [
    "as_rows", "cache_dir", "find_compiler", "load_error", "load_library", "openmp_ready", "per_worker", "run_job",
    "run_parallel", "thread_pool", "vector_source", "worker_count",
]

_LOCK = threading.Lock()
_LIBRARIES: dict[str, ctypes.CDLL | None] = {}
_ERRORS: dict[str, str] = {}
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_PID = 0
_IMPORT_PID = os.getpid()
_FORKED = False
_SHARED_OPENMP: bool | None = None
#: Whether :func:`run_job` may use the OpenMP driver (tests set it to False to run the thread pool instead).
USE_OPENMP = True


def _mark_forked() -> None:
    global _FORKED
    _FORKED = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)

#: Appended to every library: the OpenMP driver of :func:`run_job` (``hfd_run``; ``hfd_openmp`` says whether the
#: library was built with OpenMP). Slice ``w`` of ``slices`` is ``[n w / slices, n (w + 1) / slices)``, as in
#: :func:`run_parallel`; each slice keeps its own index even if the runtime gives fewer threads than asked.
_DRIVER = r"""
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
typedef void (*hfd_job_fn)(int64_t worker, int64_t begin, int64_t end, const int64_t *args);
int hfd_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
void hfd_run(hfd_job_fn job, const int64_t *args, int64_t n, int64_t slices) {
#ifdef _OPENMP
    #pragma omp parallel num_threads((int)slices)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t w = t; w < slices; w += nt) {
            const int64_t b = n * w / slices, e = n * (w + 1) / slices;
            if (b < e) job(w, b, e, args);
        }
    }
#else
    (void)job; (void)args; (void)n; (void)slices;
#endif
}
"""


def cache_dir() -> Path:
    """Folder of the compiled libraries: ``$HF_DENSESSM_CACHE/cpu_kernels``, default ``~/.cache/hf_densessm``."""
    root = os.environ.get("HF_DENSESSM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_densessm")
    return Path(root) / "cpu_kernels"


def find_compiler() -> str | None:
    """Path of the C compiler: ``$CC`` if set (and found), else ``cc``, else ``gcc``; ``None`` if none is found."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _compile(compiler: str, source_path: Path, out_path: Path, flags: list[str]) -> str | None:
    """Compile; return None on success, else the compiler's message."""
    cmd = [compiler, *flags, str(source_path), "-o", str(out_path), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as error:
        return f"{' '.join(cmd)}: {error}"
    return None if done.returncode == 0 else f"{' '.join(cmd)}:\n{done.stderr.strip()[-2000:]}"


def load_library(name: str, source: str) -> ctypes.CDLL | None:
    """The compiled library of C ``source``, built on first use and cached on disk (module docstring).

    Args:
        name: a short name for the cache file and messages (e.g. ``"selective_scan"``).
        source: the C source text.

    Returns:
        The loaded :class:`ctypes.CDLL`, or ``None`` when it cannot be built here (the reason is warned once and
        kept: :func:`load_error`).
    """
    with _LOCK:
        if name in _LIBRARIES:
            return _LIBRARIES[name]
        library, error = None, None
        compiler = find_compiler()
        source += _DRIVER
        if compiler is None:
            error = "no C compiler found (set $CC or install cc/gcc)"
        else:
            base_flags = ["-O3", "-std=c11", "-fPIC", "-shared"]
            key = hashlib.sha256(
                "\0".join([source, " ".join(base_flags), _compiler_version(compiler), platform.machine(),
                           platform.system()]).encode()
            ).hexdigest()[:24]
            folder = cache_dir()
            target = folder / f"{name}-{key}.so"
            try:
                if not target.exists():
                    folder.mkdir(parents=True, exist_ok=True)
                    with tempfile.TemporaryDirectory(dir=folder) as tmp:
                        src = Path(tmp) / f"{name}.c"
                        src.write_text(source)
                        built = Path(tmp) / f"{name}.so"
                        # without OpenMP (e.g. a compiler with no OpenMP runtime) the thread pool runs the slices;
                        # without -march=native, e.g. compilers that spell it -mcpu=native
                        for extra in (["-fopenmp", "-march=native"], ["-march=native"], ["-fopenmp"], []):
                            error = _compile(compiler, src, built, base_flags + extra)
                            if error is None:
                                break
                        if error is None:
                            os.replace(built, target)  # atomic: other processes see the old state or the new file
                if error is None:
                    library = ctypes.CDLL(str(target))
                    library.hfd_openmp.restype = ctypes.c_int
                    library.built_with_openmp = bool(library.hfd_openmp())  # read once, not per kernel call
                    library.hfd_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
                    library.hfd_run.restype = None
            except OSError as oserror:
                error = f"{type(oserror).__name__}: {oserror}"
        if error is not None:
            _ERRORS[name] = error
            warnings.warn(
                f"hf_densessm: the compiled CPU kernel {name!r} is not available ({error.splitlines()[0]}); the "
                "PyTorch path runs instead (slower on the CPU, same results).",
                RuntimeWarning,
                stacklevel=3,
            )
        _LIBRARIES[name] = library
        return library


def load_error(name: str) -> str | None:
    """Why :func:`load_library` returned ``None`` for ``name`` in this process (``None`` if it did not)."""
    return _ERRORS.get(name)


def thread_pool() -> tuple[ThreadPoolExecutor, int]:
    """A process-wide pool of ``torch.get_num_threads()`` workers and its size; rebuilt when that number changes and
    in a forked child (whose copy of the pool has no threads)."""
    global _POOL, _POOL_SIZE, _POOL_PID
    size = max(1, torch.get_num_threads())
    with _LOCK:
        if _POOL is None or _POOL_SIZE != size or _POOL_PID != os.getpid():
            if _POOL is not None and _POOL_PID == os.getpid():
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=size, thread_name_prefix="hf_densessm_cpu")
            _POOL_SIZE, _POOL_PID = size, os.getpid()
        return _POOL, _POOL_SIZE


def worker_count(n_items: int) -> int:
    """How many slices :func:`run_parallel` cuts ``n_items`` into by default (the pool's size, at most
    ``n_items``, at least 1): the number of per-worker buffers a kernel needs."""
    return max(1, min(n_items, thread_pool()[1]))


def _shared_openmp_runtime() -> bool:
    """Whether exactly one OpenMP runtime is mapped in this process and it is a ``libgomp`` (Linux; read once,
    after a library was loaded): then the libraries' OpenMP regions run on PyTorch's OpenMP threads."""
    global _SHARED_OPENMP
    if _SHARED_OPENMP is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = None
        runtimes = set()
        for line in (maps or "").splitlines():
            path = line.split()[-1] if line.split() else ""
            base = os.path.basename(path)
            if base.startswith(("libgomp", "libiomp", "libomp")):
                runtimes.add(path)
        _SHARED_OPENMP = maps is not None and len(runtimes) == 1 and "libgomp" in os.path.basename(next(iter(runtimes)))
    return _SHARED_OPENMP


def openmp_ready(library: ctypes.CDLL) -> bool:
    """Whether :func:`run_job` runs ``library``'s jobs in its OpenMP driver here (module docstring)."""
    return (
        USE_OPENMP
        and not _FORKED
        and os.getpid() == _IMPORT_PID
        and library.built_with_openmp
        and _shared_openmp_runtime()
    )


def as_rows(x: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, int]:
    """``x`` as a ``(rows, width)`` tensor (``width`` default: its last dimension) with unit stride along ``width``,
    for a kernel that walks rows: a view when the leading dimensions collapse into one row stride, else a contiguous
    copy; and that row stride (elements)."""
    width = x.shape[-1] if width is None else width
    try:
        rows = x.view(-1, width)
    except RuntimeError:
        rows = x.reshape(-1, width).contiguous()
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, rows.stride(0)


def per_worker(buffer) -> list[int]:
    """The job arguments of a per-worker buffer ``(workers, ...)``: worker 0's address and the stride from one worker's
    part to the next, in bytes (a job reads worker ``w``'s part at ``address + w * stride``)."""
    return [buffer.data_ptr(), buffer.stride(0) * buffer.element_size()]


def run_job(library: ctypes.CDLL, name: str, args, n_items: int, workers: int | None = None) -> int:
    """Run the C job ``name`` of ``library`` (``void name(int64_t worker, int64_t begin, int64_t end, const int64_t
    *args)``) on ``workers`` contiguous slices of ``range(n_items)`` (default: :func:`worker_count`): in the
    library's OpenMP driver where :func:`openmp_ready`, else on :func:`run_parallel`. ``args`` are the job's
    arguments as 64-bit integers (pointers as addresses). Returns the number of slices (slice ``w`` may use the
    ``w``-th of per-worker buffers)."""
    job = getattr(library, name)
    packed = (ctypes.c_int64 * max(1, len(args)))(*args)
    slices = worker_count(n_items) if workers is None else max(1, min(n_items, workers))
    if openmp_ready(library):
        library.hfd_run(ctypes.cast(job, ctypes.c_void_p), packed, n_items, slices)
        return slices
    return run_parallel(
        lambda w, b, e: job(ctypes.c_int64(w), ctypes.c_int64(b), ctypes.c_int64(e), packed), n_items, slices
    )


def run_parallel(fn, n_items: int, workers: int | None = None) -> int:
    """Call ``fn(worker, begin, end)`` on ``workers`` contiguous slices of ``range(n_items)`` (default: the pool's
    size, at most ``n_items``), the first in this thread and the others in :func:`thread_pool`; re-raises the
    first exception. Returns the number of slices (``worker`` runs ``0 .. slices - 1``)."""
    pool, size = thread_pool()
    workers = worker_count(n_items) if workers is None else max(1, min(n_items, workers))
    bounds = [n_items * w // workers for w in range(workers + 1)]
    futures = [pool.submit(fn, w, bounds[w], bounds[w + 1]) for w in range(1, workers)]
    fn(0, bounds[0], bounds[1])
    for future in futures:
        future.result()
    return workers


# The vector prelude every kernel shares, one copy per compute type: $real (element), $ireal (same-width integer),
# $W (lanes in 64 bytes), $sfx (name suffix), exponential constants ($MAGIC = 1.5 * 2^mantissa_bits: adding it
# rounds to an integer kept in the low bits of the mantissa).
_PRELUDE = Template(r"""
typedef $real vec$sfx __attribute__((vector_size($W * sizeof($real))));
typedef $ireal ivec$sfx __attribute__((vector_size($W * sizeof($real))));
#define ZERO$sfx ((vec$sfx){0})

static inline vec$sfx vexp$sfx(vec$sfx x) {
    const vec$sfx lo = ZERO$sfx + ($real)$EXP_LO, hi = ZERO$sfx + ($real)$EXP_HI;
    const vec$sfx magic = ZERO$sfx + ($real)$MAGIC;
    ivec$sfx m = x < lo;
    x = (vec$sfx)((m & (ivec$sfx)lo) | (~m & (ivec$sfx)x));
    m = x > hi;
    x = (vec$sfx)((m & (ivec$sfx)hi) | (~m & (ivec$sfx)x));
    vec$sfx t = x * ($real)1.44269504088896340736 + magic;
    vec$sfx n = t - magic;
    ivec$sfx ni = (ivec$sfx)t - (ivec$sfx)magic;
    vec$sfx r = x - n * ($real)$LN2_HI - n * ($real)$LN2_LO;
    vec$sfx p = $POLY;
    ivec$sfx bits = (ni + $EXP_BIAS) << $MANT_BITS;
    return p * (vec$sfx)bits;
}

static inline vec$sfx vsigmoid$sfx(vec$sfx x) { return ($real)1 / (($real)1 + vexp$sfx(-x)); }

/* PyTorch's softplus (threshold 20: x itself above it), log(1 + e^x) = max(x, 0) + log1p(t), t = e^{-|x|} in (0, 1],
   log1p(t) = 2 atanh(s), s = t / (2 + t) in (0, 1/3]: an odd series in s, no rounding of 1 + t. */
static inline vec$sfx vsoftplus$sfx(vec$sfx x) {
    const vec$sfx zero = ZERO$sfx;
    ivec$sfx neg = x < zero;
    const vec$sfx ax = (vec$sfx)((neg & (ivec$sfx)(-x)) | (~neg & (ivec$sfx)x));
    const vec$sfx t = vexp$sfx(-ax), s = t / (($real)2 + t), r = s * s;
    const vec$sfx l1p = ($real)2 * s * $ATANH;
    const vec$sfx pos = (vec$sfx)(~neg & (ivec$sfx)x);   /* max(x, 0) */
    ivec$sfx big = x > ZERO$sfx + ($real)20;
    const vec$sfx sp = pos + l1p;
    return (vec$sfx)((big & (ivec$sfx)x) | (~big & (ivec$sfx)sp));
}

static inline vec$sfx vld$sfx(const $real *p, int64_t nl) {
    vec$sfx v = ZERO$sfx;
    if (nl == $W) memcpy(&v, p, sizeof v); else for (int64_t l = 0; l < nl; l++) v[l] = p[l];
    return v;
}
static inline void vst$sfx($real *p, vec$sfx v, int64_t nl) {
    if (nl == $W) memcpy(p, &v, sizeof v); else for (int64_t l = 0; l < nl; l++) p[l] = v[l];
}
static inline vec$sfx vlds$sfx(const $real *p, int64_t stride, int64_t nl) {
    vec$sfx v = ZERO$sfx;
    for (int64_t l = 0; l < nl; l++) v[l] = p[l * stride];
    return v;
}
static inline void vsts$sfx($real *p, int64_t stride, vec$sfx v, int64_t nl) {
    for (int64_t l = 0; l < nl; l++) p[l * stride] = v[l];
}
static inline $real hsum$sfx(vec$sfx v) {
    $real s = 0;
    for (int l = 0; l < $W; l++) s += v[l];
    return s;
}

""")

_TYPES = (
    # real, ireal, W, sfx, EXP_LO, EXP_HI, MAGIC, LN2_HI, LN2_LO, Taylor degree, EXP_BIAS, MANT_BITS
    ("float", "int32_t", 16, "_f32", "-87.0", "88.0", "12582912.0", "0.693359375", "-2.12194440e-4", 7, 127, 23),
    ("double", "int64_t", 8, "_f64", "-708.0", "709.0", "6755399441055744.0", "6.93147180369123816490e-01",
     "1.90821492927058770002e-10", 13, 1023, 52),
)


def _horner(coefficients: list[str]) -> str:
    """``c0 + r * (c1 + r * (...))`` as C text."""
    text = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        text = f"({c} + r * {text})"
    return text


def vector_source(header: str, body: Template) -> str:
    """C source of a kernel for float32 (suffix ``_f32``, 16 lanes) and float64 (``_f64``, 8 lanes).

    The shared prelude defines, per type, ``vec$sfx`` (64 bytes of ``$real``, GCC vector extensions: the compiler
    maps it to AVX-512, AVX2 or NEON registers), ``ZERO$sfx``, ``vexp$sfx`` (Cody-Waite range reduction and a Taylor
    polynomial: degree 7 in float32, relative error below 2e-7; degree 13 in float64, below 1e-15; arguments
    clamped to the normal range, so no overflow and no denormals; compilers vectorize ``exp`` only under
    ``-ffast-math``, which this package never uses), ``vsigmoid$sfx``, ``vsoftplus$sfx`` (PyTorch's softplus,
    threshold 20, as ``max(x, 0) + 2 atanh(t / (2 + t))``, ``t = exp(-|x|)``), loads/stores of ``nl <= W`` lanes
    (``vld``, ``vst``; strided ``vlds``, ``vsts``) and ``hsum$sfx``.

    Args:
        header: C text once, after the standard includes (e.g. an argument struct).
        body: the kernel's C text with the prelude's placeholders (``$real``, ``$W``, ``$sfx``).
    """
    parts = ["#include <stdint.h>\n#include <string.h>\n#include <math.h>\n", header]
    for real, ireal, lanes, sfx, lo, hi, magic, ln2_hi, ln2_lo, degree, bias, mant in _TYPES:
        poly = _horner([f"({real}){1.0 / factorial(k)!r}" for k in range(degree + 1)])
        # atanh(s) / s = sum_k r^k / (2k + 1), r = s^2 <= 1/9: 8 terms in float32, 17 in float64 (below the rounding)
        atanh = _horner([f"({real}){1.0 / (2 * k + 1)!r}" for k in range(8 if real == "float" else 17)])
        fields = dict(real=real, ireal=ireal, W=lanes, sfx=sfx, EXP_LO=lo, EXP_HI=hi, MAGIC=magic, LN2_HI=ln2_hi,
                      LN2_LO=ln2_lo, POLY=poly, EXP_BIAS=bias, MANT_BITS=mant, ATANH=atanh)
        parts += [_PRELUDE.substitute(fields), body.substitute(fields)]
    return "".join(parts)
