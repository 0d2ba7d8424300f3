"""The engine's architecture, checked from its source: layers, imports one way, public names only, sizes.

The layers (README.md, "Layout"): platform -> formats -> engine -> kernels -> training, measure -> ledger; theory (numpy
only) and viz (nothing from ref_impl) may be imported by anyone; exercises use theory, formats and engine. Each
module is parsed, never imported, so a violation is reported with its file and line.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ref_impl"

# rank: a module may import its own layer and any layer of lower rank
RANK = {"platform": 0, "formats": 1, "engine": 2, "kernels": 3, "training": 4, "measure": 5, "ledger": 6}
FREE = {"theory", "viz"}                                  # importable by every layer
MAY_IMPORT = {
    "theory": {"theory", "viz"},                          # first principles: numpy, the standard library
    "viz": {"viz"},
    # the exercises check a learner's code against the engine; kernels for the launch-rule exercises
    "exercises": {"theory", "formats", "engine", "kernels", "viz", "exercises"},
}
ROOT_NAMES = {"ROOT", "MODELS_DIR", "RESULTS_DIR"}        # `from ref_impl import ...`: paths of the repository
OPTIONAL = {"mlx_lm", "llama_cpp", "torch", "transformers"}   # peers imported only where they are used
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS: dict[str, str] = {}                       # "module:function" -> why it stays long
# the CLI imports a command's modules when the command runs, so `inspect`, `quantize` and `--help` never load MLX
LAZY_IMPORTS = {"__main__.py"}

MODULES = sorted(PACKAGE.rglob("*.py"))


def layer_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else "top"          # __init__.py / __main__.py of the package itself


def imported_ref_impl(node: ast.AST) -> list[tuple[str, list[str]]]:
    """(dotted module, names) of each ref_impl import in an import statement; names empty for `import x`."""
    if isinstance(node, ast.ImportFrom):
        if node.level:
            return [("." * node.level + (node.module or ""), [a.name for a in node.names])]
        if node.module and node.module.split(".")[0] == "ref_impl":
            return [(node.module, [a.name for a in node.names])]
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names if a.name.split(".")[0] == "ref_impl"]
    return []


def target_layers(module: str, names: list[str]) -> set[str]:
    """The layers an import reaches: `from ref_impl import engine` reaches engine, `from ref_impl.engine.model
    import X` too; `from ref_impl import MODELS_DIR` reaches only the package root."""
    parts = module.split(".")
    if len(parts) > 1:
        return {parts[1]}
    return {n for n in names if n not in ROOT_NAMES} or {"top"}


def allowed(src: str, dst: str) -> bool:
    if src == "top" or dst == src:
        return True
    if dst == "top":
        return src not in FREE
    if src in MAY_IMPORT:
        return dst in MAY_IMPORT[src]
    if dst in FREE:
        return True
    return dst in RANK and src in RANK and RANK[dst] <= RANK[src]


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


@pytest.mark.parametrize("path", MODULES, ids=ids(MODULES))
def test_imports_run_one_way(path):
    src, bad = layer_of(path), []
    for node in ast.walk(parse(path)):
        for module, names in imported_ref_impl(node):
            if module.startswith("."):
                bad.append(f"line {node.lineno}: relative import {module!r}: write ref_impl.<layer>.<module>")
                continue
            for dst in target_layers(module, names):
                if not allowed(src, dst):
                    bad.append(f"line {node.lineno}: {src} imports {dst} ({module})")
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def private_uses(tree: ast.Module) -> list[str]:
    """Private names taken from another ref_impl module: imported by name, or read off an imported module."""
    bad, modules = [], set()
    for node in ast.walk(tree):
        for module, names in imported_ref_impl(node):
            bad += [f"line {node.lineno}: imports {n} from {module}" for n in names if n.startswith("_")]
            if isinstance(node, ast.ImportFrom):
                modules |= {a.asname or a.name for a in node.names}
            else:
                modules |= {a.asname or a.name.split(".")[0] for a in node.names}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            bad.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return bad


@pytest.mark.parametrize("path", MODULES, ids=ids(MODULES))
def test_no_private_name_crosses_a_module(path):
    bad = private_uses(parse(path))
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def nested_imports(tree: ast.Module) -> list[str]:
    """Imports inside functions of anything but an optional peer (TYPE_CHECKING blocks are module level)."""
    bad = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]} if not node.level else {"."}
            else:
                continue
            if not roots <= OPTIONAL:
                bad.append(f"line {node.lineno} in {fn.name}: {', '.join(sorted(roots))}")
    return bad


@pytest.mark.parametrize("path", MODULES, ids=ids(MODULES))
def test_imports_sit_at_the_top_of_the_module(path):
    bad = [] if path.name in LAZY_IMPORTS and path.parent == PACKAGE else nested_imports(parse(path))
    assert not bad, f"{path.relative_to(ROOT)}: in-function imports of required packages: " + "; ".join(bad)


@pytest.mark.parametrize("path", MODULES, ids=ids(MODULES))
def test_modules_and_functions_are_short(path):
    lines = path.read_text().count("\n")
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by concept"
    key = str(path.relative_to(PACKAGE).with_suffix("")).replace("/", ".")
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(parse(path))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES and f"{key}:{n.name}" not in LONG_FUNCTIONS]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


def test_the_tree_has_the_layers_of_the_design():
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert layers == set(RANK) | FREE | {"exercises"}
    loose = {p.name for p in PACKAGE.glob("*.py")} - {"__init__.py", "__main__.py"}
    assert not loose, f"modules outside every layer: {sorted(loose)}"


NOTEBOOKS = sorted((ROOT / "book").rglob("*.ipynb"))


def notebook_tree(path: Path) -> ast.Module:
    """Every code cell of a notebook as one module; IPython's magics and shell lines left out."""
    cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    code = "\n".join(line for cell in cells for line in cell.splitlines() if not line.lstrip().startswith(("%", "!")))
    return ast.parse(code, filename=str(path))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_notebooks_use_public_names_only(path):
    bad = private_uses(notebook_tree(path))
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_checks_catch_what_they_forbid():
    """Each rule fires on a module that breaks it (a checker that passes everything proves nothing)."""
    tree = ast.parse("from ref_impl.measure.bench import _summarize\nfrom ref_impl import kernels\n"
                     "kernels._kernel()\n\ndef f():\n    import numpy\n    import llama_cpp\n")
    assert private_uses(tree) == ["line 1: imports _summarize from ref_impl.measure.bench", "line 3: kernels._kernel"]
    assert nested_imports(tree) == ["line 6 in f: numpy"]
    assert not allowed("engine", "measure") and not allowed("formats", "engine") and not allowed("theory", "engine")
    assert allowed("theory", "viz") and not allowed("viz", "theory") and not allowed("exercises", "measure") and not allowed("training", "measure")
    assert allowed("measure", "training") and allowed("ledger", "measure") and allowed("engine", "theory")
    assert target_layers("ref_impl", ["MODELS_DIR"]) == {"top"} and target_layers("ref_impl", ["viz"]) == {"viz"}
