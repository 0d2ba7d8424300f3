"""The TTFT and jitter check (C16) on synthetic and recorded runs, each machine's newest complete kv-jitter run
read and named (a synthetic results folder of two runs per machine), and the one definition of a pause both
dispatch pages read."""

from __future__ import annotations

import numpy as np
import pytest

from ref_impl import ledger
from ref_impl.ledger.dispatch_jitter import C16Evidence, CacheRuns
from tests.test_ledger_dispatch import no_results, results_in, write_run
from tests.test_ledger_dispatch_caching import kv_jitter_run


def runs(model: str, concat: float, chunked: float = 1.02, pauses: tuple = (), backend: str = "cuda") -> CacheRuns:
    """Medians relative to a static 1 ms; chunked crosses 4 thresholds and pauses at len(pauses) of them."""
    return CacheRuns("cpu" if backend == "cpu" else "gpu", backend, model,
                     {"float": 1.0, "chunked": chunked, "concat": concat}, 4, pauses, 0)


def evidence(*r: CacheRuns) -> C16Evidence:
    return C16Evidence(r, ("f.json",))


RULE_CASES = {
    "C16": [(evidence(runs("tiny", 1.2, pauses=(300.0,)), runs("8B", 1.1)), "confirmed"),
            (evidence(runs("tiny", 1.0, pauses=(300.0,)), runs("8B", 1.01)), "qualified"),   # growth pauses only
            (evidence(runs("tiny", 1.2), runs("8B", 1.1)), "qualified"),                    # per-step cost only
            # concat 20% slower, but static and chunked (the same work per step) 25% apart: within the spread
            (evidence(runs("tiny", 1.2, chunked=0.75), runs("8B", 0.98)), "refuted"),
            (evidence(runs("8B", 0.98), runs("tiny", 3.0, backend="cpu")), "refuted")],      # the CPU is context
}


def test_c16_verdict_names_the_runs_and_leaves_locks_untested():
    v = ledger.CLAIMS["C16"].judge(evidence(runs("tiny", 1.0, pauses=(300.0, 40.0)), runs("8B", 1.2)))
    assert v.status == "qualified" and "paused at 2 of 8 growth thresholds" in v.summary
    assert "1 of 2 models" in v.summary and "8B +20% against 2%" in v.summary
    assert "locks are not testable here" in v.summary and "tiny" in v.condition
    assert v.evidence["GPU chunked threshold pauses: longest"].value == 300.0


def test_c16_growth_positions_by_hand():
    # a 32-token prompt fills a 256-slot buffer: grows at positions 256, 512, ...; 300 tokens: 512 slots first
    assert ledger.growth_positions(32, 1000) == [256, 512, 768]
    assert ledger.growth_positions(300, 1000) == [512, 768]
    assert ledger.growth_positions(256, 600) == [256, 512]          # full after prefill: grows on step 0
    assert ledger.growth_positions(5, 40, step=16) == [16, 32]


def test_c16_threshold_pauses_on_a_trace_built_by_hand():
    # prompt 32, 600 intervals of 1 ms; interval j submits the step writing position 33 + j:
    # position 512 is interval 479, position 300 (off threshold) is interval 267
    itl = np.ones(600)
    itl[479], itl[267], itl[223] = 400.0, 50.0, 5.0                 # 256 (interval 223) only 5x: no pause
    t = ledger.JitterTrace("f.json", "gpu", "cuda", "m", "chunked", 32, itl)
    assert t.positions[0] == 33 and t.positions[479] == 512
    p = ledger.threshold_pauses(t)
    assert p == {"thresholds": [256, 512], "paused": [512], "off_threshold": [300]}


def test_c16_reads_the_recorded_kv_jitter_runs(monkeypatch, tmp_path):
    v = ledger.check("C16", live=False)
    traces = ledger.jitter_traces()
    assert traces and "locks are not testable here" in v.summary
    assert all(t.caption in v.source for t in traces)
    for t in traces:    # prompt + generated tokens = context: ITLs are one fewer than the tokens
        assert t.prompt_len >= 1 and t.prompt_len + len(t.itl_ms) + 1 <= 1 << 16
    # the median ratios are what numpy says of the recorded samples
    by = {(t.machine, t.model, t.strategy): t for t in traces}
    for key, n in v.evidence.items():
        if key.endswith("p50 / static p50"):
            machine, model = key.removeprefix("context, CPU: ").split(": ")[0].split(", ")
            s = key.split(": ")[-1].split(" ")[0]
            assert n.value == pytest.approx(np.median(by[machine, model, s].itl_ms)
                                            / np.median(by[machine, model, "float"].itl_ms))
    no_results(monkeypatch, tmp_path)
    v = ledger.check("C16", live=False)
    assert v.status == "pending" and "python -m ref_impl bench --dispatch" in v.summary


def test_both_dispatch_pages_count_pauses_by_one_definition():
    # a pause is an ITL over PAUSE_FACTOR x its run's median: 9.9x is jitter, 10.1x a pause, on either page
    itl = np.ones(600)
    itl[479], itl[223] = 10.1, 9.9                                  # positions 512 and 256 (prompt 32)
    assert ledger.PAUSE_FACTOR == 10 and ledger.GROWTH_STEP == ledger.JITTER_STEP == 256
    assert ledger.find_pauses(itl).tolist() == [479]
    pauses, growth = ledger.growth_pauses(itl.tolist(), 32)
    assert pauses == [479] and growth == [223, 479]
    p = ledger.threshold_pauses(ledger.JitterTrace("f.json", "gpu", "cuda", "m", "chunked", 32, itl))
    assert p["paused"] == [512] and [int(ledger.JitterTrace("f", "g", "cuda", "m", "chunked", 32, itl).positions[i])
                                     for i in pauses] == p["paused"]
    # on the recorded runs the two pages agree pause for pause
    kv = {label: ledger.kv_recorded(run) for label, run in ledger.dispatch_runs("kv-jitter").items()}
    for t in ledger.jitter_traces():
        d = kv[t.machine][t.model, t.strategy]
        idx, _ = ledger.growth_pauses(d["itl"], d["prompt_len"])
        assert d["prompt_len"] == t.prompt_len
        assert sorted(int(t.positions[i]) for i in idx) == sorted(
            threshold_pos for k in ("paused", "off_threshold") for threshold_pos in ledger.threshold_pauses(t)[k])


def test_c16_reads_each_machines_newest_complete_run_and_names_it(monkeypatch, tmp_path):
    write_run(tmp_path, "gpu", "cuda", 1, kv_jitter_run(50.0))
    gpu = write_run(tmp_path, "gpu", "cuda", 2, kv_jitter_run(400.0))
    write_run(tmp_path, "gpu", "cuda", 3, kv_jitter_run(float("nan")))         # a failed measurement
    cpu = write_run(tmp_path, "cpu", "cpu", 1, kv_jitter_run(1.0))
    results_in(monkeypatch, tmp_path)
    traces = ledger.jitter_traces()
    assert {(t.machine, t.caption.split("results/")[1].rstrip(")")) for t in traces} == {("gpu", gpu), ("cpu", cpu)}
    assert {t.prompt_len for t in traces} == {32} and len(traces) == 6
    v = ledger.check("C16", live=False)
    assert v.evidence["GPU chunked threshold pauses: longest"].value == 400.0      # the newer run's pause
    assert f"results/{gpu}" in v.source and f"results/{cpu}" in v.source and "gpu-20260101" not in v.source
