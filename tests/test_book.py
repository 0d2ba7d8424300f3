"""The book as a reader gets it: built with warnings as errors, then opened in headless Chromium
with the network cut off, where every plotly figure must draw from the book's own plotly.js and
every formula must be typeset by the book's own MathJax.

The build goes into the repository's `_build/` (what `make book` writes), so notebooks executed
once are reused from its cache. Screenshots land in `test-output/screenshots/`, one per page.
Chromium is Debian's (`make setup` installs it when run as root); set CHROMIUM to use another.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import plotly
import pytest
import yaml

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


@pytest.fixture(scope="module")
def built_book() -> Path:
    jb = Path(sys.executable).parent / "jupyter-book"
    run = subprocess.run([str(jb), "build", str(ROOT), "--warningiserror", "--keep-going"],
                         cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if run.returncode:
        pytest.fail(f"jupyter-book build failed (rc {run.returncode}):\n{(run.stdout + run.stderr)[-6000:]}")
    return HTML


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


class PageVisit:
    """One page opened with every non-local request aborted and recorded."""

    def __init__(self, browser, base: str, page_path: str):
        self.base, self.blocked, self.errors, self.local = base, [], [], []
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))
        self.page.on("response", self._response)
        self.page.goto(f"{base}/{page_path}.html", wait_until="load", timeout=TIMEOUT_MS)

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

    def _console(self, msg):
        # A blocked CDN request logs "Failed to load resource" at the remote URL: not the book's
        # own script failing (those requests are listed in self.blocked and checked separately).
        if msg.type == "error" and self._is_local(msg.location.get("url") or self.base + "/"):
            where = f"{msg.location.get('url')}:{msg.location.get('lineNumber')}"
            self.errors.append(f"console: {msg.text} ({where})")

    def close(self):
        self.context.close()


@pytest.mark.parametrize("page_path", toc_pages())
def test_page_draws_every_figure_and_formula_offline(browser, server, built_book, page_path):
    html = built_book / f"{page_path}.html"
    assert html.is_file(), f"{html} was not built"
    expected = html.read_text().count('class="plotly-graph-div"')
    formulas = html.read_text().count('class="math notranslate nohighlight"')  # Sphinx's \(..\) and \[..\]
    visit = PageVisit(browser, server, page_path)
    try:
        page = visit.page
        page.wait_for_function(
            """() => [...document.querySelectorAll('.plotly-graph-div')]
                     .every(d => d.classList.contains('js-plotly-plot') && d.querySelector('.main-svg'))""",
            timeout=TIMEOUT_MS)
        drawn = page.evaluate(
            """() => [...document.querySelectorAll('.js-plotly-plot')].map(d => ({
                 svgs: d.querySelectorAll('.main-svg').length,
                 traces: d.querySelectorAll('.trace, .hm').length,   // a heatmap draws a .hm layer
                 height: d.getBoundingClientRect().height}))""")
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"{page_path.replace('/', '__')}.png"), full_page=True)

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
        missing = [(u, s) for u, s in visit.local if s >= 400]
        assert not missing, f"the book links files it does not have: {missing}"
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


def test_dropdowns_switch_traces_without_a_kernel(browser, server, built_book):
    """Click the last option of every dropdown menu; the figure's visible traces must change."""
    for page_path in toc_pages():
        if "updatemenu" not in (built_book / f"{page_path}.html").read_text():
            continue
        visit = PageVisit(browser, server, page_path)
        try:
            page = visit.page
            page.wait_for_selector(".js-plotly-plot .updatemenu-header", timeout=TIMEOUT_MS)
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
            assert not visit.errors, "errors in the page:\n" + "\n".join(visit.errors)
        finally:
            visit.close()
