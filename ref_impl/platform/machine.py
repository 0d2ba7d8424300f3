"""What ran the numbers: the machine record every results file carries, and the commit of the code."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata as pkg_metadata
from pathlib import Path

import mlx.core as mx

from ref_impl.platform import blas


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        return out.stdout.strip() or platform.machine()
    return platform.processor() or platform.machine()


def _gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "Apple GPU (Metal)" if mx.metal.is_available() else None


def machine_info(label: str | None = None) -> dict:
    """What ran the numbers: CPU, cores, GPU, MLX backend and version, Python, BLAS, and the MLX_ environment
    variables set (MLX reads some once, at its first kernel: MLX_USE_CUDA_GRAPHS changes how a step reaches the
    GPU)."""
    gpu = _gpu_name()
    on_gpu = mx.default_device() == mx.gpu
    backend = ("metal" if mx.metal.is_available() else "cuda") if on_gpu else "cpu"
    return {
        "label": label or f"{platform.node() or 'machine'}-{backend}",
        "cpu": _cpu_model(), "cores": os.cpu_count(), "gpu": gpu, "backend": backend,
        "mlx": mx.__version__, "python": platform.python_version(), "os": platform.platform(),
        "blas": blas.blas_info(), "mlx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")},
    }


def package_version(name: str) -> str:
    """The installed version of a package, or "unknown"."""
    try:
        return pkg_metadata.version(name)
    except pkg_metadata.PackageNotFoundError:
        return "unknown"


def git_commit() -> str:
    """The commit of the code that ran: REF_IMPL_GIT where set (a copy of the tree on a lent GPU
    machine, whose .git, if any, need not match the files it ran), else git's answer."""
    if os.environ.get("REF_IMPL_GIT"):
        return os.environ["REF_IMPL_GIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout.strip()
    except OSError:
        pass
    return "unknown"
