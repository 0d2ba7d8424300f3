"""Give MLX's CPU backend an optimized BLAS on Linux.

The ``mlx[cpu]`` wheel for Linux links the netlib *reference* BLAS/LAPACK
(a few GFLOP/s for float32 GEMM). ``libmlx.so`` imports plain LP64 symbols
(``cblas_sgemm``, ``sgesdd_``, ...), so a library exporting the same names that
is loaded into the global symbol scope *before* ``import mlx`` wins the symbol
lookup. We load the system's OpenBLAS built with ``DYNAMIC_ARCH``: one library
holding kernels for every CPU of its architecture, chosen when it loads, so it
runs on any x86-64 or aarch64 machine (Debian/Ubuntu: ``libopenblas0-pthread``,
which ``make setup`` installs; Fedora: ``openblas-threads``).

An OpenBLAS older than the CPU it runs on does not recognise it and falls back to
its oldest kernels (Debian 12's 0.3.21 picks SSE3 "Prescott" on a 2023 Xeon); then
we reload it with the newest kernels the CPU's flags allow (``OPENBLAS_CORETYPE``).

``REF_IMPL_BLAS=reference`` keeps MLX's bundled reference BLAS;
``REF_IMPL_BLAS=/path/to/libopenblas.so`` loads that library instead.
"""

from __future__ import annotations

import _ctypes
import contextlib
import ctypes
import ctypes.util
import os
import platform
import re
import sys
import warnings
from collections.abc import Iterator

ENV_VAR = "REF_IMPL_BLAS"
#: What was loaded (a description) or why nothing was (``"not loaded: ..."``).
BLAS_INFO: str | None = None
_loaded: str | None = None

# A build without DYNAMIC_ARCH runs one CPU's kernels: the /proc/cpuinfo flags each target
# needs, so that a library built for another CPU falls back instead of dying of SIGILL.
_AVX512 = {"avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
_TARGET_FLAGS = {
    "SKYLAKEX": _AVX512, "COOPERLAKE": _AVX512 | {"avx512_bf16"},
    "SAPPHIRERAPIDS": _AVX512 | {"avx512_bf16", "amx_tile"},
    "HASWELL": {"avx2", "fma"}, "ZEN": {"avx2", "fma"},
    "NEOVERSEN2": {"asimd", "sve", "sve2", "bf16"}, "NEOVERSEN1": {"asimd"}, "ARMV8": set(),
}
# OpenBLAS cores (openblas_get_corename) with AVX2+FMA float32 kernels; any other core on a CPU
# that has AVX2 and FMA is the fallback of an OpenBLAS that did not recognise the CPU.
_AVX2_CORES = {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids"}


def _cpu_flags() -> set[str]:
    """CPU feature flags of this machine (x86 ``flags`` / arm64 ``Features`` in /proc/cpuinfo)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    return set()


def best_x86_core(flags: set[str]) -> str | None:
    """The OpenBLAS core name (``OPENBLAS_CORETYPE``) with the widest float32 kernels these x86
    CPU flags can run, or None where no AVX2 kernels can (then OpenBLAS's own choice stands)."""
    if _AVX512 <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def _find_openblas() -> str | None:
    """Path or soname of the system OpenBLAS (the pthreads build first, as Fedora names it)."""
    return next(filter(None, map(ctypes.util.find_library, ("openblasp", "openblas"))), None)


def _sgemm_works(lib: ctypes.CDLL) -> bool:
    """Check ``cblas_sgemm`` (row-major, LP64 ints, transposed B) on a 2x3 @ (2x3)^T product."""
    f = lib.cblas_sgemm
    f.restype = None
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                       ctypes.c_void_p, ctypes.c_int]
    a, b, c = (ctypes.c_float * 6)(1, 2, 3, 4, 5, 6), (ctypes.c_float * 6)(1, 0, 2, 0, 1, -1), (ctypes.c_float * 4)()
    f(101, 111, 112, 2, 2, 3, 1.0, a, 3, b, 3, 0.0, c, 2)  # RowMajor, NoTrans, Trans
    return list(c) == [7.0, -1.0, 16.0, -1.0]


def _open(path: str, coretype: str | None = None) -> tuple[ctypes.CDLL, str, str]:
    """Load ``path`` privately (RTLD_LOCAL: tested before MLX can see it), with OpenBLAS's
    ``OPENBLAS_CORETYPE`` set to ``coretype`` while it initialises; return (lib, config, core)."""
    saved = os.environ.get("OPENBLAS_CORETYPE")
    if coretype:
        os.environ["OPENBLAS_CORETYPE"] = coretype
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    finally:
        if coretype:            # OpenBLAS reads it once, at load: leave the environment as it was
            os.environ.pop("OPENBLAS_CORETYPE") if saved is None else os.environ.update(OPENBLAS_CORETYPE=saved)
    lib.openblas_get_config.restype = lib.openblas_get_corename.restype = ctypes.c_char_p
    return lib, lib.openblas_get_config().decode().strip(), lib.openblas_get_corename().decode()


def load_optimized_blas() -> str | None:
    """Load an optimized BLAS into the global symbol scope so MLX's CPU backend uses it.

    Call before ``mlx`` is imported. Returns a description (version/config, kernels,
    threads, path) or None; the reason for None is kept in ``BLAS_INFO``.
    Honours ``REF_IMPL_BLAS`` (``reference``, or a library path), ``OPENBLAS_CORETYPE``
    and ``OPENBLAS_NUM_THREADS``.
    """
    global BLAS_INFO, _loaded
    if _loaded:
        return _loaded

    def skip(reason: str) -> None:
        global BLAS_INFO
        BLAS_INFO = f"not loaded: {reason}"

    choice = os.environ.get(ENV_VAR, "").strip()
    if choice.lower() in ("reference", "off", "0", "none"):
        return skip(f"disabled by {ENV_VAR}={choice}")
    if not sys.platform.startswith("linux"):
        return skip(f"not needed on {sys.platform}")
    if "mlx.core" in sys.modules:
        warnings.warn("ref_impl.platform.blas: mlx is already imported; MLX keeps its reference BLAS",
                      RuntimeWarning, stacklevel=2)
        return skip("mlx was imported first")
    path = choice or _find_openblas()
    if path is None:
        return skip("no system OpenBLAS found (Debian/Ubuntu: apt-get install libopenblas0-pthread; "
                    "Fedora: dnf install openblas-threads)")
    try:
        lib, config, core = _open(path)
    except OSError as e:
        return skip(f"cannot load {path}: {e}")
    except AttributeError:
        return skip(f"{path} is not OpenBLAS (no openblas_get_config)")
    why = "chosen by OpenBLAS for this CPU"
    flags = _cpu_flags()
    if "DYNAMIC_ARCH" not in config:
        target = next((t for t in _TARGET_FLAGS if re.search(rf"\b{t}\b", config.upper())), None)
        if target is None or not _TARGET_FLAGS[target] <= flags:
            return skip(f"{path} is built for {target or 'an unknown CPU'} only ({config}); this CPU lacks "
                        f"{sorted(_TARGET_FLAGS.get(target, {'?'}) - flags)}")
        why = f"the only kernels of this {target} build"
    elif "OPENBLAS_CORETYPE" in os.environ:
        why = f"OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']}"
    elif platform.machine() == "x86_64" and core.lower() not in _AVX2_CORES and (best := best_x86_core(flags)):
        detected = core
        _ctypes.dlclose(lib._handle)    # unloaded (nothing else holds it), so the reload re-initialises
        lib, config, core = _open(path, best)
        why = f"forced: OpenBLAS {config.split()[1]} took this CPU for {detected}; its flags allow {best}"
    if "USE64BITINT" in config:
        return skip(f"{path} is ILP64 ({config}); MLX calls the LP64 interface")
    if not _sgemm_works(lib):
        return skip(f"{path}: cblas_sgemm self-test gave wrong results")
    ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)  # promote to the global scope
    _loaded = BLAS_INFO = (f"{config} (kernels {core}: {why}; threads: {lib.openblas_get_num_threads()}) "
                           f"from {os.path.realpath(path) if os.path.isabs(path) else path}")
    return _loaded


def blas_info() -> str:
    """Describe the BLAS that MLX's CPU backend uses in this process (for ``machine.blas``)."""
    if _loaded:
        return _loaded
    if sys.platform == "darwin":
        return "Apple Accelerate (MLX on macOS)"
    reason = BLAS_INFO or "load_optimized_blas() was not called"
    return f"reference BLAS/LAPACK bundled with mlx (netlib); OpenBLAS {reason}"


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run OpenBLAS on one thread inside the block, then restore its thread count. Timings on a
    busy 2-core machine need it: two BLAS threads then wait on each other for tens of ms."""
    lib = ctypes.CDLL(None)
    if not hasattr(lib, "openblas_set_num_threads"):   # Accelerate (macOS) or the reference BLAS
        yield
        return
    threads = lib.openblas_get_num_threads()
    lib.openblas_set_num_threads(1)
    try:
        yield
    finally:
        lib.openblas_set_num_threads(threads)
