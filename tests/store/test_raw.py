"""The raw part of a store knows nothing of the layout: each class implementing RawStore (found in
the source, so a new store is checked too) names no layout helper or constant and spells no layout
folder; store/layout.py does all of that for every store."""

from __future__ import annotations

import ast
from pathlib import Path

from neffbuild.store.base import DELETABLE, MARKER
from neffbuild.store.raw import RawStore

ROOT = Path(__file__).resolve().parents[2]
LAYOUT_MODULES = ("base.py", "packs.py", "lease.py", "layout.py", "loose.py")  # under neffbuild/store/
RAW_METHODS = {"get", "get_versioned", "put_new", "swap", "names", "objects", "delete"}


def defined(tree: ast.Module) -> set[str]:
    """What a module defines at its top level (not what it imports)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def layout_names(store: Path) -> set[str]:
    return set().union(*(defined(ast.parse((store / m).read_text())) for m in LAYOUT_MODULES))


def raw_classes(package: Path) -> dict[str, tuple[ast.ClassDef, set[str]]]:
    """Every class under package defining the raw methods (the protocol aside), by module path and
    name, with the names its module defines itself (an S3 limit of its own is not the layout's)."""
    found = {}
    for path in sorted(p for p in package.rglob("*.py") if p.relative_to(package).as_posix() != "store/raw.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                if methods >= RAW_METHODS:
                    found[f"{path.relative_to(package.parent).as_posix()}:{node.name}"] = (node, defined(tree))
    return found


def layout_in(cls: ast.ClassDef, names: set[str]) -> list[str]:
    """The layout names and folders a raw class uses."""
    used = []
    for node in ast.walk(cls):
        if isinstance(node, ast.Name) and node.id in names:
            used.append(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in names:
            used.append(node.attr)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and (node.value == MARKER or node.value.startswith(DELETABLE))
        ):
            used.append(repr(node.value))
    return sorted(set(used))


def test_the_raw_protocol_is_the_methods_looked_for() -> None:
    declared = {n for n in vars(RawStore) if not n.startswith("_")}
    assert declared >= RAW_METHODS


def test_no_raw_store_uses_the_layout() -> None:
    classes = raw_classes(ROOT / "neffbuild")
    assert set(classes) == {"neffbuild/store/local.py:LocalDisk", "neffbuild/store/s3/store.py:S3Medium"}
    names = layout_names(ROOT / "neffbuild" / "store")
    assert {k: layout_in(c, names - own) for k, (c, own) in classes.items()} == {k: [] for k in classes}


def test_the_check_finds_layout_planted_in_a_raw_store(tmp_path: Path) -> None:
    store = ROOT / "neffbuild" / "store"
    planted = tmp_path / "neffbuild" / "store" / "gcs.py"
    planted.parent.mkdir(parents=True)
    methods = "".join(f"    def {m}(self):\n        pass\n" for m in sorted(RAW_METHODS))
    planted.write_text(
        "class GcsRaw:\n" + methods + "    def list_docs(self, kind):\n        return self.names(doc_key(kind, 'x'))\n"
        "    def blobs(self):\n        return self.objects('blobs/')\n"
    )
    [(where, (cls, _))] = raw_classes(tmp_path / "neffbuild").items()
    assert where == "neffbuild/store/gcs.py:GcsRaw"
    assert layout_in(cls, layout_names(store)) == ["'blobs/'", "doc_key"]
