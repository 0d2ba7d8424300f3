"""Serve plotly.js from the book itself: no CDN, no committed copy.

At build time this copies `plotly.min.js` from the installed plotly package (the same version that
drew the figures' JSON, so the two always match) into the HTML output's `_static/`, and loads it on
every page ahead of the page body, where `ref_impl.viz` puts each figure's `Plotly.newPlot` script,
with `course_figures.js`, which fits each figure's tick labels to the width it is drawn at (a phone's, too).
It also sets COURSE_BOOK_BUILD=1 for the kernels that execute the notebooks, so `ref_impl.viz`
emits each figure as HTML only: myst-nb warns about any output mime type it cannot render, and
the plotly JSON that live Jupyter draws is one. And it drops a duplicated inline script that
would otherwise throw on every page (see `_drop_duplicate_scripts`), so the pages' consoles stay
clean and `tests/test_book.py` can demand that. Registered in `_config.yml`,
`sphinx.local_extensions`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import plotly

SOURCE = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
TARGET = "plotly.min.js"  # under _static/
FIT = Path(__file__).with_name("course_figures.js")  # fits each figure's tick labels to the width it is drawn at


def _add_plotly(app) -> None:
    if app.builder.format != "html":
        return
    if not SOURCE.is_file():
        raise FileNotFoundError(f"{SOURCE} is missing: reinstall plotly (make setup)")
    # Copied before any page is written, so Sphinx stamps the link with the file's checksum
    # (?v=...) and browsers drop a cached copy when plotly is upgraded.
    static = Path(app.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SOURCE, static / TARGET)
    shutil.copyfile(FIT, static / FIT.name)
    # A plain <script> in <head> runs before the body's figure scripts; it sets window.Plotly itself.
    app.add_js_file(TARGET, priority=200)
    app.add_js_file(FIT.name, priority=201)


def _drop_duplicate_scripts(app, pagename, templatename, context, doctree) -> None:
    # Sphinx 7.4 lists an inline script added after builder init twice (once as filename None, once
    # as ''), so sphinx-thebe's `const THEBE_JS_URL = ...` runs twice and throws on every page.
    scripts, seen = context.get("script_files", []), set()
    unique = []
    for js in scripts:
        key = (getattr(js, "filename", js) or "", tuple(sorted(getattr(js, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    scripts[:] = unique


def setup(app):
    os.environ["COURSE_BOOK_BUILD"] = "1"  # inherited by the kernels myst-nb starts
    app.connect("builder-inited", _add_plotly)
    app.connect("html-page-context", _drop_duplicate_scripts)
    return {"version": plotly.__version__, "parallel_read_safe": True, "parallel_write_safe": True}
