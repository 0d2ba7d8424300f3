"""Chapter GGUF layout (book/kquants/gguf-layout): C10 and C32, what GGUF's 32-byte alignment buys.

The shipped model's tensor offsets and the quantized blocks' sizes give the layout facts; each machine's
reference alignment sweep (results/, experiment "alignment", read by `loads.recorded_sweeps`: numpy sums
and GEMVs over float32 buffers at 0, 1, 4, 16, 32 and 64 bytes past a cache line, in L2 and from DRAM)
gives the penalty the alignment is said to avoid, and decides. With `live=True` gather also asks
`loads.measure_alignment` for the same sweep, repeated on this machine, and shows it beside the recorded
one with its spread; it never decides.

See chapter: gguf
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass

from ref_impl.formats import ggml, gguf
from ref_impl.ledger import core
from ref_impl.ledger.core import SHIPPED_MODEL, Number, Verdict, claim, decide, repeated
from ref_impl.measure import loads
from ref_impl.measure.loads import measure_alignment

LINE, LOAD = 64, 32          # bytes in an x86-64 cache line; bytes in one 256-bit (AVX) load
BLOCK_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")
PENDING = ("the GGUF chapter's alignment sweep", "python -m ref_impl bench --alignment --label my-machine")


@dataclass(frozen=True)
class SplitLoads:
    """One sweep, in % of time: numpy's GEMV at the worse of 4 and 16 bytes (every second 32-byte load
    splits a cache line) against the better of 0 and 32 (none does), in L2 and from DRAM; the scatter,
    the largest gap between offsets 0 and 64 (both on a line) over the sweep's ops; misaligned floats."""
    l2: float
    dram: float
    scatter_l2: float
    scatter_dram: float
    one_byte_l2: float       # GEMV at 1 byte (floats not 4-byte aligned) against 0 and 32, in L2


def split_loads(rows) -> SplitLoads:
    """A sweep's rows (loads.Throughput) as its split-load costs and scatter."""
    t = {(r.op, r.buffer_bytes, r.offset_bytes): r.seconds for r in rows if r.backend == "numpy"}
    near, far = sorted({size for _, size, _ in t})

    def extra(size, offsets):
        return 100 * (max(t["gemv", size, o] for o in offsets) / min(t["gemv", size, 0], t["gemv", size, 32]) - 1)

    def scatter(size):
        return max(abs(100 * (t[op, size, 64] / t[op, size, 0] - 1)) for op, s, o in t if (s, o) == (size, 0))
    one = extra(near, (1,)) if ("gemv", near, 1) in t else math.nan
    return SplitLoads(extra(near, (4, 16)), extra(far, (4, 16)), scatter(near), scatter(far), one)


@dataclass(frozen=True)
class AlignmentEvidence:
    """What C10 and C32 rest on: the layout (the default alignment, the shipped model's offsets, each
    quantized type's share of blocks that start 32-byte aligned), each recorded machine's sweep,
    the sweeps' source, and this machine's live sweeps (shown, never deciding)."""
    alignment: int
    tensors: int
    offsets_aligned: float                   # % of the shipped model's tensor offsets that are multiples of 32
    block_aligned: dict[str, float]          # GGML type -> % of its blocks that start 32-byte aligned
    recorded: dict[str, SplitLoads]          # machine label -> its recorded sweep
    source: str
    live: tuple[SplitLoads, ...] = ()


def block_alignment(types=BLOCK_TYPES) -> dict[str, float]:
    """% of each type's blocks that start 32-byte aligned in an aligned tensor: block k starts at
    k × block bytes, a multiple of 32 for one block in 32 / gcd(block bytes, 32)."""
    return {t: 100 * math.gcd(ggml.BLOCK[ggml.GGMLType[t]][1], LOAD) / LOAD for t in types}


def gather_alignment(live: bool) -> AlignmentEvidence | None:
    """The layout facts, the recorded sweeps (None when none is recorded) and, live, this machine's."""
    sweeps = loads.recorded_sweeps(core.RESULTS_DIR)
    if not sweeps:
        return None
    with gguf.read(SHIPPED_MODEL) as f:
        offsets = [t.offset for t in f.tensors.values()]
    runs = "; ".join(f"{s.run.caption}: {s.run.machine['cpu']}, numpy's BLAS {s.numpy_blas}"
                     for _, s in sorted(sweeps.items()))
    aligned = 100 * sum(o % LOAD == 0 for o in offsets) / len(offsets)
    return AlignmentEvidence(gguf.DEFAULT_ALIGNMENT, len(offsets), aligned,
                             block_alignment(), {label: split_loads(s.rows) for label, s in sweeps.items()},
                             runs, tuple(split_loads(rows) for rows in measure_alignment()) if live else ())


def recorded_evidence(ev: AlignmentEvidence) -> dict[str, Number]:
    """The recorded sweeps as evidence, per machine."""
    out = {}
    for label, s in sorted(ev.recorded.items()):
        out |= {f"recorded ({label}): split-load cost, numpy GEMV in L2 (4/16 vs 0/32 bytes)": Number(s.l2, "%"),
                f"recorded ({label}): scatter in L2 (offsets 0 vs 64)": Number(s.scatter_l2, "%"),
                f"recorded ({label}): split-load cost, numpy GEMV from DRAM": Number(s.dram, "%"),
                f"recorded ({label}): scatter from DRAM (offsets 0 vs 64)": Number(s.scatter_dram, "%")}
    return out


def live_evidence(ev: AlignmentEvidence) -> tuple[dict[str, Number], str]:
    """This machine's sweeps as evidence (median and range), and a clause for the summary."""
    if not ev.live:
        return {}, " (live sweep not run: live=False)"
    n = {"live split-load cost, numpy GEMV in L2 (this machine)": repeated([s.l2 for s in ev.live], "%"),
         "live scatter in L2 (this machine)": repeated([s.scatter_l2 for s in ev.live], "%"),
         "live split-load cost, numpy GEMV from DRAM (this machine)": repeated([s.dram for s in ev.live], "%"),
         "live scatter from DRAM (this machine)": repeated([s.scatter_dram for s in ev.live], "%")}
    l2, sl2, dram, sdram = n.values()
    return n, (f"; on this machine, now ({l2.rounds} sweeps, shown beside the recorded one and not deciding), "
               f"split loads cost {l2.value:+.1f}% in L2 (range {l2.low:+.1f} to {l2.high:+.1f}%, scatter "
               f"{sl2.value:.1f}%) and {dram.value:+.1f}% from DRAM (range {dram.low:+.1f} to {dram.high:+.1f}%, "
               f"scatter {sdram.value:.1f}%)")


def source_of(ev: AlignmentEvidence, tail: str) -> str:
    live = f"live, numpy (one BLAS thread) on this machine ({platform.machine()}), beside " if ev.live else ""
    return f"{live}{ev.source}; {tail}"


def penalties(ev: AlignmentEvidence) -> tuple[list[str], list[str], str]:
    """The machines whose split loads cost more than the scatter in L2 and from DRAM, and a clause
    giving each machine's numbers."""
    l2 = [m for m, s in ev.recorded.items() if s.l2 > s.scatter_l2]
    dram = [m for m, s in ev.recorded.items() if s.dram > s.scatter_dram]
    text = "; ".join(
        f"on {m}'s CPU split loads cost numpy's GEMV {s.l2:+.1f}% in L2 "
        f"({'more than' if m in l2 else 'within'} its {s.scatter_l2:.1f}% scatter) and {s.dram:+.1f}% from DRAM "
        f"({'more than' if m in dram else 'within'} its {s.scatter_dram:.1f}% scatter)"
        for m, s in sorted(ev.recorded.items()))
    return l2, dram, text


def judge_c10(ev: AlignmentEvidence) -> Verdict:
    """The rule of C10 (see its `rule`), applied to the layout and the recorded sweeps."""
    l2, dram, measured = penalties(ev)
    misaligned = {t: p for t, p in ev.block_aligned.items() if p < 100}
    status = decide(holds=ev.offsets_aligned == 100 and not misaligned and len(dram) == len(ev.recorded),
                    contradicted=ev.offsets_aligned < 100 or not l2)
    ev_out = {"GGUF default alignment (general.alignment absent)": Number(ev.alignment, "bytes"),
              f"shipped model: tensor data offsets that are multiples of {LOAD} ({ev.tensors} tensors)":
                  Number(ev.offsets_aligned, "%")}
    ev_out |= {f"{t} blocks ({ggml.BLOCK[ggml.GGMLType[t]][1]} bytes) that start {LOAD}-byte aligned": Number(p, "%")
               for t, p in ev.block_aligned.items()}
    ev_out |= recorded_evidence(ev)
    ev_out |= {f"recorded ({m}): misaligned floats (1 byte), numpy GEMV in L2": Number(s.one_byte_l2, "%")
               for m, s in sorted(ev.recorded.items()) if not math.isnan(s.one_byte_l2)}
    live, live_text = live_evidence(ev)
    layout = (f"{ev.offsets_aligned:.0f}% of the shipped model's {ev.tensors} tensor offsets are multiples of "
              f"{LOAD} (general.alignment defaults to {ev.alignment} bytes)")
    limits = []
    if misaligned:
        limits.append("quantized blocks follow each other unpadded, so inside every tensor only " + ", ".join(
            f"{p:g}% of {t}" for t, p in misaligned.items()) + " blocks start 32-byte aligned (ggml's kernels "
            "use unaligned loads)")
    if len(dram) < len(ev.recorded):
        limits.append("from DRAM, where decoding streams the weights, split loads cost no more than the scatter on "
                      + ", ".join(sorted(set(ev.recorded) - set(dram))))
    lead = {"confirmed": f"Confirmed: {layout}, every block starts aligned and split loads cost more than the "
                         "scatter in L2 and from DRAM, so the alignment spares every vector load a penalty",
            "qualified": f"The alignment is real but spares vector loads a penalty only for "
                         f"{'float tensors' if misaligned else 'data'}"
                         f"{' read from cache' if len(dram) < len(ev.recorded) else ''}: {layout}; but "
                         + "; and ".join(limits),
            "refuted": f"Refuted: {layout}" + ("" if l2 else ", and misaligned float32 loads cost no more than the "
                                                        "scatter even in L2: there is no penalty to avoid")}[status]
    condition = ("every tensor and block 32-byte aligned, with a split-load penalty wherever weights are read"
                 if status == "confirmed" else
                 "float tensors whose rows are whole 32-byte units, read from cache (L1/L2) by 256-bit loads"
                 + ("; not quantized blocks" if misaligned else "")
                 + ("; not weights streamed from DRAM" if len(dram) < len(ev.recorded) else ""))
    return Verdict(status, f"{lead}; {measured}{live_text}.", ev_out | live, condition,
                   source_of(ev, "ggml docs/gguf.md; ggml-cpu/arch/x86/quants.c (_mm256_loadu_si256); "
                                 "the shipped model"))


C10 = claim("C10", "gguf", gather_alignment, judge_c10,
            short="GGUF aligns every tensor to 32 bytes so vector loads (NEON/AVX) run zero-copy without unaligned "
                  "penalties",
            quote="GGUF binary layout enforces 32-byte alignment for all tensor weight arrays, ensuring zero-copy "
                  "vector instructions (NEON and AVX) execute without unaligned memory access penalties.",
            rule="Evidence: the shipped model's tensor offsets, the share of each quantized type's blocks that start "
                 "on 32 bytes (arithmetic), and the recorded alignment sweep: numpy GEMV's extra time at 4/16 bytes "
                 "against 0/32, in L2 and from DRAM, each against the scatter between offsets 0 and 64 (both on a "
                 "cache line). Refuted if a tensor offset is not a multiple of 32, or if split loads cost no more "
                 "than the scatter even in L2 on every recorded machine (no penalty to avoid). Confirmed if every "
                 "tensor and every block starts aligned and split loads cost more than the scatter in L2 and from "
                 "DRAM; qualified otherwise, naming the blocks and the memory level the alignment does not help.",
            outcomes=("confirmed", "qualified", "refuted"), pending=PENDING)


def split_share(offset: int, load: int = LOAD) -> float:
    """% of `load`-byte loads, one after another from `offset` bytes past a line, that cross a 64-byte line."""
    starts = [(offset + k * load) % LINE for k in range(LINE // math.gcd(load, LINE))]
    return 100 * sum(s + load > LINE for s in starts) / len(starts)


def judge_c32(ev: AlignmentEvidence) -> Verdict:
    """The rule of C32 (see its `rule`), applied to the geometry and the recorded sweeps."""
    l2, dram, measured = penalties(ev)
    aligned_split = split_share(0) + split_share(LOAD)
    status = decide(holds=False, contradicted=aligned_split > 0 or not l2)   # GPU threads: no sweep recorded
    ev_out = {"32-byte loads that split a 64-byte line, from a 32-byte-aligned address": Number(aligned_split, "%"),
              "32-byte loads that split a 64-byte line, from 4 bytes past a line": Number(split_share(4), "%"),
              "64-byte (AVX-512) loads that split a line, from 32 bytes past a line": Number(split_share(32, 64), "%")}
    ev_out |= recorded_evidence(ev)
    live, live_text = live_evidence(ev)
    geometry = (f"a 256-bit load from a 32-byte-aligned address never crosses a 64-byte cache line, while "
                f"{split_share(4):.0f}% of those from 4 bytes past a line do (and {split_share(32, 64):.0f}% of "
                "512-bit loads from 32 bytes past one)")
    if status == "refuted":
        lead = (f"Refuted on the CPU: {geometry}, but split loads cost no more than the scatter even in L2, "
                "so there is no penalty for the alignment to prevent")
        condition = "none measured: no split-load penalty on any recorded CPU"
    else:
        where = "in cache and from DRAM" if len(dram) == len(ev.recorded) else "only for data in cache"
        lead = (f"The geometry holds and the penalty it avoids is real {where} on the host CPU: {geometry}; "
                "GPU threads were not measured")
        condition = ("data in L1/L2 read by 256-bit loads on the host CPU"
                     + ("" if len(dram) == len(ev.recorded) else "; not weights streamed from DRAM, where memory, "
                                                                "not the load unit, sets the pace")
                     + "; GPU threads not measured")
    return Verdict(status, f"{lead}; {measured}{live_text}.", ev_out | live, condition,
                   source_of(ev, "arithmetic; Intel optimization manual (split loads); no GPU sweep recorded"))


C32 = claim("C32", "gguf", gather_alignment, judge_c32,
            short="32-byte alignment avoids unaligned-access penalties and cache-line splits for 256-bit SIMD loads",
            quote="32-byte memory alignment prevents unaligned memory access penalties and cacheline splits during "
                  "vectorized 256-bit SIMD load instructions across host CPU and GPU threads.",
            rule="Evidence: the geometry of 256-bit loads against 64-byte lines, and the recorded alignment sweep: "
                 "numpy GEMV's extra time at 4/16 bytes (every second load splits a line) against 0/32 (none does), "
                 "in L2 and from DRAM, each against the scatter between offsets 0 and 64. Refuted if aligned loads "
                 "split lines or split loads cost no more than the scatter in L2 on every recorded machine (no "
                 "penalty to prevent); qualified otherwise, naming where the penalty shows (in cache, from DRAM). "
                 "It cannot confirm: the claim covers GPU threads and no GPU sweep is recorded.",
            outcomes=("qualified", "refuted"), pending=PENDING)


CLAIMS = (C10, C32)   # in id order; __init__ assembles the registry
