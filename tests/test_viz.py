"""viz: importing it changes nothing; one explicit call makes plotly draw offline in the course's look."""

import subprocess
import sys

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
