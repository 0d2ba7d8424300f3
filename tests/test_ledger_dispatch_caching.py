"""The caching and workspace checks (C02, C09, C15, C28): their rules on synthetic evidence (RULE_CASES,
both sides of every threshold), their evidence on the recorded results, each machine's newest complete run read
and named (a synthetic results folder of two runs per machine), C02's copy timed against the one measured
bandwidth (`records.bandwidth`), live readings measured in measure/ and shown only, and pending without results."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from ref_impl import ledger
from ref_impl.ledger.core import Number
from ref_impl.ledger.dispatch_caching import (
    CACHED,
    FRESH,
    WARM,
    WARM_CACHED,
    CacheRun,
    FirstCallEvidence,
    FirstCalls,
    KVJitter,
    WiredEvidence,
    WiredReads,
    growth_share,
)
from ref_impl.measure import latency, records
from ref_impl.measure.latency import CompileCost
from ref_impl.measure.loads import WiredRead
from ref_impl.measure.records import record
from tests.test_ledger_dispatch import no_results, results_in, write_run


# ---- synthetic evidence ----------------------------------------------------------------------------

def calls(fresh: float, cached: float, warm: float = 2.0, warm_cached: float = 2.0, backend: str = "cuda",
          label: str = "gpu") -> FirstCalls:
    """A machine whose runs have these first tokens (ms) and 1 ms steady tokens after them."""
    runs = {FRESH: fresh, CACHED: cached, WARM: warm, WARM_CACHED: warm_cached}
    return FirstCalls(label, backend, {k: (t,) + (1.0,) * 7 for k, t in runs.items()}, {k: 1.0 for k in runs},
                      {1: 10.0, 2: 1.0}, {(1, "first_call_ms"): 900.0, (2, "first_call_ms"): 5.0})


def first(*machines: FirstCalls) -> FirstCallEvidence:
    return FirstCallEvidence(machines + (calls(3.0, 2.0, backend="cpu", label="cpu"),))


def cache(pauses: int = 0, share: float = 0.0, max_ms: float = 10.0) -> CacheRun:
    return CacheRun(1000, pauses, 5.0, 10.0, max_ms, 250.0, 300.0, 4, pauses, share)


def kv(*shares: float, concat_pauses: int = 0) -> KVJitter:
    """One run per chunked variance share, on two machines; concat's pauses in the first run."""
    runs = {(f"m{i % 2}", f"model{i}"): {"float": cache(), "concat": cache(concat_pauses if i == 0 else 0),
                                         "chunked": cache(3 if s > 0.5 else 0, s, 500.0 if s > 0.5 else 12.0)}
            for i, s in enumerate(shares)}
    return KVJitter(runs, {"m0": (3000.0, "m0, 1 Jan 2026, commit abc0001 (results/m0-20260101.json)")})


def wired(label: str = "linux", locked: bool = True) -> WiredReads:
    v = ("first_touch", "prefaulted", "mlocked")
    return WiredReads(label, 64 << 20, 4 << 20, {"first_touch": (16384.0,), "prefaulted": (1.0,), "mlocked": (0.0,)},
                      0.0, dict(zip(v, (3.0, 19.0, 21.0))), dict(zip(v, (1.5, 0.34, 0.26))), locked)


RULE_CASES = {
    "C28": [(first(calls(5000.0, 2.0)), "confirmed"),                # a hitch, and none once cached
            (first(calls(10.5, 2.0)), "confirmed"),                  # just over the pause line (10× steady)
            (first(calls(5000.0, 200.0)), "qualified"),              # the cache shortens it, a pause remains
            (first(calls(5000.0, 200.0), calls(5000.0, 2.0, label="gpu2")), "qualified"),
            (first(calls(10.0, 2.0)), "refuted"),                    # at the line is no pause: no hitch
            (first(calls(5000.0, 6000.0)), "refuted"),               # the cache does not shorten it
            (first(calls(5000.0, 2.0), calls(5.0, 2.0, label="gpu2")), "refuted")],
    "C09": [(first(calls(5000.0, 2.0)), "confirmed"),                # cache alone and warm-ups leave no pause
            (first(calls(5000.0, 2.0, warm_cached=10.0)), "confirmed"),
            (first(calls(5000.0, 200.0)), "qualified"),              # only the warm-up avoids it
            (first(calls(5.0, 2.0)), "qualified"),                   # nothing to avoid
            (first(calls(5000.0, 2.0, warm_cached=10.5)), "refuted"),    # a pause after the warm-up
            (first(calls(5000.0, 200.0, warm=50.0)), "refuted")],
    "C15": [(WiredEvidence((wired(),)), "not testable here"),
            (WiredEvidence((wired(), wired("other", locked=False))), "not testable here")],
    "C02": [(kv(0.99, 0.1), "qualified"),                            # thresholds dominate one run of two
            (kv(0.9, 0.8), "qualified"),                             # every run, but allocating never stalls
            (kv(0.9, 0.8, concat_pauses=2), "confirmed"),
            (kv(0.51, 0.6, concat_pauses=1), "confirmed"),
            (kv(0.5, 0.1, concat_pauses=3), "refuted"),              # half is not "primarily"
            (kv(0.2), "refuted")],
}


# ---- the rules ------------------------------------------------------------------------------------

def test_live_readings_never_decide_and_are_shown():
    live = {"live mx.compile first call of a new function": Number(12.0, "ms", 1.0, 900.0, 5)}
    for cid, judge in (("C28", ledger.dispatch_caching.judge_c28), ("C15", ledger.dispatch_caching.judge_c15)):
        for evidence, expected in RULE_CASES[cid]:
            v = judge(replace(evidence, live=live, live_machine="x86_64"))
            assert v.status == expected and "does not decide" in v.summary and v.source.startswith("live (x86_64)")
            assert v.evidence["live mx.compile first call of a new function"].rounds == 5


def test_c02_text_counts_are_the_evidence_counts():
    """The static cache's pauses, the runs where thresholds dominate: stated as counted, not typed."""
    v = ledger.dispatch_caching.judge_c02(replace(kv(0.99, 0.1), runs={
        **kv(0.99, 0.1).runs, ("m1", "model1"): {"float": cache(1), "concat": cache(), "chunked": cache(0, 0.1)}}))
    assert "paused 1 time across the 2 runs" in v.summary and "in 1 of 2 recorded runs" in v.summary
    assert "model0 on m0" in v.condition and "model1" not in v.condition


def test_growth_share_is_the_variance_at_the_growth_steps():
    # prompt 32, step 256: growth steps at ITLs 223, 479, 735; spikes there carry nearly all the variance
    itl = [1.0] * 800
    itl[479] = 300.0
    assert growth_share(itl, 32) > 0.99
    itl[479], itl[100] = 1.0, 300.0                       # the same spike away from any growth step
    assert growth_share(itl, 32) < 0.01
    assert growth_share([1.0] * 800, 32) == 0.0


def test_growth_pauses_finds_the_steps_by_hand():
    # prompt 32: ITL i ends with the step writing position 32 + i + 1, so growth steps of 256 fall at
    # i = 479 (position 512) and i = 735 (768); median 1 ms, pauses (over PAUSE_FACTOR = 10 ms) only there
    itl = [1.0] * 800
    itl[479], itl[735] = 300.0, 40.0
    pauses, growth = ledger.growth_pauses(itl, 32)
    assert pauses == [479, 735] and growth == [223, 479, 735]
    assert ledger.growth_pauses([1.0] * 10, 5, step=4) == ([], [2, 6])


# ---- on the recorded results ------------------------------------------------------------------------

def test_c09_c28_read_the_recorded_first_call_results(monkeypatch, tmp_path):
    rec = {label: ledger.first_call_recorded(run) for label, run in ledger.dispatch_runs("first-call").items()}
    gpu = [lab for lab, d in rec.items() if d["backend"] == "cuda"]
    assert gpu, "results/ holds an H200 first-call run"
    g = gpu[0]
    for cid in ("C09", "C28"):
        v = ledger.check(cid, live=False)
        assert v.status in ledger.CLAIMS[cid].outcomes and "portable analog" in v.summary and "Metal" in v.summary
        fresh = v.evidence[f"first token, fresh process, empty kernel cache ({g})"].value
        cached = v.evidence[f"first token, second process, kernel cache on disk ({g})"].value
        steady = v.evidence[f"steady decode step, median ({g})"].value
        assert fresh == rec[g]["tokens"][1, 1][0] and steady == rec[g]["steady"][1, 1]
        # the counts the rule reads are the records' tokens over the pause line
        n = v.evidence[f"tokens over 10× a steady one, second process, kernel cache on disk ({g})"].value
        assert n == sum(t > ledger.PAUSE_FACTOR * rec[g]["steady"][2, 1] for t in rec[g]["tokens"][2, 1])
        assert fresh > 10 * cached > 10 * steady
        # the reason the rule gives: the cached process still pauses, a warm-up does not
        assert (v.status == "qualified") == (n > 0)
    no_results(monkeypatch, tmp_path)
    for cid in ("C09", "C28"):
        v = ledger.check(cid, live=False)
        assert v.status == "pending" and "bench --dispatch" in v.summary


def test_c02_pauses_sit_at_growth_steps_and_concat_never_pauses(monkeypatch, tmp_path):
    v = ledger.check("C02", live=False)
    ev = v.evidence
    near = ev["chunked: pauses within one token of a growth step (Llama-3.1-8B, h200)"].value
    assert near == ev["chunked: pauses over 10× the median ITL (Llama-3.1-8B, h200)"].value > 0
    concat = sum(n.value for k, n in ev.items() if k.startswith("concat: pauses over"))
    shares = [n.value for k, n in ev.items() if k.startswith("chunked: share of the ITL variance")]
    assert v.status == ledger.core.decide(all(s > 50 for s in shares) and concat > 0, not any(s > 50 for s in shares))
    copy = ev["copying the whole chunked cache once at the measured bandwidth (h200)"].value
    assert ev["chunked: longest ITL (Llama-3.1-8B, h200)"].value > 100 * copy          # the pause is not the copy
    gbs, source = records.bandwidth(ledger.dispatch_runs("kv-jitter")["h200"])       # the one measured bandwidth
    assert ev["measured bandwidth (h200)"].value == gbs and source.caption in v.source
    assert 100 < ev["concat: cache at the end (Llama-3.1-8B, h200)"].value < 1000   # book/dispatch/ttft-jitter reads it
    static = sum(n.value for k, n in ev.items() if k.startswith("static: pauses over"))
    assert f"paused {static:,.0f} time" in v.summary
    assert re.search(rf"in {sum(s > 50 for s in shares)} of {len(shares)} recorded runs", v.summary)
    no_results(monkeypatch, tmp_path)
    v = ledger.check("C02", live=False)
    assert v.status == "pending" and "bench --dispatch" in v.summary


def test_c15_faults_one_per_page_and_says_not_testable(monkeypatch, tmp_path):
    v = ledger.check("C15", live=False)
    assert v.status == "not testable here" and "macOS" in v.summary
    faults = {k: n.value for k, n in v.evidence.items() if k.startswith("first touch of")}
    assert faults
    for k, n in faults.items():
        mib = float(k.split("of ")[1].split(" MiB")[0].replace(",", ""))
        assert n == mib * 2**20 / 4096      # 4 KiB pages: 64 MiB -> 16,384 faults
    no_results(monkeypatch, tmp_path)
    v = ledger.check("C15", live=False)
    assert v.status == "pending" and "bench --dispatch" in v.summary


# ---- which run: each machine's newest complete one, named ----------------------------------------------

VARIANTS = ("first_touch", "prefaulted", "mlocked")


def first_call_run(first_ms: float) -> list[dict]:
    """A first-call run: a fresh process's first token `first_ms`, every other first token 2 ms, steady 1 ms."""
    recs = []
    for p in (1, 2):
        where = {"variant": f"process-{p}", "process": p}
        for run in (1, 2):
            t = [first_ms if (p, run) == (1, 1) else 2.0] + [1.0] * 7
            recs += [record("first-call", "token_ms", "ms", t[0], samples=t, model="m", run=run, **where),
                     record("first-call", "steady_token_ms", "ms", 1.0, model="m", run=run, **where)]
        recs.append(record("first-call", "process_s", "s", 10.0 / p, model="m", **where))
        recs += [record("first-call", metric, "ms", ms, **{**where, "variant": "mx.compile"})
                 for metric, ms in (("first_call_ms", 900.0), ("later_call_ms", 1.0))]
    return recs


def kv_jitter_run(pause_ms: float, cache_bytes: float = 1e8) -> list[dict]:
    """A kv-jitter run of the tiny model: 600 ITLs of 1 ms after a 32-token prompt for each cache, the chunked one
    pausing `pause_ms` at its growth to 512 positions (ITL 479)."""
    recs = []
    for s in ("float", "chunked", "concat"):
        itl = [1.0] * 600
        if s == "chunked":
            itl[479] = pause_ms
        where = {"model": "tiny", "context": 32 + 600 + 1, "variant": s}
        recs += [record("kv-jitter", "itl_ms", "ms", sum(itl) / len(itl), samples=itl, **where)]
        recs += [record("kv-jitter", metric, unit, value, **where) for metric, unit, value in (
            ("itl_p50_ms", "ms", 1.0), ("itl_p99_ms", "ms", 1.0), ("itl_max_ms", "ms", max(itl)),
            ("cache_bytes", "B", cache_bytes), ("peak_memory", "B", 3e8), ("active_memory_before", "B", 1e8))]
    return recs


def wired_run(gbs: float) -> list[dict]:
    """A wired run of a 64 MiB buffer read 4 MiB at a time, every variant at `gbs` GB/s."""
    recs = []
    for variant in VARIANTS:
        extra = {"variant": variant, "bytes": 64 << 20, "tensor_bytes": 4 << 20,
                 "locked": True if variant == "mlocked" else None}
        recs += [record("wired", "read_bandwidth", "GB/s", gbs, **extra),
                 record("wired", "minor_faults", "faults", 16384.0 if variant == "first_touch" else 0.0, **extra),
                 record("wired", "major_faults", "faults", 0.0, **extra),
                 record("wired", "tensor_read_max_ms", "ms", 0.5, samples=[0.2] * 16, **extra)]
    return recs


def roofs_run(gbs: float) -> list[dict]:
    """A roofs run: an MLX copy at half `gbs`, a read at `gbs` (the fastest probe, the measured bandwidth)."""
    return [record("roofs", "bandwidth", "GB/s", gbs / 2, variant="copy"),
            record("roofs", "bandwidth", "GB/s", gbs, variant="read")]


@pytest.fixture()
def two_runs_per_machine(monkeypatch, tmp_path):
    """A results folder where each machine ran the dispatch suite twice (and once more, failed, on the GPU), and
    the GPU ran its roofs twice, on other days: (newest complete GPU run, newest roofs run, newest CPU run)."""
    write_run(tmp_path, "gpu", "cuda", 1, roofs_run(1000.0))
    write_run(tmp_path, "gpu", "cuda", 2, first_call_run(5000.0) + kv_jitter_run(50.0) + wired_run(3.0))
    gpu = write_run(tmp_path, "gpu", "cuda", 3, first_call_run(8000.0) + kv_jitter_run(400.0) + wired_run(19.0))
    roofs = write_run(tmp_path, "gpu", "cuda", 4, roofs_run(4000.0))
    write_run(tmp_path, "gpu", "cuda", 5, kv_jitter_run(float("nan")))             # a failed measurement
    write_run(tmp_path, "cpu", "cpu", 1, first_call_run(3.0) + kv_jitter_run(1.0) + wired_run(2.0))
    cpu = write_run(tmp_path, "cpu", "cpu", 2, first_call_run(4.0) + kv_jitter_run(1.0) + wired_run(5.0))
    results_in(monkeypatch, tmp_path)
    return gpu, roofs, cpu


def test_each_machine_reads_its_newest_complete_run_and_names_it(two_runs_per_machine):
    gpu, roofs, cpu = two_runs_per_machine
    for experiment in ("first-call", "kv-jitter", "wired"):
        assert {k: r.file for k, r in ledger.dispatch_runs(experiment).items()} == {"gpu": gpu, "cpu": cpu}
    v28 = ledger.check("C28", live=False)
    assert v28.status == "confirmed"
    assert v28.evidence["first token, fresh process, empty kernel cache (gpu)"].value == 8000
    v15 = ledger.check("C15", live=False)
    assert v15.evidence["prefaulted: read rate, median of repeats (gpu)"].value == 19.0
    assert v15.evidence["prefaulted: read rate, median of repeats (cpu)"].value == 5.0
    v02 = ledger.check("C02", live=False)
    assert v02.evidence["chunked: longest ITL (tiny, gpu)"].value == 400.0
    for v in (v28, v15, v02):          # each names the runs it read, and no older one
        assert f"results/{gpu}" in v.source and f"results/{cpu}" in v.source and "gpu-20260102" not in v.source


def test_c02_times_the_copy_at_the_machines_reference_bandwidth_and_names_that_run(two_runs_per_machine):
    gpu, roofs, cpu = two_runs_per_machine
    v = ledger.check("C02", live=False)
    # the kv-jitter run recorded no probe: its machine's reference roofs run (the newest), fastest probe 4,000 GB/s
    assert v.evidence["measured bandwidth (gpu)"].value == 4000.0
    assert v.evidence["copying the whole chunked cache once at the measured bandwidth (gpu)"].value == pytest.approx(
        2 * 100 / 4000)                                                      # read and write 100 MB: ms
    assert f"measured bandwidth: gpu, 4 Jan 2026, commit abc0004 (results/{roofs})" in v.source
    assert "at gpu's measured bandwidth (4,000 GB/s)" in v.summary and "20260101" not in v.source


def test_live_readings_come_from_measure_and_never_decide(monkeypatch, two_runs_per_machine):
    costs = tuple(CompileCost(4096, 8, first, 0.1, 0.2, 0.05) for first in (900.0, 3.0, 2.0, 2.5, 3.5))
    reads = {k: tuple(WiredRead(k, 16 << 20, 1 << 20, 2.0, gbs, (0.1,) * 16, 4096 if k == "first_touch" else 0, 0,
                                None) for gbs in (8.0, 9.0, 10.0)) for k in VARIANTS}
    monkeypatch.setattr(latency, "measure_compile", lambda rounds: costs[:rounds])
    monkeypatch.setattr(latency, "measure_wired", lambda rounds: {k: r[:rounds] for k, r in reads.items()})
    for cid, key, value in (("C28", "live mx.compile first call of a new function", 3.0),
                            ("C15", "live prefaulted: read rate", 9.0)):
        live, recorded = ledger.check(cid, live=True), ledger.check(cid, live=False)
        assert live.status == recorded.status and live.evidence[key].value == value
        assert "does not decide" in live.summary and key not in recorded.evidence
