"""What a page of the book must be to read as a textbook, checked on its notebook: how much prose it
has, whether its visible code runs as shown, and whether its outputs read (no stderr, no long logs).

tests/test_book.py runs these checks on every page; run this file on one notebook while writing it:

    .venv/bin/python tests/book_pages.py book/intro/roofline.ipynb [its executed copy]

(the executed copy, e.g. from `jupyter nbconvert --to notebook --execute`, adds the output checks; the
book's build leaves one per page in _build/jupyter_execute/).
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import sys
from pathlib import Path

MAX_PROSE_WORDS = 4_000      # a chapter page; more is two pages, or lab notes
MAX_OUTPUT_LINES = 25        # a text output longer than this is a log, unless its cell is a deliberate listing
LISTING = "listing"          # the cell tag that marks a long text output as deliberate
HIDDEN = ("remove-cell", "remove-input")   # tags whose cell's source the reader does not see


def cells(path: Path) -> list[dict]:
    return json.loads(Path(path).read_text())["cells"]


def tags(cell: dict) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def prose(markdown: str) -> str:
    """The words a reader reads in a markdown cell: without code blocks, display math, HTML tags, MyST
    targets and directive options."""
    text = re.sub(r"```.*?```|~~~.*?~~~", " ", markdown, flags=re.S)
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)
    text = re.sub(r"<[^>]+>", " ", text)
    return re.sub(r"^\([\w-]+\)=\s*$|^:\w+:.*$", " ", text, flags=re.M)


def prose_words(nb_cells: list[dict]) -> int:
    """Words of prose on the page: markdown cells only, counted as a reader would (a number is a word)."""
    return sum(len(re.findall(r"[A-Za-z0-9][\w'’.,%/-]*", prose("".join(c["source"]))))
               for c in nb_cells if c["cell_type"] == "markdown")


def _code(cell: dict) -> ast.Module | None:
    source = "\n".join(line for line in "".join(cell["source"]).splitlines() if not line.lstrip().startswith(("%", "!")))
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def defined(tree: ast.AST) -> set[str]:
    """Every name a cell binds: assignments and loop targets, functions, classes, their arguments, imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def used(tree: ast.AST) -> set[str]:
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def hidden_names_used(nb_cells: list[dict]) -> list[tuple[int, str]]:
    """(cell index, name) for each name a visible code cell uses that only a hidden cell defines: copied from
    the page and run, that cell raises NameError."""
    visible, hidden, trees = set(), set(), {}
    for i, c in enumerate(nb_cells):
        if c["cell_type"] != "code" or (tree := _code(c)) is None:
            continue
        trees[i] = tree
        (hidden if set(tags(c)) & set(HIDDEN) else visible).update(defined(tree))
    only_hidden = hidden - visible - set(dir(builtins))
    return [(i, name) for i, tree in trees.items() if not set(tags(nb_cells[i])) & set(HIDDEN)
            for name in sorted(used(tree) & only_hidden)]


def _text(output: dict) -> str:
    if output["output_type"] == "stream":
        return "".join(output["text"])
    data = output.get("data", {})
    if set(data) == {"text/plain"}:   # a value with no richer view: the page shows its repr as text
        return "".join(data["text/plain"])
    return ""


def output_problems(executed_cells: list[dict]) -> list[str]:
    """What an executed page shows that a textbook should not: stderr (warnings, a library's log), a text
    output longer than MAX_OUTPUT_LINES lines unless its cell is tagged LISTING."""
    problems = []
    for i, c in enumerate(executed_cells):
        if c["cell_type"] != "code" or "remove-output" in tags(c) or "remove-cell" in tags(c):
            continue
        outputs = c.get("outputs", [])
        stderr = "".join(_text(o) for o in outputs if o.get("name") == "stderr").strip()
        if stderr:
            problems.append(f"cell {i} writes to stderr: {stderr.splitlines()[0][:80]!r}")
        lines = "".join(_text(o) for o in outputs if o.get("name") != "stderr").rstrip("\n").splitlines()
        if len(lines) > MAX_OUTPUT_LINES and LISTING not in tags(c):
            problems.append(f"cell {i} prints {len(lines)} lines (more than {MAX_OUTPUT_LINES}: summarise it, "
                            f"or tag the cell {LISTING!r} if it is a deliberate listing)")
    return problems


if __name__ == "__main__":
    source = Path(sys.argv[1])
    print(f"{source}: {prose_words(cells(source)):,} words of prose (at most {MAX_PROSE_WORDS:,} on a chapter page)")
    for i, name in hidden_names_used(cells(source)):
        print(f"  cell {i} uses {name!r}, which only a hidden cell defines")
    if len(sys.argv) > 2:
        for problem in output_problems(cells(Path(sys.argv[2]))):
            print(f"  {problem}")
