"""The book as a reader gets it: built with warnings as errors, then opened in headless Chromium
with the network cut off, where every plotly figure must draw from the book's own plotly.js and
every formula must be typeset by the book's own MathJax.

The build goes into the repository's `_build/` (what `make book` writes), so notebooks executed
once are reused from its cache. Screenshots land in `test-output/screenshots/`, one per page.
Chromium is Debian's (`make setup` installs it when run as root); set CHROMIUM to use another.
"""

from __future__ import annotations

import ast
import base64
import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import plotly
import pytest
import yaml

from tests import book_pages

ROOT = Path(__file__).resolve().parent.parent
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "test-output" / "screenshots"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 120_000  # plotly.min.js is 4.8 MB; a busy 2-core CI machine parses it slowly


def notebooks() -> list[Path]:
    return sorted(p for p in (ROOT / "book").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def toc_pages() -> list[str]:
    """Every page in _toc.yml, as its path without suffix (e.g. 'book/intro')."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = [toc["root"]]

    def walk(entries):
        for e in entries or []:
            if "file" in e:
                pages.append(e["file"])
            for key in ("parts", "chapters", "sections"):
                walk(e.get(key))

    walk(toc.get("parts") or toc.get("chapters"))
    return pages


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_notebooks_are_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") != [] or c.get("execution_count") is not None)]
    assert not dirty, (f"{path.relative_to(ROOT)}: code cells {dirty} carry outputs or execution counts; "
                       "clear them before committing")


# The chapter template (how-to-read.ipynb tells the reader): every chapter has these second-level
# sections, a heading's number aside ("## 4. Live: ..."), with the learning goals first and the further
# reading last. A pattern matches the start of the heading, so a section can say more after a colon.
TEMPLATE = {
    "Learning goals": r"learning goals\b",
    "Prerequisites": r"prerequisites\b",
    "The idea": r"the idea\b",
    "The engine at work": r"the engine at work\b",
    "A live experiment": r"live\b",
    "Recorded results": r"(recorded results|measured)\b",
    "Claims checked": r"claims checked\b",
    "What we found": r"what we found\b",
    "Exercises": r"exercises\b",
    "Further reading": r"further reading\b",
}
NOT_CHAPTERS = ("book/how-to-read", "book/appendix/", "book/build-it/")

# Words from the making of the book, not from the course: no page and no printed output may use them.
WORKSHOP_WORDS = (r"\blent\b", r"\bleases?\b", r"\bsessions?\b", r"\bdevice time\b", r"\boverran\b",
                  r"NBVAL", r"\bunknown\b", r"\bTODO\b", r"\bFIXME\b", r"\bissue \d+",
                  r"\bthe next this chapter needs\b")


def chapters() -> list[Path]:
    return [ROOT / f"{p}.ipynb" for p in toc_pages()
            if (ROOT / f"{p}.ipynb").is_file() and not p.startswith(NOT_CHAPTERS)]


def h2_headings(path: Path) -> list[str]:
    """Second-level headings of a notebook's markdown cells, without their section numbers."""
    cells = json.loads(path.read_text())["cells"]
    lines = [line for c in cells if c["cell_type"] == "markdown" for line in "".join(c["source"]).splitlines()]
    return [re.sub(r"^[\d.]+\s+", "", line[3:].strip()) for line in lines if line.startswith("## ")]


@pytest.mark.parametrize("path", chapters(), ids=lambda p: str(p.relative_to(ROOT)))
def test_chapter_follows_the_template(path):
    heads = h2_headings(path)
    missing = [name for name, pat in TEMPLATE.items() if not any(re.match(pat, h, re.I) for h in heads)]
    assert not missing, f"{path.relative_to(ROOT)} lacks the template's sections {missing}; its sections: {heads}"
    assert re.match(TEMPLATE["Learning goals"], heads[0], re.I), f"the first section is {heads[0]!r}"
    assert re.match(TEMPLATE["Further reading"], heads[-1], re.I), f"the last section is {heads[-1]!r}"
    at = {name: next(i for i, h in enumerate(heads) if re.match(pat, h, re.I)) for name, pat in TEMPLATE.items()}
    assert at["Claims checked"] < at["What we found"] < at["Exercises"], \
        f"{path.relative_to(ROOT)}: 'What we found' closes the chapter, after the claims and before the exercises"


def what_we_found(path: Path) -> list[str]:
    """The bullets of a chapter's 'What we found' section."""
    text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    section = re.search(r"^## [\d.]*\s*What we found.*?$(.*?)(?=^## |\Z)", text, re.M | re.S | re.I)
    return re.findall(r"^[-*] (.+?)(?=^[-*] |^\s*$|\Z)", section.group(1), re.M | re.S) if section else []


@pytest.mark.parametrize("path", chapters(), ids=lambda p: str(p.relative_to(ROOT)))
def test_chapter_ends_with_what_it_found(path):
    """3-6 findings, each with its number (glued from the computation, or printed by it) and a link to the
    verdict it bears on (a ledger row of the page, `#claim-CXX`) or to the section that measured it."""
    bullets = what_we_found(path)
    assert 3 <= len(bullets) <= 6, f"{path.relative_to(ROOT)}: {len(bullets)} findings in 'What we found'"
    for b in bullets:
        assert re.search(r"\{glue(:\w+)?\}`", b), f"a finding without a computed number: {b[:80]!r}"
        assert re.search(r'href="#claim-C\d\d"|\{ref\}`', b), f"a finding that links no verdict or section: {b[:80]!r}"


@pytest.mark.parametrize("path", chapters(), ids=lambda p: str(p.relative_to(ROOT)))
def test_chapter_prose_fits_one_page(path):
    words = book_pages.prose_words(book_pages.cells(path))
    assert words <= book_pages.MAX_PROSE_WORDS, \
        f"{path.relative_to(ROOT)}: {words:,} words of prose; move probes and dead ends to its lab notes"


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_visible_code_runs_as_shown(path):
    """Copied from the page and run in order, the visible code needs nothing a hidden cell defines."""
    hidden = book_pages.hidden_names_used(book_pages.cells(path))
    assert not hidden, f"{path.relative_to(ROOT)}: visible cells use names only hidden cells define: {hidden}"


def test_the_page_checks_catch_what_they_name():
    code = lambda src, *tags: {"cell_type": "code", "source": src, "metadata": {"tags": list(tags)}, "outputs": []}  # noqa: E731
    cells = [code("N_ALL = 5\nimport numpy as np", "remove-cell"), code("x = N_ALL * np.pi"),
             code("def f(n):\n    return n + 1\nf(2)"), code("y = f(1)  # defined above, shown")]
    assert book_pages.hidden_names_used(cells) == [(1, "N_ALL"), (1, "np")]
    out = lambda name, text: {"output_type": "stream", "name": name, "text": text}  # noqa: E731
    executed = [dict(code("a"), outputs=[out("stdout", "x\n" * 26)]), dict(code("b", "listing"), outputs=[out("stdout", "x\n" * 40)]),
                dict(code("c"), outputs=[out("stderr", "warning: tensor falls back\n")]),
                dict(code("d"), outputs=[out("stdout", "x\n" * 25)])]
    problems = book_pages.output_problems(executed)
    assert len(problems) == 2 and problems[0].startswith("cell 0 prints 26 lines") and "cell 2 writes to stderr" in problems[1]
    md = {"cell_type": "markdown", "source": "## Idea\n\nFour words of prose.\n\n```python\nnot = prose + at_all\n```\n<b>x</b>"}
    assert book_pages.prose_words([md]) == 6   # Idea, Four, words, of, prose., x


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_outputs_read_as_a_textbook(built_book, path):
    """No stderr, warnings or raw logs in a page; a long text output only in a cell tagged as a listing."""
    executed = ROOT / "_build" / "jupyter_execute" / path.relative_to(ROOT)
    problems = book_pages.output_problems(book_pages.cells(executed))
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_no_table_of_the_book_prints_e_notation(built_book):
    """Times and sizes read as 1,960 ms, never 1.96e+03, in every table of every page."""
    found = {}
    for page in toc_pages():
        cells = re.findall(r"<t[dh][^>]*>([^<]*)</t[dh]>", (built_book / f"{page}.html").read_text())
        bad = [c for c in cells if re.search(r"\d\.?\d*e[+-]\d+", c)]
        if bad:
            found[page] = bad[:3]
    assert not found, f"tables print e-notation: {found}"


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cells_that_only_check_are_hidden_from_the_page(path):
    """A cell of nothing but asserts is for nbval and the build, not the reader: tagged remove-cell."""
    shown = []
    for i, c in enumerate(json.loads(path.read_text())["cells"]):
        if c["cell_type"] != "code" or "remove-cell" in c["metadata"].get("tags", []):
            continue
        try:
            body = ast.parse("".join(c["source"])).body
        except SyntaxError:           # IPython syntax (%magic): not a plain check
            continue
        if body and all(isinstance(node, ast.Assert) for node in body):
            shown.append(i)
    assert not shown, f"{path.relative_to(ROOT)}: cells {shown} only assert; tag them remove-cell"


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_text_has_no_workshop_words(path):
    """Markdown, and the strings code cells print; comments are for the code's readers and may say more."""
    cells = json.loads(path.read_text())["cells"]
    text = "\n".join("".join(c["source"]) if c["cell_type"] == "markdown" else
                     "\n".join(re.findall(r"print\((.*)", "".join(c["source"]))) for c in cells)
    found = sorted({m.group(0) for pat in WORKSHOP_WORDS for m in re.finditer(pat, text, re.I)})
    assert not found, f"{path.relative_to(ROOT)} says {found}: words from the workshop, not the course"


def test_viz_renderer_emits_html_for_the_book_and_json_for_jupyter(monkeypatch):
    from ref_impl import viz

    fig = viz.line_chart({"a": ([1, 2], [3, 4])}, "A rises", "Time (s)", "Rate (tokens/s)")
    monkeypatch.setenv("COURSE_BOOK_BUILD", "1")
    book = viz.CourseRenderer().to_mimebundle(fig.to_dict())
    assert list(book) == ["text/html"]
    assert "Plotly.newPlot" in book["text/html"] and "<script src" not in book["text/html"]
    assert "require" not in book["text/html"]
    monkeypatch.delenv("COURSE_BOOK_BUILD")
    live = viz.CourseRenderer().to_mimebundle(fig.to_dict())
    assert set(live) == {"text/html", "application/vnd.plotly.v1+json"}
    assert "tokens/s" in fig.data[0].hovertemplate
    with pytest.raises(ValueError, match="no unit"):
        viz.figure("t", "Time", "Rate (tokens/s)")
    bars = viz.with_slider(viz.bar_chart(["a", "b"], {"x": [1, 2], "y": [3, 4]}, "B wins", "Case (name)",
                                         "Speed (tokens/s)"), {"x": [0], "y": [1]}, "Series: ")
    assert [t.visible for t in bars.data] == [True, False] and len(bars.layout.sliders[0].steps) == 2


def test_viz_titles_wrap_as_html_and_figures_keep_the_rules(monkeypatch):
    from ref_impl import viz

    monkeypatch.setenv("COURSE_BOOK_BUILD", "1")
    fig = viz.line_chart({"a": ([1, 10], [3, 4])}, "A rises & <b>falls</b>", "Time (s)", "Rate (tokens/s)",
                         log_x=True)
    page = viz.CourseRenderer().to_mimebundle(fig.to_dict())["text/html"]
    assert page.startswith('<p class="course-figure-title"') and "A rises & <b>falls</b></p>" in page
    assert '"text":"A rises' not in page.replace(" ", "")          # not drawn a second time inside the plot
    assert viz.lint(fig) == [] and fig.layout.xaxis.tickformat == viz.LOG_TICKS
    assert len(set(viz.PALETTE)) == len(viz.PALETTE) == len(viz.DASHES) == 12
    many = {f"s{i}": ([0, 1], [i, i]) for i in range(len(viz.PALETTE) + 1)}
    with pytest.raises(ValueError, match="palette has 12 colours"):
        viz.line_chart(many, "Too many", "Time (s)", "Rate (tokens/s)")
    bad = viz.figure("Bad", "Time (s)", "Rate (tokens/s)", log_y=True)
    bad.add_scatter(x=[1], y=[1], name="one", line_color=viz.PALETTE[0])
    bad.add_scatter(x=[1], y=[2], name="two", line_color=viz.PALETTE[0])
    bad.update_layout(legend=dict(x=1.02, orientation="v"), yaxis_tickformat=None)
    found = " | ".join(viz.lint(bad))
    assert "'one' and 'two' share" in found and "right of the plot" in found and "yaxis is a log axis without full tick labels" in found


def test_viz_lint_rejects_two_labels_alike_and_long_legends_and_the_renderer_refuses_them():
    from ref_impl import viz

    twice = viz.bar_chart(["4-bit L4", "4-bit L4"], {"run A": [6.4, 6.5]}, "Stacked", "Setting (name)", "Time (ms)")
    assert any("share the categories ['4-bit L4']" in p for p in viz.lint(twice))
    same = viz.figure("Same", "Time (s)", "Rate (tokens/s)")
    same.add_scatter(x=[1], y=[1], name="run", line_color=viz.PALETTE[0])
    same.add_scatter(x=[1], y=[2], name="run", line_color=viz.PALETTE[1])
    assert any("labelled 'run'" in p for p in viz.lint(same))
    # one name per menu option, never two at once, is one series; a span on a timeline (base) is no grouped bar
    menu = viz.with_dropdown(viz.line_chart([("run", [1], [1]), ("run", [1], [2])], "Menu", "Time (s)", "Rate (tokens/s)"),
                             {"first": [0], "second": [1]})
    spans = viz.figure("Spans", "Time (ms)", "Unit (name)")
    spans.add_bar(y=["CPU", "CPU"], x=[1, 2], base=[0, 1], orientation="h", name="encode")
    assert viz.lint(menu) == [] and viz.lint(spans) == []
    seven = viz.line_chart({f"s{i}": ([0, 1], [i, i]) for i in range(7)}, "Seven", "Time (s)", "Rate (tokens/s)")
    assert any("7 legend entries, more than 6" in p for p in viz.lint(seven))
    assert viz.lint(seven.update_layout(showlegend=False, hovermode="x unified")) == []   # a hover table
    by_menu = viz.line_chart({f"s{i}": ([0, 1], [i, i]) for i in range(8)}, "Menu", "Time (s)", "Rate (tokens/s)")
    assert viz.lint(viz.with_dropdown(by_menu, {"first": range(4), "second": range(4, 8)})) == []   # 4 at a time
    with pytest.raises(ValueError, match="breaks the book's figure rules.*share the categories"):
        viz.CourseRenderer().to_mimebundle(twice.to_dict())
    assert viz.with_dropdown(seven, {"a": [0]}).layout.updatemenus[0].x == 0   # left: the toolbar is at the right


def page_labels() -> set[str]:
    """Every MyST label `(name)=` a page of the book defines."""
    texts = [p.read_text() for p in (ROOT / "book").rglob("*.md")]
    texts += ["".join(c["source"]) for p in notebooks() for c in json.loads(p.read_text())["cells"]
              if c["cell_type"] == "markdown"]
    return {m for t in texts for m in re.findall(r"^\(([\w-]+)\)=[ \t]*$", t, re.M)}


def test_every_see_chapter_pointer_names_a_page_label():
    """A module's `See chapter: <label>` sends the reader to a page: the label must exist."""
    labels = page_labels()
    pointers = [(p.relative_to(ROOT), m) for p in sorted((ROOT / "ref_impl").rglob("*.py"))
                for m in re.findall(r"See chapter: ([\w-]+)", p.read_text())]
    assert len(pointers) > 60 and {"intro-roofline", "kquants", "reference-machines"} <= labels
    missing = [f"{path}: {label}" for path, label in pointers if label not in labels]
    assert not missing, f"pointers to no page label (labels: {sorted(labels)}): {missing}"


def test_the_number_scanner_catches_two_values_of_one_quantity_and_accepts_a_named_run():
    """tests/book_numbers on made-up pages: the check below can fail."""
    from tests.book_numbers import disagreements, statements

    table = {("measured bandwidth", "h200"): (3068.2, "h200-20261202-063646.json"),
             ("held-out perplexity", "cpu-2core"): (6.2663, "cpu-2core-20261205-000000.json")}
    same = "<main><p>On the H200 the measured bandwidth is 3,068 GB/s.</p></main>"
    other = "<main><p>The H200's measured bandwidth: 3,486 GB/s.</p></main>"
    named = ("<main><div class='cell_output'><pre>H200, measured bandwidth 3,486 GB/s\n"
             "h200, 29 Nov 2026, commit 6f02605 (results/h200-20261129-122549.json)</pre></div></main>")
    ppl = "<main><p>The shipped model's held-out perplexity on the 2-core CPU is 7.4056.</p></main>"
    sample = "<main><p>The shipped model's held-out perplexity on a sample of 16,384 tokens (2-core CPU): 7.4056.</p></main>"
    found = {name: statements(name, page) for name, page in
             (("same", same), ("other", other), ("named", named), ("ppl", ppl), ("sample", sample))}
    assert [s.value for s in found["same"]] == [3068.0] and [s.decimals for s in found["ppl"]] == [4]
    assert found["sample"] == []                                   # another quantity, labelled as such
    bad = disagreements([s for v in found.values() for s in v], table)
    assert len(bad) == 2 and bad[0].startswith("other: measured bandwidth on h200") and bad[1].startswith("ppl:")


def test_one_value_per_reference_quantity_across_pages(built_book):
    """Item 6 of the reference table's promise: a quantity of the table (records.reference_quantities) stated on
    any page has the table's value, unless a caption beside it names the other run it comes from."""
    from ref_impl.measure import records
    from tests.book_numbers import disagreements, statements

    table = {(q.name, q.label): (q.value, q.run.file) for q in records.reference_quantities()}
    found = [s for page in toc_pages() for s in statements(page, (built_book / f"{page}.html").read_text())]
    assert len({s.page for s in found}) >= 3 and {s.quantity for s in found} >= {"measured bandwidth"}
    bad = disagreements(found, table)
    assert not bad, "\n".join(bad)


def test_pages_that_show_recorded_numbers_name_runs_that_exist(built_book):
    """A page whose code reads results/ (through measure.records, or the ledger's recorded evidence) names the runs
    it shows in caption lines (`Run.caption`), and every results file a page names is in results/."""
    from tests.book_numbers import RESULTS_FILE

    readers = [p for p in chapters() + [ROOT / "book/appendix/reference-machines.ipynb"]
               if re.search(r"\brecords\.|_recorded\(|ledger\.check\(", "".join(
                   "".join(c["source"]) for c in json.loads(p.read_text())["cells"] if c["cell_type"] == "code"))]
    assert len(readers) >= 10
    present = {p.name for p in (ROOT / "results").glob("*.json")}
    for path in readers:
        page = (built_book / path.relative_to(ROOT)).with_suffix(".html").read_text()
        named = set(RESULTS_FILE.findall(page))
        assert named, f"{path.relative_to(ROOT)} reads recorded results but names no run"
        assert named <= present, f"{path.relative_to(ROOT)} names runs that are not in results/: {named - present}"


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_runs_top_to_bottom_in_the_build(built_book, path):
    """The build executes every notebook once (allow_errors false: a failing cell or assert fails the build);
    each must have come out of it executed, every code cell run, no error output."""
    executed = ROOT / "_build" / "jupyter_execute" / path.relative_to(ROOT)
    assert executed.is_file(), f"{path.relative_to(ROOT)} was not executed by the book's build"
    code = [c for c in json.loads(executed.read_text())["cells"] if c["cell_type"] == "code"]
    assert code and all(c.get("execution_count") for c in code if "".join(c["source"]).strip())
    errors = [o["ename"] for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.relative_to(ROOT)}: {errors}"


@pytest.fixture(scope="module")
def server(built_book):
    handler = functools.partial(_QuietHandler, directory=str(built_book))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"Chromium not found at {CHROMIUM}: run `make setup` (as root on Debian it installs "
                    "the chromium package), or set CHROMIUM to a Chromium binary")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def tab(browser):
    """One tab for every visit: its renderer keeps plotly.min.js compiled from one page to the next (a new tab
    or context parses its 4.8 MB again, about 3 s of each visit on 2 cores)."""
    context = browser.new_context()
    # each page still opens as on a first visit: no theme mode, tab choice or sidebar scroll carried over
    context.add_init_script("try { localStorage.clear(); sessionStorage.clear(); } catch (e) {}")
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    context.close()


class PageVisit:
    """One page opened in `tab` at `width` with every non-local request aborted and recorded."""

    def __init__(self, tab, base: str, page_path: str, width: int = 1280):
        self.base, self.blocked, self.errors, self.local = base, [], [], []
        self.page = tab
        self.page.set_viewport_size({"width": width, "height": 900 if width > 600 else 844})
        self.page.route("**/*", self._route)
        self.page.on("console", self._console)
        self.page.on("pageerror", self._pageerror)
        self.page.on("response", self._response)
        try:
            self.page.goto(f"{base}/{page_path}.html", wait_until="load", timeout=TIMEOUT_MS)
        except BaseException:
            self.close()   # the caller gets no visit to close, and the next visit must not inherit these
            raise

    def _is_local(self, url: str) -> bool:
        return url.startswith(self.base + "/") or urlsplit(url).scheme in ("data", "blob", "about")

    def _response(self, response):
        if self._is_local(response.url):
            self.local.append((response.url, response.status))

    def _route(self, route):
        if self._is_local(route.request.url):
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort()

    def _pageerror(self, exc):
        self.errors.append(f"uncaught: {exc}")

    def _console(self, msg):
        # A blocked CDN request logs "Failed to load resource" at the remote URL: not the book's
        # own script failing (those requests are listed in self.blocked and checked separately).
        if msg.type == "error" and self._is_local(msg.location.get("url") or self.base + "/"):
            where = f"{msg.location.get('url')}:{msg.location.get('lineNumber')}"
            self.errors.append(f"console: {msg.text} ({where})")

    def close(self):
        """Leave the tab to the next visit, with nothing of this one's listening."""
        self.page.unroute("**/*", self._route)
        for event, handler in (("console", self._console), ("pageerror", self._pageerror),
                               ("response", self._response)):
            self.page.remove_listener(event, handler)


WIDTHS = {"desktop": 1280, "phone": 390}  # px: a laptop's browser, and a phone held upright

# Each figure as drawn: its size, its plot area, what text sticks out of it, which legend entries share a
# colour, and the log-axis ticks whose label is not their value (plotly's "2 5 100 2 5" minor labels).
FIGURE_GEOMETRY = r"""() => [...document.querySelectorAll('.js-plotly-plot')].map(d => {
  const fl = d._fullLayout, box = d.getBoundingClientRect();
  const out = [...d.querySelectorAll('.gtitle, .g-gtitle text, .annotation-text, .legend')]
    .map(e => e.getBoundingClientRect())
    .filter(r => r.width > 0 && (r.left < box.left - 2 || r.right > box.right + 2)).length;
  const owner = {}, shared = [];
  for (const t of d._fullData) {
    if (t.visible !== true || !t.showlegend || !t.name) continue;
    const c = (t.line && t.line.color) || (t.marker && typeof t.marker.color === 'string' && t.marker.color);
    if (!c) continue;
    const who = t.legendgroup || t.name;
    if (owner[c] === undefined) owner[c] = who; else if (owner[c] !== who) shared.push(`${owner[c]} / ${who}: ${c}`);
  }
  const badTicks = [];
  for (const k of Object.keys(fl).filter(k => /^[xy]axis\d*$/.test(k) && fl[k].type === 'log')) {
    for (const v of (fl[k]._vals || [])) {
      const text = String(v.text).replace(/<[^>]*>/g, '').replace(/,/g, '').replace('−', '-').trim();
      const m = text.match(/^(-?[\d.]+)([kMGTmµ]?)$/);
      if (!m) continue;
      const value = parseFloat(m[1]) * ({k: 1e3, M: 1e6, G: 1e9, T: 1e12, m: 1e-3, 'µ': 1e-6}[m[2]] || 1);
      if (Math.abs(Math.log10(value) - v.x) > 0.02) badTicks.push(`${k}: '${v.text}' at ${Math.pow(10, v.x).toPrecision(3)}`);
    }
  }
  const overlaps = [];
  for (const layer of d.querySelectorAll('.xaxislayer-above, .yaxislayer-above')) {
    const boxes = [...layer.querySelectorAll('.xtick text, .ytick text')].map(t => [t.textContent, t.getBoundingClientRect()])
      .filter(([, r]) => r.width > 0);
    for (let i = 1; i < boxes.length; i++) {
      const [ta, a] = boxes[i - 1], [tb, b] = boxes[i];
      if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1) overlaps.push(`${ta} / ${tb}`);
    }
  }
  return {width: fl.width, plot: fl._size.w, plotHeight: fl._size.h, height: box.height, out, shared, badTicks, overlaps};
})"""


# The page as laid out: wider than the window (it scrolls sideways on a phone), a figure drawn past its own
# cell or over the blocks around it, an axis title cut by the figure's edge, plotly's toolbar over a menu.
PAGE_LAYOUT = r"""() => {
  const inside = (a, b, tol = 1) => a.top >= b.top - tol && a.bottom <= b.bottom + tol;
  const meet = (a, b, tol = 1) => a.left < b.right - tol && b.left < a.right - tol && a.top < b.bottom - tol && b.top < a.bottom - tol;
  const wide = document.documentElement.scrollWidth - window.innerWidth;
  const overlaps = [], clipped = [], covered = [];
  document.querySelectorAll('.js-plotly-plot').forEach((gd, i) => {
    const cell = gd.closest('.cell') || gd.parentElement;
    const svgs = [...gd.querySelectorAll('.main-svg')].map(s => s.getBoundingClientRect());
    const box = cell.getBoundingClientRect();
    if (svgs.some(s => !inside(s, box))) overlaps.push(`figure ${i} is drawn outside its cell`);
    for (const other of [cell.previousElementSibling, cell.nextElementSibling]) {
      if (other && meet(gd.getBoundingClientRect(), other.getBoundingClientRect())) overlaps.push(`figure ${i} covers the ${other === cell.nextElementSibling ? 'next' : 'previous'} block`);
    }
    const paper = gd.querySelector('.main-svg').getBoundingClientRect();
    for (const t of gd.querySelectorAll('.g-xtitle text, .g-ytitle text, .g-x2title text, .g-y2title text')) {
      const r = t.getBoundingClientRect();
      if (r.width > 0 && (r.left < paper.left - 1 || r.right > paper.right + 1 || r.top < paper.top - 1 || r.bottom > paper.bottom + 1))
        clipped.push(`figure ${i}: axis title '${t.textContent.slice(0, 40)}' is cut by the figure's edge`);
    }
    const bar = gd.querySelector('.modebar');
    if (bar) {
      const m = bar.getBoundingClientRect();
      for (const c of gd.querySelectorAll('.updatemenu-header-group, .updatemenu-header, .slider-group, .slider-container'))
        if (meet(m, c.getBoundingClientRect())) { covered.push(`figure ${i}: the toolbar covers a menu or slider`); break; }
    }
  });
  return {wide: wide > 1 ? [`the page is ${document.documentElement.scrollWidth} px wide in a ${window.innerWidth} px window`] : [], overlaps, clipped, covered};
}"""


def _check_layout(layout: dict) -> None:
    problems = [p for kind in ("wide", "overlaps", "clipped", "covered") for p in layout[kind]]
    assert not problems, "the page does not lay out:\n" + "\n".join(problems)


def _check_figures_read(figures: list[dict]) -> None:
    for i, f in enumerate(figures):
        assert f["plot"] >= min(0.6 * f["width"], 400), \
            f"figure {i}: its plot is {f['plot']:.0f} px of {f['width']:.0f} (a legend or margin takes the rest)"
        assert not f["out"], f"figure {i}: {f['out']} title, annotation or legend boxes run off the figure"
        assert not f["shared"], f"figure {i}: legend entries share a colour: {f['shared']}"
        assert not f["badTicks"], f"figure {i}: log-axis tick labels that are not their value: {f['badTicks'][:4]}"
        assert not f["overlaps"], f"figure {i}: tick labels drawn over each other: {f['overlaps'][:4]}"
        assert f["plotHeight"] >= 200, f"figure {i}: its plot is {f['plotHeight']:.0f} px tall"


BAD_PAGE = """<!doctype html><html><head><script src="plotly.min.js"></script></head><body style="margin:8px">
<pre style="white-space: pre">{wide}</pre>
<div class="cell" style="height: 120px; overflow: visible"><div id="f"></div></div>
<div class="cell"><p>the next cell</p></div>
<script>
Plotly.newPlot("f", [{{x: [1, 2], y: [3, 4], type: "scatter"}}],
  {{height: 420, margin: {{t: 20}}, xaxis: {{title: {{text: "{long}"}}}},
    updatemenus: [{{x: 1, xanchor: "right", y: 1.1, yanchor: "top", buttons: [{{label: "an option", method: "restyle", args: [{{}}]}}]}}]}},
  {{displaylogo: false}});
</script></body></html>"""


def test_the_layout_checks_catch_what_they_name(tab, tmp_path):
    """PAGE_LAYOUT on a page that breaks every rule at a phone's width: a line that widens the page, a figure
    drawn past its cell onto the next, an axis title cut by the figure's edge, a menu under the toolbar."""
    (tmp_path / "plotly.min.js").write_bytes((Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes())
    (tmp_path / "bad.html").write_text(BAD_PAGE.format(wide="x" * 200, long="A title far too long " * 4))
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    visit = PageVisit(tab, f"http://127.0.0.1:{httpd.server_address[1]}", "bad", WIDTHS["phone"])
    try:
        visit.page.wait_for_function("() => document.querySelector('#f .main-svg')", timeout=TIMEOUT_MS)
        layout = visit.page.evaluate(PAGE_LAYOUT)
    finally:
        visit.close()
        httpd.shutdown()
        httpd.server_close()
    assert all(layout[kind] for kind in ("wide", "overlaps", "clipped", "covered")), layout
    with pytest.raises(AssertionError, match="does not lay out"):
        _check_layout(layout)


def _screenshot(page, path: Path) -> None:
    """The whole page as a PNG, as page.screenshot(full_page=True) takes it but with Chromium's fast PNG
    compression: the same pixels in a file a quarter larger, in two thirds of the time (a 25,000 px tall
    page: 2.1 s rather than 3.3 s on 2 cores)."""
    page.evaluate("() => document.fonts.ready.then(() => true)")   # what page.screenshot waits for too
    cdp = page.context.new_cdp_session(page)
    try:
        size = cdp.send("Page.getLayoutMetrics")["cssContentSize"]
        shot = cdp.send("Page.captureScreenshot", {
            "format": "png", "optimizeForSpeed": True, "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}})
    finally:
        cdp.detach()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))


def _visible_words(page) -> list[str]:
    text = page.evaluate("() => document.querySelector('main, article, body').innerText")
    return sorted({m.group(0) for pat in WORKSHOP_WORDS for m in re.finditer(pat, text, re.I)})


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("page_path", toc_pages())
def test_page_draws_every_figure_and_formula_offline(tab, server, built_book, page_path, width):
    html = built_book / f"{page_path}.html"
    assert html.is_file(), f"{html} was not built"
    expected = html.read_text().count('class="plotly-graph-div"')
    formulas = html.read_text().count('class="math notranslate nohighlight"')  # Sphinx's \(..\) and \[..\]
    visit = PageVisit(tab, server, page_path, WIDTHS[width])
    try:
        page = visit.page
        page.wait_for_function(
            """() => [...document.querySelectorAll('.plotly-graph-div')]
                     .every(d => d.classList.contains('js-plotly-plot') && d.querySelector('.main-svg'))""",
            timeout=TIMEOUT_MS)
        if expected:   # course_figures.js has fitted every figure to this width
            page.wait_for_function("() => document.documentElement.dataset.courseFigures === 'fitted'",
                                   timeout=TIMEOUT_MS)
        drawn = page.evaluate(
            """() => [...document.querySelectorAll('.js-plotly-plot')].map(d => ({
                 svgs: d.querySelectorAll('.main-svg').length,
                 traces: d.querySelectorAll('.trace, .hm').length,   // a heatmap draws a .hm layer
                 height: d.getBoundingClientRect().height}))""")
        geometry = page.evaluate(FIGURE_GEOMETRY)
        layout = page.evaluate(PAGE_LAYOUT)
        _screenshot(page, SHOTS / f"{page_path.replace('/', '__')}--{width}.png")

        assert not [u for u in visit.blocked if "plotly" in u.lower()], \
            f"the page asked the network for plotly: {visit.blocked}"
        assert len(drawn) == expected, f"{expected} figures in the HTML, {len(drawn)} drawn"
        for i, fig in enumerate(drawn):
            assert fig["svgs"] and fig["traces"] and fig["height"] > 100, f"figure {i} is empty: {fig}"
        if expected:
            plotly_js = [(u, s) for u, s in visit.local if "/_static/plotly.min.js" in u]
            assert plotly_js and all(s == 200 for _, s in plotly_js), f"plotly.min.js not served: {plotly_js}"
            version = page.evaluate("() => window.Plotly.version")
            assert version == plotly.offline.get_plotlyjs_version(), f"the page runs plotly.js {version}"
        _check_formulas_typeset(visit, formulas)
        _check_figures_read(geometry)
        _check_layout(layout)
        words = _visible_words(page)
        assert not words, f"the page says {words}: words from the workshop, not the course"
        if (ROOT / f"{page_path}.ipynb").is_file():
            assert page.locator("details.run-locally").count() == 1, "no 'Run it locally' box under the title"
        missing = [(u, s) for u, s in visit.local if s >= 400]
        assert not missing, f"the book links files it does not have: {missing}"
        if width == "desktop" and "updatemenu" in html.read_text():   # last: clicking changes the figures
            page.wait_for_selector(".js-plotly-plot .updatemenu-header", timeout=TIMEOUT_MS)
            _check_dropdowns(page, page_path)
        assert not visit.errors, "errors in the page:\n" + "\n".join(visit.errors)
    finally:
        visit.close()


def _check_formulas_typeset(visit: PageVisit, formulas: int) -> None:
    """Every math element of the page was turned into MathJax output, by the book's own copy."""
    assert not [u for u in visit.blocked if "mathjax" in u.lower()], \
        f"the page asked the network for MathJax: {visit.blocked}"
    if not formulas:
        return
    page = visit.page
    page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                           timeout=TIMEOUT_MS)
    typeset = page.evaluate(
        r"""async () => {
             await MathJax.startup.promise;
             const maths = [...document.querySelectorAll('.math')];
             return {version: MathJax.version, maths: maths.length,
                     done: maths.filter(m => m.querySelector('mjx-container')).length,
                     raw: maths.filter(m => /\\[(\[]/.test(m.textContent)).map(m => m.textContent.slice(0, 60)),
                     errors: document.querySelectorAll('mjx-merror').length}; }""")
    served = [(u, s) for u, s in visit.local if "/_static/mathjax/" in u]
    assert any("tex-mml-chtml.js" in u and s == 200 for u, s in served), f"MathJax not served: {served}"
    assert any(u.split("?")[0].endswith(".woff") for u, _ in served), f"no MathJax font was loaded: {served}"
    assert typeset["maths"] == formulas and typeset["done"] == formulas, \
        f"{formulas} formulas in the HTML, {typeset['done']} typeset: {typeset}"
    assert not typeset["raw"] and not typeset["errors"], f"formulas left as TeX or in error: {typeset}"


def test_the_book_has_figures(built_book):
    """The figure checks above must have something to check."""
    assert any('class="plotly-graph-div"' in (built_book / f"{p}.html").read_text() for p in toc_pages())


def test_the_book_has_formulas(built_book):
    """The MathJax checks above must have something to check."""
    assert any('class="math notranslate nohighlight"' in (built_book / f"{p}.html").read_text()
               for p in toc_pages())


def test_the_book_has_dropdowns(built_book):
    """The dropdown check of the page test (desktop width) must have something to check."""
    assert any("updatemenu" in (built_book / f"{p}.html").read_text() for p in toc_pages())


def _check_dropdowns(page, page_path: str) -> None:
    """Click the last option of every dropdown menu; the figure's visible traces must change, with no kernel."""
    for n, gd in enumerate(page.query_selector_all(".js-plotly-plot")):
        if not gd.query_selector(".updatemenu-header"):
            continue
        before = gd.evaluate("d => d.data.map(t => t.visible)")
        gd.scroll_into_view_if_needed()
        gd.query_selector(".updatemenu-header").click()
        buttons = gd.query_selector_all(".updatemenu-dropdown-button")
        assert len(buttons) > 1, f"{page_path}: figure {n}'s menu did not open"
        buttons[-1].click()
        after = gd.evaluate("d => d.data.map(t => t.visible)")
        assert after != before, f"{page_path}: figure {n}'s menu changed nothing"


def test_landing_page_links_every_page_and_says_who_it_is_for():
    intro = (ROOT / "book" / "intro.md").read_text()
    linked = set(re.findall(r"\{doc\}`([^`]+)`", intro))
    missing = [p for p in toc_pages()[1:] if p.removeprefix("book/") not in linked]
    assert not missing, f"book/intro.md does not link {missing}"
    assert "## Who it is for" in intro and "## What to know first" in intro


def test_an_outline_is_marked_in_preparation_in_the_table_of_contents():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    entries = [c for part in toc["parts"] for c in part["chapters"]]
    for e in entries:
        source = next((ROOT / f"{e['file']}{s}" for s in (".md", ".ipynb") if (ROOT / f"{e['file']}{s}").is_file()))
        outline = "```{admonition} In preparation" in source.read_text()
        assert outline == ("in preparation" in e.get("title", "").lower()), \
            f"{e['file']}: an outline is marked '(in preparation)' in _toc.yml, a written chapter is not"


def test_the_publishing_workflow_builds_with_the_readmes_command():
    """GitHub Pages gets what `make book` (the README's command) writes to _build/html."""
    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "book.yml").read_text())
    steps = [s for job in flow["jobs"].values() for s in job["steps"]]
    assert "make book" in (ROOT / "README.md").read_text()
    assert [s for s in steps if s.get("run", "").strip() == "make book"], "no step runs `make book`"
    upload = [s for s in steps if s.get("uses", "").startswith("actions/upload-pages-artifact@")]
    assert upload and upload[0]["with"]["path"] == "_build/html"
    assert "_build/html" in (ROOT / "Makefile").read_text()
    assert any(s.get("uses", "").startswith("actions/deploy-pages@") for s in steps)
    assert flow["permissions"]["pages"] == "write" and flow["permissions"]["id-token"] == "write"


def test_run_it_locally_names_the_repository_from_wherever_the_book_is_built():
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    import run_locally as rl

    github = {"GITHUB_SERVER_URL": "https://github.com", "GITHUB_REPOSITORY": "someone/course"}
    assert rl.repository_url(github) == "https://github.com/someone/course"
    assert rl.repository_url({"BOOK_REPOSITORY_URL": "https://example.org/c/"}) == "https://example.org/c"
    for remote in ("git@github.com:someone/course.git", "https://github.com/someone/course.git",
                   "https://token@github.com/someone/course", "ssh://git@github.com/someone/course.git"):
        assert rl.repository_url({}, remote) == "https://github.com/someone/course", remote
    assert rl.repository_url({}, "") is None and rl.repository_url({}, "/srv/git/course") is None
    assert rl.theme_knows("https://github.com/someone/course") and not rl.theme_knows("https://example.org/c")
    lines = rl.commands("book/intro/roofline.ipynb", "https://github.com/someone/course")
    assert lines[:2] == ["git clone https://github.com/someone/course", "cd course"]
    assert lines[-1] == ".venv/bin/jupyter lab book/intro/roofline.ipynb"
    assert any(line.startswith("make lab ") for line in lines)
    assert "git clone" not in "".join(rl.commands("book/x.ipynb", None))
    assert "&lt;script&gt;" in rl.box("book/x.ipynb", "https://h/<script>")
    assert rl.branch({}) == "main" and rl.branch({"GITHUB_REF_NAME": "pages"}) == "pages"
    # the commands must work: `make lab` exists and installs JupyterLab, with nothing to compile (no peer),
    # and the whole set (`make setup`) is the lab set plus the peer and the test tools
    assert re.search(r"^lab:", (ROOT / "Makefile").read_text(), re.M)
    lab, full = ((ROOT / f).read_text() for f in ("requirements-lab.txt", "requirements.txt"))
    assert re.search(r"^jupyterlab==", lab, re.M) and not re.search(r"^llama-cpp-python", lab, re.M)
    assert re.search(r"^-r requirements-lab.txt$", full, re.M) and re.search(r"^llama-cpp-python==", full, re.M)
    assert "-r ../requirements-lab.txt" in (ROOT / "binder" / "requirements.txt").read_text()   # Binder: the lab set


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_notebook_starts_by_installing_the_course_where_it_is_missing(path):
    """Colab, or a notebook opened alone: its first code cell fetches the course (run_locally.setup_cell);
    the book's pages leave it out (remove-cell)."""
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    import run_locally as rl

    first = next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
    assert "".join(first["source"]) == rl.setup_cell(path.relative_to(ROOT).as_posix()), \
        f"{path.relative_to(ROOT)}: its first code cell is not the course's setup cell (run_locally.setup_cell)"
    assert {"remove-cell", rl.SETUP_TAG} <= set(first["metadata"].get("tags", []))


def test_the_setup_cell_says_how_to_get_the_course_and_does_nothing_where_it_is_installed():
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    import run_locally as rl

    cell = rl.setup_cell("book/intro/roofline.ipynb")
    env = {k: v for k, v in os.environ.items() if k != "COURSE_REPOSITORY"}
    alone = subprocess.run([sys.executable, "-I", "-S", "-c", cell], capture_output=True, text=True, env=env)
    assert alone.returncode != 0 and "clone the course and run `make lab`" in alone.stderr   # no site-packages
    here = subprocess.run([sys.executable, "-c", cell + "\nprint(os.getcwd())"], capture_output=True, text=True,
                          env={**env, "COURSE_REPOSITORY": "/nonexistent"}, cwd=ROOT / "book")
    assert here.returncode == 0 and here.stdout.strip() == str(ROOT / "book"), here.stderr   # installed: nothing


def test_notebook_pages_offer_binder_and_colab_where_the_repository_is_known(tmp_path):
    """A two-page book with the course's launch buttons and run_locally, built as the publishing workflow
    builds it (the repository known): its notebook page links Binder and Colab at that repository's main."""
    book = tmp_path / "book"
    (book / "book" / "x").mkdir(parents=True)
    config = {"title": "t", "execute": {"execute_notebooks": "off"},
              "launch_buttons": yaml.safe_load((ROOT / "_config.yml").read_text())["launch_buttons"],
              "sphinx": {"local_extensions": {"run_locally": str(ROOT / "book" / "_ext")}}}
    (book / "_config.yml").write_text(yaml.safe_dump(config))
    (book / "_toc.yml").write_text("format: jb-book\nroot: book/intro\nchapters:\n  - file: book/x/a\n")
    (book / "book" / "intro.md").write_text("# Intro\n")
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "# A"}], "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}
    (book / "book" / "x" / "a.ipynb").write_text(json.dumps(nb))
    env = {**os.environ, "BOOK_REPOSITORY_URL": "https://github.com/someone/course"}
    env.pop("GITHUB_REF_NAME", None)
    run = subprocess.run([str(Path(sys.executable).parent / "jupyter-book"), "build", str(book), "--warningiserror"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    page = (book / "_build" / "html" / "book" / "x" / "a.html").read_text()
    assert "https://mybinder.org/v2/gh/someone/course/main?urlpath=lab/tree/book/x/a.ipynb" in page
    assert "https://colab.research.google.com/github/someone/course/blob/main/book/x/a.ipynb" in page


def test_links_between_pages_land_on_what_they_name(built_book):
    """Every link from one page of the book to another reaches a built file and, with #anchor, an id on it
    (the ledger's rows and the chapters' claim tables link to each other)."""
    broken = []
    for page in toc_pages():
        source = built_book / f"{page}.html"
        for href in set(re.findall(r"""href=["']([^"':]+?\.html(?:#[^"']*)?)["']""", source.read_text())):
            target, _, anchor = href.partition("#")
            path = (source.parent / target).resolve()
            if not path.is_file():
                broken.append(f"{page}: {href} (no file)")
            elif anchor and not re.search(rf"""id=["']{re.escape(anchor)}["']""", path.read_text()):
                broken.append(f"{page}: {href} (no id {anchor!r})")
    assert not broken, "\n".join(broken[:20])
