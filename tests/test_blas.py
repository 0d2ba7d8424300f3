"""ref_impl.platform.blas: the BLAS interposed under MLX's CPU backend computes what numpy computes.

Each check runs in a fresh interpreter, because only the import order (loader, then mlx)
decides which BLAS MLX binds to. The fallbacks (no library, not OpenBLAS, a wrong sgemm, an
OpenBLAS that does not know the CPU) are driven by a stand-in OpenBLAS compiled here from C.
No timing here: the speed of each BLAS is a benchmark's business.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ref_impl.platform import blas

ROOT = Path(__file__).resolve().parent.parent

# Runs in the child: load (or not), import mlx, compare CPU matmuls and LAPACK calls with numpy.
CHILD = r"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if MLX_FIRST:
        import mlx.core
    import ref_impl.platform.blas as rb          # ref_impl/__init__ calls load_optimized_blas()
    loaded = rb.load_optimized_blas()   # idempotent: same answer again
import mlx.core as mx
import numpy as np

rng = np.random.default_rng(0)
def r(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)

def check(name, got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    scale = max(np.abs(want).max(), 1.0)
    err = float(np.abs(got - want).max() / scale)
    assert err < 1e-4, f"{name}: max relative error {err}"

with mx.stream(mx.cpu):
    for m, k, n in [(64, 64, 64), (1, 300, 17), (257, 129, 65), (33, 1, 70), (200, 512, 3)]:
        a, b = r(m, k), r(k, n)
        A, B = mx.array(a), mx.array(b)
        check(f"{m}x{k}x{n}", A @ B, a.astype(np.float64) @ b)
        check(f"{m}x{k}x{n} both transposed", B.T @ A.T, (a.astype(np.float64) @ b).T)
        At, Bt = mx.array(np.ascontiguousarray(a.T)), mx.array(np.ascontiguousarray(b.T))
        check(f"{m}x{k}x{n} A^T stored", At.T @ B, a.astype(np.float64) @ b)
        check(f"{m}x{k}x{n} B^T stored", A @ Bt.T, a.astype(np.float64) @ b)
    a, b = r(3, 4, 33, 70), r(3, 4, 70, 45)
    check("batched", mx.array(a) @ mx.array(b), a.astype(np.float64) @ b)
    check("broadcast batch", mx.array(a) @ mx.array(b[0, 0]), a.astype(np.float64) @ b[0, 0])
    c, a, b = r(40, 50), r(40, 30), r(30, 50)
    check("addmm", mx.addmm(mx.array(c), mx.array(a), mx.array(b), alpha=2.0, beta=0.5),
          0.5 * c + 2.0 * (a.astype(np.float64) @ b))
    a, b = r(31, 47, dtype=np.float64), r(47, 29, dtype=np.float64)
    check("float64 (dgemm)", mx.array(a) @ mx.array(b), a @ b)
    a = r(20, 30) + 1j * r(20, 30)
    b = r(30, 10) + 1j * r(30, 10)
    check("complex64 (cgemm)", mx.array(a.astype(np.complex64)) @ mx.array(b.astype(np.complex64)), a @ b)
    s = r(48, 48) + 48 * np.eye(48, dtype=np.float32)
    check("inv (sgetrf/sgetri)", mx.linalg.inv(mx.array(s)), np.linalg.inv(s.astype(np.float64)))
    spd = s @ s.T
    check("cholesky (spotrf)", mx.linalg.cholesky(mx.array(spd)), np.linalg.cholesky(spd.astype(np.float64)))
    check("svd (sgesdd)", mx.linalg.svd(mx.array(s), compute_uv=False),
          np.linalg.svd(s.astype(np.float64), compute_uv=False))
    check("eigvalsh (ssyevd)", mx.linalg.eigvalsh(mx.array(spd)), np.linalg.eigvalsh(spd.astype(np.float64)))

import ctypes
try:                                     # the stand-in's call count, where it is in the global scope
    calls = ctypes.c_long.in_dll(ctypes.CDLL(None), "stand_in_sgemm_calls").value
except ValueError:
    calls = None
print(json.dumps({"loaded": loaded, "BLAS_INFO": rb.BLAS_INFO, "blas_info": rb.blas_info(),
                  "stand_in_calls": calls, "warnings": [str(w.message) for w in caught]}))
"""


def run_child(env_var: str | None = None, mlx_first: bool = False, **env_extra: str) -> dict:
    """Run CHILD in a fresh interpreter from the repository root; return its JSON report."""
    env = {k: v for k, v in os.environ.items() if k not in ("REF_IMPL_BLAS", "OPENBLAS_CORETYPE")}
    if env_var is not None:
        env["REF_IMPL_BLAS"] = env_var
    env.update(env_extra)
    code = f"MLX_FIRST = {mlx_first}\n{CHILD}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# A stand-in OpenBLAS: the entry points ref_impl.platform.blas calls and a plain, correct cblas_sgemm that counts its
# calls. Like an OpenBLAS older than the CPU, it reports "Prescott" unless OPENBLAS_CORETYPE names a core.
STAND_IN = r"""
#include <stdlib.h>
static const char *core = "Prescott";
long stand_in_sgemm_calls = 0;
__attribute__((constructor)) static void init(void) {
    const char *forced = getenv("OPENBLAS_CORETYPE");
    if (forced) core = forced;
}
char *openblas_get_config(void) { return "OpenBLAS 0.0.0 DYNAMIC_ARCH stand-in"; }
const char *openblas_get_corename(void) { return core; }
int openblas_get_num_threads(void) { return 1; }
void openblas_set_num_threads(int n) { (void)n; }
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    stand_in_sgemm_calls++;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int p = 0; p < k; p++) {   /* op(A)[i, p] and op(B)[p, j]; 111 = no transpose, 101 = row-major */
                int ar = ta == 111 ? i : p, ac = ta == 111 ? p : i, br = tb == 111 ? p : j, bc = tb == 111 ? j : p;
                s += (double)(order == 101 ? a[ar * lda + ac] : a[ac * lda + ar])
                     * (order == 101 ? b[br * ldb + bc] : b[bc * ldb + br]);
            }
            float *out = order == 101 ? &c[i * ldc + j] : &c[j * ldc + i];
            *out = (float)(alpha * (s + OFF) + (beta == 0 ? 0 : beta * *out));
        }
}
"""


def stand_in(tmp_path: Path, off: int = 0) -> str:
    """Compile STAND_IN into a shared library; off != 0 makes its sgemm wrong by that much per entry."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (README: both commands need one)"
    src, lib = tmp_path / "stand_in.c", tmp_path / f"libopenblas-stand-in-{off}.so"
    src.write_text(STAND_IN)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", f"-DOFF={off}", "-o", str(lib), str(src)], check=True)
    return str(lib)


def test_with_loader_mlx_matches_numpy():
    out = run_child()
    assert out["blas_info"].strip()
    if out["loaded"]:
        assert "OpenBLAS" in out["loaded"] and out["blas_info"] == out["loaded"]
    else:
        assert out["BLAS_INFO"].startswith("not loaded:")


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the loader acts on Linux only")
x86_avx2 = pytest.mark.skipif(platform.machine() != "x86_64" or blas.best_x86_core(blas._cpu_flags()) is None,
                              reason="forcing AVX2 kernels needs an x86-64 CPU with AVX2 and FMA")


@linux_only
def test_openblas_is_used_on_linux():
    """A missing install step (libopenblas0-pthread) must not go unnoticed; its kernels suit this CPU."""
    out = run_child()
    assert out["loaded"], out["BLAS_INFO"]
    assert "DYNAMIC_ARCH" in out["loaded"] and "self-test" not in out["loaded"]
    best = blas.best_x86_core(blas._cpu_flags()) if platform.machine() == "x86_64" else None
    if best:     # never an old fallback core on a CPU that has AVX2 (Debian 12's OpenBLAS gives one here)
        core = out["loaded"].split("(kernels ")[1].split(":")[0]
        assert core.lower() in blas._AVX2_CORES, out["loaded"]


@linux_only
@x86_avx2
@pytest.mark.parametrize("core", ["Haswell", "Prescott"])
def test_forced_kernels_compute_what_numpy_computes(core):
    """OpenBLAS's runtime dispatch, forced to the AVX2 kernels (what an AVX2-only CPU runs) and to SSE3's:
    the loader keeps the user's choice, and MLX's matmuls on it match numpy (checked in the child)."""
    out = run_child(OPENBLAS_CORETYPE=core)
    assert out["loaded"] and f"(kernels {core}: OPENBLAS_CORETYPE={core};" in out["loaded"]


@linux_only
@x86_avx2
def test_an_openblas_that_does_not_know_the_cpu_is_reloaded_with_its_best_kernels(tmp_path):
    out = run_child(stand_in(tmp_path))
    best = blas.best_x86_core(blas._cpu_flags())
    assert out["loaded"].startswith("OpenBLAS 0.0.0 DYNAMIC_ARCH stand-in")
    assert f"(kernels {best}: forced: OpenBLAS 0.0.0 took this CPU for Prescott; its flags allow {best};" in out["loaded"]
    assert out["stand_in_calls"] > 0                    # MLX's matmuls went through the loaded library


@linux_only
def test_a_wrong_sgemm_falls_back_to_the_reference(tmp_path):
    out = run_child(stand_in(tmp_path, off=1))
    assert out["loaded"] is None and "cblas_sgemm self-test gave wrong results" in out["BLAS_INFO"]
    assert out["blas_info"].startswith("reference BLAS/LAPACK bundled with mlx")
    assert out["stand_in_calls"] is None                # never promoted to the global scope


@linux_only
@pytest.mark.parametrize("path, reason", [("/nonexistent/libopenblas.so.0", "cannot load /nonexistent/libopenblas.so.0"),
                                          ("libm.so.6", "libm.so.6 is not OpenBLAS")])
def test_a_missing_or_foreign_library_falls_back_to_the_reference(path, reason):
    out = run_child(path)
    assert out["loaded"] is None and reason in out["BLAS_INFO"] and reason in out["blas_info"]


def test_best_x86_core_follows_the_flags():
    avx512 = {"avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "sse3"}
    assert blas.best_x86_core(avx512) == "SkylakeX"
    assert blas.best_x86_core(avx512 - {"avx512vl"}) == "Haswell"
    assert blas.best_x86_core({"avx2", "sse3"}) is None and blas.best_x86_core(set()) is None


def test_disable_env_var_is_respected():
    out = run_child("reference")  # matmuls still checked, on the reference BLAS
    assert out["loaded"] is None
    assert "REF_IMPL_BLAS=reference" in out["BLAS_INFO"]
    assert "reference" in out["blas_info"] and out["blas_info"].strip()


@linux_only
def test_too_late_after_mlx_import():
    out = run_child(mlx_first=True)
    assert out["loaded"] is None
    assert "mlx was imported first" in out["BLAS_INFO"]
    assert any("already imported" in w for w in out["warnings"])
