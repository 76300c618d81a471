"""The floor plan, read from the source: no module over 500 lines (split it by concern), no
function outside the click layer takes more than 8 parameters (group them into a frozen options
object), and the views' signatures say what they print (no Any)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "neffbuild"
MOST_PARAMETERS = 8
MOST_LINES = 500


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional, keyword-only, *args and **kwargs: everything a caller may pass, less self/cls."""
    a = function.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_module_is_over_500_lines() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50  # the package, not an empty glob
    lengths = {path: len(path.read_text().splitlines()) for path in modules}
    over = [f"{path.relative_to(ROOT)} ({n})" for path, n in lengths.items() if n > MOST_LINES]
    assert over == [], "split these modules by concern: " + ", ".join(over)


def test_every_fmt_skip_in_the_package_says_why() -> None:
    """`# fmt: skip` keeps a hand-packed statement from the formatter; a second comment says why."""
    bare = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"# fmt: skip\s*$", line)
    ]
    assert bare == [], "say why after it (`# fmt: skip  # a table: ...`), or let ruff format it: " + ", ".join(bare)


def test_no_function_outside_the_click_layer_takes_more_than_8_parameters() -> None:
    modules = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "cli"]
    assert len(modules) > 50  # the package, not an empty glob
    over = [
        f"{path.relative_to(ROOT)}:{f.lineno} {f.name} ({parameters(f)})"
        for path in sorted(modules)
        for f in functions(path)
        if parameters(f) > MOST_PARAMETERS
    ]
    assert over == [], "group these parameters into a frozen options object: " + ", ".join(over)


def test_the_parameter_count_counts_every_kind_of_parameter() -> None:
    source = "def f(self, a, /, b, *args, c, **kwargs): pass\ndef g(a, b, c, d, e, f, g, h, i): pass"
    f, g = (n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
    assert parameters(f) == 5 and parameters(g) == 9


def test_no_view_signature_says_any() -> None:
    views = sorted((PACKAGE / "cli" / "views").glob("*.py"))
    assert {p.name for p in views} >= {"__init__.py", "console.py", "progress.py", "ci.py", "host.py", "store.py"}
    found = []
    for path in views:
        tree = ast.parse(path.read_text())
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        defs += [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body if isinstance(m, ast.FunctionDef)]
        for f in defs:
            a = f.args
            annotations = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x]
            if any("Any" in ast.unparse(t) for t in [*annotations, f.returns] if t is not None):
                found.append(f"{path.name}:{f.lineno} {f.name}")
    assert found == []
