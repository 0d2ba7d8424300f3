"""Chapter dispatch, TTFT and jitter (book/dispatch/ttft-jitter): C16, and what a pause is.

Each machine's reference kv-jitter run (`dispatch_runs`: every inter-token latency of a static, a
chunked and a concat KV cache) answers C16, the KV cache standing in for a workspace allocated
before the loop, every step, or at growth steps; the caching chapter's C02 reads the same runs.
Both count pauses by the one definition here (`find_pauses`): an inter-token latency over
PAUSE_FACTOR times its run's median. C02 says the jitter is caused by pauses at context thresholds,
so a pause must stand apart from the jitter itself: the factor sits above the spread that a static
cache, which neither allocates nor crosses a threshold, shows on its own. A chunked cache grows
every GROWTH_STEP positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ref_impl.ledger.core import Number, Verdict, claim, decide
from ref_impl.ledger.dispatch import dispatch_runs

GROWTH_STEP = 256   # kvcache.ChunkedKVCache's default step, mlx-lm's KVCache.step
PAUSE_FACTOR = 10   # an inter-token latency over PAUSE_FACTOR × its run's median is a pause


def find_pauses(itl_ms: np.ndarray | list[float], factor: float = PAUSE_FACTOR) -> np.ndarray:
    """Indices of the pauses of one run: its inter-token latencies over `factor` × the run's median."""
    a = np.asarray(itl_ms, dtype=float)
    return np.flatnonzero(a > factor * np.median(a))


@dataclass(frozen=True)
class JitterTrace:
    """One recorded kv-jitter run: every inter-token latency of one KV-cache strategy on one machine."""
    caption: str                # the run it was recorded in (Run.caption)
    machine: str                # results label, e.g. "h200"
    backend: str                # "cuda" or "cpu"
    model: str
    strategy: str               # a name of kvquant.FLOATS
    prompt_len: int
    itl_ms: np.ndarray

    @property
    def positions(self) -> np.ndarray:
        """Per interval, the cache position written by the step *submitted* in it: with async_eval
        pipelining, interval j (token j to token j+1) builds and queues the step writing position
        prompt_len + j + 1 while it waits for the one writing prompt_len + j."""
        return self.prompt_len + 1 + np.arange(len(self.itl_ms))

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.itl_ms, q))


def jitter_traces() -> list[JitterTrace]:
    """The `itl_ms` traces of each machine's reference kv-jitter run (`dispatch_runs`); prompt_len is the
    record's context (prompt + generated tokens) less the ITLs less one."""
    return [JitterTrace(run.caption, label, run.machine["backend"], r["model"], r["variant"],
                        r["context"] - len(r["samples"]) - 1, np.array(r["samples"], dtype=float))
            for label, run in dispatch_runs("kv-jitter").items() for r in run.select(metric="itl_ms") if r["samples"]]


def growth_positions(prompt_len: int, end: int, step: int = GROWTH_STEP) -> list[int]:
    """Cache positions at which a ChunkedKVCache that prefilled prompt_len tokens grows, below `end`:
    its first buffer holds ceil(prompt_len / step) steps, so every multiple of step >= prompt_len."""
    first = -(-prompt_len // step) * step
    return list(range(first, end, step))


def threshold_pauses(t: JitterTrace, factor: float = PAUSE_FACTOR) -> dict[str, list[int]]:
    """Positions of the growth thresholds in the run, and of its pauses (`find_pauses`) on and off them."""
    pos = t.positions
    grow = growth_positions(t.prompt_len, int(pos[-1]) + 1)
    paused = [int(p) for p in pos[find_pauses(t.itl_ms, factor)]]
    return {"thresholds": grow, "paused": [p for p in grow if p in paused],
            "off_threshold": [p for p in paused if p not in grow]}


@dataclass(frozen=True)
class CacheRuns:
    """One model's three recorded kv-jitter runs on one machine, as C16 reads them: the KV cache stands in
    for a workspace, allocated before the loop (static), every step (concat) or every GROWTH_STEP positions
    (chunked). Static and chunked do the same work per step between growth steps."""
    machine: str
    backend: str
    model: str
    p50_ms: dict[str, float]            # strategy -> median ITL
    thresholds: int = 0                 # the chunked run's growth thresholds crossed
    pauses_ms: tuple[float, ...] = ()   # its ITLs at the thresholds it paused at (over PAUSE_FACTOR x its median)
    off_threshold: int = 0              # its pauses elsewhere

    def vs_static(self, strategy: str) -> float:
        """A strategy's median ITL over the static cache's, less one."""
        return self.p50_ms[strategy] / self.p50_ms["float"] - 1

    @property
    def step_cost(self) -> bool:
        """Allocating every step cost something: concat's median exceeds static's by more than static's and
        chunked's medians differ, the spread between two runs that do the same work per step."""
        return self.vs_static("concat") > abs(self.vs_static("chunked"))


@dataclass(frozen=True)
class C16Evidence:
    runs: tuple[CacheRuns, ...]
    captions: tuple[str, ...]           # the kv-jitter runs read (Run.caption)


def gather_c16(live: bool) -> C16Evidence | None:
    """Each machine's reference kv-jitter run, per model with all three caches; None without a GPU's."""
    traces = {(t.machine, t.model, t.strategy): t for t in jitter_traces()}
    runs = []
    for machine, model in sorted({(m, mo) for m, mo, _ in traces}):
        if not all((machine, model, s) in traces for s in ("float", "chunked", "concat")):
            continue
        ch = traces[machine, model, "chunked"]
        p = threshold_pauses(ch)
        runs.append(CacheRuns(machine, ch.backend, model,
                              {s: traces[machine, model, s].percentile(50) for s in ("float", "chunked", "concat")},
                              len(p["thresholds"]), tuple(float(ch.itl_ms[ch.positions == x][0]) for x in p["paused"]),
                              len(p["off_threshold"])))
    if not any(r.backend != "cpu" for r in runs):
        return None
    return C16Evidence(tuple(runs), tuple(sorted({t.caption for t in traces.values()})))


def judge_c16(e: C16Evidence) -> Verdict:
    """Confirmed if per-step allocation costs on every GPU model and growth pauses; refuted if neither costs
    anything anywhere; qualified otherwise, naming which did."""
    gpu = [r for r in e.runs if r.backend != "cpu"]
    cpu = [r for r in e.runs if r.backend == "cpu"]
    stepped = [r for r in gpu if r.step_cost]
    paused = [r for r in gpu if r.pauses_ms]
    status = decide(len(stepped) == len(gpu) and bool(paused), contradicted=not stepped and not paused)
    ev = {}
    for r in gpu:
        ev[f"{r.machine}, {r.model}: static ITL p50"] = Number(r.p50_ms["float"], "ms")
        for s in ("concat", "chunked"):
            ev[f"{r.machine}, {r.model}: {s} p50 / static p50"] = Number(1 + r.vs_static(s), "×")
    pauses = [x for r in gpu for x in r.pauses_ms]
    crossed, off = sum(r.thresholds for r in gpu), sum(r.off_threshold for r in gpu)
    ev |= {f"GPU chunked runs: {GROWTH_STEP}-step thresholds crossed": Number(crossed, "thresholds"),
           f"GPU chunked runs: thresholds with an ITL > {PAUSE_FACTOR}× the run's median":
               Number(len(pauses), "thresholds"),
           f"GPU chunked runs: ITLs > {PAUSE_FACTOR}× median off the thresholds": Number(off, "tokens")}
    if pauses:
        ev |= {"GPU chunked threshold pauses: shortest": Number(min(pauses), "ms"),
               "GPU chunked threshold pauses: longest": Number(max(pauses), "ms")}
    for r in cpu:
        for s in ("concat", "chunked"):
            ev[f"context, CPU: {r.machine}, {r.model}: {s} p50 / static p50"] = Number(1 + r.vs_static(s), "×")
    removes = ("both" if paused and len(stepped) == len(gpu) else
               "the growth pauses, and a per-step cost only where there was one" if paused else
               "a per-step cost where there was one, and no growth pauses, there being none" if stepped else
               "nothing measurable")
    summary = (f"On the GPU ({', '.join(sorted({r.machine for r in gpu}))}) a KV cache that grows every "
               f"{GROWTH_STEP} positions (chunked) paused at {len(pauses)} of {crossed} growth thresholds, and one "
               f"that allocates a new history every step (concat) slowed the median ITL by more than the runs' "
               f"spread for {len(stepped)} of {len(gpu)} models, so a cache allocated before the loop removes "
               f"{removes} (MLX, the KV cache standing in for a workspace)")
    if pauses:
        summary += (f"; the pauses lasted {min(pauses):.0f}-{max(pauses):.0f} ms, on "
                    + ", ".join(r.model for r in paused) + f", with {off} pauses elsewhere")
    if stepped:
        summary += ("; concat against static, beside the static-chunked spread: "
                    + ", ".join(f"{r.model} {100 * r.vs_static('concat'):+.0f}% against "
                                f"{100 * abs(r.vs_static('chunked')):.0f}%" for r in stepped))
    if cpu:
        spread = max(abs(r.vs_static("chunked")) for r in cpu)
        summary += (f"; on the CPU ({', '.join(sorted({r.machine for r in cpu}))}), context only, the medians of "
                    f"static and chunked, which do the same work per step, differ by up to {100 * spread:.0f}%")
    summary += ("; kernel locks are not testable here (MLX exposes none, and one decode stream has nothing to "
                "contend with).")
    unstepped = [r.model for r in gpu if not r.step_cost]
    condition = {
        "confirmed": "a fixed-shape cache allocated before the loop removes both a per-step allocation cost and the "
                     "pauses of a growing cache, measured through MLX on a GPU; lock contention not measured",
        "refuted": "neither a per-step allocation nor a growing cache cost anything that a cache allocated before "
                   "the loop avoids, measured through MLX on a GPU; lock contention not measured",
        "qualified": ("a cache allocated before the loop removes the pauses of a cache that grows" if paused
                      else "no growing cache paused")
                     + (f"; per-step allocation, which MLX's caching allocator serves, cost nothing beyond the runs' "
                        f"spread for {', '.join(unstepped)}" if unstepped else
                        "; per-step allocation cost something on every GPU model")
                     + "; lock contention not measured"}[status]
    return Verdict(status, summary, ev, condition,
                   "kv-jitter (every inter-token latency, async_eval pipelined): " + "; ".join(e.captions))


C16 = claim("C16", "dispatch", gather_c16, judge_c16,
            short="static activation workspaces allocated at start-up remove allocation overhead and locks from the "
                  "generation loop",
            quote="Pre-allocating static activation workspaces at engine startup eliminates dynamic memory "
                  "allocation overhead and kernel locks during the generation loop.",
            rule=f"Evidence: the recorded kv-jitter runs on a GPU through MLX, KV caches standing in for workspaces: "
                 f"static (allocated before the loop), concat (every step), chunked (every {GROWTH_STEP} positions). "
                 f"Per-step allocation costs where concat's median ITL exceeds static's by more than chunked's, "
                 f"which does the same work per step, differs from it; growth costs where chunked pauses "
                 f"(ITL > {PAUSE_FACTOR}x median) at a threshold. Confirmed if per-step allocation costs on every GPU "
                 f"model and growth pauses; refuted if neither costs; qualified otherwise. Locks are not testable "
                 f"(MLX exposes none); CPU runs are context.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("a GPU's kv-jitter runs (static, chunked and concat caches)",
                     "python -m ref_impl bench --dispatch"))


CLAIMS = (C16,)   # in id order; __init__ assembles the registry
