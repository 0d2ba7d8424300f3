"""The one clock, and the statistics every measurement in the course reports.

Every timing in ref_impl reads `clock` (time.perf_counter: monotonic, the finest resolution the OS
gives) and is taken by one of three loops here: a fixed number of calls (`repeat`), as many calls as
fit in a time budget (`within`), or the tokens of a generator as they arrive (`time_tokens`, and
`token_runs` for a warm-up and repeated generations); `interleaved` runs several variants' measurements
round by round, so a machine's drift falls on all alike. A call far shorter than the clock's grain is
timed `calls` times back to back per sample (`calls_per_sample` picks how many). `wall` is the
calendar clock, only for instants compared across processes (perf_counter's zero is per process). The
numbers a chapter quotes are medians of those samples (`median`): robust to the one
preempted run that a mean would carry. `best` (the minimum) is for the rare question "how fast can
this go at all", such as a memory sweep whose noise only ever adds time; a caller that takes it says so.

Work on a GPU or through MLX's lazy graph is only timed once it has finished: the timed function
must evaluate what it computes (mx.eval, or a numpy result), or the clock stops at the enqueue.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

clock = time.perf_counter
K, T = TypeVar("K", bound=Hashable), TypeVar("T")
wall = time.time


def _sample(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of `calls` back-to-back calls of fn."""
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls


def repeat(fn: Callable[[], object], reps: int, warmup: int = 1, calls: int = 1) -> list[float]:
    """Seconds per call of each of `reps` samples (each `calls` back-to-back calls of fn), after `warmup`
    untimed calls (kernels compiled, pages touched)."""
    if reps < 1 or calls < 1:
        raise ValueError(f"reps and calls must be at least 1, got {reps}, {calls}")
    for _ in range(warmup):
        fn()
    return [_sample(fn, calls) for _ in range(reps)]


def within(fn: Callable[[], object], budget_s: float, min_reps: int = 3, max_reps: int = 1000,
           warmup: int = 0, calls: int = 1) -> list[float]:
    """Seconds per call of each sample (`calls` back-to-back calls of fn): at least min_reps samples, then
    more while the budget lasts (max_reps at most)."""
    for _ in range(warmup):
        fn()
    out, start = [], clock()
    while len(out) < min_reps or (clock() - start < budget_s and len(out) < max_reps):
        out.append(_sample(fn, calls))
    return out


def calls_per_sample(fn: Callable[[], object], target_s: float) -> int:
    """How many back-to-back calls of fn fill about target_s: a call far shorter than the clock's
    resolution and its own overhead is timed in batches of this many, then divided."""
    t0 = clock()
    fn()
    return max(1, int(target_s / max(clock() - t0, 1e-7)))


def median(samples: Sequence[float]) -> float:
    """The statistic the book reports: the middle sample (NaN for none)."""
    return float(np.median(samples)) if len(samples) else math.nan


def best(samples: Sequence[float]) -> float:
    """The fastest sample: for questions about what the hardware can do at all (noise only adds time)."""
    return float(np.min(samples)) if len(samples) else math.nan


@dataclass(frozen=True)
class TokenRun:
    """One timed generation: the clock before the first token was asked for, at each token, the ids."""
    start: float
    times: list[float]
    ids: list[int]


def time_tokens(tokens: Iterator, n: int) -> TokenRun:
    """Pull n tokens from a started generator, stamping the clock as each arrives."""
    start, times, ids = clock(), [], []
    for _, token in zip(range(n), tokens):
        times.append(clock())
        ids.append(int(token))
    return TokenRun(start, times, ids)


def token_runs(make_stream: Callable[[], Iterator], n: int, repeats: int, warmup: int = 1) -> list[TokenRun]:
    """`repeats` timed runs of n tokens, each from a fresh generator of make_stream, after `warmup`
    untimed runs (kernels compiled, caches allocated, pages touched)."""
    for _ in range(warmup):
        time_tokens(make_stream(), n)
    return [time_tokens(make_stream(), n) for _ in range(repeats)]


def interleaved(measure: Mapping[K, Callable[[], T]], repeats: int) -> dict[K, list[T]]:
    """Each variant's measurement once as a warm-up, then `repeats` rounds that take every variant's once, in
    order, so a busy neighbour or a drifting clock slows all variants alike; the timed results by variant."""
    out: dict[K, list[T]] = {key: [] for key in measure}
    for r in range(-1, repeats):
        for key, run in measure.items():
            result = run()
            if r >= 0:
                out[key].append(result)
    return out


def decode_metrics(runs: Sequence[TokenRun], prompt_len: int) -> dict[str, tuple[float, list[float]]]:
    """metric -> (median over runs, per-run values) of repeated generations: time to first token,
    prefill and decode throughput, and the inter-token latency's p50 and p99 over every gap of every run."""
    ttft = [r.times[0] - r.start for r in runs]
    gaps = [np.diff(r.times) for r in runs]
    tps = [len(g) / g.sum() for g in gaps]
    all_ms = np.concatenate(gaps) * 1e3
    return {
        "tokens_per_s": (median(tps), tps),
        "ttft_ms": (median(ttft) * 1e3, [x * 1e3 for x in ttft]),
        "prefill_tokens_per_s": (prompt_len / median(ttft), [prompt_len / x for x in ttft]),
        "itl_p50_ms": (float(np.percentile(all_ms, 50)), []),
        "itl_p99_ms": (float(np.percentile(all_ms, 99)), []),
    }
