"""The two research notes the claims come from, read as plain text: each note's title, sections and claims,
and where each claim of the ledger stands in its note.

The notes are in the repository's sources/ (SOURCES_DIR), byte for byte as received. A note is a list of
lines: its title, a header (its parent topic and snapshot date), then sections, each a heading line and
one bullet line per claim ("- <sentence> (high confidence) [source]"), then "Children", its sub-topics.
The claims the course checks are the notes' "high confidence" bullets, numbered in reading order:
C01-C16 are the first note's, C17-C32 the second's (`numbered_claims`).

`locate` finds a claim's quote verbatim in its note, giving the section heading above it and its line
number, and raises when the quote is not there, so a quote that drifts from its note fails loudly.
`sources_html` is the Sources page's table: each claim quoted, where it stands, what the course found,
its verdict and the page that checks it.

See chapter: sources
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

from ref_impl.ledger.core import (
    COLOURS,
    SEEDS,
    SOURCES_DIR,
    Claim,
    Verdict,
    claim_table,
    evidence_items,
    first_sentence,
    page_of,
)

MARK = "(high confidence)"   # how a note marks the claims the course checks
CHILDREN = "Children"        # the heading after the last section of claims


@dataclass(frozen=True)
class Section:
    """One section of a note: its heading, the line it is on, and the lines of its claims."""
    heading: str
    line: int                   # 1-based, as an editor numbers them
    claims: tuple[int, ...]     # the lines of its "high confidence" bullets


@dataclass(frozen=True)
class Note:
    """One research note as text: its file, title, parent topic, snapshot date, lines, sections of claims
    and child topics."""
    file: str
    number: int                 # 1 or 2: its place in SEEDS
    title: str
    parent: str
    snapshot: str               # the date the note's page was captured
    lines: tuple[str, ...]
    sections: tuple[Section, ...]
    children: tuple[str, ...]

    @property
    def claims(self) -> list[str]:
        """Its "high confidence" sentences, in reading order, without the mark."""
        return [claim_sentence(self.lines[n - 1]) for s in self.sections for n in s.claims]


@dataclass(frozen=True)
class Place:
    """Where a sentence stands: which note, under which section heading, on which line."""
    note: int
    file: str
    section: str
    line: int


def claim_sentence(line: str) -> str:
    """The sentence of a claim's bullet line: "- <sentence> (high confidence) [source]" -> "<sentence>"."""
    return line.removeprefix("- ").split(f" {MARK}")[0]


def read_note(file: str, folder: Path | None = None) -> Note:
    """The note in `file` (one of SEEDS), from `folder` (default SOURCES_DIR), parsed into its parts."""
    text = ((folder or SOURCES_DIR) / file).read_text(encoding="utf-8")
    lines = tuple(text.split("\n"))
    bullet = [line.startswith("- ") for line in lines]
    start = bullet.index(True) - 1                     # the first heading is the line above the first bullet
    end = lines.index(CHILDREN, start)
    sections, heading = [], None
    for n in range(start, end):
        if not bullet[n]:
            heading = Section(lines[n], n + 1, ())
            sections.append(heading)
        elif MARK in lines[n]:
            sections[-1] = heading = Section(heading.heading, heading.line, heading.claims + (n + 1,))
    parent = re.match(r"Parent: (.*?) · ", lines[1])
    snapshot = re.search(r"snapshot (\d{4}-\d\d-\d\d)", lines[1])
    children = tuple(line[2:] for line, b in zip(lines[end + 1:], bullet[end + 1:]) if b)
    return Note(file, SEEDS.index(file) + 1 if file in SEEDS else 0, lines[0], parent[1] if parent else "",
                snapshot[1] if snapshot else "", lines, tuple(sections), children)


def notes(folder: Path | None = None) -> tuple[Note, ...]:
    """Both notes, in the order of SEEDS."""
    return tuple(read_note(f, folder) for f in SEEDS)


def numbered_claims(folder: Path | None = None) -> dict[str, str]:
    """The notes' "high confidence" sentences numbered as the ledger numbers them: C01, C02, ... in reading
    order, the first note's before the second's."""
    sentences = [s for note in notes(folder) for s in note.claims]
    return {f"C{i:02d}": s for i, s in enumerate(sentences, 1)}


def locate(claim: Claim, folder: Path | None = None) -> Place:
    """Where `claim` stands in its note: its quote found verbatim in the note's text, the section heading
    above it and its line. Raises ValueError when the note does not hold the quote word for word."""
    note = read_note(claim.seed, folder)
    found = [n for n, line in enumerate(note.lines, 1) if claim.quote in line]
    if not found:
        raise ValueError(f"{claim.id}: its quote is not in {claim.seed} verbatim: {claim.quote[:60]!r}...")
    line = found[0]
    heading = max((s for s in note.sections if s.line < line), key=lambda s: s.line, default=None)
    return Place(note.number, note.file, heading.heading if heading else "", line)


# ---- the Sources page's table -------------------------------------------------------------------------

_SOURCES_CSS = """<style>
table.claim-sources tr.note th {padding-top: 14px; font-size: 1.05em}
table.claim-sources .where {color: #555; font-size: 0.92em; margin-bottom: 2px}
table.claim-sources q {font-style: italic}
ol.note-text {font-size: 0.85em; padding-left: 3em}
ol.note-text li {white-space: pre-wrap; overflow-wrap: anywhere; scroll-margin-top: 5em}
ol.note-text li:target {background: #fff3c4}
</style>"""


def _row(c: Claim, v: Verdict, place: Place) -> str:
    """One claim's row: id, verdict and page; where it stands and its words; what the course found."""
    e = html.escape
    page = page_of(c)
    evidence = evidence_items(v)
    more = f"<details><summary>evidence</summary><ul>{evidence}</ul></details>" if evidence else ""
    where = (f"Note {place.note}, <i>{e(place.section)}</i>, "
             f"<a href='#note{place.note}-line{place.line}'>line {place.line}</a>")
    return (f"<tr id='source-{c.id}'>"
            f"<td><a href='../appendix/ledger.html#claim-{c.id}'><b>{c.id}</b></a><br>"
            f"<span class='verdict' style='color:{COLOURS[v.status]}'>{e(v.status)}</span><br>"
            f"checked in <a href='../{page}.html#claim-{c.id}'>{e(page.split('/')[-1])}</a></td>"
            f"<td><div class='where'>{where}</div><q>{e(c.quote)}</q></td>"
            f"<td>{e(first_sentence(v.summary))}{more}</td></tr>")


def sources_html(rows: list[tuple[Claim, Verdict]], folder: Path | None = None) -> str:
    """The Sources page's table as one escaped HTML table, grouped by note: per claim its id, verdict
    (coloured as COLOURS) and the page that checks it; its section and line in the note with its words
    verbatim; and what the course found (the verdict's first sentence, the evidence one click away).
    Links are relative to a page one folder below book/; the table scrolls inside its box and stacks
    its cells on a narrow screen."""
    e = html.escape
    by_note = {note.number: (note, []) for note in notes(folder)}
    for c, v in rows:
        place = locate(c, folder)
        by_note[place.note][1].append(_row(c, v, place))
    body = "".join(f"<tr class='note'><th colspan='3'>Note {n}: {e(note.title)}</th></tr>" + "".join(trs)
                   for n, (note, trs) in by_note.items() if trs)
    return claim_table(_SOURCES_CSS, "claim-sources", (("id", "Claim, verdict, page"),
                                                       ("quote", "The note says (section, line)"),
                                                       ("found", "What the course found")), body)


def note_html(note: Note) -> str:
    """A note's full text, collapsed: one numbered list item per line, each with the id the table's line
    links point at (`note1-line7`)."""
    items = "".join(f"<li id='note{note.number}-line{n}'>{html.escape(line)}</li>"
                    for n, line in enumerate(note.lines, 1))
    return (f"{_SOURCES_CSS}<details><summary>Note {note.number} in full: {html.escape(note.title)} "
            f"({len(note.lines)} lines)</summary><ol class='note-text'>{items}</ol></details>")
