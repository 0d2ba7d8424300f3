"""The reference quantities as the built book states them: every statement of one, page by page.

A reference quantity (`records.reference_quantities`: a machine's measured bandwidth, the shipped model's held-out
perplexity, its decode tok/s per loop) is found in a page's text where a line names it, its machine, and a number
in its unit. A statement agrees with the reference table when it rounds from the table's value at the precision
it is printed with; one that does not must sit in a block (an output cell, a paragraph, a table row) that names the
results file it comes from, and that file must not be the reference run: a caption that names another run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bs4 import BeautifulSoup

RESULTS_FILE = re.compile(r"[\w.-]+-\d{8}-\d{6}\.json\b")
MACHINES = {"h200": re.compile(r"\bH200\b|\bh200\b"), "cpu-2core": re.compile(r"2-core CPU|\bcpu-2core\b")}

# quantity name -> (the words that name it in a line, a number in its unit: group 1); a statement is the number
# nearest the words in the line
NUMBER = r"(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
PATTERNS = {
    "measured bandwidth": (re.compile(r"measured bandwidth", re.I), re.compile(NUMBER + r"\s*GB/s")),
    "held-out perplexity": (re.compile(r"held-out perplexity(?! on (?:a sample|another text))", re.I), re.compile(r"(?<![\d.,])(\d+\.\d{2,})\b")),
    "decode tok/s, synchronous loop": (re.compile(r"synchronous loop", re.I), re.compile(NUMBER + r"\s*tok/s")),
    "decode tok/s, pipelined loop": (re.compile(r"pipelined loop", re.I), re.compile(NUMBER + r"\s*tok/s")),
}
SHIPPED = re.compile(r"stdlib-10m|shipped model")


@dataclass(frozen=True)
class Statement:
    """One number a page gives for a reference quantity, where it says it, and the results files around it."""
    page: str
    quantity: str
    machine: str
    value: float
    decimals: int
    line: str
    files: frozenset[str]


def blocks(html: str) -> list[str]:
    """A page's text in the blocks a caption belongs to: each cell's output (figure titles included, code not),
    each paragraph, list item and table row of the prose."""
    soup = BeautifulSoup(html, "html.parser")
    main = soup.find("main") or soup
    for tag in main.select("div.cell_input, script, style"):
        tag.decompose()
    out = [div.get_text("\n") for div in main.select("div.cell_output")]
    for div in main.select("div.cell_output"):
        div.decompose()
    out += [t.get_text(" ") for t in main.find_all(["p", "li", "tr", "pre", "h1", "h2", "h3"])]
    return [b for b in out if b.strip()]


def statements(page: str, html: str) -> list[Statement]:
    """Every statement of a reference quantity on one page (see the module docstring)."""
    found = []
    for block in blocks(html):
        files = frozenset(RESULTS_FILE.findall(block))
        in_block = [m for m, pat in MACHINES.items() if pat.search(block)]
        for line in block.splitlines():
            named = [m for m, pat in MACHINES.items() if pat.search(line)] or in_block
            if len(named) != 1:
                continue
            for quantity, (words, number) in PATTERNS.items():
                said = words.search(line)
                numbers = list(number.finditer(line))
                if not said or not numbers or (quantity != "measured bandwidth" and not SHIPPED.search(block)):
                    continue
                nearest = min(numbers, key=lambda m: min(abs(m.start() - said.end()), abs(said.start() - m.end())))
                text = nearest.group(1)
                decimals = len(text.split(".")[1]) if "." in text else 0
                found.append(Statement(page, quantity, named[0], float(text.replace(",", "")), decimals, line.strip(),
                                       files))
    return found


def disagreements(found: list[Statement], table: dict[tuple[str, str], tuple[float, str]]) -> list[str]:
    """The statements that neither round from the reference table's value ({(quantity, machine): (value, reference
    file)}) nor sit beside a caption naming another run than the reference."""
    bad = []
    for s in found:
        if (s.quantity, s.machine) not in table:
            continue
        value, file = table[s.quantity, s.machine]
        if abs(s.value - value) <= 0.5 * 10 ** -s.decimals * 1.0001:
            continue
        if s.files - {file}:
            continue
        bad.append(f"{s.page}: {s.quantity} on {s.machine} is {value:g} in the reference run ({file}), "
                   f"but the page says {s.value:g} with no caption naming another run: {s.line!r}")
    return bad
