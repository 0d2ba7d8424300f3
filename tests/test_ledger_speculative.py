"""The speculative decoding checks (C06, C13, C22, C24) on the recorded results."""

from __future__ import annotations

import json

import pytest

from ref_impl import ledger
from ref_impl.ledger import speculative as spec
from ref_impl.measure import records
from ref_impl.measure.records import record

# Synthetic evidence on both sides of every rule's thresholds (tests/test_ledger.py runs them all).
_FWD = {("gpu", "cuda", "big"): {1: 1.0, 9: 1.6}, ("cpu", "cpu", "small"): {1: 1.0, 9: 6.0}}
_ROW = ("gpu", "8b", "34m", 0.6, 1.30, 4, 0.07, 1.25)
RULE_CASES = {
    "C24": [(spec.Forwards({k: v for k, v in _FWD.items() if k[0] == "gpu"}), "confirmed"),
            (spec.Forwards(_FWD), "qualified"),
            (spec.Forwards({k: v for k, v in _FWD.items() if k[0] == "cpu"}), "refuted")],
    "C22": [(spec.PairSpeedups((_ROW, _ROW[:3] + (0.8, 1.5, 4, 0.07, None))), "confirmed"),
            (spec.PairSpeedups((_ROW, _ROW[:4] + (0.7, 2, 0.5, 0.6))), "qualified"),
            (spec.PairSpeedups((_ROW[:4] + (1.2, 2, 0.5, 0.6),)), "refuted")],
    "C13": [(spec.MTPRuns({"gpu": 0.6}, {"gpu": (1.3, 3)}), "confirmed"),
            (spec.MTPRuns({"gpu": 0.3, "cpu": 0.3}, {"gpu": (0.8, 1), "cpu": (1.1, 2)}), "qualified"),
            (spec.MTPRuns({"gpu": 0.02}, {"gpu": (0.9, 1)}), "refuted")],
    "C06": [(spec.SpecExactness(0.4, 1e-9, {("gpu", "draft-model"): 1.3, ("gpu", "mtp"): 1.25}), "confirmed"),
            (spec.SpecExactness(0.4, 1e-9, {("gpu", "draft-model"): 1.3, ("gpu", "mtp"): 0.9}), "qualified"),
            (spec.SpecExactness(0.4, 1e-9, {("gpu", "draft-model"): 1.1, ("gpu", "mtp"): 0.9}), "refuted"),
            (spec.SpecExactness(1e-6, 1e-9, {("gpu", "draft-model"): 1.3, ("gpu", "mtp"): 1.3}), "refuted")],
}


def test_the_synchronised_model_uses_the_recorded_forward_times():
    d = {"forward_ms": {"t": {1: 5.0, 3: 10.0}, "d": {1: 1.0}}, "plain": {"t": 200.0},
         "speed": {("t", "alpha-set", "d", 0.6): {"alpha": {2: 0.5}}}}
    # γ = 2: E = 1.75 tokens in 2 × 1 ms + 10 ms, against 5 ms a plain token
    assert spec.sync_model(d, ("t", "alpha-set", "d", 0.6), 2) == pytest.approx(1.75 * 5.0 / 12.0)
    assert spec.sync_model(d | {"forward_ms": {"t": {1: 5.0}}}, ("t", "alpha-set", "d", 0.6), 2) is None


def test_c06_exactness_is_a_test_that_can_fail():
    p_rule, p_broken = ledger.speculative.exactness()
    assert p_rule > 1e-3 > p_broken
    v = ledger.check("C06", live=False)
    assert f"p = {p_rule:.2f}" in v.summary


def test_spec_speedups_are_the_recorded_ones():
    for label, d in ledger.spec_recorded().items():
        for key, m in d["speed"].items():
            best = ledger.speculative.best_speedup(d["speed"], model=key[0], variant=key[1], alpha_set=key[3])
            assert best[0] >= max(m["speedup"].values()) - 1e-12
            for g, s in m["speedup"].items():     # a speedup is tokens/s over the plain decoder's, > 0
                assert s > 0 and m["tokens_per_s"][g] > 0


def test_c24_c22_c13_evidence_is_the_recorded_numbers():
    rec = ledger.spec_recorded()
    v24, v22, v13 = (ledger.check(c, live=False) for c in ("C24", "C22", "C13"))
    for label, d in rec.items():
        for model, ratios in d["forward"].items():
            top = max(ratios)
            assert ratios[1] == 1.0                                     # a ratio to the one-position forward
            assert v24.evidence[f"{model}, {top} positions / 1 ({label})"].value == ratios[top]
        for (model, variant, drafter, a), m in d["speed"].items():
            if variant == "alpha-set" and a is not None and a >= 0.6:
                g = max(m["speedup"], key=m["speedup"].get)
                n = v22.evidence[f"{model} / {drafter}, α set {a}, best γ = {g} ({label})"]
                assert n.value == pytest.approx(100 * (m["speedup"][g] - 1))
        if ("mtp", "stdlib-10m-mtp") in d["pooled"]:
            assert v13.evidence[f"MTP heads, greedy α on held-out text ({label})"].value == d["pooled"]["mtp", "stdlib-10m-mtp"]


def write_spec(folder, name: str, label: str, day: int, ratio9: float) -> None:
    """A results file of one machine's spec-forward records: one model's forward over 9 positions against 1."""
    recs = [record("spec-forward", "forward_ratio", "ratio", r, model="m", positions=k)
            for k, r in ((1, 1.0), (9, ratio9))]
    doc = {"schema": 1, "date": f"2026-01-0{day}T00:00:00+00:00", "git": "abc1234", "command": "bench --spec",
           "machine": {"label": label, "backend": "cpu"}, "records": recs}
    (folder / name).write_text(json.dumps(doc))


def test_spec_recorded_reads_each_machines_newest_complete_run_and_spec_in_another(monkeypatch, tmp_path):
    write_spec(tmp_path, "a-1.json", "a", 1, 3.0)
    write_spec(tmp_path, "a-2.json", "a", 2, 2.0)
    write_spec(tmp_path, "a-3.json", "a", 3, float("nan"))       # a failed measurement: not a reference
    write_spec(tmp_path, "b-1.json", "b", 4, 5.0)
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)
    rec = ledger.spec_recorded()
    assert {label: d["forward"]["m"][9] for label, d in rec.items()} == {"a": 2.0, "b": 5.0}
    assert rec["a"]["runs"]["spec-forward"].file == "a-2.json" and rec["a"]["backend"] == "cpu"
    older = next(run for run in records.runs("spec-forward", tmp_path) if run.file == "a-1.json")
    assert ledger.spec_in(older)["forward"]["m"][9] == 3.0                  # a run set beside the reference
    v = ledger.check("C24", live=False)                                     # the verdict names the runs it read
    assert v.evidence["m, 9 positions / 1 (a)"].value == 2.0
    assert "(results/a-2.json)" in v.source and "(results/b-1.json)" in v.source and "a-1.json" not in v.source


def test_spec_in_the_reference_run_is_spec_recorded():
    for label, d in ledger.spec_recorded().items():
        run = d["runs"]["spec-speed"]
        assert all(ledger.spec_in(run)[k] == d[k] for k in ("alpha", "pooled", "forward", "forward_ms", "plain",
                                                            "speed")), label
