"""The speculative decoding checks (C06, C13, C22, C24) on the recorded results."""

from __future__ import annotations

import pytest

from ref_impl import ledger


def test_c06_exactness_is_a_test_that_can_fail():
    p_rule, p_broken = ledger.speculative.exactness()
    assert p_rule > 1e-3 > p_broken
    v = ledger.check("C06", live=False)
    assert v.status == "qualified" and f"p = {p_rule:.2f}" in v.summary


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
