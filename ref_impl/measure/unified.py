"""Unified memory and zero-copy: where an MLX array's bytes live, and what moving them between numpy, the
CPU and a GPU costs.

On Apple silicon the CPU and the GPU share one pool of memory, and MLX is built on it: arrays have no
device, each operation names the device that runs it, and nothing is moved ("Unified Memory",
https://ml-explore.github.io/mlx/build/html/usage/unified_memory.html). The Metal allocator makes every
buffer with `MTL::ResourceStorageModeShared | MTL::ResourceHazardTrackingModeUntracked`, and the CPU
pointer of an array is that buffer's `contents()` (mlx/backend/metal/allocator.cpp; ml-explore/mlx at
846d176). Apple's documentation of `MTLResourceOptions.storageModeShared`: "The CPU and GPU share access
to the resource, allocated in system memory", and "you're responsible for synchronizing access ...
Ensure that all changes you schedule on either the CPU or GPU complete before accessing that resource on
the other processor"; MTLResource.h's comment on the shared mode adds that coherency "is only
guaranteed at command buffer boundaries". So shared mode needs no flush or copy call, only ordering,
which MLX provides: `mx.eval` (and the buffer protocol, which evaluates first) returns after the
command buffer that wrote the array has completed. Managed mode is the discrete-GPU (Intel Mac) design:
two copies, and after a CPU write `didModifyRange:` tells Metal which bytes to send ("If you execute GPU
commands that read the data without calling this method first, the behavior is undefined",
https://developer.apple.com/documentation/metal/mtlbuffer/didmodifyrange(_:)); "in a unified memory
model, Metal may ignore synchronization calls completely because it only creates a single memory
allocation" (Apple, "Synchronizing a managed resource").

Between MLX and numpy, copies happen where MLX's docs say: `np.array(a)` and `mx.array(b)` copy, while
`np.array(a, copy=False)` (that is, `np.asarray(a)`) is a view whose writes MLX sees, with the stated
caveat that such writes are invisible to gradients ("Conversion to NumPy and Other Frameworks",
https://ml-explore.github.io/mlx/build/html/usage/numpy.html). The view is MLX's buffer protocol, which
evaluates the array and exports its data pointer, writable (python/src/buffer.h). The writes are not
ordered against queued work: a write while a kernel reads the array races. numpy -> MLX has no
zero-copy route in the MLX 0.32.4 Linux wheels: `mx.array` takes no copy argument and
`mx.from_dlpack(x, copy=False)` refuses a CPU array; a later MLX (PR #3872, commit 0c537a4) adopts
page-aligned host buffers without a copy, on Metal only.

What is measured here (no Metal on these machines): on the CPU, MLX arrays are ordinary host memory,
so every route is either a memcpy or O(1). On an NVIDIA GPU, MLX's CUDA backend allocates arrays made
on the host with `cudaMallocManaged` (`cudaMallocHost` where the GPU lacks concurrent managed access)
and kernel outputs with `cudaMallocAsync` in device memory; the first CPU access to a kernel's output
(`Buffer::raw_ptr`, behind the buffer protocol, `.item()` and `np.array`) copies it into managed memory
(`move_to_unified_memory`, mlx/backend/cuda/allocator.cpp, the same at v0.32.1 and 846d176;
`cuda_memory_kind` asks the driver what the installed MLX returned). That first read crosses PCIe,
and a kernel's first read of a host-made array migrates its pages the other way: these are the
transfers unified memory avoids, timed here against a second read of the same bytes.
`ref_impl.measure.link.measure_link` times the same link with pinned PyTorch copies.

    python -m ref_impl bench --unified --label cpu-2core

See chapter: kv-cache
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ref_impl.measure.link import SIZES
from ref_impl.measure.records import record
from ref_impl.platform.timing import best, median, repeat, within

MAX_BYTES = 256 << 20                                   # 4 KiB .. 256 MiB of link.SIZES
SENTINEL = 42.0

# route -> (direction, conversion); every route takes the source array and returns the converted one
ROUTES: dict[str, tuple[str, Callable]] = {
    "mx.array(np)": ("numpy->mlx", mx.array),
    "mx.from_dlpack(np)": ("numpy->mlx", mx.from_dlpack),
    "np.array(mx)": ("mlx->numpy", np.array),
    "np.asarray(mx)": ("mlx->numpy", np.asarray),
    "memoryview(mx)": ("mlx->numpy", memoryview),
    "np.from_dlpack(mx)": ("mlx->numpy", np.from_dlpack),
}


def address(x: mx.array | np.ndarray | memoryview) -> int:
    """Address of the first element: numpy's `__array_interface__`; for an MLX array, that of the
    buffer its buffer protocol exports (Py_buffer.buf, the array's data pointer; it evaluates the array,
    and on CUDA first moves a kernel's output to managed memory)."""
    if isinstance(x, mx.array):
        if x.dtype == mx.bfloat16:
            raise ValueError("a bfloat16 MLX array has no PEP 3118 buffer format; take the address of "
                             "x.view(mx.uint16)")
        x = memoryview(x)
    if isinstance(x, memoryview):
        x = np.asarray(x)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"address() takes an MLX array, a numpy array or a memoryview, not {type(x).__name__}")
    return x.__array_interface__["data"][0]


def shares_memory(src: mx.array | np.ndarray | memoryview, dst: mx.array | np.ndarray | memoryview) -> bool:
    """Whether dst's first element lies inside src's bytes (a view, possibly offset), by address."""
    start = address(src)
    return start <= address(dst) < start + max(np.asarray(src).nbytes, 1)


def cuda_memory_kind(addr: int) -> str | None:
    """What the CUDA driver says an address is ("managed", "pinned host", "device", "not CUDA memory"),
    from cuPointerGetAttribute (IS_MANAGED = 8, MEMORY_TYPE = 2 with HOST = 1, DEVICE = 2; cuda.h);
    None where no CUDA driver loads (CPU-only Linux, macOS)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    cuda.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    cuda.cuInit(0)
    value = ctypes.c_uint(0)
    if cuda.cuPointerGetAttribute(ctypes.byref(value), 8, addr) != 0:
        return "not CUDA memory"                        # pageable host memory the driver never saw
    if value.value:
        return "managed"
    value.value = 0
    cuda.cuPointerGetAttribute(ctypes.byref(value), 2, addr)
    return {1: "pinned host", 2: "device"}.get(value.value, f"memory type {value.value}")


@dataclass(frozen=True)
class Conversion:
    """One conversion route, as observed: does the result share the source's bytes, and does a write
    to one show up in the other (None: the result is read-only)."""
    route: str
    direction: str
    shares_memory: bool
    writes_seen: bool | None
    src_address: int
    dst_address: int


def _route(route: str) -> tuple[str, Callable]:
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; have {', '.join(ROUTES)}")
    return ROUTES[route]


def conversion_fact(route: str, n: int = 1024) -> Conversion:
    """Convert n float32 values by `route`, then compare addresses and write through: into the numpy
    source (numpy->mlx) or the numpy result (mlx->numpy), read back by a kernel on the default device."""
    direction, convert = _route(route)
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if direction == "numpy->mlx":
        src = np.arange(n, dtype=np.float32)
        dst = convert(src)
        mx.eval(dst)
        src[0] = SENTINEL
        seen = (dst + 0)[0].item() == SENTINEL
        return Conversion(route, direction, shares_memory(src, dst), seen, address(src), address(dst))
    src = mx.arange(n, dtype=mx.float32)
    mx.eval(src)
    dst = convert(src)
    view = np.asarray(dst)                              # a memoryview's own bytes, writable as it is
    seen = None
    if view.flags.writeable:
        view[0] = SENTINEL
        seen = (src + 0)[0].item() == SENTINEL
    return Conversion(route, direction, shares_memory(src, view), seen, address(src), address(view))


def _check_sizes(sizes: Sequence[int]) -> list[int]:
    bad = [s for s in sizes if not isinstance(s, (int, np.integer)) or s < 4 or s % 4]
    if bad or not sizes:
        raise ValueError(f"sizes must be a non-empty list of byte counts, multiples of 4 (float32 "
                         f"elements); bad: {bad or 'empty'}")
    return [int(s) for s in sizes]


def conversion_times(route: str, sizes: Sequence[int] = SIZES[:9], budget_s: float = 2.0) -> list[dict]:
    """Per size: median microseconds of one conversion (a result from MLX evaluated), whether it
    copied (by address), and for a copy the rate (GB/s, best of the repeats: noise only adds time);
    the budget is split over sizes."""
    direction, convert = _route(route)
    sizes = _check_sizes(sizes)
    out = []
    for size in sizes:
        src = np.ones(size // 4, np.float32)
        if direction == "mlx->numpy":
            src = mx.array(src)
            mx.eval(src)

        def once():
            dst = convert(src)
            if isinstance(dst, mx.array):
                mx.eval(dst)
        once()                                          # warm-up: allocator caches, pages touched
        copies = not shares_memory(src, np.asarray(convert(src)))
        times = within(once, budget_s / len(sizes), min_reps=3, max_reps=200)
        extra = {"variant": route, "direction": direction, "bytes": size, "copies": copies,
                 "device": mx.default_device().type.name}
        out.append(record("unified", "convert_us", "us", median(times) * 1e6, samples=[t * 1e6 for t in times],
                          **extra))
        if copies:
            out.append(record("unified", "convert_bandwidth", "GB/s", size / best(times) / 1e9,
                              samples=[size / t / 1e9 for t in times], **extra))
    return out


def _fresh_result(src: mx.array, i: int) -> mx.array:
    """A new kernel output of src's size on the default device, evaluated, in a fresh buffer (cache
    cleared: on CUDA, device memory rather than a recycled managed buffer)."""
    mx.clear_cache()
    y = src + float(i + 1)
    mx.eval(y)
    mx.synchronize()
    return y


def _once(fn: Callable) -> float:
    """Seconds of one call of fn, no warm-up: a first read is the one measured."""
    return repeat(fn, 1, warmup=0)[0]


def first_reads(sizes: Sequence[int] = SIZES[:9], repeats: int = 5) -> list[dict]:
    """Per size, each repeat on fresh buffers: the host's first copy of a kernel's output on the default
    device into numpy against a second one (read_bandwidth, GB/s; `np.copyto` into a numpy array
    allocated and touched beforehand, so numpy's allocator is not timed), the `np.asarray` export
    alone (export_us), and a kernel's first read (a sum) of an `mx.array(np)` against a second one.
    With unified memory first equals second; on a discrete GPU the first pays the transfer."""
    sizes = _check_sizes(sizes)
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = mx.default_device().type.name
    names = {"host_first": f"host reads a fresh {device} result (np.copyto)",
             "host_again": "host reads it again (np.copyto)",
             "device_first": f"{device} reads a fresh mx.array(np) (sum)",
             "device_again": f"{device} reads it again (sum)"}
    out = []
    for size in sizes:
        src = mx.zeros((size // 4,), mx.float32)
        host, dst = np.ones(size // 4, np.float32), np.ones(size // 4, np.float32)  # ones: pages touched
        mx.eval(src + 1.0, src.sum())                   # warm-up: kernels compiled for this shape
        t = {k: [] for k in names} | {"export": []}
        memory = {}
        for i in range(repeats):
            y = _fresh_result(src, i)
            t["host_first"].append(_once(lambda: np.copyto(dst, y)))
            t["host_again"].append(_once(lambda: np.copyto(dst, y)))
            y = _fresh_result(src, i)
            t["export"].append(_once(lambda: np.asarray(y)))
            memory["result"] = cuda_memory_kind(address(y))
            mx.clear_cache()
            x = mx.array(host)
            t["device_first"].append(_once(lambda: mx.eval(x.sum())))
            t["device_again"].append(_once(lambda: mx.eval(x.sum())))
            memory["mx.array(np)"] = cuda_memory_kind(address(x))
        base = {"bytes": size, "device": device, "repeats": repeats}
        for key, name in names.items():
            rates = [size / s / 1e9 for s in t[key]]
            mem = memory["result" if key.startswith("host") else "mx.array(np)"]
            out.append(record("unified", "read_bandwidth", "GB/s", median(rates), samples=rates, variant=name,
                              memory=mem, **base))
        out.append(record("unified", "export_us", "us", median(t["export"]) * 1e6,
                          samples=[s * 1e6 for s in t["export"]],
                          variant=f"export of a fresh {device} result (np.asarray)", memory=memory["result"], **base))
    return out


def measure_unified(max_bytes: int = MAX_BYTES, budget_s: float = 20.0, repeats: int = 5) -> list[dict]:
    """Every record of experiment "unified": per route the copy/share and write-visibility facts
    (metrics shares_memory, writes_seen: 1/0, None where read-only) and conversion times, then the
    first-read experiment; sizes 4 KiB .. max_bytes. A route this MLX lacks gives a "skipped" record."""
    sizes = [s for s in SIZES if s <= max_bytes]
    if not sizes:
        raise ValueError(f"max_bytes {max_bytes} is below the smallest size, {SIZES[0]} bytes")
    device = mx.default_device().type.name
    out = []
    for route, (direction, _) in ROUTES.items():
        try:
            fact = conversion_fact(route)
            times = conversion_times(route, sizes, budget_s / len(ROUTES))
        except (TypeError, ValueError, RuntimeError, BufferError) as e:
            out.append(record("unified", "skipped", "count", 0, variant=route, direction=direction, device=device,
                              note=f"{type(e).__name__}: {e}"))
            continue
        where = {"variant": route, "direction": direction, "device": device, "src_address": hex(fact.src_address),
                 "dst_address": hex(fact.dst_address), "memory": cuda_memory_kind(fact.dst_address)}
        out += [record("unified", "shares_memory", "bool", fact.shares_memory, **where),
                record("unified", "writes_seen", "bool", fact.writes_seen, **where)]
        out += times
    return out + first_reads(sizes, repeats)
