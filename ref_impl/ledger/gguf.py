"""Chapter GGUF layout (book/kquants/gguf-layout): C10 and C32, what GGUF's 32-byte alignment buys.

The shipped model's tensor offsets and the quantized blocks' sizes give the layout facts; with
`live=True`, numpy sums and GEMVs at 0, 4, 16 and 32 bytes past a cache line measure the penalty
the alignment is said to avoid, in L2 and from DRAM.
"""

from __future__ import annotations

import functools
import math
import platform

from ref_impl.formats import ggml, gguf
from ref_impl.ledger.core import SHIPPED_MODEL, Number, Verdict, claim
from ref_impl.measure import loads


@functools.cache
def measure_alignment(budget_s: float = 2.5) -> tuple:
    """numpy sum and GEMV over float32 buffers at 0, 4, 16 and 32 bytes past a cache line, in L2
    (256 KiB) and from DRAM (64 MiB, twice a 32 MiB L3): loads.throughput_sweep, one BLAS thread."""
    return tuple(loads.throughput_sweep((0, 4, 16, 32), (256 * 2**10, 64 * 2**20), ("numpy",),
                                          ("sum", "gemv"), budget_s=budget_s))


def _block_alignment_evidence() -> dict[str, Number]:
    """Tensor offsets of the shipped model, and how many quantized blocks start 32-byte aligned."""
    with gguf.read(SHIPPED_MODEL) as f:
        offsets = [t.offset for t in f.tensors.values()]
        ev = {"GGUF default alignment (general.alignment absent)": Number(gguf.DEFAULT_ALIGNMENT, "bytes"),
              "shipped model: tensor data offsets that are multiples of 32": Number(
                  100 * sum(o % 32 == 0 for o in offsets) / len(offsets), "%")}
    for name in ("Q4_0", "Q8_0", "Q4_K", "Q6_K"):
        block_bytes = ggml.BLOCK[ggml.GGMLType[name]][1]
        # block k starts at k * block_bytes past the aligned tensor start: aligned when 32 divides it
        ev[f"{name} blocks ({block_bytes} bytes) that start 32-byte aligned"] = Number(
            100 * math.gcd(block_bytes, 32) / 32, "%")
    return ev


def _penalties(rows) -> dict[tuple[str, int], float]:
    """(op, buffer bytes) -> % extra time at 4 and 16 bytes (loads split cache lines) over 0 and 32."""
    out = {}
    for op, size in {(r.op, r.buffer_bytes) for r in rows}:
        t = {r.offset_bytes: r.seconds for r in rows if (r.op, r.buffer_bytes) == (op, size)}
        out[op, size] = 100 * (min(t[4], t[16]) / min(t[0], t[32]) - 1)
    return out


def _alignment_live(ev: dict[str, Number]) -> tuple[dict[tuple[str, int], float], str]:
    rows = measure_alignment()
    for r in rows:
        if r.op == "gemv" and r.offset_bytes in (0, 4):
            where = "in L2" if r.buffer_bytes < 2**20 else "from DRAM"
            ev[f"live numpy GEMV {where}, offset {r.offset_bytes} bytes"] = Number(r.gb_per_s, "GB/s")
    pen = _penalties(rows)
    for (op, size), p in sorted(pen.items()):
        ev[f"live {op} {'in L2' if size < 2**20 else 'from DRAM'}: extra time at 4/16 bytes vs 0/32"] = Number(p, "%")
    return pen, f"live, numpy (OpenBLAS, one thread) on this machine ({platform.machine()}); ggml docs/gguf.md"


NOISE_PCT = 3.0   # differences below this are within run-to-run scatter on a shared machine


def check_c10(live: bool) -> Verdict:
    """GGUF's alignment is real and allows zero-copy views; the penalty it is said to avoid, measured."""
    ev = _block_alignment_evidence()
    summary = ("GGUF does align every tensor's data to general.alignment (32 bytes unless the file says "
               "otherwise) and a page-aligned mmap keeps that alignment in memory, which lets a reader hand "
               "out zero-copy views; but a float32 view needs only 4-byte alignment, MLX copies the data "
               "anyway, and quantized blocks of 18, 34 or 210 bytes are misaligned inside every tensor "
               f"({ev['Q4_0 blocks (18 bytes) that start 32-byte aligned'].value:.2f}% of Q4_0 blocks start "
               "aligned), so ggml's kernels use unaligned loads regardless")
    source = "ggml docs/gguf.md; ggml-cpu/arch/x86/quants.c (_mm_loadu/_mm256_loadu); the shipped model"
    if live:
        pen, source = _alignment_live(ev)
        dram = max(pen["gemv", 64 * 2**20], pen["sum", 64 * 2**20])
        cache = pen["gemv", 256 * 2**10]
        summary += (f"; live, misaligned float32 data changes GEMV time from DRAM by {dram:+.1f}% (the decode "
                    f"case; run-to-run scatter is about {NOISE_PCT:.0f}%) and by {cache:+.1f}% in L2")
    else:
        summary += " (live timing not run: live=False)"
    return Verdict("qualified", summary + ".", ev,
                   "for float tensors whose rows are whole 32-byte units, read from cache by 256-bit loads; "
                   "not for quantized blocks, and no measurable gain when weights stream from DRAM", source)


C10 = claim("C10", "gguf", check_c10,
            short="GGUF aligns every tensor to 32 bytes so vector loads (NEON/AVX) run zero-copy without unaligned "
                  "penalties",
            quote="GGUF binary layout enforces 32-byte alignment for all tensor weight arrays, ensuring zero-copy "
                  "vector instructions (NEON and AVX) execute without unaligned memory access penalties.")


def check_c32(live: bool) -> Verdict:
    """Split loads: a 32-byte load at a 32-byte-aligned address never crosses a 64-byte line; what
    crossing costs, in cache and from DRAM."""
    ev = _block_alignment_evidence()
    ev["64-byte cache lines split by 32-byte loads at offset 4 bytes"] = Number(50, "% of loads")
    ev["64-byte cache lines split by 64-byte (AVX-512) loads at offset 32 bytes"] = Number(100, "% of loads")
    summary = ("As geometry it holds: a 256-bit load from a 32-byte-aligned address never crosses a "
               "64-byte cache line, while at any other 4-byte offset every second one does (and a 512-bit "
               "load at a 32-byte offset always does)")
    status, source = "qualified", "arithmetic; Intel optimization manual (split loads); GPU not measured"
    if live:
        pen, source = _alignment_live(ev)
        cache, dram = pen["gemv", 256 * 2**10], max(pen["gemv", 64 * 2**20], pen["sum", 64 * 2**20])
        summary += (f"; live, the split loads cost a float32 GEMV {cache:+.1f}% in L2 and {dram:+.1f}% "
                    "from DRAM, where memory, not the load unit, sets the pace")
        if cache < NOISE_PCT:
            status = "refuted"
            summary += ", so on this CPU there is no penalty for the alignment to prevent"
    else:
        summary += " (live timing not run: live=False)"
    return Verdict(status, summary + "; GPU threads were not measured.", ev,
                   "data in L1/L2 read by 256-bit loads; nothing measurable when weights stream from DRAM",
                   source)


C32 = claim("C32", "gguf", check_c32,
            short="32-byte alignment avoids unaligned-access penalties and cache-line splits for 256-bit SIMD loads",
            quote="32-byte memory alignment prevents unaligned memory access penalties and cacheline splits during "
                  "vectorized 256-bit SIMD load instructions across host CPU and GPU threads.")


CLAIMS = (C10, C32)   # in id order; __init__ assembles the registry
