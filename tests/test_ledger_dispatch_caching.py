"""The caching and workspace checks (C02, C09, C15, C28): their rules on synthetic evidence (RULE_CASES,
both sides of every threshold), their evidence on the recorded results, and pending without them."""

from __future__ import annotations

import re
from dataclasses import replace

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


def no_results(monkeypatch, tmp_path) -> None:
    """The ledger as a fresh clone without results/ would compute it: core.results reads an empty folder."""
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)


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
    runs = {(f"m{i % 2}", f"model{i}"): {"static": cache(), "concat": cache(concat_pauses if i == 0 else 0),
                                         "chunked": cache(3 if s > 0.5 else 0, s, 500.0 if s > 0.5 else 12.0)}
            for i, s in enumerate(shares)}
    return KVJitter(runs, {"m0": 3000.0})


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
        **kv(0.99, 0.1).runs, ("m1", "model1"): {"static": cache(1), "concat": cache(), "chunked": cache(0, 0.1)}}))
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
    rec = ledger.first_call_recorded()
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
    copy = ev["copying the whole chunked cache once at the measured copy bandwidth (h200)"].value
    assert ev["chunked: longest ITL (Llama-3.1-8B, h200)"].value > 100 * copy          # the pause is not the copy
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
