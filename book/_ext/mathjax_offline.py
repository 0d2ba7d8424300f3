"""Serve MathJax from the book itself: no CDN, no committed copy.

Sphinx loads MathJax 3 from a CDN by default, so with no network every formula stays raw TeX.
MathJax's browser build ships in the `sphinx-mathjax-offline` package (MathJax 3.2.2, pinned in
requirements.txt). We only take its files: at build time this copies the component the book
loads, `tex-mml-chtml.js` (TeX and MathML in, CommonHTML out), and every folder that component
fetches at run time into the HTML output's `_static/mathjax/`, then points Sphinx's `mathjax_path`
at the copy. MathJax finds its fonts and extensions next to its own script. The package's own
Sphinx hook copies its whole 24 MB tree after the build; this copies what the component can use
(about a third of it) before any page is written, so Sphinx stamps the script's link with its
checksum, as it does for plotly.js. Registered in `_config.yml`, `sphinx.local_extensions`.
"""

from __future__ import annotations

import shutil
from importlib import metadata
from pathlib import Path

from sphinx.ext.mathjax import MATHJAX_URL

DIST = "sphinx-mathjax-offline"
ENTRY = "tex-mml-chtml.js"
# What ENTRY may load after the page opens: TeX extensions (autoload, \require) and MathML
# entities; the CommonHTML fonts; the menu's lazy parts; the accessibility explorer and the
# speech-rule engine it needs (loaded only if a reader turns them on in MathJax's menu).
RUNTIME = ("input", "output/chtml", "ui", "a11y", "sre")
TARGET = "mathjax"  # under _static/


def source() -> Path:
    """The installed MathJax tree (its es5 build)."""
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the {DIST} package is missing: reinstall requirements.txt (make setup)") from None
    root = Path(str(dist.locate_file(f"{DIST}/static/mathjax")))
    if not (root / ENTRY).is_file():
        raise FileNotFoundError(f"{root / ENTRY} is missing: reinstall {DIST} (make setup)")
    return root


def _point_sphinx_at_copy(app, config) -> None:
    # Only Sphinx's default: a mathjax_path set in _config.yml wins.
    if config.mathjax_path == MATHJAX_URL:
        config.mathjax_path = f"{TARGET}/{ENTRY}"  # relative: Sphinx resolves it under _static/


def _copy_mathjax(app) -> None:
    if app.builder.format != "html" or not app.config.mathjax_path.startswith(f"{TARGET}/"):
        return
    src, dst = source(), Path(app.outdir) / "_static" / TARGET
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / ENTRY, dst / ENTRY)
    for folder in RUNTIME:
        shutil.copytree(src / folder, dst / folder, dirs_exist_ok=True)


def setup(app):
    app.connect("config-inited", _point_sphinx_at_copy)
    app.connect("builder-inited", _copy_mathjax)
    return {"version": metadata.version(DIST), "parallel_read_safe": True, "parallel_write_safe": True}
