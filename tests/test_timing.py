"""platform/timing.py, on a clock the test controls: each loop takes the samples it says it takes."""

from __future__ import annotations

import itertools

import pytest

from ref_impl.platform import timing


@pytest.fixture
def ticks(monkeypatch):
    """A clock that advances 1 s each time it is read, and a function whose calls are counted."""
    monkeypatch.setattr(timing, "clock", itertools.count().__next__)
    calls = []
    return calls, lambda: calls.append(1)


def test_repeat_warms_up_untimed_then_times_each_sample(ticks):
    calls, fn = ticks
    # per sample: one clock read before and one after `calls` calls, so each sample reads 1 s / calls
    assert timing.repeat(fn, reps=3, warmup=2, calls=4) == [0.25, 0.25, 0.25]
    assert len(calls) == 2 + 3 * 4
    with pytest.raises(ValueError, match="at least 1"):
        timing.repeat(fn, reps=0)


def test_within_takes_the_minimum_then_stops_at_the_budget_or_the_cap(ticks):
    _, fn = ticks
    assert len(timing.within(fn, budget_s=0, min_reps=3)) == 3
    # the budget is checked once per sample (one clock read) and each sample reads the clock twice:
    # 3 reads per sample after the start, so a 30 s budget allows 10 samples
    assert len(timing.within(fn, budget_s=30, min_reps=1)) == 10
    assert len(timing.within(fn, budget_s=1e9, min_reps=1, max_reps=7)) == 7


def test_median_and_best():
    assert timing.median([3.0, 1.0, 2.0, 100.0]) == 2.5 and timing.best([3.0, 1.0, 2.0]) == 1.0
    assert timing.median([]) != timing.median([]) and timing.best([]) != timing.best([])   # NaN for no samples


def test_tokens_are_stamped_as_they_arrive_and_the_metrics_follow(ticks):
    run = timing.time_tokens(iter([7, 8, 9, 10]), 3)          # start at 0, tokens at 1, 2, 3
    assert (run.start, run.times, run.ids) == (0, [1, 2, 3], [7, 8, 9])
    slow = timing.TokenRun(0.0, [0.5, 0.6, 0.8], [1, 2, 3])    # gaps 0.1 s and 0.2 s
    m = timing.decode_metrics([run, slow], prompt_len=10)
    assert m["ttft_ms"] == (pytest.approx(750.0), [1000.0, 500.0])
    assert m["tokens_per_s"][1] == [1.0, pytest.approx(2 / 0.3)]
    assert m["prefill_tokens_per_s"][0] == pytest.approx(10 / 0.75)
    assert m["itl_p50_ms"][0] == pytest.approx(600.0)         # gaps 1000, 1000, 100, 200 ms


def test_token_runs_warm_up_on_a_fresh_stream(ticks):
    made = []

    def stream():
        made.append(1)
        return iter(range(5))

    runs = timing.token_runs(stream, n=2, repeats=3, warmup=1)
    assert len(runs) == 3 and len(made) == 4 and all(r.ids == [0, 1] for r in runs)
