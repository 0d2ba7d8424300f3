"""llama.cpp's own block (de)quantizers, called through ctypes: the oracle for test_kquants.py.

llama-cpp-python ships `libggml-base.so`, which exports ggml-quants.c's reference functions
`quantize_row_<type>_ref(const float *x, void *y, int64_t k)` and
`dequantize_row_<type>(const void *x, float *y, int64_t k)`. That library is compiled for baseline
x86-64 (the -march=native flags go to libggml-cpu only), so it has no fused multiply-add: the
rounding of every float operation is the one written in the C source. `assert_fma_free` proves it
by disassembling the library, because a build with FMA contraction rounds ~6% of Q4_K blocks
differently and would make a poor oracle.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

import numpy as np

# GGML type name -> (values per block, bytes per block, C name of the type in ggml-quants.c)
TYPES = {"Q4_0": (32, 18, "q4_0"), "Q5_0": (32, 22, "q5_0"), "Q8_0": (32, 34, "q8_0"),
         "Q4_K": (256, 144, "q4_K"), "Q5_K": (256, 176, "q5_K"), "Q6_K": (256, 210, "q6_K")}


def library_path() -> Path:
    import llama_cpp

    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: is llama-cpp-python installed with its shared libraries?")
    return path


@cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path()))
    for _, _, c in TYPES.values():
        for fn in (getattr(lib, f"quantize_row_{c}_ref"), getattr(lib, f"dequantize_row_{c}")):
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return lib


@cache
def assert_fma_free() -> None:
    """Fail unless libggml-base.so contains no fused multiply-add instruction.

    Uses objdump (binutils; CI has it because it compiles llama.cpp). A missing objdump is an error,
    not a skip: without this proof a byte-equality test could pass against the wrong reference."""
    objdump = shutil.which("objdump")
    if objdump is None:
        raise RuntimeError("objdump not found: install binutils to prove the llama.cpp oracle is FMA-free")
    asm = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(library_path())], check=True,
                         capture_output=True, text=True).stdout
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        mnemonics = ("vfmadd", "vfmsub", "vfnmadd", "vfnmsub")
    elif machine in ("aarch64", "arm64"):
        mnemonics = ("fmadd", "fmsub", "fnmadd", "fnmsub", "fmla", "fmls")
    else:
        raise RuntimeError(f"no FMA mnemonics known for {machine}; extend ggml_oracle.assert_fma_free")
    instructions = [line.split("\t")[-1] for line in asm.splitlines() if line.count("\t") >= 1]
    found = [i for i in instructions if i.lstrip().startswith(mnemonics)]
    if not instructions:
        raise RuntimeError(f"objdump printed no instructions for {library_path()}")
    if found:
        raise AssertionError(f"{library_path()} has {len(found)} FMA instructions (first: {found[0].strip()!r}); "
                             "it is not the non-FMA reference build")


def quantize(x: np.ndarray, name: str) -> np.ndarray:
    """llama.cpp's quantize_row_<type>_ref on float32 rows (..., n) -> uint8 (..., n // block * bytes)."""
    block, nbytes, c = TYPES[name]
    x = np.ascontiguousarray(x, dtype=np.float32)
    assert x.shape[-1] % block == 0
    out = np.zeros((*x.shape[:-1], x.shape[-1] // block * nbytes), dtype=np.uint8)
    getattr(_lib(), f"quantize_row_{c}_ref")(x.ctypes.data, out.ctypes.data, x.size)
    return out


def dequantize(data: np.ndarray, name: str) -> np.ndarray:
    """llama.cpp's dequantize_row_<type> on uint8 rows (..., row_bytes) -> float32 (..., n)."""
    block, nbytes, c = TYPES[name]
    data = np.ascontiguousarray(data, dtype=np.uint8)
    assert data.shape[-1] % nbytes == 0
    out = np.empty((*data.shape[:-1], data.shape[-1] // nbytes * block), dtype=np.float32)
    getattr(_lib(), f"dequantize_row_{c}")(data.ctypes.data, out.ctypes.data, out.size)
    return out
