"""viz: the course's figures (figures.py: one look, the builders) and the offline renderer (render.py).

`from ref_impl import viz` gives both; a notebook calls `viz.use_offline_renderer()` once, before its first
figure, so figures draw in the static book with no kernel and no network.
"""

from ref_impl.viz.figures import (
                                  DASHES,
                                  FONT,
                                  HEIGHT,
                                  LOG_AXIS,
                                  LOG_TICKS,
                                  PALETTE,
                                  bar_chart,
                                  colour,
                                  figure,
                                  line_chart,
                                  lint,
                                  split_unit,
                                  template,
                                  with_dropdown,
                                  with_slider,
)
from ref_impl.viz.render import CourseRenderer, use_offline_renderer

__all__ = ["DASHES", "FONT", "HEIGHT", "LOG_AXIS", "LOG_TICKS", "PALETTE", "CourseRenderer", "bar_chart", "colour",
           "figure", "line_chart", "lint", "split_unit", "template", "use_offline_renderer", "with_dropdown",
           "with_slider"]
