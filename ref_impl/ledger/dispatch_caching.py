"""Chapter dispatch, pipeline caching, static workspaces and wired memory
(book/dispatch/caching-workspaces): C02, C09, C15 and C28.

Metal cannot run on the course's machines, so C09 and C28 are decided on the portable analog (MLX's
CUDA backend compiles its kernels at run time and keeps them in an on-disk cache), C02 on the three
KV-cache strategies of latency.kv_jitter, and C15, which needs macOS wiring under memory pressure, is
not testable here, with Linux's analog (first-touch, prefaulted and mlocked reads) shown. Every rule
reads each machine's reference run of its experiment (first-call, kv-jitter, wired: `dispatch_runs`),
and C02 the measured bandwidth of that run's machine (`records.bandwidth`); a pause is the jitter page's:
a token over PAUSE_FACTOR times its run's typical one. Live readings (C15's page faults, C28's
mx.compile) come from ref_impl.measure.latency, repeated, shown with their spread and never decide.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

import numpy as np

from ref_impl.ledger import core
from ref_impl.ledger.core import Number, Verdict, claim, decide, figure, repeated
from ref_impl.ledger.dispatch import dispatch_runs
from ref_impl.ledger.dispatch_jitter import GROWTH_STEP, PAUSE_FACTOR, find_pauses
from ref_impl.measure import latency, records
from ref_impl.measure.records import Run

METAL_DOCS = ("Apple Metal documentation: MTLComputePipelineState (pipeline states are made at a noncritical "
              "time, e.g. launch), MTLComputePipelineDescriptor.binaryArchives, Metal binary archives")
BENCH = "python -m ref_impl bench --dispatch"
PRIMARILY = 0.5      # C02's "primarily": over half of a run's ITL variance
LIVE_ROUNDS = 5      # repeats of each live reading
FRESH, WARM, CACHED, WARM_CACHED = (1, 1), (1, 2), (2, 1), (2, 2)   # (process, run) of the first-call records
LIVE_NOTE = "this machine's reading, shown beside the verdict, which it does not decide"


# ---- the recorded results ----------------------------------------------------------------------------

def first_call_recorded(run: Run) -> dict | None:
    """One first-call run: {"backend", "tokens": {(process, run): ms per token}, "steady": {(process, run): ms},
    "compile": {(process, metric): ms}, "process_s": {process: s}}; None without all four runs' tokens."""
    d = {"backend": run.machine["backend"], "tokens": {}, "steady": {}, "compile": {}, "process_s": {}}
    for r in run.select("first-call"):
        if r["metric"] == "token_ms":
            d["tokens"][r["process"], r["run"]] = r["samples"]
        elif r["metric"] == "steady_token_ms":
            d["steady"][r["process"], r["run"]] = r["value"]
        elif r["metric"] == "process_s":
            d["process_s"][r["process"]] = r["value"]
        elif r["variant"] == "mx.compile":
            d["compile"][r["process"], r["metric"]] = r["value"]
    return d if {FRESH, WARM, CACHED, WARM_CACHED} <= set(d["tokens"]) else None


def kv_recorded(run: Run) -> dict[tuple[str, str], dict]:
    """One kv-jitter run, per (model, strategy): every metric by name, plus "itl" (the samples), "context" and
    "prompt_len" (context less the tokens generated)."""
    out: dict[tuple[str, str], dict] = {}
    for r in run.select("kv-jitter"):
        d = out.setdefault((r["model"], r["variant"]), {"context": r["context"]})
        d[r["metric"]] = r["value"]
        if r["metric"] == "itl_ms":
            d["itl"] = r["samples"]
            d["prompt_len"] = r["context"] - len(r["samples"]) - 1
    return out


def growth_pauses(itl: list[float], prompt_len: int, step: int = GROWTH_STEP) -> tuple[list[int], list[int]]:
    """(indices of the pauses (`find_pauses`), indices of the ITLs that include a growth step). ITL i
    ends with the decode step that writes position prompt_len + i + 1; a cache growing by `step`
    positions grows when that position is a multiple of step."""
    growth = [i for i in range(len(itl)) if (prompt_len + i + 1) % step == 0]
    return find_pauses(itl).tolist(), growth


def wired_recorded(run: Run) -> dict[str, dict]:
    """One wired run, per variant (first_touch, prefaulted, mlocked): each metric's values over the repeats,
    "tensor_ms" (every tensor read of every repeat), "bytes", "tensor_bytes" and "locked"."""
    out: dict[str, dict] = {}
    for r in run.select("wired"):
        d = out.setdefault(r["variant"], {"tensor_ms": []})
        d.setdefault(r["metric"], []).append(r["value"])
        d |= {"bytes": r["bytes"], "tensor_bytes": r["tensor_bytes"], "locked": r["locked"]}
        if r["metric"] == "tensor_read_max_ms":
            d["tensor_ms"] += r["samples"]
    return out


# ---- live readings (ref_impl.measure.latency): repeated, reported, never deciding ---------------------

def live_phrase(live: dict[str, Number]) -> str:
    """The live readings as a clause of a summary."""
    return "; live here: " + ", ".join(f"{k.removeprefix('live ')} {n}" for k, n in live.items()) + f" ({LIVE_NOTE})"


def plural(n: float, word: str) -> str:
    return f"{n:,.0f} {word}" + ("" if n == 1 else "s")


# ---- C28 and C09: run-time compilation and its cache (first-call) ----------------------------------

@dataclass(frozen=True)
class FirstCalls:
    """One machine's recorded first-call runs: process 1 starts with an empty kernel cache, process 2 finds
    what process 1 compiled; each generates twice (run 2 follows a warm-up: every kernel already ran)."""
    label: str
    backend: str                                        # "cuda" compiles kernels at first use, "cpu" does not
    tokens: dict[tuple[int, int], tuple[float, ...]]    # (process, run) -> ms per token; token 1 holds the prefill
    steady: dict[tuple[int, int], float]                # (process, run) -> a steady token's ms (median from the 3rd)
    process_s: dict[int, float]                         # process -> launch to exit, s
    compile_ms: dict[tuple[int, str], float] = field(default_factory=dict)   # mx.compile: (process, metric) -> ms
    caption: str = ""                                   # the run they were recorded in (Run.caption)

    def paused(self, run: tuple[int, int]) -> list[float]:
        """The tokens of one run over PAUSE_FACTOR × its steady token (ms): its hitch."""
        return [t for t in self.tokens[run] if t > PAUSE_FACTOR * self.steady[run]]

    def hitch_ms(self, run: tuple[int, int]) -> float:
        """What the paused tokens of one run took above a steady token."""
        return sum(t - self.steady[run] for t in self.paused(run))


@dataclass(frozen=True)
class FirstCallEvidence:
    """C09's and C28's evidence: every machine's first-call runs, and (C28, live) this machine's mx.compile."""
    machines: tuple[FirstCalls, ...]
    live: dict[str, Number] = field(default_factory=dict)
    live_machine: str = ""

    @property
    def gpus(self) -> list[FirstCalls]:
        return [m for m in self.machines if m.backend != "cpu"]


RUN_NAMES = {FRESH: "fresh process, empty kernel cache", CACHED: "second process, kernel cache on disk",
             WARM: "second run of the fresh process", WARM_CACHED: "second run of the second process"}


def gather_first_calls(live: bool, with_live: bool = False) -> FirstCallEvidence | None:
    """Each machine's reference first-call run, or None without a GPU's (the rules judge a backend that compiles)."""
    machines = tuple(FirstCalls(label, d["backend"], {k: tuple(v) for k, v in d["tokens"].items()}, dict(d["steady"]),
                                dict(d["process_s"]), dict(d["compile"]), run.caption)
                     for label, run in dispatch_runs("first-call").items()
                     if (d := first_call_recorded(run)) is not None)
    if not any(m.backend != "cpu" for m in machines):
        return None
    if not (live and with_live):
        return FirstCallEvidence(machines)
    costs = latency.measure_compile(LIVE_ROUNDS)
    return FirstCallEvidence(machines, {
        "live mx.compile first call of a new function": repeated([c.first_call_ms for c in costs], "ms"),
        "live mx.compile later calls, median": repeated([c.later_call_ms for c in costs], "ms")}, platform.machine())


def first_call_numbers(m: FirstCalls) -> dict[str, Number]:
    """The evidence of one machine's first-call runs."""
    ev = {f"first token, {RUN_NAMES[FRESH]} ({m.label})": Number(m.tokens[FRESH][0], "ms"),
          f"first token, {RUN_NAMES[CACHED]} ({m.label})": Number(m.tokens[CACHED][0], "ms"),
          f"first token, {RUN_NAMES[WARM]} ({m.label})": Number(m.tokens[WARM][0], "ms"),
          f"first token, {RUN_NAMES[WARM_CACHED]} ({m.label})": Number(m.tokens[WARM_CACHED][0], "ms"),
          f"steady decode step, median ({m.label})": Number(m.steady[FRESH], "ms")}
    for run, name in RUN_NAMES.items():
        ev[f"tokens over {PAUSE_FACTOR}× a steady one, {name} ({m.label})"] = Number(len(m.paused(run)), "tokens")
        ev[f"their time above a steady token, {name} ({m.label})"] = Number(m.hitch_ms(run), "ms")
    if m.process_s.get(2):
        ev[f"whole fresh process / whole second process ({m.label})"] = Number(m.process_s[1] / m.process_s[2], "×")
    names = {(1, "first_call_ms"): "first call, fresh process", (2, "first_call_ms"): "first call, second process",
             (1, "later_call_ms"): "later calls, median"}
    ev |= {f"mx.compile {name} ({m.label})": Number(m.compile_ms[k], "ms")
           for k, name in names.items() if k in m.compile_ms}
    return ev


def first_call_source(e: FirstCallEvidence) -> str:
    """Where C09's and C28's numbers come from: the live reading, each machine's first-call run, Apple's docs."""
    source = "first-call: " + "; ".join(m.caption for m in e.machines)
    return (f"live ({e.live_machine}) and " if e.live else "") + f"{source}; {METAL_DOCS}"


def cpu_clause(e: FirstCallEvidence) -> str:
    """What the machines that compile nothing for a GPU show, as a summary clause."""
    return "".join(f"; on {m.label} ({m.backend}), where nothing is compiled for a GPU, the first token took "
                   f"{m.tokens[FRESH][0] / m.steady[FRESH]:.1f}× a steady one and "
                   f"{plural(len(m.paused(FRESH)), 'token')} of the fresh process paused"
                   for m in e.machines if m.backend == "cpu")


def c28_finding(m: FirstCalls) -> str:
    """C28 on one GPU: hitch in a fresh process, none once the compiled kernels are cached."""
    fresh, cached = m.paused(FRESH), m.paused(CACHED)
    return decide(bool(fresh) and not cached, contradicted=not fresh or m.hitch_ms(CACHED) >= m.hitch_ms(FRESH))


def combined(findings: list[str]) -> str:
    """The status of a claim judged on each GPU: refuted if one refutes it, confirmed if all confirm it."""
    return decide(all(f == "confirmed" for f in findings), any(f == "refuted" for f in findings))


def c28_text(m: FirstCalls) -> str:
    """One GPU's first-call runs as C28 reads them."""
    f, c = m.hitch_ms(FRESH), m.hitch_ms(CACHED)
    less = f" ({f / c:,.0f}× less)" if 0 < c < f else " (no less)" if c >= f else ""
    return (f"on {m.label} ({m.backend}) a fresh process paused {len(m.paused(FRESH))} of its {len(m.tokens[FRESH])} "
            f"tokens, {figure(f)} ms above its {figure(m.steady[FRESH])} ms steady token (the first took "
            f"{figure(m.tokens[FRESH][0])} ms); a second process that found the compiled kernels in the on-disk cache "
            f"paused {plural(len(m.paused(CACHED)), 'token')}, {figure(c)} ms above a steady token{less}, and a second "
            f"run of the fresh process (a warm-up before it) paused {plural(len(m.paused(WARM)), 'token')}")


def judge_c28(e: FirstCallEvidence) -> Verdict:
    """Run-time compilation hitches the first tokens; a cache of compiled kernels removes the hitch."""
    status = combined([c28_finding(m) for m in e.gpus])
    no_hitch = [m.label for m in e.gpus if not m.paused(FRESH)]
    lead = {"confirmed": "Run-time compilation hitches the first tokens and a cache of the compiled kernels removes "
                         "the hitch, on the portable analog",
            "qualified": "Run-time compilation hitches the first tokens, and a cache of the compiled kernels shortens "
                         "the hitch without removing it, on the portable analog",
            "refuted": (f"A fresh process's first tokens did not hitch on {', '.join(no_hitch)}, the portable analog"
                        if no_hitch else "A cache of the compiled kernels did not shorten the first-token hitch on "
                                         "the portable analog")}[status]
    summary = (f"{lead}: MLX's CUDA backend compiles its kernels at first use and keeps them in an on-disk cache, "
               f"as Metal compiles pipelines and MTLBinaryArchive keeps them (Metal cannot run here); "
               + "; ".join(c28_text(m) for m in e.gpus) + cpu_clause(e) + (live_phrase(e.live) if e.live else ""))
    ev = {k: n for m in e.machines for k, n in first_call_numbers(m).items()} | e.live
    left = [f"{m.label}: {plural(len(m.paused(CACHED)), 'token')}, {figure(m.hitch_ms(CACHED))} ms"
            for m in e.gpus if m.paused(CACHED)]
    condition = {"confirmed": "as stated, on the portable analog: a fresh process hitches and a process that finds "
                              "the compiled kernels does not",
                 "qualified": "the cache removes the compilation, not every first-use cost: with the compiled kernels "
                              f"on disk the first tokens still pause ({'; '.join(left)}), and only running every "
                              "kernel once (a warm-up) removes the rest",
                 "refuted": "no hitch for a cache to remove" if no_hitch else "the cache leaves the hitch as long"}
    return Verdict(status, summary + ".", ev, condition[status] + "; judged on MLX CUDA's run-time compilation and "
                   "on-disk kernel cache, the portable analog of Metal pipeline compilation and MTLBinaryArchive",
                   first_call_source(e))


C28 = claim("C28", "dispatch", lambda live: gather_first_calls(live, with_live=True), judge_c28,
            short="runtime shader compilation causes hitches at the first tokens; an MTLBinaryArchive cache removes "
                  "them",
            quote="Runtime compilation of Metal compute shaders creates hitches during initial token generation; "
                  "caching compiled pipeline states in an MTLBinaryArchive eliminates shader compilation latency.",
            rule=f"Evidence: recorded first-call runs on a GPU backend that compiles its kernels at first use (MLX "
                 f"CUDA with its on-disk kernel cache, the portable analog of Metal pipelines and MTLBinaryArchive; "
                 f"Metal cannot run here); a token pauses when over {PAUSE_FACTOR}× its run's steady token (the "
                 f"jitter page's line). Confirmed if a fresh process pauses and a second process that finds the "
                 f"compiled kernels does not; refuted if the fresh one does not pause or the cache does not shorten "
                 f"the paused time; qualified otherwise (the cache shortens the hitch but a pause remains). Live "
                 f"mx.compile timings are shown, never decide.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("the dispatch chapter's first-call results of a GPU", BENCH))


def c09_finding(m: FirstCalls) -> str:
    """C09 on one GPU: no pause after a warm-up (pre-compiled), none either with only the compiled kernels cached."""
    warm = m.paused(WARM) + m.paused(WARM_CACHED)
    return decide(bool(m.paused(FRESH)) and not m.paused(CACHED), contradicted=bool(warm))


def c09_text(m: FirstCalls) -> str:
    """One GPU's first-call runs as C09 reads them: the first token is the first context evaluation."""
    t = {run: m.tokens[run][0] for run in RUN_NAMES}
    ratio = f", and that whole process ran {m.process_s[1] / m.process_s[2]:.0f}× faster" if m.process_s.get(2) else ""
    warm = len(m.paused(WARM)) + len(m.paused(WARM_CACHED))
    return (f"on {m.label} ({m.backend}) a fresh process's first context evaluation took {figure(t[FRESH])} ms, "
            f"{t[FRESH] / m.steady[FRESH]:,.0f}× a steady decode step, with {plural(len(m.paused(FRESH)), 'token')} "
            f"of the run over {PAUSE_FACTOR}× one; with the compiled kernels cached on disk the next process's took "
            f"{figure(t[CACHED])} ms, with {plural(len(m.paused(CACHED)), 'token')} over{ratio}; after a warm-up "
            f"(every kernel run once, pre-compiling it) it took {figure(t[WARM])} ms in the fresh process and "
            f"{figure(t[WARM_CACHED])} ms in the cached one, {t[WARM] / m.steady[WARM]:.1f}× and "
            f"{t[WARM_CACHED] / m.steady[WARM_CACHED]:.1f}× a steady step, with {plural(warm, 'token')} over the line")


def judge_c09(e: FirstCallEvidence) -> Verdict:
    """Pre-compiling (a warm-up before serving) and caching compiled kernels, against the first-evaluation pause."""
    status = combined([c09_finding(m) for m in e.gpus])
    none = [m.label for m in e.gpus if not m.paused(FRESH)]
    lead = {"confirmed": "Pre-compiling and caching avoid the first-evaluation pause on the portable analog, and the "
                         "kernel cache alone already does",
            "qualified": (f"No fresh process paused on {', '.join(none)}, so the portable analog had no compile pause "
                          "to avoid" if none else "A warm-up before serving avoids the first-evaluation pause on the "
                          "portable analog, but a cache of the compiled kernels alone does not"),
            "refuted": "The first evaluation still pauses after a warm-up on the portable analog"}[status]
    summary = (f"{lead}: " + "; ".join(c09_text(m) for m in e.gpus)
               + "; Metal's pipeline state objects were not measured (Metal cannot run here)")
    ev = {k: n for m in e.machines for k, n in first_call_numbers(m).items()}
    cached = "; ".join(f"{m.label}: {figure(m.hitch_ms(FRESH))} ms without it, {figure(m.hitch_ms(CACHED))} ms with it"
                       for m in e.gpus)
    condition = {"confirmed": "as stated, on the portable analog: the compiled kernels, cached or pre-compiled, leave "
                              "no pause at the first evaluation",
                 "qualified": ("there was no compile pause to avoid" if none else "pre-compiling must run every kernel "
                               "once before serving (a warm-up): the compiled kernels found in the on-disk cache alone "
                               f"still leave a pause; the cache makes that warm-up cheap (the paused time, {cached})"),
                 "refuted": "none: a warmed-up process still pauses at its first evaluation"}
    return Verdict(status, summary + ".", ev, condition[status] + "; judged on MLX CUDA, the portable analog of Metal "
                   "pipeline states", first_call_source(e))


C09 = claim("C09", "dispatch", gather_first_calls, judge_c09,
            short="pre-compiling pipeline state objects and caching shaders avoids compile pauses at first context "
                  "evaluation",
            quote="Pre-compiling Metal pipeline state objects and caching shader functions avoids runtime "
                  "compilation pauses during initial context evaluation.",
            rule=f"Evidence: recorded first-call runs on MLX CUDA (the portable analog of Metal pipeline state "
                 f"objects; Metal cannot run here): tokens over {PAUSE_FACTOR}× their run's steady token in a fresh "
                 f"process, in one that finds the compiled kernels on disk, and in runs after a warm-up (every kernel "
                 f"run once: pre-compiled), with and without the cache. Refuted if a run after a warm-up still "
                 f"pauses; confirmed if the fresh process pauses and the cached one does not even before a warm-up; "
                 f"qualified otherwise, naming what avoided the pause.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("the dispatch chapter's first-call results of a GPU", BENCH))


# ---- C15: wired memory (wired) -------------------------------------------------------------------------

@dataclass(frozen=True)
class WiredReads:
    """One machine's recorded reads of a fresh buffer, tensor by tensor, per variant (first_touch, prefaulted,
    mlocked): the portable analog of wired pages."""
    label: str
    buffer_bytes: int
    tensor_bytes: int
    minor_faults: dict[str, tuple[float, ...]]   # per variant, over the repeats
    major_faults: float                          # every variant, every repeat
    read_gbs: dict[str, float]                   # per variant, median over the repeats
    tensor_p99_ms: dict[str, float]              # per variant, over every tensor read of every repeat
    locked: bool                                 # the mlocked variant's mlock succeeded
    caption: str = ""                            # the run they were recorded in (Run.caption)


@dataclass(frozen=True)
class WiredEvidence:
    machines: tuple[WiredReads, ...]
    live: dict[str, Number] = field(default_factory=dict)
    live_machine: str = ""


VARIANTS = ("first_touch", "prefaulted", "mlocked")


def gather_c15(live: bool) -> WiredEvidence | None:
    """Each machine's reference wired run, and with `live` this machine's reads (latency.measure_wired, shown only);
    None without a recorded run."""
    machines = tuple(WiredReads(label, v["first_touch"]["bytes"], v["first_touch"]["tensor_bytes"],
                                {k: tuple(v[k]["minor_faults"]) for k in VARIANTS},
                                sum(sum(v[k]["major_faults"]) for k in VARIANTS),
                                {k: float(np.median(v[k]["read_bandwidth"])) for k in VARIANTS},
                                {k: float(np.percentile(v[k]["tensor_ms"], 99)) for k in VARIANTS},
                                bool(v["mlocked"]["locked"]), run.caption)
                     for label, run in dispatch_runs("wired").items() for v in [wired_recorded(run)])
    if not machines:
        return None
    if not live:
        return WiredEvidence(machines)
    w = latency.measure_wired(rounds=LIVE_ROUNDS)
    mib = w["first_touch"][0].buffer_bytes >> 20
    ev = {f"live first touch of {mib} MiB: minor page faults":
          repeated([r.minor_faults for r in w["first_touch"]], "faults")}
    ev |= {f"live {k}: read rate": repeated([r.gb_per_s for r in w[k]], "GB/s") for k in VARIANTS}
    return WiredEvidence(machines, ev, platform.machine())


def wired_numbers(m: WiredReads) -> dict[str, Number]:
    mib, tmib = m.buffer_bytes / 2**20, m.tensor_bytes / 2**20
    ev = {f"first touch of {mib:,.0f} MiB: minor page faults ({m.label})":
          Number(float(np.median(m.minor_faults["first_touch"])), "faults"),
          f"prefaulted: minor page faults ({m.label})": Number(max(m.minor_faults["prefaulted"]), "faults"),
          f"mlocked: minor page faults ({m.label})": Number(max(m.minor_faults["mlocked"]), "faults")}
    for k in VARIANTS:
        ev[f"{k}: read rate, median of repeats ({m.label})"] = Number(m.read_gbs[k], "GB/s")
        ev[f"{k}: {tmib:g} MiB tensor read, p99 ({m.label})"] = Number(m.tensor_p99_ms[k], "ms")
    ev[f"major faults, every variant ({m.label})"] = Number(m.major_faults, "faults")
    ev[f"largest tensor read within 1 ms at the slower resident rate ({m.label})"] = Number(
        min(m.read_gbs["prefaulted"], m.read_gbs["mlocked"]) * 1e6 / 2**20, "MiB")
    return ev


def judge_c15(e: WiredEvidence) -> Verdict:
    """Not testable here (macOS wiring, swap under pressure); Linux's first-touch, prefaulted and mlocked reads
    shown."""
    parts = []
    for m in e.machines:
        touch = float(np.median(m.minor_faults["first_touch"]))
        resident = max(max(m.minor_faults["prefaulted"]), max(m.minor_faults["mlocked"]))
        g, p = m.read_gbs, m.tensor_p99_ms
        tmib = m.tensor_bytes / 2**20
        parts.append(f"on {m.label} a first touch of {m.buffer_bytes / 2**20:,.0f} MiB took {touch:,.0f} minor faults"
                     + (f", one per {m.buffer_bytes / touch:,.0f} bytes," if touch else ",")
                     + f" and read at {figure(g['first_touch'])} GB/s ({tmib:g} MiB tensor p99 "
                     f"{figure(p['first_touch'])} ms), resident pages with at most {plural(resident, 'fault')} at "
                     f"{figure(g['prefaulted'])} GB/s prefaulted and {figure(g['mlocked'])} GB/s mlocked "
                     f"({g['mlocked'] / g['prefaulted']:.2f}× the prefaulted rate"
                     f"{'' if m.locked else '; mlock failed, so unlocked'}; "
                     f"p99 {figure(p['prefaulted'])} and {figure(p['mlocked'])} ms), with {m.major_faults:,.0f} major "
                     f"faults in all; at the slower resident rate only tensors up to "
                     f"{min(g['prefaulted'], g['mlocked']) * 1e6 / 2**20:,.0f} MiB read within a millisecond")
    summary = ("Not testable here: wiring is macOS's (mx.set_wired_limit), and keeping weights out of swap needs "
               "memory pressure, which these Linux runs did not create; the portable analog, Linux's first-touch, "
               "prefaulted and mlock(2)ed pages: " + "; ".join(parts) + "; so whether a read is sub-millisecond is "
               "set by the tensor's bytes over the bandwidth, wired or not" + (live_phrase(e.live) if e.live else ""))
    ev = {k: n for m in e.machines for k, n in wired_numbers(m).items()} | e.live
    most = max(max(max(m.minor_faults["prefaulted"]), max(m.minor_faults["mlocked"])) for m in e.machines)
    source = "wired: " + "; ".join(m.caption for m in e.machines)
    return Verdict("not testable here", summary + ".", ev,
                   f"macOS-specific; on Linux, resident pages (prefaulted or mlocked) read with at most "
                   f"{plural(most, 'fault')}, and mlock's guarantee matters only under memory pressure, which was "
                   "not created",
                   (f"live ({e.live_machine}) and " if e.live else "") + f"{source}; mlx.core.set_wired_limit and "
                   "mlx-lm generate.py wired_limit (documentation and source)")


C15 = claim("C15", "dispatch", gather_c15, judge_c15,
            short="wired pages on macOS keep weights out of swap, giving consistent sub-millisecond tensor reads",
            quote="Allocating inference memory as wired pages on macOS prevents the virtual memory subsystem from "
                  "paging model weights to swap disks, ensuring consistent sub-millisecond tensor read latencies.",
            rule="Evidence: recorded Linux reads of first-touch, prefaulted and mlock(2)ed buffers (the portable "
                 "analog of wired pages): page faults, read rates, tensor-read p99, and the largest tensor the slower "
                 "resident rate reads within 1 ms. Always not testable here: wiring is macOS's and keeping weights "
                 "out of swap needs memory pressure, which these machines lack; the analog is shown, it does not "
                 "decide. Live page-fault readings are shown beside it.",
            outcomes=("not testable here",),
            pending=("the dispatch chapter's wired-memory results", BENCH))


# ---- C02: jitter from growing the KV cache at context thresholds (kv-jitter) ------------------------

@dataclass(frozen=True)
class CacheRun:
    """One recorded kv-jitter run of one KV-cache strategy, summarized: inter-token latencies (ITLs), memory."""
    tokens: int                 # ITLs recorded
    pauses: int                 # ITLs over PAUSE_FACTOR × the run's median (find_pauses)
    p50_ms: float
    p99_ms: float
    max_ms: float
    cache_mb: float             # what the cache holds at the end
    peak_mb: float              # peak memory above what was active before the run (the weights)
    growth_steps: int = 0       # steps at which a cache growing by GROWTH_STEP positions grows, in the run
    pauses_at_growth: int = 0   # pauses within one token of one
    growth_share: float = 0.0   # share of the run's ITL variance in the ITLs within one token of one


@dataclass(frozen=True)
class KVJitter:
    """C02's evidence: per (machine, model), the static, chunked and concat runs; per machine, the caption of its
    kv-jitter run and the measured bandwidth (GB/s, `records.bandwidth`) with the caption of the run it was
    measured in, where its machine recorded one."""
    runs: dict[tuple[str, str], dict[str, CacheRun]]
    bandwidth: dict[str, tuple[float, str]] = field(default_factory=dict)
    captions: dict[str, str] = field(default_factory=dict)


STRATEGIES = ("float", "chunked", "concat")


def growth_share(itl: list[float], prompt_len: int, step: int = GROWTH_STEP) -> float:
    """The share of a run's ITL variance (squared deviations from its mean) in the ITLs within one token of a step
    at which a cache growing by `step` positions grows."""
    a = np.asarray(itl, dtype=float)
    near = sorted({j for g in growth_pauses(itl, prompt_len, step)[1] for j in (g - 1, g, g + 1) if 0 <= j < len(a)})
    dev = (a - a.mean()) ** 2
    return float(dev[near].sum() / dev.sum()) if near and dev.sum() > 0 else 0.0


def cache_run(d: dict) -> CacheRun:
    """One kv_recorded run, summarized."""
    pauses, growth = growth_pauses(d["itl"], d["prompt_len"])
    return CacheRun(len(d["itl"]), len(pauses), d["itl_p50_ms"], d["itl_p99_ms"], d["itl_max_ms"],
                    d["cache_bytes"] / 1e6, (d["peak_memory"] - d["active_memory_before"]) / 1e6, len(growth),
                    sum(any(abs(p - g) <= 1 for g in growth) for p in pauses), growth_share(d["itl"], d["prompt_len"]))


def machine_bandwidth(run: Run) -> tuple[float, str] | None:
    """(GB/s, caption of the run it was measured in): the measured bandwidth a copy on `run`'s machine is timed
    against (`records.bandwidth`), or None where that machine recorded no memory probe."""
    try:
        gbs, source = records.bandwidth(run, core.RESULTS_DIR)
    except LookupError:
        return None
    return gbs, source.caption


def gather_c02(live: bool) -> KVJitter | None:
    """Every (machine, model) of each machine's reference kv-jitter run with all three strategies, or None when
    there is none."""
    kv_runs = dispatch_runs("kv-jitter")
    by_label = {label: kv_recorded(run) for label, run in kv_runs.items()}
    runs = {(label, model): {s: cache_run(by[model, s]) for s in STRATEGIES}
            for label, by in by_label.items() for model in dict.fromkeys(m for m, _ in by)
            if all((model, s) in by for s in STRATEGIES)}
    if not runs:
        return None
    labels = dict.fromkeys(label for label, _ in runs)
    bandwidth = {label: bw for label in labels if (bw := machine_bandwidth(kv_runs[label])) is not None}
    return KVJitter(runs, bandwidth, {label: kv_runs[label].caption for label in labels})


def c02_numbers(e: KVJitter, order: list[tuple[str, str]], worst: tuple[str, str]) -> dict[str, Number]:
    """The evidence: every run's pauses and growth share, the worst run in full, and the copy it would cost."""
    ev: dict[str, Number] = {}
    for label, model in order:
        tag, r = f"{model}, {label}", e.runs[label, model]
        ev |= {f"{s}: pauses over {PAUSE_FACTOR}× the median ITL ({tag})": Number(r[s].pauses, "pauses")
               for s in STRATEGIES}
        ev[f"chunked: longest ITL ({tag})"] = Number(r["chunked"].max_ms, "ms")
        ev[f"chunked: share of the ITL variance within one token of a growth step ({tag})"] = Number(
            100 * r["chunked"].growth_share, "%")
    label, model = worst
    tag, r = f"{model}, {label}", e.runs[worst]
    ev[f"chunked: growth steps in the run ({tag})"] = Number(r["chunked"].growth_steps, "steps")
    ev[f"chunked: pauses within one token of a growth step ({tag})"] = Number(r["chunked"].pauses_at_growth, "pauses")
    for s in STRATEGIES:
        ev |= {f"{s}: ITL p50 ({tag})": Number(r[s].p50_ms, "ms"), f"{s}: ITL p99 ({tag})": Number(r[s].p99_ms, "ms"),
               f"{s}: longest ITL ({tag})": Number(r[s].max_ms, "ms"),
               f"{s}: cache at the end ({tag})": Number(r[s].cache_mb, "MB"),
               f"{s}: peak memory above the weights ({tag})": Number(r[s].peak_mb, "MB")}
    if label in e.bandwidth:
        ev[f"measured bandwidth ({label})"] = Number(e.bandwidth[label][0], "GB/s")
        ev[f"copying the whole chunked cache once at the measured bandwidth ({label})"] = Number(
            2 * r["chunked"].cache_mb / e.bandwidth[label][0], "ms")      # read and write: MB / (GB/s) = ms
    return ev


def judge_c02(e: KVJitter) -> Verdict:
    """Where the jitter of a growing cache sits, whether allocating stalls, and what a static cache costs."""
    order = sorted(e.runs, key=lambda k: -e.runs[k]["chunked"].growth_share)
    dominated = [k for k in order if e.runs[k]["chunked"].growth_share > PRIMARILY]
    concat_pauses = sum(e.runs[k]["concat"].pauses for k in order)
    status = decide(len(dominated) == len(order) and concat_pauses > 0, contradicted=not dominated)
    names = lambda keys: ", ".join(f"{model} on {label}" for label, model in keys) or "none"   # noqa: E731
    worst = max(dominated or order, key=lambda k: e.runs[k]["chunked"].max_ms)
    label, model = worst
    st, ch, cc = (e.runs[worst][s] for s in STRATEGIES)
    top = max(e.runs[k]["chunked"].growth_share for k in order)
    summary = (f"Growth thresholds carry over half the ITL variance of a growing cache in {len(dominated)} of "
               f"{len(order)} recorded runs ({names(dominated)}), and a cache that allocates and copies at every token "
               f"(concat) paused {plural(concat_pauses, 'time')} across them: on {label}, a cache that grows by "
               f"{GROWTH_STEP} positions (mlx-lm's policy) paused {plural(ch.pauses, 'time')} in {ch.tokens:,} "
               f"tokens of the {model}-shaped model, {ch.pauses_at_growth} of them within one token of one of its "
               f"{ch.growth_steps} growth steps, up to {figure(ch.max_ms)} ms against a {figure(ch.p50_ms)} ms median, "
               f"and the ITLs at its growth steps carry {ch.growth_share:.0%} of its ITL variance")
    rest = [e.runs[k]["chunked"].growth_share for k in order if k not in dominated]
    if rest and dominated:
        span = {figure(100 * min(rest)), figure(100 * max(rest))}
        summary += f"; in the other {plural(len(rest), 'run')} they carry {'-'.join(sorted(span, key=float))}%"
    if label in e.bandwidth:
        copy_ms = 2 * ch.cache_mb / e.bandwidth[label][0]
        summary += (f"; copying that whole cache once takes {figure(copy_ms)} ms at {label}'s measured bandwidth "
                    f"({figure(e.bandwidth[label][0])} GB/s), {ch.max_ms / copy_ms:,.0f}× less than its longest ITL")
    static_pauses = sum(e.runs[k]["float"].pauses for k in order)
    summary += (f"; the static cache, allocated before decoding, paused {plural(static_pauses, 'time')} across the "
                f"{len(order)} runs ({st.pauses} in that one, longest ITL {figure(st.max_ms)} ms, p99 "
                f"{st.p99_ms / st.p50_ms:.1f}× p50), and its price is memory: {figure(st.cache_mb)} MB held from the "
                f"first token, where at the end concat held {figure(cc.cache_mb)} MB and chunked "
                f"{figure(ch.cache_mb)} MB (whole steps), and its peak above the weights was "
                f"{'higher' if st.peak_mb > ch.peak_mb else 'not higher'} than the chunked cache's "
                f"({figure(st.peak_mb)} MB against {figure(ch.peak_mb)} MB)")
    quiet = [m for m in dict.fromkeys(lb for lb, _ in order)
             if not any(e.runs[k][s].pauses for k in order if k[0] == m for s in STRATEGIES)]
    summary += f"; on {', '.join(quiet)} no strategy paused at all" if quiet else ""
    alloc = ("allocating at every token stalled too" if concat_pauses else
             "allocation itself, at every token, did not stall, so the stall comes with a new buffer size, not with "
             "allocating")
    condition = {"confirmed": f"as stated: in every recorded run the growth thresholds carry most of the jitter, and "
                              f"{alloc}",
                 "qualified": f"only for a cache that grows in large steps, in {names(dominated)}, where each new size "
                              f"stalls the loop; {alloc}"
                              + ("; in the other runs the jitter has other causes" if rest else ""),
                 "refuted": f"none: in no recorded run do growth thresholds carry over half the ITL variance "
                            f"(at most {top:.0%})"}[status]
    source = "kv-jitter: " + "; ".join(e.captions.values())
    if e.bandwidth:
        source += "; measured bandwidth: " + "; ".join(c for _, c in e.bandwidth.values())
    return Verdict(status, summary + ".", c02_numbers(e, order, worst), condition, source)


C02 = claim("C02", "dispatch", gather_c02, judge_c02,
            short="inter-token latency jitter is mainly caused by dynamic KV-cache allocations and compaction pauses "
                  "when context thresholds are crossed",
            quote="Inter-token latency variance (jitter) is primarily induced by dynamic KV cache heap allocations "
                  "and memory compaction pauses when context thresholds are crossed.",
            rule=f"Evidence: recorded kv-jitter runs, every inter-token latency (ITL) of a static cache, a chunked one "
                 f"(grows every {GROWTH_STEP} positions, mlx-lm's policy) and a concat one (allocates and copies every "
                 f"token), per machine and model. Confirmed if in every run the ITLs within one token of a growth "
                 f"step carry over half of the chunked cache's ITL variance ('primarily') and the concat cache pauses "
                 f"too (an ITL over {PAUSE_FACTOR}× its median: allocation itself stalls); refuted if in no run do "
                 f"they carry over half; qualified otherwise, naming the runs where they do and whether allocating "
                 f"stalls.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("the dispatch chapter's kv-jitter results", BENCH))


CLAIMS = (C02, C09, C15, C28)   # in id order; __init__ assembles the registry
