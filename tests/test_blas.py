"""ref_impl.blas: the BLAS interposed under MLX's CPU backend computes what numpy computes.

Each check runs in a fresh interpreter, because only the import order (loader, then mlx)
decides which BLAS MLX binds to. No timing here: see the module docstring of ref_impl/blas.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Runs in the child: load (or not), import mlx, compare CPU matmuls and LAPACK calls with numpy.
CHILD = r"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if MLX_FIRST:
        import mlx.core
    import ref_impl.blas as rb          # ref_impl/__init__ calls load_optimized_blas()
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

print(json.dumps({"loaded": loaded, "BLAS_INFO": rb.BLAS_INFO, "blas_info": rb.blas_info(),
                  "warnings": [str(w.message) for w in caught]}))
"""


def run_child(env_var: str | None = None, mlx_first: bool = False) -> dict:
    """Run CHILD in a fresh interpreter from the repository root; return its JSON report."""
    env = {k: v for k, v in os.environ.items() if k != "REF_IMPL_BLAS"}
    if env_var is not None:
        env["REF_IMPL_BLAS"] = env_var
    code = f"MLX_FIRST = {mlx_first}\n{CHILD}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_with_loader_mlx_matches_numpy():
    out = run_child()
    assert out["blas_info"].strip()
    if out["loaded"]:
        assert "OpenBLAS" in out["loaded"] and out["blas_info"] == out["loaded"]
    else:
        assert out["BLAS_INFO"].startswith("not loaded:")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the loader acts on Linux only")
def test_openblas_is_used_on_linux():
    """A missing install step (cmeel-openblas, libgfortran5) must not go unnoticed."""
    out = run_child()
    if not out["loaded"] and "this CPU lacks" in out["BLAS_INFO"]:
        pytest.skip(out["BLAS_INFO"])
    assert out["loaded"], out["BLAS_INFO"]


def test_disable_env_var_is_respected():
    out = run_child("reference")  # matmuls still checked, on the reference BLAS
    assert out["loaded"] is None
    assert "REF_IMPL_BLAS=reference" in out["BLAS_INFO"]
    assert "reference" in out["blas_info"] and out["blas_info"].strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the loader acts on Linux only")
def test_too_late_after_mlx_import():
    out = run_child(mlx_first=True)
    assert out["loaded"] is None
    assert "mlx was imported first" in out["BLAS_INFO"]
    assert any("already imported" in w for w in out["warnings"])
