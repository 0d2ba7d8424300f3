"""The checker core and the package's face: every checker reports a learner's stub and crash instead of
raising, a Result shows as ✓ or ✗, and every `ex.<name>` the notebooks call exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ref_impl import exercises as ex

BOOK = Path(__file__).resolve().parent.parent / "book"


CHECKERS = sorted(name for name in dir(ex) if name.startswith("check_"))


@pytest.mark.parametrize("name", CHECKERS)
def test_every_checker_reports_a_stub_and_a_crash_instead_of_raising(name):
    """A learner's unwritten stub says so; an exception inside their code becomes a ✗ naming it."""
    def stub(*_):
        raise NotImplementedError

    def crash(*_):
        return 1 / 0
    checker = getattr(ex, name)
    assert "not written yet" in checker(stub).message
    r = checker(crash)
    assert not r and "raised ZeroDivisionError" in r.message


def test_results_display_as_tick_or_cross():
    good, bad = ex.check_ridge_point(165.2e12 / 1008e9), ex.check_ridge_point(1.0)   # RTX 4090's ridge; a wrong one
    assert repr(good).startswith("✓") and repr(bad).startswith("✗") and "Hint" in repr(bad)
    assert bool(good) and not bad
    assert "✓" in good._repr_html_() and "<script" not in ex.Result(False, "<script>")._repr_html_()


def test_every_name_the_notebooks_call_is_exported():
    """The notebooks use `from ref_impl import exercises as ex` and call `ex.<name>`: each name is in __all__."""
    called = set()
    for path in BOOK.rglob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                called |= set(re.findall(r"\bex\.([A-Za-z_][A-Za-z0-9_]*)", "".join(cell["source"])))
    assert called, "no notebook calls a checker"
    assert not called - set(ex.__all__), sorted(called - set(ex.__all__))
    assert all(hasattr(ex, name) for name in ex.__all__)
