"""The GGUF layout chapter's checks (C10, C32): layout facts by hand, the live verdict's rule."""

from __future__ import annotations

import pytest

from ref_impl import ledger
from ref_impl.measure.loads import Throughput


def test_c10_c32_facts_by_hand():
    ev = ledger.check("C10", live=False).evidence
    assert ev["GGUF default alignment (general.alignment absent)"].value == 32
    assert ev["shipped model: tensor data offsets that are multiples of 32"].value == 100
    # block k starts at k * 18 bytes: a multiple of 32 when 16 divides k (gcd(18, 32) = 2, so 2/32)
    assert ev["Q4_0 blocks (18 bytes) that start 32-byte aligned"].value == pytest.approx(6.25)
    assert ev["Q4_K blocks (144 bytes) that start 32-byte aligned"].value == pytest.approx(50)
    assert ledger.check("C10", live=False).status == "qualified"
    v = ledger.check("C32", live=False)
    assert v.status == "qualified" and "GPU threads were not measured" in v.summary


def test_c10_c32_live_verdicts_follow_the_measured_penalty(monkeypatch):
    live = {cid: ledger.check(cid, live=True) for cid in ("C10", "C32")}    # measure_alignment: timed once
    for cid, v in live.items():
        assert any(k.startswith("live GEMV") or k.startswith("live gemv") for k in v.evidence), cid
    assert live["C10"].status == "qualified"
    assert live["C32"].status in ("qualified", "refuted")
    # the rule: C32 is refuted when the in-cache split-load penalty is within the noise
    def rows(slow):
        return tuple(Throughput("numpy", op, size, off, off % 64, t, size / t / 1e9, True)
                     for op in ("sum", "gemv") for size in (256 * 2**10, 64 * 2**20)
                     for off, t in ((0, 1.0), (4, slow), (16, slow), (32, 1.0)))
    monkeypatch.setattr(ledger.gguf, "measure_alignment", lambda: rows(1.01))
    assert ledger.check("C32", live=True).status == "refuted"
    monkeypatch.setattr(ledger.gguf, "measure_alignment", lambda: rows(1.10))
    v = ledger.check("C32", live=True)
    assert v.status == "qualified" and v.evidence["live gemv in L2: extra time at 4/16 bytes vs 0/32"].value == \
        pytest.approx(10)
