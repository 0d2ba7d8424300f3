"""The link, measured: host memory copies, and host<->device copies where PyTorch sees a CUDA GPU.

What `ref_impl.theory.interconnect` models from first principles, timed on this machine
(`python -m ref_impl bench --link`, experiment "link"): numpy copies per size (the host's own memory
rate), and through PyTorch pageable and pinned copies each way, GB/s by CUDA events and by the host
clock, a handshake per layer against one transfer, and the time of one small transfer. Rates are the
best of the repeats (noise only ever adds time); completion and transfer times are medians.
A page reads a machine's copies back from its reference run: `records.references("link", variant=HOST_COPY)`.

See chapter: interconnect
"""

from __future__ import annotations

import subprocess

import numpy as np

from ref_impl.measure.records import record
from ref_impl.platform.timing import best, clock, median, within

SIZES = tuple(4096 * 4**i for i in range(10))   # 4 KiB .. 1 GiB
HOST_COPY = "host copy (numpy)"                  # the host copies' variant
MAX_SAMPLES = 200                                # samples kept per record


def link_record(variant: str, metric: str, unit: str, value: float, samples=(), **extra) -> dict:
    """A "link" record, its samples capped at MAX_SAMPLES."""
    return record("link", metric, unit, value, variant=variant, samples=list(samples)[:MAX_SAMPLES], **extra)


def host_copy_bandwidth(sizes=SIZES, budget_s: float = 4.0, max_bytes: int = 1 << 30) -> list[dict]:
    """Host memory copy rate (np.copyto, bytes copied per second, best of the repeats) per size, the
    budget split evenly over sizes; small sizes are timed in batches to stay above the clock's grain."""
    sizes = [s for s in sizes if s <= max_bytes]
    out = []
    for size in sizes:
        src, dst = np.ones(size, np.uint8), np.zeros(size, np.uint8)
        times = within(lambda: np.copyto(dst, src), budget_s / len(sizes), max_reps=200, warmup=1,
                       calls=max(1, (1 << 20) // size))
        out.append(link_record(HOST_COPY, "copy_bandwidth", "GB/s", size / best(times) / 1e9,
                               [size / t / 1e9 for t in times], bytes=size))
    return out


def _event_copies(torch, src, dst, pinned: bool, budget_s: float) -> tuple[list[float], list[float]]:
    """Seconds of repeated copies src -> dst, by CUDA events around the copy (GPU-side) and by the host
    clock around copy + synchronize: at least 3, then more while budget_s lasts (200 at most)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev, wall, t0 = [], [], clock()
    while len(ev) < 3 or (clock() - t0 < budget_s and len(ev) < MAX_SAMPLES):
        w0 = clock()
        start.record()
        dst.copy_(src, non_blocking=pinned)
        end.record()
        end.synchronize()                   # also waits for the copy queued before `end`
        wall.append(clock() - w0)
        ev.append(start.elapsed_time(end) / 1e3)
    return ev, wall


def _copy_records(torch, sizes: list[int], each_s: float) -> list[dict]:
    """Per direction (h2d, d2h), host memory (pageable, pinned) and size: GB/s, CUDA events and host clock."""
    out = []
    for pinned in (False, True):
        for direction in ("h2d", "d2h"):
            variant = f"{direction} {'pinned' if pinned else 'pageable'}"
            for size in sizes:
                host = torch.ones(size, dtype=torch.uint8)
                host = host.pin_memory() if pinned else host
                dev = torch.empty(size, dtype=torch.uint8, device="cuda")
                src, dst = (host, dev) if direction == "h2d" else (dev, host)
                dst.copy_(src, non_blocking=pinned)     # warm-up
                torch.cuda.synchronize()
                ev, wall = _event_copies(torch, src, dst, pinned, each_s)
                for metric, ts in (("copy_bandwidth", ev), ("copy_bandwidth_wall", wall)):
                    rates = [size / t / 1e9 for t in ts if t > 0]
                    out.append(link_record(variant, metric, "GB/s", max(rates), rates, bytes=size))
                del host, dev, src, dst
    return out


def _handshake_records(torch, total: int, layers: int, budget_s: float) -> list[dict]:
    """`layers` pinned transfers with a synchronize after each against one transfer of the same bytes, and
    4 KiB pinned transfers one by one: median completion and per-transfer times."""
    host = torch.ones(total, dtype=torch.uint8).pin_memory()
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    chunk = total // layers

    def per_layer():
        for i in range(layers):
            dev[i * chunk:(i + 1) * chunk].copy_(host[i * chunk:(i + 1) * chunk], non_blocking=True)
            torch.cuda.synchronize()                    # a handshake per layer

    def contiguous():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    def one_small():
        dev[:4096].copy_(host[:4096], non_blocking=True)
        torch.cuda.synchronize()

    out = []
    for name, fn in ((f"h2d pinned, {layers} transfers, sync each", per_layer),
                     ("h2d pinned, one transfer", contiguous)):
        ts = within(fn, budget_s / 10, min_reps=10, max_reps=200, warmup=1)
        out.append(link_record(name, "completion_ms", "ms", median(ts) * 1e3, [t * 1e3 for t in ts],
                               bytes=total, transfers=layers if "sync each" in name else 1))
    ts = within(one_small, budget_s / 20, min_reps=100, max_reps=2000, warmup=1)
    out.append(link_record("h2d pinned 4 KiB, sync each", "transfer_us", "us", median(ts) * 1e6,
                           [t * 1e6 for t in ts], bytes=4096, p99_us=float(np.percentile(ts, 99)) * 1e6))
    return out


def device_copy_bandwidth(sizes=SIZES, budget_s: float = 60.0, max_bytes: int = 1 << 30,
                          layers: int = 64) -> tuple[list[dict], str | None]:
    """Host<->device copies through PyTorch, when it sees a CUDA GPU: (records, None), or ([], why not).

    Per direction (h2d, d2h), host memory (pageable, pinned) and size: GB/s by CUDA events around the
    copy on the current stream (GPU-side time) and by the host clock around copy + synchronize. Then
    the handshake experiment: `layers` pinned transfers with a synchronize after each against one
    transfer of the same bytes, repeated; and 4 KiB pinned transfers one by one (per-transfer time)."""
    try:
        import torch
    except ImportError:
        return [], "torch is not installed: host-device copies not measured"
    if not torch.cuda.is_available():
        return [], "torch sees no CUDA device: host-device copies not measured"
    sizes = [s for s in sizes if s <= max_bytes]
    out = _copy_records(torch, sizes, budget_s / (5 * len(sizes)))   # 4 configurations, then the handshake runs
    out += _handshake_records(torch, min(max_bytes, 256 << 20), layers, budget_s)
    return out + pcie_link_records(), None


def pcie_link_records() -> list[dict]:
    """The GPU's PCIe generation and width (current and maximum), as nvidia-smi reports them."""
    fields = ("pcie.link.gen.current", "pcie.link.width.current", "pcie.link.gen.max", "pcie.link.width.max")
    try:
        res = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        values = [float(v) for v in res.stdout.splitlines()[0].split(",")]
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return []
    return [link_record("nvidia-smi", f.replace(".", "_"), "gen" if "gen" in f else "lanes", v)
            for f, v in zip(fields, values)]


def measure_link(budget_s: float = 60.0, max_bytes: int = 1 << 30) -> list[dict]:
    """Every link record: host copies always, host<->device copies where PyTorch sees a GPU; when it
    does not, one record says why (metric "skipped", its reason in "note")."""
    records = host_copy_bandwidth(budget_s=min(10.0, budget_s / 4), max_bytes=max_bytes)
    device, why = device_copy_bandwidth(budget_s=budget_s, max_bytes=max_bytes)
    return records + (device or [link_record("host-device copy (torch)", "skipped", "count", 0, note=why)])
