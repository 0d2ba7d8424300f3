"""The course's tables: one look for every table a page shows, so numbers read the same everywhere.

A column names its quantity with its unit in the header ("decode (tok/s)"), formats every value with one
fixed-decimal spec (thousands separated; e-notation is refused: a time or a size reads as 1,960 ms, never
1.96e+03), and says in one line what it means when the header alone would not. The table draws as HTML in
a box that scrolls sideways on a narrow screen, so a wide table never widens the page, and as aligned text
where there is no HTML.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

CSS = """<style>
.course-table {overflow-x: auto; max-width: 100%; margin: 0.5em 0 1em 0}
.course-table table {border-collapse: collapse; font-size: 0.88em; white-space: nowrap}
.course-table th, .course-table td {padding: 3px 10px; border-bottom: 1px solid #ddd; text-align: right}
.course-table th {vertical-align: bottom; font-weight: 600; white-space: normal; min-width: 5em}
.course-table th.text, .course-table td.text {text-align: left}
.course-table caption {caption-side: top; text-align: left; font-weight: 600; padding-bottom: 4px}
.course-table ul.notes {font-size: 0.85em; margin: 4px 0 0 0; padding-left: 1.2em; white-space: normal}
</style>"""


@dataclass(frozen=True)
class Column:
    """One column: its header with the unit ("prefill (ms)"), the format of its values (",.1f"; empty for
    text), and what it means when the header does not say (shown under the table)."""
    header: str
    fmt: str = ""
    note: str = ""

    def __post_init__(self):
        if re.search(r"[eEgGn%]$", self.fmt):
            raise ValueError(f"column {self.header!r}: format {self.fmt!r} is not fixed-decimal; use e.g. ',.1f'")

    def cell(self, value) -> str:
        """A value as the table prints it: formatted numbers, text as given, a dash where there is none."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "–"
        return format(value, self.fmt) if self.fmt and not isinstance(value, str) else str(value)


@dataclass(frozen=True)
class Table:
    """Rows of values under columns, with a caption; displayed by Jupyter and the book as HTML."""
    columns: tuple[Column, ...]
    rows: tuple[tuple, ...]
    caption: str = ""

    def __post_init__(self):
        bad = [i for i, r in enumerate(self.rows) if len(r) != len(self.columns)]
        if bad:
            raise ValueError(f"rows {bad} do not have one value per column ({len(self.columns)} columns)")

    def _repr_html_(self) -> str:
        e = html.escape
        numeric = [bool(c.fmt) for c in self.columns]
        kind = ["" if n else " class='text'" for n in numeric]
        head = "".join(f"<th{k}>{e(c.header)}</th>" for c, k in zip(self.columns, kind))
        body = "".join("<tr>" + "".join(f"<td{k}>{e(c.cell(v))}</td>" for c, k, v in zip(self.columns, kind, row))
                       + "</tr>" for row in self.rows)
        caption = f"<caption>{e(self.caption)}</caption>" if self.caption else ""
        notes = "".join(f"<li><b>{e(c.header)}</b>: {e(c.note)}</li>" for c in self.columns if c.note)
        notes = f"<ul class='notes'>{notes}</ul>" if notes else ""
        return (f"{CSS}<div class='course-table'><table>{caption}<thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>{notes}</div>")

    def __str__(self) -> str:
        cells = [[c.header for c in self.columns]] + [[c.cell(v) for c, v in zip(self.columns, r)] for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        lines = ["  ".join(s.rjust(w) if c.fmt else s.ljust(w) for s, w, c in zip(row, widths, self.columns)).rstrip()
                 for row in cells]
        notes = [f"{c.header}: {c.note}" for c in self.columns if c.note]
        return "\n".join(([self.caption] if self.caption else []) + lines + notes)

    __repr__ = __str__


def table(columns: Sequence[Column], rows: Sequence[Sequence], caption: str = "") -> Table:
    """A table of `rows` (one value per column) to display in a notebook or print."""
    return Table(tuple(columns), tuple(tuple(r) for r in rows), caption)
