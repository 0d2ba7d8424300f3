"""The checker core: a `Result` (✓ or ✗ with a message), and the judges every chapter's checkers share.

A checker takes the learner's answer -- a number, or a function that it calls on several test
inputs -- and compares it with the engine's own computation. A number is right within a relative
tolerance (`RTOL`, 1%, unless a checker says otherwise); an exact answer (an offset, a yes/no, a
name) must be equal. A wrong answer is compared with the values the usual mistakes produce (bits
for bytes, K without V, GiB for GB, ...): a match names the mistake, otherwise the hint gives the
size of the miss and the recipe. `bool(result)` is `result.ok`; a notebook displays it as ✓ or ✗.

See chapter: intro-roofline
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

RTOL = 0.01  # an answer within 1% of the engine's value is right
# dtype names by element size, for the checkers that build real caches (the mlx dtype is `getattr(mx, name)`)
DTYPE_NAMES = {2: "float16", 4: "float32", 1: "uint8"}


@dataclass(frozen=True)
class Result:
    """The verdict on one answer: `ok`, and a message that says why (with a hint when wrong)."""

    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"{'✓' if self.ok else '✗'} {self.message}"

    def _repr_html_(self) -> str:
        colour, mark = ("#009E73", "✓") if self.ok else ("#D55E00", "✗")
        return (f'<div style="border-left:4px solid {colour};padding:4px 10px">'
                f'<b style="color:{colour}">{mark}</b> {html.escape(self.message)}</div>')


Mistake = tuple[float, str]  # (the value this mistake gives, the hint that names it)


def run_answer(task: str, label: str, fn: Callable, *args):
    """Call the learner's function: (its value, None), or (None, a ✗ Result saying what went wrong)."""
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, Result(False, f"{task}: not written yet. Replace the `raise NotImplementedError` line.")
    except Exception as exc:  # the learner's code: report it, don't crash the check cell
        return None, Result(False, f"{task} ({label}): your function raised {type(exc).__name__}: {exc}")


def array_answer(task: str, label: str, what: str, fn: Callable, *args) -> tuple[np.ndarray | None, Result | None]:
    """Call the learner's function and take its output as a float64 array: (the array, None), or (None, a ✗
    Result saying what went wrong: not written yet, raised, or not `what`)."""
    out, failed = run_answer(task, label, fn, *args)
    if failed is not None:
        return None, failed
    try:
        return np.asarray(out, dtype=np.float64), None
    except (TypeError, ValueError):
        return None, Result(False, f"{task} ({label}): expected {what}, got {type(out).__name__} {out!r:.80}.")


def close(a: float, b: float, rtol: float = RTOL) -> bool:
    """Whether a and b agree within the relative tolerance `rtol`."""
    return math.isclose(a, b, rel_tol=rtol)


def judge(answer, right: float, unit: str, mistakes: list[Mistake], recipe: str,
          rtol: float = RTOL) -> tuple[bool, str]:
    """(ok, message) for one number against the right value and the values of known mistakes."""
    if isinstance(answer, (np.integer, np.floating)):
        answer = float(answer)
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        return False, f"expected a finite number in {unit}, got {answer!r}."
    if close(answer, right, rtol):
        return True, f"{answer:,.4g} {unit} (engine: {right:,.4g} {unit})."
    if answer <= 0:
        return False, f"{answer:,.4g} {unit}: the answer is a positive number of {unit}."
    # the nearest known mistake within tolerance names the slip (two slips can land close together)
    near = [(abs(answer - value) / value, hint) for value, hint in mistakes
            if close(answer, value, rtol) and not close(value, right, rtol)]
    if near:
        return False, f"{answer:,.4g} {unit}, not {right:,.4g}. Hint: {min(near)[1]}"
    return False, (f"{answer:,.4g} {unit} is {answer / right:.3g}× the engine's {right:,.4g} {unit}. "
                   f"Hint: {recipe}")


def judge_cases(task: str, answer, cases: list[tuple[tuple, str, float, list[Mistake]]], unit: str,
                recipe: str, rtol: float = RTOL) -> Result:
    """A number is judged on the first case; a function is called on every case's arguments."""
    if not callable(answer):
        _, label, right, mistakes = cases[0]
        ok, msg = judge(answer, right, unit, mistakes, recipe, rtol)
        return Result(ok, f"{task} ({label}): {msg}")
    for args, label, right, mistakes in cases:
        value, failed = run_answer(task, label, answer, *args)
        if failed is not None:
            return failed
        ok, msg = judge(value, right, unit, mistakes, recipe, rtol)
        if not ok:
            return Result(False, f"{task} ({label}): {msg}")
    return Result(True, f"{task}: right on all {len(cases)} cases, within {100 * rtol:g}%.")


def unit_slips(right: float, unit: str) -> list[Mistake]:
    """The GB and GiB slips of an answer wanted in `unit` (bytes, or bytes per second)."""
    return [(right / 1e9, f"that is in GB; give the answer in {unit}."),
            (right / 2**30, f"that is in GiB; give the answer in {unit}.")]


def judge_exact(task: str, answer, cases: list[tuple[tuple, str, object, list[tuple[object, str]]]], recipe: str,
                kind: type) -> Result:
    """Exact answers (offsets, yes/no): a value is judged on the first case, a function on every case."""
    def verdict(value, label, right, mistakes) -> Result | None:
        if kind is bool and not isinstance(value, (bool, np.bool_)):
            return Result(False, f"{task} ({label}): expected True or False, got {value!r}.")
        if kind is int and isinstance(value, (float, np.floating)) and float(value).is_integer():
            value = int(value)
        if kind is int and (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))):
            return Result(False, f"{task} ({label}): expected a whole number of bytes, got {value!r}.")
        if value == right:
            return None
        hint = next((h for v, h in mistakes if v == value and v != right), recipe)
        return Result(False, f"{task} ({label}): {value!r}, not {right!r}. Hint: {hint}")

    if not callable(answer):
        args, label, right, mistakes = cases[0]
        bad = verdict(answer, label, right, mistakes)
        return bad if bad is not None else Result(True, f"{task} ({label}): {answer!r}, right.")
    for args, label, right, mistakes in cases:
        value, failed = run_answer(task, label, answer, *args)
        if failed is not None:
            return failed
        bad = verdict(value, label, right, mistakes)
        if bad is not None:
            return bad
    return Result(True, f"{task}: right on all {len(cases)} cases.")
