"""The figure builders every chapter uses: one look, units on every axis, menus that need no kernel.

One plotly template (`template()`: a colour-blind-safe palette of twelve, one font, white background,
legends in rows below the plot, so it keeps its width on a phone), a few builders (`figure`, `line_chart`,
`bar_chart`) whose axis titles must carry a unit in parentheses, e.g. "Batch size (tokens)", which the hover
labels repeat, and two ways to explore a figure with no kernel behind it (`with_dropdown`, `with_slider`: both
switch which traces are shown). `lint` lists what a figure does against these rules (a colour given to two
series, a legend at the right, a log axis printing its minor ticks as lone digits); the book's browser test
checks the drawn figures for the same and for their plot width.

References: Paul Tol, "Colour schemes" (2021, the "muted" scheme), https://personal.sron.nl/~pault/;
Okabe & Ito, "Color Universal Design" (2008), https://jfly.uni-koeln.de/color/.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

# Okabe-Ito, ordered so the first lines are the most distinct (their yellow is too pale on white), then
# five of Paul Tol's "muted" colours: twelve, and no figure may give one colour to two series.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
           "#882255", "#332288", "#999933", "#44AA99", "#888888")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot") * 2   # one per colour
# A log axis labelled at 1, 2 and 5 of each decade, every label printed in full (20, 50, 100, not a
# lone "2" or "5"); in the book, course_figures.js drops to one label per decade where they crowd
LOG_TICKS = ",~r"
LOG_AXIS = dict(type="log", tickformat=LOG_TICKS, dtick="D2")
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
HEIGHT = 460  # px; the width follows the page
MAX_LEGEND = 6   # legend entries a phone shows in full below a plot; more: group them, or name them on an axis
MENU_TOP = 34  # px: the strip at a figure's top where plotly's toolbar appears, which a menu must leave free


_UNIT = re.compile(r"^(?P<name>.*\S)\s*\((?P<unit>[^()]+)\)\s*$")


def split_unit(title: str) -> tuple[str, str]:
    """'Batch size (tokens)' -> ('Batch size', 'tokens'). Raises ValueError if the unit is missing:
    every axis says what it measures. Use '(×)' or '(count)' for dimensionless quantities."""
    m = _UNIT.match(title)
    if not m:
        raise ValueError(f"axis title {title!r} has no unit: write it as 'Quantity (unit)'")
    return m["name"], m["unit"]


@functools.cache
def template() -> go.layout.Template:
    """The course look as a plotly template: every builder applies it, so no registry is needed."""
    axis = dict(showline=True, linecolor="#444", ticks="outside", gridcolor="#e5e5e5",
                zeroline=False, automargin=True, title_standoff=8)
    return go.layout.Template(layout=dict(
        font=dict(family=FONT, size=14, color="#222"),
        # in live Jupyter the title sits above the plot and pushes the margin; the book draws it as
        # HTML instead (CourseRenderer), where it wraps at any width
        title=dict(font=dict(size=17), x=0, xanchor="left", xref="paper", yref="paper", automargin=True),
        colorway=list(PALETTE),
        paper_bgcolor="white", plot_bgcolor="white",
        xaxis=axis, yaxis=axis,
        # below the plot, in rows: a legend at the right takes its width from the plot, and on a
        # phone leaves it a sliver; in the container's coordinates it never meets the x-axis title
        legend=dict(bgcolor="rgba(255,255,255,0.8)", title_text="", orientation="h",
                    xref="container", x=0, xanchor="left", yref="container", y=0, yanchor="bottom"),
        hoverlabel=dict(font=dict(family=FONT, size=13)),
        margin=dict(l=70, r=20, t=40, b=60),
        height=HEIGHT,
    ))


def _trace_colour(trace) -> str | None:
    for part in ("line", "marker"):
        c = getattr(getattr(trace, part, None), "color", None)
        if isinstance(c, str):
            return c.lower()
    return None


def _shown_together(fig: go.Figure) -> list[list]:
    """The sets of traces a reader sees at once: as first drawn, and after each menu or slider choice."""
    masks = [[t.visible is not False for t in fig.data]]
    for control in (*fig.layout.updatemenus, *fig.layout.sliders):
        for step in (*getattr(control, "buttons", ()), *getattr(control, "steps", ())):
            visible = step.args[0].get("visible") if step.args else None
            if isinstance(visible, (list, tuple)) and len(visible) == len(fig.data):
                masks.append([v is not False for v in visible])
    return [[t for t, on in zip(fig.data, mask) if on] for mask in masks]


def lint(fig: go.Figure) -> list[str]:
    """The ways `fig` breaks the book's figure rules, found from the figure alone (an empty list when it
    keeps them): two series with one label (unless one legend group: one series across menu options) or
    one colour, two bars of a trace on one category (plotly draws them as one bar), more than MAX_LEGEND
    legend entries, a legend placed at the right of the plot, a log axis without full tick labels."""
    problems, owner, views = [], {}, _shown_together(fig)
    twice = set()   # labels two series of one view share, though not one legend group: one series across options
    for shown in views:
        group: dict[str, object] = {}
        for t in shown:
            if t.name and t.showlegend is not False and group.setdefault(t.name, t.legendgroup or id(t)) != (
                    t.legendgroup or id(t)):
                twice.add(t.name)
    problems += [f"two series shown together are labelled {name!r}: say what differs" for name in sorted(twice)]
    for t in fig.data:
        if t.type == "bar" and t.base is None:   # bars with a base are spans on a timeline, not a grouped bar each
            at = list((t.y if t.orientation == "h" else t.x) or ())
            twice = sorted({str(c) for c in at if at.count(c) > 1})
            if twice:
                problems.append(f"bars of {t.name or 'a trace'!r} share the categories {twice}: plotly draws them as one bar")
        c = _trace_colour(t)
        if not t.name or t.showlegend is False or c is None:
            continue
        if owner.setdefault(c, t.name) != t.name:
            problems.append(f"{owner[c]!r} and {t.name!r} share the colour {c}")
    entries = max(len({t.legendgroup or t.name for t in shown if t.name and t.showlegend is not False})
                  for shown in views)   # a hidden trace has no legend entry
    if entries > MAX_LEGEND and fig.layout.showlegend is not False:
        problems.append(f"{entries} legend entries, more than {MAX_LEGEND}: group them, name them on an axis, "
                        "or split the figure")
    legend = fig.layout.legend
    if legend.orientation == "v" or (legend.x is not None and legend.x >= 1 and legend.xref != "container"):
        problems.append("the legend sits at the right of the plot: leave its place to the template (below)")
    for key, axis in fig.layout.to_plotly_json().items():
        if re.match(r"[xy]axis\d*$", key) and axis.get("type") == "log" and not axis.get("tickformat"):
            problems.append(f"{key} is a log axis without full tick labels: update it with **viz.LOG_AXIS")
    return problems


def colour(i: int, n: int | None = None) -> str:
    """The i-th series' colour. Raises ValueError past the palette: a figure with more series than
    colours would give two of them one colour; split it, or let a menu show some at a time."""
    if not 0 <= i < len(PALETTE):
        raise ValueError(f"series {i}{f' of {n}' if n else ''}: the palette has {len(PALETTE)} colours, and no "
                         "two series of a figure may share one; split the figure or add a menu")
    return PALETTE[i]


def figure(title: str, x_title: str, y_title: str, log_x: bool = False, log_y: bool = False) -> go.Figure:
    """An empty figure in the course template. `title` states the point, not the subject; both axis
    titles carry their unit in parentheses."""
    split_unit(x_title), split_unit(y_title)
    fig = go.Figure(layout=dict(template=template(), title_text=title))
    fig.update_xaxes(title_text=x_title, **(LOG_AXIS if log_x else {}))
    fig.update_yaxes(title_text=y_title, **(LOG_AXIS if log_y else {}))
    return fig


def _hover(fig: go.Figure, x_fmt: str, y_fmt: str) -> str:
    (xn, xu), (yn, yu) = split_unit(fig.layout.xaxis.title.text), split_unit(fig.layout.yaxis.title.text)
    return (f"<b>%{{fullData.name}}</b><br>{xn}: %{{x{x_fmt}}} {xu}<br>"
            f"{yn}: %{{y{y_fmt}}} {yu}<extra></extra>")


def line_chart(series: Mapping[str, tuple[Sequence[float], Sequence[float]]]
               | Sequence[tuple[str, Sequence[float], Sequence[float]]],
               title: str, x_title: str, y_title: str, log_x: bool = False, log_y: bool = False,
               markers: bool = True, x_fmt: str = ":,.4~g", y_fmt: str = ":,.4~g") -> go.Figure:
    """One line per entry of `series`: {name: (x, y)}, or [(name, x, y), ...] when names repeat
    (one line per name and dropdown option). Each name keeps one colour and dash, so a line looks
    the same in every option and the lines stay apart in greyscale. Hover labels show units."""
    fig = figure(title, x_title, y_title, log_x, log_y)
    hover = _hover(fig, x_fmt, y_fmt)
    entries = [(name, x, y) for name, (x, y) in series.items()] if isinstance(series, Mapping) else series
    style: dict[str, int] = {}
    for name, x, y in entries:
        i = style.setdefault(name, len(style))
        fig.add_trace(go.Scatter(
            x=list(x), y=list(y), name=name, legendgroup=name, mode="lines+markers" if markers else "lines",
            line=dict(color=colour(i), dash=DASHES[i], width=2.5),
            marker=dict(size=6), hovertemplate=hover))
    return fig


def bar_chart(categories: Sequence[str], series: Mapping[str, Sequence[float]], title: str, x_title: str,
              y_title: str, log_y: bool = False, y_fmt: str = ":,.4~g", horizontal: bool = False) -> go.Figure:
    """Grouped bars: one bar per category for each entry of `series` ({name: values}). `x_title` names
    the categories and `y_title` the values, whichever way the bars run; `horizontal` bars put the
    categories down the side, where long names never collide on a narrow page."""
    fig = figure(title, *((y_title, x_title) if horizontal else (x_title, y_title)),
                 **({"log_x": log_y} if horizontal else {"log_y": log_y}))
    (cn, _), (vn, vu) = split_unit(x_title), split_unit(y_title)
    c, v = ("y", "x") if horizontal else ("x", "y")
    hover = f"<b>%{{fullData.name}}</b><br>{cn}: %{{{c}}}<br>{vn}: %{{{v}{y_fmt}}} {vu}<extra></extra>"
    for i, (name, values) in enumerate(series.items()):
        fig.add_trace(go.Bar(**{c: list(categories), v: list(values)}, name=name, orientation="h" if horizontal else "v",
                             marker_color=colour(i, len(series)), hovertemplate=hover))
    fig.update_layout(barmode="group", bargap=0.25)
    if horizontal:
        fig.update_yaxes(autorange="reversed")   # the first category on top, as it reads
    return fig


def _visibility(fig: go.Figure, options: Mapping[str, Sequence[int]]) -> list[list[bool]]:
    n = len(fig.data)
    masks = []
    for label, shown in options.items():
        bad = [i for i in shown if not 0 <= i < n]
        if bad:
            raise IndexError(f"option {label!r} names traces {bad}, the figure has {n}")
        masks.append([i in set(shown) for i in range(n)])
    if not masks:
        raise ValueError("no options given")
    for trace, visible in zip(fig.data, masks[0]):
        trace.visible = visible
    return masks


def with_dropdown(fig: go.Figure, options: Mapping[str, Sequence[int]]) -> go.Figure:
    """A menu that shows, for each option ({label: indices of the traces to show}), only those
    traces; the first option is shown at first. Works in the static page: plotly.js switches the
    traces, no kernel is involved. Labels should say what they pick, e.g. 'Matrix: 1024 × 384'."""
    masks = _visibility(fig, options)
    buttons = [dict(label=name, method="restyle", args=[{"visible": mask}])
               for name, mask in zip(options, masks)]
    # above the plot's top left corner, below the strip where plotly's toolbar appears (the figure's top
    # MENU_TOP px, across most of a phone's width); the book draws the title above the figure
    fig.update_layout(updatemenus=[dict(buttons=buttons, direction="down", showactive=True,
                                        x=0.0, xanchor="left", y=1.0, yanchor="bottom", pad=dict(b=4))],
                      margin_t=max(fig.layout.margin.t or 0, MENU_TOP + 40))
    return fig


def with_slider(fig: go.Figure, steps: Mapping[str, Sequence[int]], prefix: str, pad_t: int = 50) -> go.Figure:
    """A slider with one step per entry of `steps` ({step label: indices of the traces to show}),
    e.g. one step per batch size. `prefix` names the quantity and unit, e.g. 'Batch size (tokens): '.
    `pad_t`: pixels between the plot and the slider (more for long or rotated tick labels)."""
    masks = _visibility(fig, steps)
    # inset from both edges, so the first and last step labels, centred on their ticks, are not cut off
    fig.update_layout(sliders=[dict(
        active=0, currentvalue=dict(prefix=prefix), pad=dict(t=pad_t), x=0.04, len=0.92,
        steps=[dict(label=name, method="restyle", args=[{"visible": mask}])
               for name, mask in zip(steps, masks)])])
    return fig

