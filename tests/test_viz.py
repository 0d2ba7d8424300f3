"""viz: importing it changes nothing; one explicit call makes plotly draw offline in the course's look."""

import subprocess
import sys

import pytest

CHECK = """
import plotly.io as pio
before = (pio.renderers.default, pio.templates.default)
from ref_impl import viz
assert (pio.renderers.default, pio.templates.default) == before, "importing viz changed plotly's defaults"
fig = viz.figure("A title", "Time (s)", "Rate (tokens/s)")
assert fig.layout.template.layout.colorway == viz.PALETTE   # the look travels with the figure, no registry
viz.use_offline_renderer()
viz.use_offline_renderer()                                   # idempotent
assert pio.renderers.default == "course" and pio.templates.default == "course"
assert isinstance(pio.renderers["course"], viz.CourseRenderer)
"""


def test_importing_viz_has_no_side_effects_and_the_renderer_is_one_call():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_table_formats_every_number_one_way_and_explains_its_columns():
    from ref_impl import viz

    t = viz.table([viz.Column("rung"), viz.Column("decode (tok/s)", ",.1f", "tokens per second"),
                   viz.Column("time (ms)", ",.0f")], [("plain", 109.25, 1960.4), ("<b>", 1234.5, float("nan"))], "ladder")
    page = t._repr_html_()
    assert "<td>1,960</td>" in page and "<td>1,234.5</td>" in page and "<td>–</td>" in page   # separators, a dash
    assert "&lt;b&gt;" in page and "<b>decode (tok/s)</b>: tokens per second" in page   # escaped; the note shown
    assert "overflow-x: auto" in page                      # a wide table scrolls in its box, not the page
    assert str(t).splitlines()[:3] == ["ladder", "rung" + " " * 3 + "decode (tok/s)  time (ms)",
                                       "plain" + " " * 11 + "109.2" + " " * 6 + "1,960"]   # text left, numbers right
    for fmt in (".3g", ".2e", ".1%"):
        with pytest.raises(ValueError, match="not fixed-decimal"):
            viz.Column("time (ms)", fmt)
    with pytest.raises(ValueError, match=r"rows \[0\] do not have one value per column"):
        viz.table([viz.Column("a")], [(1, 2)])
