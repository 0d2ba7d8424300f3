"""The claim registry: every seed claim once and verbatim, each chapter module's claims, every rule
reaching every outcome it allows on synthetic evidence (each chapter's test module lists its cases in
RULE_CASES), no literal verdict, pending when results are missing, live and recorded builds agreeing,
evidence with units, `live=False` that times nothing, and the ledger's HTML table."""

from __future__ import annotations

import ast
import importlib
import math
import re
import time
from pathlib import Path

import pytest

from ref_impl import ledger
from ref_impl.platform import timing

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"          # CI keeps a copy of shared/ beside the clone
IDS = [f"C{i:02d}" for i in range(1, 33)]


@pytest.fixture(scope="module")
def live_ledger():
    return dict((c.id, v) for c, v in ledger.ledger(live=True))


def test_every_id_c01_to_c32_is_registered_once_in_order():
    ids = [c.id for m in ledger.MODULES for c in m.CLAIMS]
    assert sorted(ids) == IDS                       # each claim in exactly one chapter module
    assert list(ledger.CLAIMS) == IDS
    assert all(ledger.CLAIMS[i].id == i for i in IDS)


def test_claims_name_a_valid_chapter_and_seed_file_and_every_chapter_has_claims():
    for c in ledger.CLAIMS.values():
        assert c.chapter in ledger.CHAPTERS, c.id
        assert c.seed == ledger.SEEDS[0 if int(c.id[1:]) <= 16 else 1], c.id
        assert c.short and c.quote.endswith("."), c.id
    assert {c.chapter for c in ledger.CLAIMS.values()} == set(ledger.CHAPTERS)
    assert len({c.quote for c in ledger.CLAIMS.values()}) == 32
    for m in ledger.MODULES:                        # a module's claims are its chapter's, in id order, each checked
        assert [c.id for c in m.CLAIMS] == sorted(c.id for c in m.CLAIMS), m.__name__
        assert len({c.chapter for c in m.CLAIMS}) == 1 and all(c.gather and c.judge for c in m.CLAIMS), m.__name__


def test_quotes_are_verbatim_sentences_of_their_seed_file():
    texts = {name: (ledger.core.SOURCES_DIR / name).read_text() for name in ledger.SEEDS}   # sources/, in the repository
    for c in ledger.CLAIMS.values():
        assert f"- {c.quote} (high confidence)" in texts[c.seed], c.id
    assert sum(t.count("(high confidence)") for t in texts.values()) == len(ledger.CLAIMS)


def test_chapters_match_the_claims_table():
    """The home chapters against the workshop's numbered table of the claims, where it is beside the checkout
    (CI keeps it there); the notes themselves, in sources/, are checked above and in tests/test_sources.py."""
    table = SHARED / "CLAIMS.md"
    if not table.is_file():
        pytest.skip(f"{table} is not beside the checkout")
    rows = dict(re.findall(r"^\| (C\d\d) \| ([\w-]+) \|", table.read_text(), re.M))
    assert rows == {c.id: c.chapter for c in ledger.CLAIMS.values()}


def test_an_unknown_claim_is_named():
    with pytest.raises(KeyError, match="C99"):
        ledger.check("C99")


def test_live_false_times_nothing(monkeypatch):
    def no_clock(*_):
        raise AssertionError("live=False must not time anything")
    for name in ("perf_counter", "perf_counter_ns", "time", "monotonic"):
        monkeypatch.setattr(time, name, no_clock)
    monkeypatch.setattr(timing, "clock", no_clock)
    monkeypatch.setattr(ledger.roofline, "measure_matmul", no_clock)
    monkeypatch.setattr(ledger.roofline, "measure_forward", no_clock)
    monkeypatch.setattr(ledger.gguf, "measure_alignment", no_clock)
    rows = ledger.ledger(live=False)
    assert len(rows) == 32
    verdicts = {c.id: v for c, v in rows}
    assert all(not k.startswith("live") for cid in IDS for k in verdicts[cid].evidence)


def _check_evidence(v: ledger.Verdict) -> None:
    assert v.status in ledger.STATUSES and v.status != "pending"
    assert v.summary.endswith(".") and v.condition and v.source
    assert v.evidence
    for name, n in v.evidence.items():
        assert isinstance(n, ledger.Number) and n.unit.strip(), name
        assert math.isfinite(n.value), name


@pytest.mark.parametrize("cid", IDS)
def test_implemented_checks_give_a_verdict_with_evidence_in_units(cid, live_ledger):
    _check_evidence(ledger.check(cid, live=False))
    _check_evidence(live_ledger[cid])


def test_live_verdicts_carry_live_measurements_and_say_so(live_ledger):
    for cid in ("C10", "C14", "C26", "C27", "C32"):
        v = live_ledger[cid]
        assert any(k.startswith("live") for k in v.evidence) and v.source.startswith("live"), cid


def test_the_ledger_does_not_time_twice(live_ledger, monkeypatch):
    def timed_again():
        raise AssertionError("timed again")
    monkeypatch.setattr(time, "perf_counter", timed_again)
    monkeypatch.setattr(timing, "clock", timed_again)
    assert {c.id: v.status for c, v in ledger.ledger(live=True)} == {k: v.status for k, v in live_ledger.items()}


def no_results(monkeypatch, tmp_path) -> None:
    """The ledger as a fresh clone without results/ would compute it: core.RESULTS_DIR is an empty folder."""
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)


# ---- the rules ------------------------------------------------------------------------------------

def rule_cases() -> dict[str, list]:
    """Every chapter test module's RULE_CASES: claim id -> [(synthetic evidence, expected status), ...]."""
    cases: dict[str, list] = {}
    for m in ledger.MODULES:
        module = importlib.import_module(f"test_ledger_{m.__name__.rsplit('.', 1)[1]}")
        cases |= module.RULE_CASES
    return cases


def test_every_claim_has_a_rule_outcomes_and_cases_reaching_each_outcome():
    cases = rule_cases()
    assert sorted(cases) == IDS
    for cid, c in ledger.CLAIMS.items():
        assert len(c.rule.split()) >= 12 and c.outcomes, cid
        assert set(c.outcomes) <= set(ledger.STATUSES) - {"pending"}, cid
        reached = set()
        for evidence, expected in cases[cid]:
            v = c.judge(evidence)
            assert v.status == expected, (cid, expected, v.summary)
            assert v.summary.endswith(".") and v.evidence and v.source, cid
            reached.add(v.status)
        assert reached == set(c.outcomes), f"{cid}: synthetic evidence reaches {reached}, the rule allows {c.outcomes}"


def test_no_verdict_is_a_literal_except_not_testable_here():
    for m in ledger.MODULES:
        tree = ast.parse(Path(m.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Verdict" and node.args:
                status = node.args[0]
                if isinstance(status, ast.Constant):
                    assert status.value == "not testable here", f"{m.__name__}:{node.lineno}: literal {status.value!r}"


def test_missing_results_make_a_claim_pending_with_its_command(monkeypatch, tmp_path):
    no_results(monkeypatch, tmp_path)
    for cid, c in ledger.CLAIMS.items():
        v = ledger.check(cid, live=False)
        if c.pending:
            assert v.status == "pending" and c.pending[1] in v.summary, (cid, v.status)
        else:
            assert v.status != "pending", f"{cid} reads no results, so it needs none"


def test_live_and_recorded_builds_agree(live_ledger):
    assert {cid: v.status for cid, v in live_ledger.items()} == {c.id: v.status for c, v in ledger.ledger(live=False)}


def test_every_claim_links_to_the_page_that_checks_it():
    book = ROOT / "book"
    for c in ledger.CLAIMS.values():
        page = book / f"{ledger.page_of(c)}.ipynb"
        assert page.is_file() and re.search(rf"\b{c.id}\b", page.read_text()), f"{c.id}: {page} does not check it"
    row = ledger.ledger_html([(ledger.CLAIMS["C16"], ledger.Verdict("qualified", "The first sentence here gives the whole reason. Second one."))])
    assert "href='../dispatch/ttft-jitter.html'" in row and "href='../appendix/ledger.html#claim-C16'" in row
    assert ": The first sentence here gives the whole reason.<details>" in row and "Second one." in row   # the reason in the row, the rest a click away


def test_first_sentence_is_the_reason_without_its_asides():
    assert ledger.first_sentence("Held at 1.5x on the H200 and the CPU alike. The CPU differs.") == \
        "Held at 1.5x on the H200 and the CPU alike."
    assert ledger.first_sentence("It batches the kernels it has (its source: 64+ nodes (a few)) into buffers. More.") \
        == "It batches the kernels it has into buffers."
    assert ledger.first_sentence("The worst pauses do come from growing the cache: on h200, 6 of 1,900") == \
        "The worst pauses do come from growing the cache."
    # a clause too short to give a reason takes the next one with it
    assert ledger.first_sentence("Half of it holds: the draft is exact; the speedup is not. Rest.") == \
        "Half of it holds: the draft is exact."
    assert ledger.first_sentence("No sentence end") == "No sentence end."


def test_number_formatting_keeps_three_figures_and_the_unit():
    assert str(ledger.Number(663.0, "GB/s")) == "663 GB/s"
    assert str(ledger.Number(1169.4, "FLOP/byte")) == "1,169 FLOP/byte"
    assert str(ledger.Number(24.375, "Gbps")) == "24.4 Gbps"
    assert str(ledger.Number(0.99951, "FLOP/byte")) == "1.00 FLOP/byte"
    assert str(ledger.Number(1.2e-12, "errors/bit")) == "1.20 × 10⁻¹² errors/bit"   # a power of ten, not 1.20e-12
    assert str(ledger.Number(0.002, "s")) == "0.00200 s"


def test_ledger_html_escapes_text_and_has_one_row_per_claim():
    rows = ledger.ledger(live=False)
    page = ledger.ledger_html(rows)
    assert page.count("<tr id='claim-") == 32 and "C32" in page
    evil = ledger.Claim("C99", "roofline", "a <b>", "x < y & z.", ledger.SEEDS[0])
    page = ledger.ledger_html([(evil, ledger.Verdict("refuted", "<script>alert(1)</script>."))])
    assert "<script>" not in page and "&lt;script&gt;" in page and "x &lt; y &amp; z." in page
    assert ledger.status_counts(rows)["pending"] == 0            # every rule's results are recorded


def test_verdict_texts_have_no_workshop_words():
    from test_book import WORKSHOP_WORDS
    for c, v in ledger.ledger(live=False):
        text = " ".join((c.rule, v.summary, v.condition, v.source, *v.evidence))
        found = sorted({m.group(0) for pat in WORKSHOP_WORDS for m in re.finditer(pat, text, re.I)})
        assert not found, f"{c.id} says {found}"
