"""The renderer that lets the static book draw the course's figures with no kernel and no network.

In a kernel, plotly's default display is the `application/vnd.plotly.v1+json` mime type, which JupyterLab
draws natively (plotly ships the jupyterlab-plotly extension) but Jupyter Book drops; the `notebook_connected`
renderer fetches plotly.js from a CDN. The `course` renderer emits a `text/html` div whose script calls the
page's global `Plotly`, and, in live Jupyter, the plotly JSON beside it. During the book build
(`COURSE_BOOK_BUILD=1`, set by `book/_ext/plotly_offline.py`, which also puts plotly.min.js from the installed
plotly on every page) it emits the HTML alone: myst-nb warns about every mime type it cannot render, even one it
would not have picked. Nothing happens at import: a notebook calls `viz.use_offline_renderer()` once.

Reference: plotly.py `plotly/io/_base_renderers.py` (HtmlRenderer).
"""

from __future__ import annotations

import json
import os

import plotly.graph_objects as go
import plotly.io as pio
from plotly.io._base_renderers import MimetypeRenderer

from ref_impl.viz.figures import FONT, HEIGHT, lint, template

TITLE_CSS = f"font-family: {FONT}; font-size: 17px; font-weight: 600; color: #222; margin: 1em 0 0.2em 0"
NAME = "course"   # the template's and the renderer's name in plotly's registries


class CourseRenderer(MimetypeRenderer):
    """Display a figure as its title in HTML, which wraps at any page width, above a div that draws
    the rest with the page's global `Plotly`; plus plotly JSON, title included, for live Jupyter
    unless COURSE_BOOK_BUILD=1. No plotly.js is embedded, nothing is fetched. A figure that `lint`
    finds at fault is refused, with its faults named."""

    def __init__(self, config: dict | None = None):
        self.config = {"displaylogo": False, "responsive": True, **(config or {})}

    def to_mimebundle(self, fig_dict: dict) -> dict:
        problems = lint(go.Figure(fig_dict, skip_invalid=True))
        if problems:   # the book shows no figure that breaks its rules
            raise ValueError("this figure breaks the book's figure rules (viz.lint): " + "; ".join(problems))
        layout = dict(fig_dict.get("layout") or {})
        title = dict(layout.pop("title", None) or {})
        text = title.pop("text", None)
        html = pio.to_html({**fig_dict, "layout": {**layout, "title": title}}, config=self.config,
                           include_plotlyjs=False, include_mathjax=False, full_html=False,
                           default_width="100%", default_height=f"{HEIGHT}px", validate=False)
        if text:   # the title's own markup (<b>, <br>, <sup>) is plotly's subset of HTML: kept as written
            html = f'<p class="course-figure-title" style="{TITLE_CSS}">{text}</p>\n{html}'
        if os.environ.get("COURSE_BOOK_BUILD") == "1":
            return {"text/html": html}
        spec = json.loads(pio.to_json(fig_dict, validate=False, remove_uids=False))
        return {"application/vnd.plotly.v1+json": {**spec, "config": self.config}, "text/html": html}


def use_offline_renderer() -> None:
    """Register the `course` template and renderer and make them plotly's defaults, so a figure shown in
    a notebook (its last expression, or fig.show()) is drawn offline in the course's look. Idempotent."""
    pio.templates[NAME] = template()
    pio.templates.default = NAME
    pio.renderers[NAME] = CourseRenderer()
    pio.renderers.default = NAME
