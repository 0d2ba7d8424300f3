"""Loads: what GGUF's layout buys when a model is loaded and when its weights are read, and what a read
costs when its pages are not yet resident, measured here.

Three experiments. `throughput_sweep` reads one float32 buffer placed at a chosen byte offset past a
64-byte cache-line boundary (0, 4, 16, 32, 64 ... ; 1 is not even float32-aligned) and times a
sum and a matrix-vector product (GEMV) over it with numpy and with MLX, in a buffer that fits the
L2 cache and in one far larger than the L3. `measure_load` loads a GGUF file three ways -- memory-
mapped (`gguf.read`), read() into memory, and MLX's own `mx.load` -- and records the time to open,
the time of the first pass over every weight, and the resident memory (RSS) each way adds, with the
file's pages in the page cache ("warm") or evicted first ("cold", Linux only). `wired_reads` reads a
weight-sized buffer on first touch, after it was touched once, and mlocked (Linux's analog of the
pages macOS wires for the GPU).

`python -m ref_impl bench --alignment --label my-machine` records the chapter's sweep in results/
(experiment "alignment", `bench_alignment`); `recorded_sweeps` reads each machine's reference run of it
back, and `measure_alignment` repeats it live a few times, for the claim ledger to show beside its
verdicts. `bench --dispatch` records the wired reads (experiment "wired", `latency.bench_dispatch`).

Every function takes a time budget and returns plain dataclasses with the unit in each field name.

References: Intel 64 and IA-32 Architectures Optimization Reference Manual (split loads: a load
that crosses a 64-byte cache line); llama.cpp docs/gguf.md (general.alignment).
See chapter: gguf
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import mmap
import os
import resource
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ref_impl import RESULTS_DIR
from ref_impl.formats import ggml, gguf
from ref_impl.measure.records import Run, record, references
from ref_impl.platform import blas
from ref_impl.platform.timing import calls_per_sample, clock, repeat

KiB, MiB = 2**10, 2**20
LINE = 64           # bytes in a cache line on x86-64 and on Apple's cores' L1
OFFSETS = (0, 4, 16, 32, 64)
GEMV_COLS = 1024    # columns of the GEMV matrix: 4 KiB rows


# ---- resident memory ---------------------------------------------------------------------------------

def rss_mb() -> dict[str, float]:
    """This process's resident memory in MB (1e6 bytes): total, anonymous (heap: what read() fills)
    and file-backed (mapped file pages: what mmap fills). Linux reads /proc/self/status; elsewhere
    only the peak RSS is known, so anon and file are NaN."""
    status = Path("/proc/self/status")
    if status.is_file():
        kb = {k: float(v.split()[0]) for k, v in
              (line.split(":", 1) for line in status.read_text().splitlines() if line.startswith(("VmRSS", "Rss")))}
        mb = 1024 / 1e6                                  # the file's "kB" are KiB
        return {"rss": kb["VmRSS"] * mb, "anon": kb.get("RssAnon", np.nan) * mb,
                "file": kb.get("RssFile", np.nan) * mb}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rss": peak / (1e6 if sys.platform == "darwin" else 1e3), "anon": np.nan, "file": np.nan}


# ---- timing helpers ----------------------------------------------------------------------------------

@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """numpy's OpenBLAS (and MLX's, via blas.one_blas_thread) on one thread inside the block: on a
    busy 2-core machine two BLAS threads wait on each other and the timings scatter."""
    libs = {line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower()} \
        if os.path.exists("/proc/self/maps") else set()
    restore = []
    for path in libs:
        lib = ctypes.CDLL(path)
        for get, put in (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                         ("openblas_get_num_threads", "openblas_set_num_threads")):
            if hasattr(lib, get):
                restore.append((getattr(lib, put), getattr(lib, get)()))
                getattr(lib, put)(1)
    try:
        with blas.one_blas_thread():
            yield
    finally:
        for put, n in restore:
            put(n)


def numpy_blas() -> str:
    """The BLAS behind numpy and the CPU kernels it picked, e.g. "OpenBLAS (SkylakeX kernels)"."""
    cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    name = cfg.get("name", "a BLAS numpy does not name")
    if os.path.exists("/proc/self/maps"):
        for path in {line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower()}:
            lib = ctypes.CDLL(path)
            for sym in ("scipy_openblas_get_corename64_", "openblas_get_corename"):
                if "numpy" in path and hasattr(lib, sym):
                    fn = getattr(lib, sym)
                    fn.restype = ctypes.c_char_p
                    return f"{name} ({fn().decode()} kernels)"
    return name


# ---- aligned vs misaligned reads ---------------------------------------------------------------------

@dataclass(frozen=True)
class Throughput:
    """One timed read of a float32 buffer that starts `offset_bytes` past a cache-line boundary."""
    backend: str            # "numpy" or "mlx"
    op: str                 # "sum" (a reduction) or "gemv" (matrix (rows, 1024) times a vector)
    buffer_bytes: int
    offset_bytes: int       # requested: bytes past a page (so cache-line) boundary
    line_offset: int        # address of the first element modulo 64, as measured
    seconds: float          # fastest single call
    gb_per_s: float         # buffer_bytes / seconds / 1e9
    float32_aligned: bool   # the address is a multiple of 4 (numpy's `flags.aligned`)
    rounds: int = 1         # interleaved rounds timed; `seconds` is the fastest


def _address(a) -> int:
    """The data address of a numpy array or of an evaluated MLX array (a view into its buffer)."""
    return (a if isinstance(a, np.ndarray) else np.array(a, copy=False)).ctypes.data


# The bytes the sweep's buffers are filled with. A float32's exponent field is the top byte's low 7 bits
# and the next byte's top bit; with every byte in 0x38-0x43 (either sign), the four bytes at *any*
# offset, 1 byte included, read as a normal float of magnitude 2**-15 to 2**9: never zero, subnormal,
# inf or NaN. Subnormal inputs (or products) make many x86 cores take a slow microcode assist per
# multiply, a cost that has nothing to do with alignment and would hide it.
FILL_BYTES = np.array([sign | b for sign in (0x00, 0x80) for b in range(0x38, 0x44)], np.uint8)


def fill_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` random bytes from FILL_BYTES: viewed as float32 at any byte offset, normal numbers only."""
    return FILL_BYTES[rng.integers(0, FILL_BYTES.size, n, dtype=np.uint8)]


def _numpy_views(nbytes: int, offsets: Sequence[int], rng: np.random.Generator):
    raw = np.empty(nbytes + 2 * 4096, np.uint8)
    start = -_address(raw) % 4096                        # a page boundary, hence a cache-line one
    raw[:] = fill_bytes(raw.size, rng)
    views = {off: raw[start + off:start + off + nbytes].view(np.float32) for off in offsets}
    return raw, views


def _mlx_views(nbytes: int, offsets: Sequence[int], rng: np.random.Generator):
    n = nbytes // 4
    base = mx.array(fill_bytes(4 * (n + 1024), rng).view(np.float32))    # the same kind of floats as numpy's
    mx.eval(base)
    k0 = (-_address(base) % LINE) // 4                    # MLX's CPU buffers start 8 bytes past a malloc block
    views = {}
    for off in offsets:
        if off % 4:
            continue                                      # MLX slices whole elements: no view at 1 byte
        v = base[k0 + off // 4:k0 + off // 4 + n]
        mx.eval(v)
        views[off] = v
    return base, views


def throughput_sweep(offsets: Sequence[int] = OFFSETS, sizes: Sequence[int] = (256 * KiB, 96 * MiB),
                     backends: Sequence[str] = ("numpy", "mlx"), ops: Sequence[str] = ("sum", "gemv"),
                     budget_s: float = 8.0, seed: int = 0) -> list[Throughput]:
    """Time `ops` over float32 buffers of each size in `sizes` (bytes) at each offset, per backend.

    The offsets of one (backend, op, size) are timed in interleaved rounds, so a busy neighbour
    slows them alike; each result is the fastest round (noise only ever adds time). Tiny buffers
    are timed as loops of calls. The whole sweep stops after about `budget_s` seconds (at least
    three rounds each). BLAS runs on one thread. Offsets that are not a multiple of 4 bytes run in
    numpy only (MLX slices whole elements). The buffers hold seeded random normal floats (FILL_BYTES),
    at every offset, so no subnormal number slows one offset for a reason other than its alignment.
    """
    rng = np.random.default_rng(seed)
    groups = [(b, op, size) for b in backends for size in sizes for op in ops]
    per_group = budget_s / max(len(groups), 1)
    out = []
    with one_thread():
        for backend, size in dict.fromkeys((b, s) for b, _, s in groups):
            keep, views = (_numpy_views if backend == "numpy" else _mlx_views)(size, offsets, rng)
            for op in ops:
                out += _time_group(backend, op, size, views, per_group, rng)
            del keep, views
    return out


def _kernel(backend: str, op: str, view, x):
    rows = view.shape[0] // GEMV_COLS
    if backend == "numpy":
        if op == "sum":
            return lambda: np.add.reduce(view)
        w = view[:rows * GEMV_COLS].reshape(rows, GEMV_COLS)
        return lambda: w @ x
    if op == "sum":
        return lambda: mx.eval(mx.sum(view))
    w = view[:rows * GEMV_COLS].reshape(rows, GEMV_COLS)
    return lambda: mx.eval(w @ x)


def _time_group(backend: str, op: str, size: int, views: dict, budget_s: float,
                rng: np.random.Generator) -> list[Throughput]:
    """Interleaved rounds over the offsets (each a sample of ~2 ms of calls) until the budget is spent
    (at least three): the fastest sample per offset."""
    x = rng.standard_normal(GEMV_COLS, dtype=np.float32)
    if backend == "mlx":
        x = mx.array(x)
    fns = {off: _kernel(backend, op, v, x) for off, v in views.items()}
    calls = {off: calls_per_sample(fn, 2e-3) for off, fn in fns.items()}
    best = {off: np.inf for off in fns}
    start, rounds = clock(), 0
    while rounds < 3 or clock() - start < budget_s:
        for off, fn in fns.items():
            best[off] = min(best[off], repeat(fn, 1, warmup=0, calls=calls[off])[0])
        rounds += 1
    return [Throughput(backend, op, size, off, _address(views[off]) % LINE, best[off], size / best[off] / 1e9,
                       _address(views[off]) % 4 == 0, rounds) for off in fns]


# The sweep the GGUF chapter shows and records: offsets past a cache line (1 byte: not even float32-
# aligned), a buffer that fits any core's L2, and one that streams from DRAM (`sweep_sizes`).
SWEEP_OFFSETS = (0, 1, 4, 16, 32, 64)


def last_level_cache_bytes() -> int | None:
    """The largest cache cpu0 reports (Linux's /sys; None where there is none to read)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        if text:
            sizes.append(int(text.rstrip("KMG")) * {"K": KiB, "M": MiB, "G": 2**30}.get(text[-1], 1))
    return max(sizes, default=None)


def sweep_sizes() -> tuple[int, int]:
    """(256 KiB, in any core's L2; three times this CPU's last-level cache, at least 96 MiB and at most
    1 GiB, which streams from DRAM): a 96 MiB buffer sits in the 300 MiB L3 of a large Xeon."""
    llc = last_level_cache_bytes() or 32 * MiB
    return 256 * KiB, min(max(96 * MiB, 3 * llc), 1024 * MiB)


def sweep_records(rows: Sequence[Throughput]) -> list[dict]:
    """A sweep as results/ records (experiment "alignment"), one per (backend, op, size, offset)."""
    blas_name = numpy_blas()
    return [record("alignment", "read_rate", "GB/s", r.gb_per_s, weights="F32", variant=f"{r.backend} {r.op}",
                   backend=r.backend, op=r.op, buffer_bytes=r.buffer_bytes, offset_bytes=r.offset_bytes,
                   line_offset=r.line_offset, seconds=r.seconds, float32_aligned=r.float32_aligned, rounds=r.rounds,
                   numpy_blas=blas_name if r.backend == "numpy" else None) for r in rows]


def bench_alignment(budget_s: float = 60.0) -> list[dict]:
    """The GGUF chapter's sweep as records (`bench --alignment`): GEMV and sum read rates at SWEEP_OFFSETS
    past a cache line, in a buffer inside L2 and one that streams from DRAM (`sweep_sizes`), numpy and MLX."""
    return sweep_records(throughput_sweep(SWEEP_OFFSETS, sweep_sizes(), budget_s=budget_s))


@dataclass(frozen=True)
class RecordedSweep:
    """One machine's recorded alignment sweep: its run (machine, date, commit), rows, and numpy's BLAS there."""
    run: Run
    rows: tuple[Throughput, ...]
    numpy_blas: str | None      # the BLAS numpy used (sweep_records' field), None where the run did not say


def recorded_sweeps(results_dir: str | os.PathLike = RESULTS_DIR) -> dict[str, RecordedSweep]:
    """Per machine label, its reference alignment sweep (`records.references`: the newest complete run)."""
    out = {}
    for label, run in references("alignment", Path(results_dir), metric="read_rate").items():
        rows = tuple(Throughput(r["backend"], r["op"], r["buffer_bytes"], r["offset_bytes"], r["line_offset"],
                                r["seconds"], r["value"], r["float32_aligned"], r["rounds"]) for r in run.records)
        out[label] = RecordedSweep(run, rows, next((r["numpy_blas"] for r in run.records if r.get("numpy_blas")), None))
    return out


LIVE_SWEEPS = 3     # live sweeps, each with its own buffers: the spread beside the median


@functools.cache
def measure_alignment(sweeps: int = LIVE_SWEEPS, budget_s: float = 0.6) -> tuple[tuple[Throughput, ...], ...]:
    """`sweeps` independent numpy sweeps on this machine (`throughput_sweep`, one BLAS thread, the chapter's
    offsets and buffer sizes), once per process: the live reading the ledger's C10 and C32 show beside the
    recorded sweep, which decides."""
    return tuple(tuple(throughput_sweep(SWEEP_OFFSETS, sweep_sizes(), ("numpy",), ("sum", "gemv"),
                                        budget_s=budget_s, seed=k))
                 for k in range(sweeps))


# ---- mmap vs read ------------------------------------------------------------------------------------

def write_synthetic(path: str | os.PathLike, total_mb: float = 256, n_tensors: int = 8) -> Path:
    """A GGUF of `n_tensors` float32 matrices (rows of 4096 values) totalling about `total_mb` MB,
    each filled with one constant (fast to make; the loader does not care about values)."""
    rows = max(1, int(total_mb * 1e6 / n_tensors / (4096 * 4)))
    tensors = {f"blk.{i}.weight": np.full((rows, 4096), i / 8, np.float32) for i in range(n_tensors)}
    gguf.write(path, {"general.architecture": "synthetic", "general.name": f"synthetic-{total_mb:g}MB"},
               tensors)
    return Path(path)


def evict(path: str | os.PathLike) -> bool:
    """Drop the file's pages from the page cache (fsync, then POSIX_FADV_DONTNEED), so the next read
    comes from the disk. Linux only; returns False where the call does not exist. Pages that some
    process still maps stay. (On a virtual machine the host may still cache the disk.)"""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


@dataclass(frozen=True)
class LoadTiming:
    """One load of a GGUF file: until every tensor is an array, then one pass summing all of them."""
    method: str             # "mmap", "read", "mx.load"
    cache: str              # "cold" (the file's pages evicted first) or "warm" (in the page cache)
    file_mb: float
    open_s: float           # until every tensor is an array
    first_pass_s: float     # one sum over every tensor: mmap's page faults (and disk reads) land here
    rss_open_mb: float      # RSS growth after open
    rss_pass_mb: float      # RSS growth after the pass
    anon_pass_mb: float     # of which anonymous (private heap copies)
    file_pass_mb: float     # of which file-backed (the page cache, mapped: shared with other processes)


METHODS = ("mmap", "read", "mx.load")


def _give_back_memory() -> None:
    """Free what the last load left: Python garbage, MLX's buffer cache, and heap pages glibc keeps
    for reuse (malloc_trim), so the next load's RSS growth is its own."""
    gc.collect()
    if "mlx.core" in sys.modules:
        sys.modules["mlx.core"].clear_cache()
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def measure_load(path: str | os.PathLike, method: str, cache: str = "warm") -> LoadTiming:
    """Load `path` by `method` ("mmap": gguf.read, views into the map; "read": the whole file read()
    into a bytearray, views into it; "mx.load": MLX's GGUF loader, which copies into MLX arrays),
    after evicting the file's pages when `cache` is "cold"."""
    if method not in METHODS or cache not in ("cold", "warm"):
        raise ValueError(f"method must be one of {METHODS} and cache 'cold' or 'warm'")
    path = os.fspath(path)
    with gguf.read(path) as f:                 # the tensor table, before the clock starts
        infos = list(f.tensors.values())
    _give_back_memory()
    if cache == "cold" and not evict(path):
        raise OSError("cannot evict pages on this OS: measure warm only")
    before = rss_mb()
    t0 = clock()
    if method == "mmap":
        keep = gguf.read(path)
        arrays = [keep.array(i.name) for i in infos]
    elif method == "read":
        keep = bytearray(os.path.getsize(path))
        with open(path, "rb") as fh:
            fh.readinto(keep)
        arrays = [np.frombuffer(keep, np.float32 if i.type is ggml.GGMLType.F32 else np.uint8,
                                count=i.nbytes // (4 if i.type is ggml.GGMLType.F32 else 1), offset=i.offset)
                  for i in infos]
    else:
        keep = mx.load(path)
        arrays = list(keep.values())
        mx.eval(arrays)
    t1 = clock()
    opened = rss_mb()
    if method == "mx.load":
        mx.eval([mx.sum(a) for a in arrays])
    else:
        for a in arrays:
            np.add.reduce(a, axis=None)
    t2 = clock()
    after = rss_mb()
    del arrays
    if method == "mmap":
        keep.close()
    del keep
    _give_back_memory()
    return LoadTiming(method, cache, os.path.getsize(path) / 1e6, t1 - t0, t2 - t1,
                      opened["rss"] - before["rss"], after["rss"] - before["rss"],
                      after["anon"] - before["anon"], after["file"] - before["file"])


def load_comparison(path: str | os.PathLike, methods: Sequence[str] = METHODS,
                    caches: Sequence[str] = ("cold", "warm")) -> list[LoadTiming]:
    """`measure_load` for every method, cold (where the OS can evict) and then warm."""
    caches = [c for c in caches if c == "warm" or hasattr(os, "posix_fadvise")]
    out = []
    for cache in caches:
        if cache == "warm":                 # read the file once, so every warm load finds it cached
            with open(path, "rb") as fh:
                while fh.read(16 * MiB):
                    pass
        out += [measure_load(path, method, cache) for method in methods]
    return out


# ---- wired memory, the Linux analog (C15) ------------------------------------------------------------
# macOS "wires" the pages MLX hands the GPU, so a tensor read never waits on a page fault (or swap).
# On Linux the analog is mlock(2): it faults every page in and pins it. Here one weight-sized buffer is
# read tensor by tensor on first touch (every page faults), after it was touched once, and mlocked.

@dataclass(frozen=True)
class WiredRead:
    """One pass reading a buffer of float32 "tensors" in turn (a sum over each)."""
    variant: str                    # "first_touch", "prefaulted" or "mlocked"
    buffer_bytes: int
    tensor_bytes: int
    read_ms: float                  # the whole pass
    gb_per_s: float
    tensor_read_ms: tuple[float, ...]   # each tensor's read, in order
    minor_faults: int               # ru_minflt during the pass (page mapped without I/O)
    major_faults: int               # ru_majflt during the pass (page read from disk or swap)
    locked: bool | None             # mlock succeeded; None where it was not tried
    error: str = ""                 # why mlock failed (e.g. EPERM, or ENOMEM under RLIMIT_MEMLOCK)


def _mlock(address: int, nbytes: int, lock: bool = True) -> str:
    """mlock (or munlock) a range through libc; "" on success, else the errno's message."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "mlock" if lock else "munlock", None)
    if fn is None:
        return "mlock is not available here"
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    if fn(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) != 0:
        err = ctypes.get_errno()
        return f"{'mlock' if lock else 'munlock'} failed: {os.strerror(err)} (errno {err})"
    return ""


def _timed_pass(buf, tensor_bytes: int) -> tuple[float, list[float], int, int]:
    """One pass over buf, tensor_bytes at a time: (seconds, ms per tensor, minor faults, major faults).
    Each tensor is read once (a first touch cannot be repeated), so there is no warm-up."""
    view = np.frombuffer(buf, dtype=np.float32)
    per = tensor_bytes // 4
    times = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = clock()
    for lo in range(0, view.size, per):
        t = clock()
        np.add.reduce(view[lo:lo + per])
        times.append((clock() - t) * 1e3)
    total = clock() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    del view
    return total, times, after.ru_minflt - before.ru_minflt, after.ru_majflt - before.ru_majflt


def wired_reads(buffer_bytes: int = 256 * MiB, tensor_bytes: int = 4 * MiB, repeats: int = 3,
                variants: Sequence[str] = ("first_touch", "prefaulted", "mlocked")) -> list[WiredRead]:
    """Read a fresh anonymous mmap of buffer_bytes, tensor_bytes at a time, `repeats` times per variant:
    "first_touch" reads pages never touched (each page faults; Linux maps its shared zero page),
    "prefaulted" reads pages written once before, "mlocked" reads pages written and then mlocked
    (an mlock that fails, e.g. without CAP_IPC_LOCK beyond RLIMIT_MEMLOCK, is recorded in `error`
    and the pass still runs, unlocked). Each repeat maps a new buffer."""
    if tensor_bytes < 4 or buffer_bytes < tensor_bytes or repeats < 1:
        raise ValueError(f"wired_reads needs 4 <= tensor_bytes <= buffer_bytes and repeats >= 1, got "
                         f"{tensor_bytes}, {buffer_bytes}, {repeats}")
    buffer_bytes -= buffer_bytes % tensor_bytes
    out = []
    for variant in variants:
        if variant not in ("first_touch", "prefaulted", "mlocked"):
            raise ValueError(f"unknown variant {variant!r}")
        for _ in range(repeats):
            buf = mmap.mmap(-1, buffer_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            locked, error, address = None, "", 0
            if variant != "first_touch":
                fill = np.frombuffer(buf, dtype=np.float32)
                fill[:] = 1.0                                # every page allocated and written
                address = fill.ctypes.data
                if variant == "mlocked":
                    error = _mlock(address, buffer_bytes)
                    locked = not error
                del fill
            seconds, times, minflt, majflt = _timed_pass(buf, tensor_bytes)
            if locked:
                _mlock(address, buffer_bytes, lock=False)
            buf.close()
            out.append(WiredRead(variant, buffer_bytes, tensor_bytes, seconds * 1e3, buffer_bytes / seconds / 1e9,
                                 tuple(times), minflt, majflt, locked, error))
    return out

