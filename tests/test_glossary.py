"""The glossary (book/appendix/glossary.md) and its links (book/_ext/glossary_links.py).

Three layers: the pages' sources, read without building, must use no acronym or listed term of art
that the glossary lacks; the extension's matching, on small doctrees, must link only the first prose
use of an entry; and the built book (the `built_book` fixture) must carry those links, first uses to
`glossary.html#term-...`, and a general index that the glossary fills.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from docutils import nodes
from docutils.core import publish_doctree

ROOT = Path(__file__).resolve().parent.parent
GLOSSARY = ROOT / "book" / "appendix" / "glossary.md"
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import glossary_links as gl  # noqa: E402

# Words in capitals that are not jargon: a reader needs no definition of them.
NOT_JARGON = {
    "ACM", "AMD", "ICML", "MICRO", "SC", "NVIDIA",  # organisations and venues in citations
    "AI", "IA",                                     # in cited titles ("AI inference", "IA-32 Architectures")
    "RTX",                                          # a product line, with its model number (RTX 5090)
    "AN", "TN", "WP350", "JESD239",                 # document numbers of cited application notes and standards
    "OR",                                           # the English word, as in "OR-ed"
    "README",                                       # a file's name
}
NOT_JARGON_PATTERN = re.compile(r"C\d\d|M\d|[ABH]\d{3}")  # claim ids (C01-C32); chip names (M5 Max, H100)

# Terms of art that no capitals give away: any of them the pages use must have an entry.
TERMS_OF_ART = [
    "all-reduce", "arithmetic intensity", "bandwidth-delay product", "bank conflict", "bonus token",
    "cache line", "chi-square", "coalesced", "command buffer", "compute-bound", "CUDA graph", "cuDNN",
    "dp4a", "draft model", "eGPU", "eye diagram", "Flash-Decoding", "flash attention", "GbE", "GBd",
    "ggml", "GiB", "grouped-query attention", "half2", "HBM3e", "host-bound", "issue slot", "K-quant",
    "KiB", "KVQuant", "lazy evaluation", "llama.cpp", "memory-bound", "Medusa", "MiB", "micro-batch",
    "mlock", "mlx-lm", "mmap", "MoE", "NaN", "ncu", "nibble", "Nyquist frequency", "occupancy",
    "OCuLink", "outlier channel", "page cache", "page fault", "PCIe", "perplexity", "pinned memory",
    "pipeline state object", "prefill", "ptxas", "retimer", "ridge point", "RMSNorm", "roofline", "RoPE",
    "shared storage mode", "SiLU", "simdgroup", "SKP ordered set", "speculative decoding", "split load",
    "sub-block", "subnormal", "super-block", "tensor parallelism", "threadgroup", "TMA descriptor",
    "unified memory", "unit interval", "warp", "wired memory", "zero-copy", "α-set pair",
]

ACRONYM = re.compile(r"(?<![\w\-.])([A-Z][A-Z0-9_]*[A-Z0-9])s?(?!\w)")
CODE_DIRECTIVES = {"code", "code-block", "code-cell", "sourcecode", "math", "raw", "eval-rst", "literalinclude"}


def glossary_entries(text: str | None = None) -> list[tuple[list[str], str]]:
    """The glossary's entries in order: (terms, definition), from its one `{glossary}` fence."""
    text = GLOSSARY.read_text() if text is None else text
    body = re.search(r"^```\{glossary\}[^\n]*\n(.*?)^```\s*$", text, re.M | re.S)
    assert body, f"{GLOSSARY.relative_to(ROOT)} has no ```{{glossary}} block"
    entries: list[tuple[list[str], str]] = []
    for line in body.group(1).splitlines():
        if not line.strip() or line.lstrip().startswith(":"):
            continue
        if not line[0].isspace():
            if entries and entries[-1][1]:
                entries.append(([line.strip()], ""))
            elif entries:
                entries[-1][0].append(line.strip())
            else:
                entries.append(([line.strip()], ""))
        else:
            entries[-1] = (entries[-1][0], (entries[-1][1] + " " + line.strip()).strip())
    return entries


def glossary_terms() -> list[str]:
    return [t for terms, _ in glossary_entries() for t in terms]


def pages() -> list[Path]:
    found = [*(ROOT / "book").rglob("*.ipynb"), *(ROOT / "book").rglob("*.md")]
    return sorted(p for p in found if ".ipynb_checkpoints" not in p.parts and p != GLOSSARY
                  and "_ext" not in p.parts)


def markdown(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text()


def prose(text: str) -> str:
    """Markdown less what is not prose: code (fenced, indented by a code directive, inline), math,
    roles, HTML tags, URLs and link targets, labels and directive options."""
    kept, fences = [], []  # open fences: (marker, is_code)
    for line in text.splitlines():
        if fences and re.fullmatch(rf"\s*{re.escape(fences[-1][0][0])}{{{len(fences[-1][0])},}}\s*", line):
            fences.pop()
            continue
        m = re.match(r"^\s*(`{3,}|~{3,}|:{3,})\s*(\{([\w:-]+)\})?", line)
        if m and not (fences and fences[-1][1]):
            code = m.group(3) is None or m.group(3) in CODE_DIRECTIVES
            fences.append((m.group(1), code))
            kept.append("" if code else line[m.end():])  # a directive's argument is a title
            continue
        if fences and (fences[-1][1] or re.match(r"^\s*:[\w-]+:", line)):
            continue
        kept.append(line)
    t = "\n".join(kept)
    t = re.sub(r"\$\$.*?\$\$", " ", t, flags=re.S)
    t = re.sub(r"(?<!\\)\$[^$\n]+\$", " ", t)
    t = re.sub(r"\{[\w:-]+\}`[^`]*`", " ", t)  # roles: {doc}`...`, {glue:text}`...`
    t = re.sub(r"(`+)[^`]+?\1", " ", t)
    t = re.sub(r"<!--.*?-->", " ", t, flags=re.S)
    t = re.sub(r"<[^>\n]+>", " ", t)
    t = re.sub(r"\]\([^)]*\)", "]", t)
    t = re.sub(r"https?://\S+", " ", t)
    t = re.sub(r"^\([\w-]+\)=\s*$", " ", t, flags=re.M)
    return t


def spelled(term: str) -> str:
    """A regex for `term`, its words split by any white space (a line break in the source)."""
    return re.escape(term).replace(r"\ ", r"\s+")


def jargon(text: str) -> set[str]:
    """Acronyms (words of capitals and digits) and listed terms of art in the prose of `text`."""
    t = prose(text)
    found = {m.group(1) for m in ACRONYM.finditer(t)
             if m.group(1) not in NOT_JARGON and not NOT_JARGON_PATTERN.fullmatch(m.group(1))}
    found |= {term for term in TERMS_OF_ART
              if re.search(rf"(?<![\w-]){spelled(term)}(?:s|es)?(?![\w])", t, re.I)}
    return found


def covered(word: str, terms: list[str]) -> bool:
    """A word is defined when it is a term, or a word of one ("SKP" of "SKP ordered set", "GT" of
    "GT/s"), in any case ("GGML" is the entry "ggml")."""
    words = {w.lower() for t in terms for w in [t, *re.split(r"[\s\-/]+", t)]}
    return word.lower() in words


# --- the sources -------------------------------------------------------------------------------

def test_every_acronym_and_term_of_art_in_the_pages_has_an_entry():
    terms = glossary_terms()
    missing: dict[str, list[str]] = {}
    for path in pages():
        for word in sorted(jargon(markdown(path))):
            if not covered(word, terms):
                missing.setdefault(word, []).append(str(path.relative_to(ROOT)))
    assert not missing, "terms the pages use that the glossary lacks:\n" + "\n".join(
        f"  {w}: {', '.join(where[:3])}" for w, where in sorted(missing.items()))


def test_the_scan_finds_jargon_and_skips_code_and_math():
    text = ("The GEMV reads, and TLPs carry; the `NOTPROSE` code, $MATHX$, a [link](https://X.org/ABC)\n"
            "and C27 are not terms. A warp and an issue slot.\n\n```python\nCODEWORD = 1\n```\n\n"
            "```{admonition} Claims checked\n:class: important\nDLLPs here count.\n```\n")
    assert jargon(text) == {"GEMV", "TLP", "DLLP", "warp", "issue slot"}
    assert not covered("ZZTOP", glossary_terms())
    assert covered("GGML", glossary_terms()) and covered("GT", glossary_terms())


def test_glossary_is_one_sorted_list_of_short_definitions():
    entries = glossary_entries()
    text = GLOSSARY.read_text()
    assert re.search(r"^# Glossary$", text, re.M) and text.count("```{glossary}") == 1
    firsts = [terms[0] for terms, _ in entries]
    assert firsts == sorted(firsts, key=str.casefold), "entries out of alphabetical order"
    terms = [t.casefold() for t in glossary_terms()]
    assert len(terms) == len(set(terms)), "a term is listed twice"
    for terms_, definition in entries:
        sentences = re.findall(r"(?<!\b[A-Z])(?<!\be\.g)(?<!\bi\.e)[.!?](?=\s+[A-Z$(\"]|$)", definition)
        assert definition and len(sentences) <= 2, f"{terms_[0]}: {len(sentences)} sentences"
    assert len(entries) >= 150


def test_glossary_is_in_the_book_and_its_extension_registered():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    appendix = next(p for p in toc["parts"] if p["caption"] == "Appendix")
    assert "book/appendix/glossary" in [c.get("file") for c in appendix["chapters"]]
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["sphinx"]["local_extensions"].get("glossary_links") == "book/_ext"


def test_every_glossary_term_can_be_matched_in_prose():
    terms = glossary_terms()
    regex, order = gl.term_regex(terms)
    for term in terms:
        m = regex.search(f"a {term} here")
        assert m and m.group() == term and order[m.lastindex - 1] == term, term


# --- the extension, on small doctrees -----------------------------------------------------------

def link(rst: str, entries: dict[str, str]) -> tuple[nodes.document, list[str]]:
    """Parse `rst` and link it; `entries` maps each term to its entry's name."""
    doctree = publish_doctree(rst, settings_overrides={"report_level": 5})
    regex, order = gl.term_regex(entries)
    linked = gl.link_first_uses(doctree, regex, order,
                                lambda term: ("glossary.html#term-" + term.lower(), entries[term], "def"))
    return doctree, linked


def refs(doctree) -> list[tuple[str, str]]:
    return [(r.astext(), r["refuri"]) for r in doctree.findall(nodes.reference) if "glossary-link" in r["classes"]]


def test_links_only_the_first_prose_use():
    doctree, linked = link("A GEMV title\n============\n\nThe ``GEMV`` code, a `GEMV <https://x.org>`_ link,\n"
                           "then GEMV in prose, and GEMV again.\n\n.. math:: GEMV\n\nLast GEMV.\n",
                           {"GEMV": "GEMV"})
    assert linked == ["GEMV"]
    assert refs(doctree) == [("GEMV", "glossary.html#term-gemv")]
    ref = next(r for r in doctree.findall(nodes.reference) if "glossary-link" in r["classes"])
    assert isinstance(ref.parent, nodes.paragraph) and str(ref.previous_sibling()).endswith("then ")
    assert not list(next(doctree.findall(nodes.literal)).findall(nodes.reference))
    assert not list(next(doctree.findall(nodes.title)).findall(nodes.reference))
    assert ref.parent.astext().replace("\n", " ").endswith("then GEMV in prose, and GEMV again.")


def test_matches_whole_words_in_their_case_and_one_link_per_entry():
    doctree, linked = link("gemv and XGEMV and GEMVx are not it; GEMVs are. A KV-cache, then KV and a\n"
                           "KV cache. Ridge points rise; fp16 is FP16. mlx-lm is not MLX, nor mlx.\n",
                           {"GEMV": "GEMV", "KV cache": "KV", "KV": "KV", "ridge point": "ridge point",
                            "FP16": "FP16", "MLX": "MLX", "mlx-lm": "mlx-lm"})
    assert refs(doctree) == [("GEMVs", "glossary.html#term-gemv"), ("KV-cache", "glossary.html#term-kv cache"),
                             ("Ridge points", "glossary.html#term-ridge point"),
                             ("fp16", "glossary.html#term-fp16"), ("mlx-lm", "glossary.html#term-mlx-lm"),
                             ("MLX", "glossary.html#term-mlx")]
    assert linked == ["GEMV", "KV cache", "ridge point", "FP16", "mlx-lm", "MLX"]


def test_skips_notebook_cells_raw_html_and_words_split_over_lines():
    doctree = publish_doctree("Intro without the word.\n\n.. raw:: html\n\n   <p>GEMV</p>\n\nissue\nslots matter.\n",
                              settings_overrides={"report_level": 5})
    cell = nodes.container(nb_element="cell_code_output", classes=["cell_output"])
    cell += nodes.paragraph("", "", nodes.Text("GEMV from an output"))
    doctree.insert(1, cell)
    doctree += nodes.paragraph("", "", nodes.Text("a GEMV in prose"))
    doctree += nodes.paragraph("", "", nodes.Text("the TMA"), nodes.Text("\n"), nodes.Text("descriptor"))
    regex, order = gl.term_regex(["GEMV", "issue slot", "TMA", "TMA descriptor"])
    linked = gl.link_first_uses(doctree, regex, order, lambda t: ("#" + t, t, t))
    assert linked == ["issue slot", "GEMV", "TMA descriptor"]
    assert "GEMV from an output" == cell.astext()
    assert [text for text, _ in refs(doctree)] == ["issue\nslots", "GEMV", "TMA\ndescriptor"]


# --- the built book -----------------------------------------------------------------------------

FIRST_USES = [("book/intro/roofline", "GEMV"), ("book/signalling/gddr7-pam3", "PAM3"),
              ("book/signalling/thunderbolt-pcie", "TLP"), ("book/dispatch/command-buffers", "CUDA graph"),
              ("book/speculative/speculative-mtp", "MTP")]
SKIP_TAGS = {"code", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "script", "style", "math"}
SKIP_CLASSES = {"cell_input", "cell_output", "math", "run-locally", "admonition-title", "headerlink"}


def _article(path: Path):
    from bs4 import BeautifulSoup

    return BeautifulSoup(path.read_text(), "html.parser").find("article")


def _in_prose(string) -> bool:
    for parent in string.parents:
        if parent.name in SKIP_TAGS or SKIP_CLASSES & set(parent.get("class") or ()):
            return False
        if parent.name == "a" and "#term-" not in (parent.get("href") or ""):
            return False
    return True


def glossary_anchors(built_book: Path) -> dict[str, str]:
    """Each term of the built glossary, and the id of its anchor."""
    page = _article(built_book / "book" / "appendix" / "glossary.html")
    return {dt.get_text().rstrip("#").strip(): dt["id"] for dt in page.select("dl.glossary dt")}


@pytest.mark.parametrize("page,term", FIRST_USES, ids=[f"{p.rsplit('/', 1)[-1]}-{t}" for p, t in FIRST_USES])
def test_first_use_on_a_page_links_to_its_entry(built_book, page, term):
    anchor = glossary_anchors(built_book)[term]
    article = _article(built_book / f"{page}.html")
    word = re.compile(rf"(?<![\w-]){spelled(term)}(?:s|es)?(?![\w])")
    first = next((s for s in article.find_all(string=word) if _in_prose(s)), None)
    assert first is not None, f"{page} never uses {term} in prose"
    link = first.find_parent("a")
    assert link is not None and link["href"].endswith(f"glossary.html#{anchor}"), \
        f"{page}: the first prose use of {term} is not a link to its entry: {first.parent}"
    same = [a for a in article.find_all("a", href=re.compile(r"glossary\.html#term-")) if a["href"] == link["href"]]
    assert len(same) == 1, f"{page} links {term} {len(same)} times"


def test_links_stay_out_of_headings_code_and_the_glossary_itself(built_book):
    pages = [p for p in built_book.joinpath("book").rglob("*.html") if p.name != "glossary.html"]
    linking = 0
    for path in pages:
        article = _article(path)
        links = article.find_all("a", href=re.compile(r"glossary\.html#term-")) if article else []
        linking += bool(links)
        for a in links:
            bad = [p.name for p in a.parents if p.name in SKIP_TAGS or SKIP_CLASSES & set(p.get("class") or ())]
            assert not bad, f"{path.relative_to(built_book)}: a glossary link inside {bad[0]}: {a}"
    assert linking >= len(pages) - 2, f"only {linking} of {len(pages)} pages link to the glossary"
    own = _article(built_book / "book" / "appendix" / "glossary.html")
    assert not own.find_all("a", class_="glossary-link")


def test_general_index_lists_the_glossary_terms(built_book):
    index = (built_book / "genindex.html").read_text()
    entries = re.findall(r'href="book/appendix/glossary\.html#term-[^"]+"', index)
    assert len(entries) >= len(glossary_terms()), f"the index has {len(entries)} glossary entries"
    anchors = glossary_anchors(built_book)
    assert sorted(anchors) == sorted(glossary_terms())
    assert f'href="book/appendix/glossary.html#{anchors["GEMV"]}"' in index
