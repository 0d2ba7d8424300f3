"""The TTFT and jitter check (C16), and the one definition of a pause both dispatch pages read."""

from __future__ import annotations

import math

import numpy as np

from ref_impl import ledger


def no_results(monkeypatch, tmp_path) -> None:
    """The ledger as a fresh clone without results/ would compute it: core.results reads an empty folder."""
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)


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
    assert traces and v.status == "qualified" and "locks are not testable here" in v.summary
    assert all(f"results/{t.file}" in v.source for t in traces)
    for t in traces:    # prompt + generated tokens = context: ITLs are one fewer than the tokens
        assert t.prompt_len >= 1 and t.prompt_len + len(t.itl_ms) + 1 <= 1 << 16
    # p99 / p50 evidence is what numpy says of the recorded samples
    for key, n in v.evidence.items():
        if key.endswith("ITL p99 / p50"):
            machine, model, s = key.split(": ")[0].split(", ")
            t = next(t for t in traces if (t.machine, t.model, t.strategy) == (machine, model, s))
            assert math.isclose(n.value, np.percentile(t.itl_ms, 99) / np.percentile(t.itl_ms, 50))
    no_results(monkeypatch, tmp_path)
    assert ledger.check("C16", live=False).status == "not testable here"


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
    kv = ledger.kv_recorded()
    for t in ledger.jitter_traces():
        d = kv[t.machine][t.model, t.strategy]
        idx, _ = ledger.growth_pauses(d["itl"], d["prompt_len"])
        assert d["prompt_len"] == t.prompt_len
        assert sorted(int(t.positions[i]) for i in idx) == sorted(
            threshold_pos for k in ("paused", "off_threshold") for threshold_pos in ledger.threshold_pauses(t)[k])
