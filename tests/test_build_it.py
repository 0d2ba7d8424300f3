"""The Build-it-yourself part (book/build-it, ref_impl/exercises/build.py): every piece the finale assembles has
a stub in its step's notebook that its checker rejects, a worked solution under `worked_<name>` that a
collapsed cell checks, and the finale's table of pieces names real checkers. (The book's build runs every
notebook with the worked solutions, and the finale asserts that they give the engine's greedy text.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ref_impl import exercises
from ref_impl.exercises import build

ROOT = Path(__file__).resolve().parent.parent
PART = ROOT / "book" / "build-it"


def cells(step: int) -> list[dict]:
    (path,) = PART.glob(f"{step:02d}-*.ipynb")
    return json.loads(path.read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def test_the_finale_runs_every_step_notebook_in_order():
    names = sorted(p.stem for p in PART.glob("0[1-7]-*.ipynb"))
    assert list(build.STEP_NOTEBOOKS) == names and len(names) == 7
    finale = "".join(source(c) for c in json.loads((PART / "08-finale.ipynb").read_text())["cells"])
    assert all(f'"{n}"' in finale for n in names)


@pytest.mark.parametrize("piece", build.PIECES, ids=lambda p: p.name)
def test_every_piece_has_a_stub_its_check_rejects_and_a_checked_worked_solution(piece):
    code = [source(c) for c in cells(piece.step) if c["cell_type"] == "code"]
    definition = (f"def {piece.name}(", f"class {piece.name}")
    stubs = [s for s in code if s.lstrip().startswith(definition) and "NotImplementedError" in s]
    assert len(stubs) == 1, f"step {piece.step}: one stub cell for {piece.name}"
    namespace: dict = {}
    exec(stubs[0], namespace)                                    # the learner's copy, as shipped
    verdict = getattr(exercises, piece.check)(namespace[piece.name])
    assert not verdict and "not written yet" in verdict.message, verdict
    solutions = [c for c in cells(piece.step) if c["cell_type"] == "code" and "solution" in c["metadata"].get("tags", [])
                 and f"worked_{piece.name}" in source(c)]
    assert solutions, f"step {piece.step}: no worked solution for {piece.name}"
    assert "hide-cell" in solutions[0]["metadata"]["tags"]
    assert any(f"ex.{piece.check}(worked_{piece.name})" in source(c) and "assert worked" in source(c)
               for c in solutions), f"step {piece.step}: the worked {piece.name} is not checked"


@pytest.mark.parametrize("step", range(1, 8))
def test_a_step_links_its_chapter_and_keeps_the_learners_names(step):
    text = "".join(source(c) for c in cells(step) if c["cell_type"] == "markdown")
    assert "{doc}`../" in text, f"step {step} links no chapter"
    for c in cells(step):
        if c["cell_type"] == "code" and "solution" in c["metadata"].get("tags", []):
            for piece in (p for p in build.PIECES if p.step == step):
                assert f"\ndef {piece.name}(" not in "\n" + source(c), "a solution would overwrite the learner's code"


def test_a_learner_who_fills_every_stub_gets_the_engines_text_from_their_own_code(monkeypatch):
    """Every step notebook's code run in one namespace, as the finale runs it, with each stub filled by the worked
    solution under the learner's name: every check passes, the finale runs only the learner's pieces, and they
    continue the Q8_0 shipped model with the engine's greedy tokens."""
    import tempfile

    from ref_impl import MODELS_DIR
    from ref_impl.engine.compose import generate
    from ref_impl.formats.quantize import quantize_file
    from ref_impl.kernels import loading

    monkeypatch.chdir(PART)                                # the notebooks' own directory, as the book runs them
    namespace: dict = {"display": lambda *a, **k: None}
    for step in range(1, 8):
        for cell in cells(step):
            if cell["cell_type"] == "code" and "course-setup" not in cell["metadata"].get("tags", []):
                exec(source(cell), namespace)
        for piece in (p for p in build.PIECES if p.step == step):   # the learner's cell, filled
            namespace[piece.name] = namespace[f"worked_{piece.name}"]
    rows, pieces = build.progress(namespace)
    assert [r[2] for r in rows] == ["yours"] * len(build.PIECES), [r for r in rows if r[2] != "yours"]
    with tempfile.TemporaryDirectory() as tmp:
        q8 = Path(tmp) / "q8.gguf"
        quantize_file(MODELS_DIR / "stdlib-10m.gguf", q8, "Q8_0")
        engine = loading.load_file(q8, loading.LoadOptions(weights="float", kernels="off", dtype="float32"))
        ids = engine.tokenizer.encode("import os\n\ndef main(", bos=True)
        model, tokenizer = build.load_with(pieces["read_gguf"], pieces["dequantize_q8_0"], q8)
        mine = build.decode_with(pieces, model, ids, 24)
    assert mine == generate(engine.model, engine.tokenizer, ids, 24, stop_at_eos=False).tokens
