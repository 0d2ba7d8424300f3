"""The caching and workspace checks (C02, C09, C15, C28) on the recorded results."""

from __future__ import annotations

from ref_impl import ledger


def no_results(monkeypatch, tmp_path) -> None:
    """The ledger as a fresh clone without results/ would compute it: core.results reads an empty folder."""
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)


def test_growth_pauses_finds_the_steps_by_hand():
    # prompt 32: ITL i ends with the step writing position 32 + i + 1, so growth steps of 256 fall at
    # i = 479 (position 512) and i = 735 (768); median 1 ms, pauses (over PAUSE_FACTOR = 10 ms) only there
    itl = [1.0] * 800
    itl[479], itl[735] = 300.0, 40.0
    pauses, growth = ledger.growth_pauses(itl, 32)
    assert pauses == [479, 735] and growth == [223, 479, 735]
    assert ledger.growth_pauses([1.0] * 10, 5, step=4) == ([], [2, 6])


def test_c09_c28_read_the_recorded_first_call_results(monkeypatch, tmp_path):
    rec = ledger.first_call_recorded()
    gpu = [lab for lab, d in rec.items() if d["backend"] == "cuda"]
    assert gpu, "results/ holds an H200 first-call run"
    for cid in ("C09", "C28"):
        v = ledger.check(cid, live=False)
        assert v.status == "qualified" and "portable analog" in v.summary and "Metal" in v.summary
        g = gpu[0]
        fresh = v.evidence[f"first token, fresh process, empty kernel cache ({g})"].value
        cached = v.evidence[f"first token, second process, kernel cache on disk ({g})"].value
        steady = v.evidence[f"steady decode step, median ({g})"].value
        # the cache removes most of the pause but the first token still exceeds a steady one
        assert fresh > 10 * cached > 10 * steady
        assert fresh == rec[g]["tokens"][1, 1][0]
    no_results(monkeypatch, tmp_path)
    assert ledger.check("C09", live=False).status == ledger.check("C28", live=False).status == "not testable here"


def test_c02_pauses_sit_at_growth_steps_and_concat_never_pauses(monkeypatch, tmp_path):
    v = ledger.check("C02", live=False)
    ev = v.evidence
    assert v.status == "qualified"
    near = [n.value for k, n in ev.items() if k.startswith("chunked: pauses within one token of a growth step")]
    total = [n.value for k, n in ev.items() if k.startswith("chunked: pauses over") and "Llama-3.1-8B" in k]
    assert near and near[0] == total[0] > 0
    assert all(n.value == 0 for k, n in ev.items() if k.startswith("concat: pauses over"))
    copy = next(n.value for k, n in ev.items() if k.startswith("copying the whole chunked cache"))
    longest = next(n.value for k, n in ev.items() if k.startswith("chunked: longest ITL (Llama-3.1-8B"))
    assert longest > 100 * copy          # the pause is not the copy
    no_results(monkeypatch, tmp_path)
    assert ledger.check("C02", live=False).status == "not testable here"


def test_c15_faults_one_per_page_and_says_not_testable():
    v = ledger.check("C15", live=False)
    assert v.status == "not testable here" and "macOS" in v.summary
    for k, n in v.evidence.items():
        if k.startswith("first touch of"):
            mib = float(k.split("of ")[1].split(" MiB")[0].replace(",", ""))
            assert n.value == mib * 2**20 / 4096      # 4 KiB pages: 64 MiB -> 16,384 faults
