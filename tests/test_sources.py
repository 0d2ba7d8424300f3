"""The sources, in the repository: the two notes byte for byte in sources/, every claim of the ledger quoted
verbatim from them and numbered as they number it, and no page that refers to a file the repository does
not hold (the notes' old place outside it, ../shared/, or a path that does not exist)."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pytest

from ref_impl import ledger
from ref_impl.ledger import sources

ROOT = Path(__file__).resolve().parent.parent
IDS = [f"C{i:02d}" for i in range(1, 33)]


# ---- (a), (b): the notes and the claims ----------------------------------------------------------------

def test_the_ledger_reads_the_notes_from_the_repository():
    assert ledger.core.SOURCES_DIR == ROOT / "sources"
    assert all((ROOT / "sources" / f).is_file() for f in ledger.SEEDS)


def test_the_notes_are_the_files_the_readme_names_byte_for_byte():
    """sources/README.md maps each file to its title and SHA-256: the one place that names them."""
    rows = re.findall(r"^\| `([\w.]+\.txt)` \| (\d): (.+?) \| `([0-9a-f]{64})` \|$",
                      (ROOT / "sources" / "README.md").read_text(), re.MULTILINE)
    assert [r[0] for r in rows] == list(ledger.SEEDS)
    for file, number, title, digest in rows:
        data = (ROOT / "sources" / file).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, f"sources/{file} is not the note as received"
        note = sources.read_note(file)
        assert (note.number, note.title) == (int(number), title)


def test_every_quote_is_found_verbatim_in_its_note():
    for c in ledger.CLAIMS.values():
        place = sources.locate(c)                 # raises when the quote is not in the note word for word
        note = sources.read_note(c.seed)
        assert note.lines[place.line - 1] == f"- {c.quote} {sources.MARK} [source]", c.id
        assert place.section in [s.heading for s in note.sections], c.id
        assert place.line in next(s.claims for s in note.sections if s.heading == place.section), c.id


def test_a_quote_that_drifted_from_its_note_is_not_located():
    c = ledger.CLAIMS["C03"]
    with pytest.raises(ValueError, match="C03"):
        sources.locate(dataclasses.replace(c, quote=c.quote.replace("1024 GB/s", "1000 GB/s")))
    with pytest.raises(ValueError, match="C17"):               # the right words in the other note
        sources.locate(dataclasses.replace(ledger.CLAIMS["C17"], seed=ledger.SEEDS[0]))


def test_the_ledgers_32_claims_are_the_notes_32():
    numbered = sources.numbered_claims()
    assert list(numbered) == IDS
    ids = [c.id for m in ledger.MODULES for c in m.CLAIMS]
    assert collections.Counter(ids) == collections.Counter(IDS)            # each present once
    assert {cid: c.quote for cid, c in ledger.CLAIMS.items()} == numbered
    marks = sum((ROOT / "sources" / f).read_text().count(sources.MARK) for f in ledger.SEEDS)
    assert marks == len(numbered) == 32                                     # the parser missed no marked claim
    assert [len(n.claims) for n in sources.notes()] == [16, 16]


def test_the_note_reader_on_a_made_up_note(tmp_path):
    text = ("A title\nParent: Its parent · Published reference · snapshot 2026-01-02\nheader\n"
            "First heading\n- Alpha holds. (high confidence) [source]\n- A hunch. (low confidence) [source]\n"
            "Second heading\n- Beta holds. (high confidence) [source]\nChildren\n- A topic (frontier)\n"
            "Frontier under this node: A topic")
    (tmp_path / ledger.SEEDS[0]).write_text(text)
    note = sources.read_note(ledger.SEEDS[0], tmp_path)
    assert (note.number, note.title, note.parent, note.snapshot) == (1, "A title", "Its parent", "2026-01-02")
    assert [(s.heading, s.line, s.claims) for s in note.sections] == [("First heading", 4, (5,)),
                                                                     ("Second heading", 7, (8,))]
    assert note.claims == ["Alpha holds.", "Beta holds."] and note.children == ("A topic (frontier)",)
    beta = dataclasses.replace(ledger.CLAIMS["C01"], quote="Beta holds.")
    assert sources.locate(beta, tmp_path) == sources.Place(1, ledger.SEEDS[0], "Second heading", 8)


def test_the_sources_table_has_every_claim_with_its_place_verdict_and_page():
    rows = [(c, ledger.Verdict("confirmed" if i % 2 else "refuted", "It holds <here>. More.")) for i, c in
            enumerate(ledger.CLAIMS.values())]
    table = sources.sources_html(rows)
    assert table.count("<tr id='source-C") == 32 and table.count("<tr class='note'>") == 2
    assert "overflow-x: auto" in table and "@media (max-width: 640px)" in table     # never wider than a phone
    assert "It holds &lt;here&gt;." in table and "<here>" not in table              # escaped
    for c, _ in rows:
        p = sources.locate(c)
        assert f"<a href='#note{p.note}-line{p.line}'>line {p.line}</a>" in table
        assert f"href='../{ledger.page_of(c)}.html#claim-{c.id}'" in table
        assert (ROOT / "book" / f"{ledger.page_of(c)}.ipynb").is_file(), c.id     # the link leads to a page
    assert f"color:{ledger.COLOURS['refuted']}'>refuted<" in table


# ---- (c): no page refers to a file the repository does not hold ----------------------------------------

TOP = ("ref_impl", "tests", "results", "models", "book", "sources", ".ci", ".github")   # the repository's folders
OUTSIDE = re.compile(r"\.\./shared\b|\bshared/(?:seeds|CLAIMS|DESIGN|STYLE|GPU)|\b(?:CLAIMS|DESIGN|STYLE|GPU)\.md\b"
                     r"|(?<![\w./-])seeds/")
REPO_PATH = re.compile(r"(?<![\w./~$-])(?:" + "|".join(map(re.escape, TOP)) + r")/[\w./*<>{}@+-]*")
RELATIVE = re.compile(r"(?<![\w./~-])(?:\.\./)+[\w./*-]*")
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?[^)]*\)|<[a-zA-Z][^<>]*?\s(?:href|src)\s*=\s*['\"]([^'\"]+)['\"]"
                  r"|\{doc\}`(?:[^`<]*<)?([^`>]+)>?`")   # markdown links, HTML tags' href and src, {doc} roles
PAGE_SUFFIXES = ("", ".ipynb", ".md")
# Paths other programs keep under a folder of the same name as one of ours, which pages name in short form
NOT_OURS = {"models/blobs/": "Ollama's store, ~/.ollama/models/blobs", "models/manifests/": "Ollama's manifests"}


def pages() -> list[Path]:
    book = [p for p in (ROOT / "book").rglob("*") if p.suffix in (".ipynb", ".md")
            and ".ipynb_checkpoints" not in p.parts and "_build" not in p.parts]
    readmes = [p for p in (ROOT / "README.md", *ROOT.glob("*/README.md"), *ROOT.glob("*/*/README.md"))
               if p.is_file() and not any(part.startswith((".", "_")) or part == "test-output"
                                          for part in p.relative_to(ROOT).parts[:-1])]
    return sorted(book) + sorted(readmes)


def chunks(path: Path) -> list[tuple[str, str]]:
    """A page's text in the pieces an offender is reported by: a notebook's cells (markdown, and code with
    its strings and comments), or a whole markdown file."""
    if path.suffix != ".ipynb":
        return [("text", path.read_text())]
    cells = json.loads(path.read_text())["cells"]
    return [(f"cell {i} ({c['cell_type']})", "".join(c["source"])) for i, c in enumerate(cells)]


def _exists(target: Path) -> bool:
    if target.suffix == ".html":
        return any(target.with_suffix(s).is_file() for s in (".ipynb", ".md"))
    return any(Path(f"{target}{s}").exists() for s in PAGE_SUFFIXES)


def _pattern_exists(token: str, base: Path) -> bool:
    """A path with a placeholder (`results/<label>-<date>.json`) exists when the folder before it does;
    a glob (`results/*.json`) when it matches a file."""
    parts = token.split("/")
    fixed = next((i for i, p in enumerate(parts) if re.search(r"[<>{}]|\.\.\.", p)), None)
    if fixed is not None:
        return (base / "/".join(parts[:fixed])).resolve().is_dir()
    if "*" in token:
        return any(base.glob(token)) if not token.startswith("../") else any(base.resolve().glob(token))
    return _exists((base / token).resolve())


def offenders_in(text: str, page_dir: Path) -> list[str]:
    """What a page's text refers to that the repository does not hold: the notes' old place outside it
    (../shared/, CLAIMS.md, seeds/) and every path that looks like a repository file but is not there:
    one under a repository folder (`results/x.json`, from the root), one climbing out of the page's folder
    (`../intro/roofline`, a {download} file), and every relative link ([..](x.ipynb), href, {doc})."""
    bad = [f"outside the repository: {m.group(0)!r}" for m in OUTSIDE.finditer(text)]
    for m in REPO_PATH.finditer(text):
        token = m.group(0).split("</")[0].rstrip(".")
        if not token.startswith(tuple(NOT_OURS)) and not _pattern_exists(token, ROOT):
            bad.append(f"no such file: {token!r}")
    links = [t for m in LINK.finditer(text) for t in m.groups() if t]
    for token in [m.group(0).rstrip(".") for m in RELATIVE.finditer(text)] + links:
        token = re.split(r"[#?]", token)[0]
        if not token or re.match(r"^[a-z][\w+.-]*:", token) or "{" in token or token.split("/")[0] in TOP:
            continue                                  # a URL, an anchor, an f-string's piece, or a root path above
        base = ROOT if token.startswith("/") else page_dir
        if not _pattern_exists(token.lstrip("/"), base):
            bad.append(f"no such file: {token!r}")
    return list(dict.fromkeys(bad))


def page_offenders(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    return [f"{rel} {where}: {b}" for where, text in chunks(path) for b in offenders_in(text, path.parent)]


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_refers_to_a_file_the_repository_does_not_hold(path):
    bad = page_offenders(path)
    assert not bad, "\n".join(bad)


def test_the_scanner_flags_what_it_forbids_and_passes_what_exists():
    page_dir = ROOT / "book" / "appendix"
    made_up = ("See `results/h200-19990101-no-such-run.json` and [the page](../nowhere/chapter.ipynb), "
               "{doc}`../intro/no-such-page`, <a href='../kquants/missing.html#x'>x</a>, "
               "the notes in ../shared/seeds/000.txt, and CLAIMS.md.")
    bad = offenders_in(made_up, page_dir)
    assert sorted(bad) == sorted(["outside the repository: '../shared'", "outside the repository: 'CLAIMS.md'",
                                  "no such file: 'results/h200-19990101-no-such-run.json'",
                                  "no such file: '../nowhere/chapter.ipynb'", "no such file: '../shared/seeds/000.txt'",
                                  "no such file: '../intro/no-such-page'", "no such file: '../kquants/missing.html'"]), bad
    assert offenders_in('{download}`note <../../sources/no-such-note.txt>`', page_dir) == [
        "no such file: '../../sources/no-such-note.txt'"]
    fine = ("`ref_impl/ledger/core.py`, `tests/test_ledger.py::test_x`, `results/*.json`, "
            "`models/<name>.train.json`, f'results/{label}.json', `mlx_lm/models/cache.py`, "
            "[mlx](https://github.com/ml-explore/mlx/tree/main/tests/x.py), {doc}`ledger`, "
            "{doc}`the roofline <../intro/roofline>`, [it](../intro/roofline.ipynb), <a href='#claim-C01'>, "
            "<a href='../appendix/ledger.html#claim-C01'>, {download}`n <../../sources/000_8c45ce1e9e68affe.txt>`, "
            "`.venv/bin/python`, `~/.ollama/models/blobs`, `Makefile`, src = 'datasheet', f(href='x').")
    assert offenders_in(fine, page_dir) == []


def test_what_the_scanner_leaves_to_other_programs_is_not_in_the_repository():
    assert not any((ROOT / prefix).exists() for prefix in NOT_OURS)
    assert offenders_in("print(f'models/blobs/sha256-{digest}')", ROOT / "book" / "appendix") == []


def test_a_notebooks_code_cells_are_scanned_strings_and_comments(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# A page\n", "Fine."]},
                    {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                     "source": ["path = ROOT / 'results/no-such.json'  # the list: seeds/ beside the checkout\n"]}]}
    page = tmp_path / "page.ipynb"
    page.write_text(json.dumps(nb))
    found = [(where, b) for where, text in chunks(page) for b in offenders_in(text, ROOT / "book" / "appendix")]
    assert found == [("cell 1 (code)", "outside the repository: 'seeds/'"),
                     ("cell 1 (code)", "no such file: 'results/no-such.json'")]
