"""Give MLX's CPU backend an optimized BLAS on Linux.

The ``mlx[cpu]`` wheel for Linux links the netlib *reference* BLAS/LAPACK
(a few GFLOP/s for float32 GEMM). ``libmlx.so`` imports plain LP64 symbols
(``cblas_sgemm``, ``sgesdd_``, ...), so a library exporting the same names that
is loaded into the global symbol scope *before* ``import mlx`` wins the symbol
lookup. We use the OpenBLAS of the ``cmeel-openblas`` wheel, which needs the
system ``libgfortran.so.5`` (Debian/Ubuntu: ``apt-get install libgfortran5``).

Set ``REF_IMPL_BLAS=reference`` to keep MLX's bundled reference BLAS.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import re
import sys
import warnings
from collections.abc import Iterator

ENV_VAR = "REF_IMPL_BLAS"
#: What was loaded (a description) or why nothing was (``"not loaded: ..."``).
BLAS_INFO: str | None = None
_loaded: str | None = None

# cmeel-openblas is built for one CPU (DYNAMIC_ARCH=OFF): the /proc/cpuinfo flags
# each build target needs, so that a wrong CPU falls back instead of dying of SIGILL.
_TARGET_FLAGS = {
    "SKYLAKEX": {"avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"},
    "COOPERLAKE": {"avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"},
    "HASWELL": {"avx2", "fma"}, "ZEN": {"avx2", "fma"},
    "NEOVERSEN2": {"asimd", "sve", "sve2", "bf16"}, "NEOVERSEN1": {"asimd"}, "ARMV8": set(),
}


def _find_openblas() -> tuple[str, str]:
    """Return (library path, ``openblas_config`` line of its .pc file) from the installed wheel."""
    dist = importlib.metadata.distribution("cmeel-openblas")  # PackageNotFoundError if absent
    files = {f.name: f for f in dist.files or ()}
    lib = str(dist.locate_file(files["libopenblas.so.0"]))
    pc = dist.locate_file(files["openblas.pc"]).read_text() if "openblas.pc" in files else ""
    config = next((line for line in pc.splitlines() if line.startswith("openblas_config=")), "")
    return lib, config


def _cpu_flags() -> set[str]:
    """CPU feature flags of this machine (x86 ``flags`` / arm64 ``Features`` in /proc/cpuinfo)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    return set()


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


def load_optimized_blas() -> str | None:
    """Load cmeel-openblas into the global symbol scope so MLX's CPU backend uses it.

    Call before ``mlx`` is imported. Returns a description (path, version/config,
    kernel, threads) or None; the reason for None is kept in ``BLAS_INFO``.
    Honours ``REF_IMPL_BLAS=reference`` (disable) and ``OPENBLAS_NUM_THREADS``.
    """
    global BLAS_INFO, _loaded
    if _loaded:
        return _loaded

    def skip(reason: str) -> None:
        global BLAS_INFO
        BLAS_INFO = f"not loaded: {reason}"

    if os.environ.get(ENV_VAR, "").strip().lower() in ("reference", "off", "0", "none"):
        return skip(f"disabled by {ENV_VAR}={os.environ[ENV_VAR]}")
    if not sys.platform.startswith("linux"):
        return skip(f"not needed on {sys.platform}")
    if "mlx.core" in sys.modules:
        warnings.warn("ref_impl.blas: mlx is already imported; MLX keeps its reference BLAS",
                      RuntimeWarning, stacklevel=2)
        return skip("mlx was imported first")
    try:
        path, config = _find_openblas()
    except (importlib.metadata.PackageNotFoundError, KeyError):
        return skip("cmeel-openblas is not installed")
    if not re.search(r"DYNAMIC_ARCH=(ON|1)\b", config):
        target = next((t for t in _TARGET_FLAGS if f" {t} " in config), None)
        if target is None or not _TARGET_FLAGS[target] <= _cpu_flags():
            return skip(f"OpenBLAS built for {target or 'an unknown CPU'}; this CPU lacks "
                        f"{sorted(_TARGET_FLAGS.get(target, {'?'}) - _cpu_flags())}")
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)  # private first: test before exposing it
    except OSError as e:
        hint = " (install it: apt-get install libgfortran5)" if "libgfortran" in str(e) else ""
        return skip(f"{e}{hint}")
    lib.openblas_get_config.restype = lib.openblas_get_corename.restype = ctypes.c_char_p
    version = lib.openblas_get_config().decode()
    if "USE64BITINT" in version:
        return skip(f"{path} is ILP64 ({version}); MLX calls the LP64 interface")
    if not _sgemm_works(lib):
        return skip(f"{path}: cblas_sgemm self-test gave wrong results")
    ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)  # promote to the global scope
    _loaded = BLAS_INFO = (f"{version.strip()} (core {lib.openblas_get_corename().decode()}, "
                           f"{lib.openblas_get_num_threads()} threads) from {path}")
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
