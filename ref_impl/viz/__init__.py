"""viz: the course's figures (figures.py: one look, the builders), its tables (tables.py) and the offline
renderer (render.py).

`from ref_impl import viz` gives all three; a notebook calls `viz.use_offline_renderer()` once, before its first
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
from ref_impl.viz.tables import Column, Table, table

__all__ = ["DASHES", "FONT", "HEIGHT", "LOG_AXIS", "LOG_TICKS", "PALETTE", "Column", "CourseRenderer", "Table", "bar_chart",
           "colour", "figure", "line_chart", "lint", "split_unit", "table", "template", "use_offline_renderer",
           "with_dropdown", "with_slider"]
