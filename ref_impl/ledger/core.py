"""What the chapters' claims share: the Claim and Verdict records, the decision vocabulary, evidence with
units, the results folder they read, and the ledger's HTML table.

A claim keeps its seed sentence verbatim, the seed file it comes from, the chapter that teaches its
mechanism, and its decision rule, written beside it in words. Its check is two functions: `gather`
collects the evidence (sourced tables, arithmetic, each machine's reference runs in RESULTS_DIR through
`measure.records`' one selector, and with `live=True` this machine's timings, taken by `measure/`: the
ledger times nothing itself) and `judge` applies the rule to it. `judge` is pure, so tests feed it
synthetic evidence on both sides of every threshold; its status comes from `decide` on what the evidence
shows, never a literal, except "not testable here" for hardware we cannot run. When the results a rule reads are
missing, `gather` returns None and the claim is pending, naming the command that records them.
Live timings are reported beside a verdict with their spread; they never decide it, so a build with
`live=True` and one with `live=False` agree.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import ref_impl
from ref_impl import MODELS_DIR

SOURCES_DIR = ref_impl.ROOT / "sources"   # the two research notes, byte for byte; sources/README.md says what they are
SEEDS = ("000_8c45ce1e9e68affe.txt", "001_71c9d8b5ea64f620.txt")  # the notes' files in SOURCES_DIR
CHAPTERS = ("roofline", "signalling", "interconnect", "gguf", "kquants", "dispatch", "kv-cache", "speculative")
STATUSES = ("confirmed", "qualified", "refuted", "not testable here", "pending")
VOCABULARY = {   # what each status means, the same for every claim; the ledger page prints it
    "confirmed": "the claim's numbers or mechanism hold under its own stated conditions",
    "qualified": "they hold only under a condition the claim leaves out, which the verdict names",
    "refuted": "measurement or arithmetic contradicts the claim under its own conditions",
    "not testable here": "the claim is about hardware we cannot run; the portable analog is measured and shown",
    "pending": "the results the rule reads are not recorded yet; the verdict names the command that records them",
}
SHIPPED_MODEL = MODELS_DIR / "stdlib-10m.gguf"


def figure(v: float) -> str:
    """A measured value as the ledger prints it: three significant figures, thousands separated; under a
    thousandth, as a power of ten ("1.20 × 10⁻¹²", an error rate), never e-notation."""
    if v and abs(v) < 1e-3:
        mantissa, exponent = f"{v:.2e}".split("e")
        return f"{mantissa} × 10{str(int(exponent)).translate(SUPERSCRIPT)}"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:#.3g}"


SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


@dataclass(frozen=True)
class Number:
    """One piece of evidence: a value and its unit; a repeated measurement also keeps its spread."""
    value: float
    unit: str
    low: float | None = None    # the smallest and largest of `rounds` repeats, of which value is the median
    high: float | None = None
    rounds: int = 1

    def __str__(self) -> str:
        spread = f" (range {figure(self.low)}-{figure(self.high)} over {self.rounds} rounds)" if self.rounds > 1 else ""
        return f"{figure(self.value)} {self.unit}{spread}"


def repeated(samples: list[float], unit: str) -> Number:
    """A measurement repeated: the median of its samples, with their range."""
    return Number(float(np.median(samples)), unit, float(min(samples)), float(max(samples)), len(samples))


def decide(holds: bool, contradicted: bool = False) -> str:
    """The status a rule's findings give: refuted when the evidence contradicts the claim under its own
    conditions, confirmed when it holds under them, qualified when it holds only under a condition the
    claim leaves out (the verdict names it)."""
    return "refuted" if contradicted else "confirmed" if holds else "qualified"


@dataclass
class Verdict:
    """What a check concluded, the numbers it rests on, when the claim holds, and where the numbers come from."""
    status: str                 # one of STATUSES
    summary: str                # one sentence
    evidence: dict[str, Number] = field(default_factory=dict)
    condition: str = ""         # under which the claim holds
    source: str = ""            # the machine that measured, or where the numbers come from


@dataclass(frozen=True)
class Claim:
    """One seed claim: its id, home chapter, short form, verbatim sentence and seed file, and its check:
    the rule in words, the evidence it gathers, the judge that applies it and the statuses it can give."""
    id: str
    chapter: str                # one of CHAPTERS
    short: str
    quote: str                  # the seed sentence, verbatim
    seed: str                   # its note: a file in SOURCES_DIR (sources/)
    rule: str = ""              # which evidence, which thresholds, which verdict: shown on the ledger page
    gather: Callable[[bool], Any] | None = None     # live -> evidence, or None when its results are missing
    judge: Callable[[Any], Verdict] | None = None   # evidence -> verdict: pure, the rule applied
    outcomes: tuple[str, ...] = ()                  # the statuses the rule can give
    pending: tuple[str, str] | None = None          # (what is missing, the command that records it)

    def check(self, live: bool = True) -> Verdict:
        """The verdict: the rule applied to the gathered evidence, or pending when its results are missing."""
        evidence = self.gather(live)
        if evidence is None:
            if self.pending is None:
                raise ValueError(f"{self.id}: no evidence, and its rule reads no results that could be missing")
            what, command = self.pending
            return Verdict("pending", f"Not checked yet: {what} are not recorded (`{command}`).")
        v = self.judge(evidence)
        if v.status not in self.outcomes:
            raise ValueError(f"{self.id}: the rule gave {v.status!r}, not one of its outcomes {self.outcomes}")
        return v


def claim(cid: str, chapter: str, gather: Callable[[bool], Any], judge: Callable[[Any], Verdict], *, short: str,
          quote: str, rule: str, outcomes: tuple[str, ...], pending: tuple[str, str] | None = None) -> Claim:
    """The Claim record of seed claim `cid`: C01-C16 come from SEEDS[0], C17-C32 from SEEDS[1]."""
    return Claim(cid, chapter, short, quote, SEEDS[int(cid[1:]) > 16], rule, gather, judge, outcomes, pending)


# ---- recorded results: every module reads them through measure.records' selector, from this folder ---------

RESULTS_DIR = ref_impl.RESULTS_DIR   # results/; a test points it at a folder of its own
TABLES = "roofline.HARDWARE (vendor datasheets), shapes.PUBLIC (config.json)"   # the sourced tables, as a source


# ---- the ledger as a page ---------------------------------------------------------------------------

def status_counts(rows: list[tuple[Claim, Verdict]]) -> dict[str, int]:
    """How many claims have each status, in the order of STATUSES."""
    return {s: sum(v.status == s for _, v in rows) for s in STATUSES}


COLOURS = {"confirmed": "#009E73", "qualified": "#E69F00", "refuted": "#D55E00",   # Okabe-Ito, as viz
           "not testable here": "#0072B2", "pending": "#777777"}

# The book page (under book/, without suffix) that teaches each chapter's claims; the dispatch part has
# four pages, so its claims name theirs. The ledger links every row to its page and the page back.
CHAPTER_PAGES = {"roofline": "intro/roofline", "signalling": "signalling/gddr7-pam3",
                 "interconnect": "signalling/thunderbolt-pcie", "gguf": "kquants/gguf-layout",
                 "kquants": "kquants/super-blocks", "dispatch": "dispatch/command-buffers",
                 "kv-cache": "kv-cache/kv-quantization", "speculative": "speculative/speculative-mtp"}
PAGE_OF_CLAIM = {"C02": "dispatch/ttft-jitter", "C09": "dispatch/caching-workspaces",
                 "C15": "dispatch/caching-workspaces", "C16": "dispatch/ttft-jitter",
                 "C28": "dispatch/caching-workspaces"}


def page_of(claim: Claim) -> str:
    """The book page that checks `claim`, e.g. 'intro/roofline'."""
    return PAGE_OF_CLAIM.get(claim.id) or CHAPTER_PAGES[claim.chapter]


def first_sentence(text: str, min_words: int = 8) -> str:
    """The reason a reader scans for: a verdict summary without its parenthetical asides, up to the end
    of its first sentence, colon or semicolon, and on to the next while that leaves under `min_words`
    words ("The mechanism is as stated:" alone would not say why a verdict is qualified)."""
    text = text.strip()
    while (shorter := re.sub(r"\s*\([^()]*\)", "", text)) != text:
        text = shorter
    parts = re.split(r"((?<=\.)\s+(?=[A-Z])|[;:]\s)", text)
    head = parts[0]
    for sep, clause in zip(parts[1::2], parts[2::2]):
        if len(head.split()) >= min_words:
            break
        head += sep + clause
    return head.rstrip(" .;:") + "."


# The look both claim tables share (the ledger's, and the Sources page's): a box that scrolls sideways rather
# than the page, cells in fixed columns, and on a narrow screen each row's cells stacked.
CLAIM_TABLE_CSS = """<style>
div.claim-table-box {overflow-x: auto; max-width: 100%}
table.claim-table {width: 100%; table-layout: fixed; border-collapse: collapse; font-size: 0.85em}
table.claim-table th, table.claim-table td {vertical-align: top; padding: 6px 8px; overflow-wrap: anywhere;
  text-align: left}
table.claim-table tbody tr {border-top: 1px solid #ddd}
table.claim-table col.id {width: 9.5em}
table.claim-table .verdict {font-weight: bold}
table.claim-table details {margin-top: 4px; font-size: 0.92em}
@media (max-width: 640px) {
  table.claim-table colgroup, table.claim-table thead {display: none}
  table.claim-table tr, table.claim-table td, table.claim-table th {display: block; width: auto}
  table.claim-table td {padding: 2px 6px}
}
</style>"""

_LEDGER_CSS = """<style>
table.claim-ledger col.claim {width: 38%}
table.claim-ledger .page {font-size: 0.92em}
table.claim-ledger .verdict {white-space: nowrap}
table.claim-ledger details dl {margin: 4px 0 0 0} table.claim-ledger details dd {margin-left: 1em}
</style>"""


def claim_table(css: str, classes: str, columns: Sequence[tuple[str, str]], body: str) -> str:
    """A claim table in CLAIM_TABLE_CSS's look, plus `css` and `classes` of its own; `columns` are each
    (col class, header)."""
    cols = "".join(f"<col class='{k}'>" for k, _ in columns)
    head = "".join(f"<th>{h}</th>" for _, h in columns)
    return (f"{CLAIM_TABLE_CSS}{css}<div class='claim-table-box'><table class='claim-table {classes}'>"
            f"<colgroup>{cols}</colgroup><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


def evidence_items(v: Verdict) -> str:
    """A verdict's evidence as escaped list items: each number's name and value with its unit."""
    return "".join(f"<li>{html.escape(k)}: <b>{html.escape(str(n))}</b></li>" for k, n in v.evidence.items())


def ledger_html(rows: list[tuple[Claim, Verdict]]) -> str:
    """The ledger as one escaped HTML table a reader scans: one row per claim with its id and page, short
    form, verdict and one-sentence reason; the decision rule, full verdict, evidence, condition, source and
    seed text one click away, so that three columns keep the rows short. Row ids (`claim-C04`) and page
    links let a chapter and the ledger point at each other: the links are relative to a page one folder
    below book/, as every chapter and the ledger are. The table scrolls inside its box and stacks its cells
    on a narrow screen."""
    e = html.escape
    body = []
    for c, v in rows:
        page = page_of(c)
        evidence = evidence_items(v)
        more = [("Decision rule", e(c.rule))] if c.rule else []
        more += [("Verdict", e(v.summary))]
        more += [("Evidence", f"<ul>{evidence}</ul>")] if evidence else []
        more += [("Holds when", e(v.condition))] if v.condition else []
        more += [("Source", e(v.source))] if v.source else []
        more += [("Seed text", f"<q>{e(c.quote)}</q> ({e(c.seed)})")]
        details = "".join(f"<dt>{k}</dt><dd>{d}</dd>" for k, d in more)
        body.append(
            f"<tr id='claim-{c.id}'><td><a href='../appendix/ledger.html#claim-{c.id}'><b>{c.id}</b></a><br>"
            f"<span class='page'>checked in <a href='../{page}.html'>{e(page.split('/')[-1])}</a></span></td>"
            f"<td>{e(c.short)}</td>"
            f"<td><span class='verdict' style='color:{COLOURS[v.status]}'>{e(v.status)}</span>: "
            f"{e(first_sentence(v.summary))}"
            f"<details><summary>rule, evidence, source</summary><dl>{details}</dl></details></td></tr>")
    return claim_table(_LEDGER_CSS, "claim-ledger", (("id", "Claim, page"), ("claim", "What it says"),
                                                     ("verdict", "Verdict and reason")), "".join(body))
