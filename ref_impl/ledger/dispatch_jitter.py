"""Chapter dispatch, TTFT and jitter (book/dispatch/ttft-jitter): C16, and what a pause is.

The recorded kv-jitter runs (every inter-token latency of a static, a chunked and a concat KV cache)
answer C16; the caching chapter's C02 reads the same runs. Both count pauses by the one definition
here (`find_pauses`): an inter-token latency over PAUSE_FACTOR times its run's median. C02 says the
jitter is caused by pauses at context thresholds, so a pause must stand apart from the jitter itself:
the factor sits above the spread that a static cache, which neither allocates nor crosses a
threshold, shows on its own. A chunked cache grows every GROWTH_STEP positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ref_impl.ledger.core import Number, Verdict, claim, results

GROWTH_STEP = 256   # kvcache.ChunkedKVCache's default step, mlx-lm's KVCache.step
PAUSE_FACTOR = 10   # an inter-token latency over PAUSE_FACTOR × its run's median is a pause


def find_pauses(itl_ms: np.ndarray | list[float], factor: float = PAUSE_FACTOR) -> np.ndarray:
    """Indices of the pauses of one run: its inter-token latencies over `factor` × the run's median."""
    a = np.asarray(itl_ms, dtype=float)
    return np.flatnonzero(a > factor * np.median(a))


@dataclass(frozen=True)
class JitterTrace:
    """One recorded kv-jitter run: every inter-token latency of one KV-cache strategy on one machine."""
    file: str
    machine: str                # results label, e.g. "h200"
    backend: str                # "cuda" or "cpu"
    model: str
    strategy: str               # a key of kvcache.CACHES
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
    """The kv-jitter `itl_ms` traces in results/, the newest file of each machine; prompt_len is the
    record's context (prompt + generated tokens) less the ITLs less one."""
    rows = [(name, m, r) for name, m, r in results("kv-jitter")
            if r["metric"] == "itl_ms" and r["samples"] and r.get("peer") is None]
    newest = {}
    for name, m, _ in rows:
        newest[m["label"]] = max(newest.get(m["label"], name), name)
    return [JitterTrace(name, m["label"], m["backend"], r["model"], r["variant"], r["context"] - len(r["samples"]) - 1,
                        np.array(r["samples"], dtype=float))
            for name, m, r in rows if newest[m["label"]] == name]


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


def check_c16(live: bool) -> Verdict:
    """Static vs growing KV caches in the recorded kv-jitter runs: what allocation in the loop costs."""
    traces = {(t.machine, t.model, t.strategy): t for t in jitter_traces()}
    if not traces:
        return Verdict("not testable here", "No kv-jitter records in results/: run `python -m ref_impl bench "
                       "--dispatch` to measure static against growing caches.",
                       {"kv-jitter traces": Number(0, "runs")}, "", "results/ (empty)")
    ev, source = {}, set()
    biggest = {}     # per machine, the model with the slowest static median: the most bytes per step
    for (machine, model, s), t in traces.items():
        if s == "static" and t.percentile(50) > biggest.get(machine, ("", 0.0))[1]:
            biggest[machine] = (model, t.percentile(50))
    for machine, (model, _) in sorted(biggest.items()):
        for s in ("static", "chunked", "concat"):
            t = traces.get((machine, model, s))
            if t is None:
                continue
            source.add(f"results/{t.file}")
            ev[f"{machine}, {model}, {s}: ITL p50"] = Number(t.percentile(50), "ms")
            ev[f"{machine}, {model}, {s}: ITL p99 / p50"] = Number(t.percentile(99) / t.percentile(50), "×")
            ev[f"{machine}, {model}, {s}: ITL max"] = Number(float(t.itl_ms.max()), "ms")
    gpu = [t for t in traces.values() if t.backend != "cpu" and t.strategy == "chunked"]
    crossed = paused = off = 0
    pause_ms, pause_models, warm_paused = [], [], False
    for t in gpu:
        p = threshold_pauses(t)
        crossed, paused, off = crossed + len(p["thresholds"]), paused + len(p["paused"]), off + len(p["off_threshold"])
        pause_ms += [float(t.itl_ms[t.positions == x][0]) for x in p["paused"]]
        pause_models += [t.model] if p["paused"] else []
        warm_paused |= GROWTH_STEP in p["paused"]      # kv_jitter's 264-token warm-up crosses the first one
    summary = ("Not as a statement about MLX: it allocates every step's activations from its buffer cache, and "
               "allocation there is cheap")
    gpu_big = [(m, mod) for m, (mod, _) in biggest.items() if traces[m, mod, "static"].backend != "cpu"]
    if gpu_big and (gpu_big[0] + ("concat",)) in traces:
        m, mod = gpu_big[0]
        st, cc, ch = (traces[m, mod, s] for s in ("static", "concat", "chunked"))
        ratio = cc.percentile(50) / st.percentile(50)
        ev[f"{m}, {mod}: concat p50 / static p50"] = Number(ratio, "×")
        summary += (f": a KV cache that allocates and copies its whole history every token (concat) decodes "
                    f"{mod} on {m} at {ratio:.2f}× the static cache's median ITL, with p99/p50 "
                    f"{cc.percentile(99) / cc.percentile(50):.2f} against {st.percentile(99) / st.percentile(50):.2f}")
    if gpu:
        ev |= {f"GPU chunked runs: {GROWTH_STEP}-step thresholds crossed": Number(crossed, "thresholds"),
               f"... of them with an ITL > {PAUSE_FACTOR}× the run's median": Number(paused, "thresholds"),
               f"GPU chunked runs: ITLs > {PAUSE_FACTOR}× median off the thresholds": Number(off, "tokens")}
        if pause_ms:
            ev |= {"GPU chunked threshold pauses: shortest": Number(min(pause_ms), "ms"),
                   "GPU chunked threshold pauses: longest": Number(max(pause_ms), "ms")}
            summary += (f". What a fixed-size cache does remove is the growing cache's changes of shape: on the GPU "
                        f"{paused} of {crossed} growth thresholds paused the loop for {min(pause_ms):.0f}-"
                        f"{max(pause_ms):.0f} ms ({off} pauses elsewhere), only on {', '.join(pause_models)} "
                        f"and {'' if warm_paused else 'only '}at buffer sizes new to the process (the threshold the "
                        f"warm-up crossed {'paused too' if warm_paused else 'did not pause again'}): a first-use cost "
                        f"inside MLX's CUDA backend that these records do not take apart "
                        f"(fresh device memory, or work for the new shape), and not a cost of allocating as such, "
                        f"since concat allocates every step and never pauses")
    cpu = [(m, mod) for m, (mod, _) in biggest.items() if (m, mod) not in gpu_big]
    if cpu and all((cpu[0] + (s,)) in traces for s in ("static", "chunked", "concat")):
        r = [traces[cpu[0] + (s,)].percentile(99) / traces[cpu[0] + (s,)].percentile(50) for s in ("static", "chunked", "concat")]
        summary += (f"; on the CPU ({cpu[0][0]}) the three strategies' p99/p50 are {min(r):.2f}-{max(r):.2f}, "
                    f"noise with no order")
    summary += "; locks are not testable here (MLX exposes none, and one decode stream has nothing to contend with)."
    return Verdict("qualified", summary, ev,
                   "a KV cache of fixed shape, allocated before the loop, removes the pauses of a cache that changes "
                   "shape as it grows; removing per-step allocation itself buys nothing measurable where a caching "
                   "allocator (MLX's) serves it; lock contention not measured",
                   "; ".join(sorted(source)) + " (kv-jitter records: every inter-token latency, async_eval pipelined)")


C16 = claim("C16", "dispatch", check_c16,
            short="static activation workspaces allocated at start-up remove allocation overhead and locks from the "
                  "generation loop",
            quote="Pre-allocating static activation workspaces at engine startup eliminates dynamic memory "
                  "allocation overhead and kernel locks during the generation loop.")


CLAIMS = (C16,)   # in id order; __init__ assembles the registry
