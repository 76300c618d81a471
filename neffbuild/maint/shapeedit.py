"""Add shapes to a manifest's entries in the manifest's own product syntax, keeping its text.

A set of shapes becomes products (`{ height = 192, width = [128, 256] }`) that cover exactly those
shapes, never one more: a product is folded into a set the entry already has only where both agree
on two of height, width and batch (then extending the third adds exactly the product); otherwise it
is added as a set of its own. The TOML is edited with tomlkit, so comments, order and layout of
everything else stay as they were.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import tomlkit
from tomlkit.items import AoT, Array, InlineTable, Item, Table

from neffbuild.documents.manifest import Shape
from neffbuild.errors import ManifestError

_FIELDS = ("height", "width", "batch")


@dataclass(frozen=True, order=True)
class Product:
    """heights x widths x batches, each sorted and without duplicates."""

    height: tuple[int, ...]
    width: tuple[int, ...]
    batch: tuple[int, ...]

    def shapes(self) -> list[Shape]:
        return [Shape(height=h, width=w, batch=b) for h in self.height for w in self.width for b in self.batch]

    def toml(self, with_batch: bool) -> str:
        parts = [f"{name} = {_value(getattr(self, name))}" for name in _FIELDS if name != "batch" or with_batch]
        return "{ " + ", ".join(parts) + " }"


@dataclass(frozen=True)
class Change:
    """What was written for one entry: `width += [384]` in its set n, or a new set."""

    entry: str
    text: str


def cover(shapes: Iterable[Shape]) -> list[Product]:
    """Products that together hold exactly these shapes: widths grouped by (height, batch), then
    heights that share a width list, then batches that share both."""
    widths: dict[tuple[int, int], set[int]] = {}
    for s in shapes:
        widths.setdefault((s.height, s.batch), set()).add(s.width)
    heights: dict[tuple[int, tuple[int, ...]], set[int]] = {}
    for (h, b), width_set in widths.items():
        heights.setdefault((b, tuple(sorted(width_set))), set()).add(h)
    batches: dict[tuple[tuple[int, ...], tuple[int, ...]], set[int]] = {}
    for (b, width_list), height_set in heights.items():
        batches.setdefault((tuple(sorted(height_set)), width_list), set()).add(b)
    return sorted(Product(hs, ws, tuple(sorted(bs))) for (hs, ws), bs in batches.items())


def add_shapes(text: str, added: Mapping[str, list[Product]]) -> tuple[str, list[Change]]:
    """The manifest text with each entry's products added (entry id -> products), and what was
    written per entry. The text must be a manifest load_manifest accepted."""
    doc = tomlkit.parse(text)
    changes: list[Change] = []
    for entry_id, products in added.items():
        table = _entry(doc, entry_id)
        for product in products:
            changes.append(Change(entry_id, _add(table, product)))
    return tomlkit.dumps(doc), changes


def _entry(doc: Any, entry_id: str) -> Any:
    for table in doc.get("model", []):
        if table.get("id") == entry_id:
            return table
    raise ManifestError(f"model[{entry_id}]: not found while editing", hint="the manifest changed while it was read")


def _add(entry: Any, product: Product) -> str:
    shapes = entry["shapes"]
    sets: list[Any] = list(shapes) if isinstance(shapes, (Array, AoT, list)) else [shapes]
    for number, shape_set in enumerate(sets):
        name = _foldable(shape_set, product)
        if name is not None:
            rebuilt = _extend(shape_set, name, getattr(product, name))
            if rebuilt is not None and isinstance(shapes, Array):
                shapes[number] = rebuilt
            elif rebuilt is not None:
                if shapes.trivia.comment:
                    rebuilt.comment(shapes.trivia.comment.lstrip("# "))
                entry["shapes"] = rebuilt
            where = f" (set {number + 1})" if len(sets) > 1 else ""
            return f"shapes{where}: {name} += {_value(getattr(product, name))}"
    with_batch = product.batch != (1,) or all("batch" in s for s in sets)
    new = product.toml(with_batch)
    if isinstance(shapes, AoT):
        table = tomlkit.table()
        for name in _FIELDS:
            if name != "batch" or with_batch:
                table[name] = _item(_value(getattr(product, name)))
        table.add(tomlkit.nl())  # the blank line before the next table, as a user writes it
        shapes.append(table)
    elif isinstance(shapes, Array):
        shapes.append(_item(new))
    elif isinstance(shapes, InlineTable):
        both = _item(f"[\n    {shapes.as_string().strip()},\n    {new},\n]")
        if shapes.trivia.comment:  # a comment after the one set stays after the list
            both.comment(shapes.trivia.comment.lstrip("# "))
        entry["shapes"] = both
    elif isinstance(shapes, Table):
        raise ManifestError(
            f"model[{entry['id']}].shapes: a [model.shapes] table holds one set; {new} needs a second",
            hint="write shapes as [[model.shapes]] tables or as a list (shapes = [{ ... }]), then run suggest again",
        )
    return f"shapes: add {new}"


def _foldable(shape_set: Any, product: Product) -> str | None:
    """The one field whose extension by the product's values adds exactly the product, if any."""
    have = {name: _values(shape_set.get(name, 1)) for name in _FIELDS}
    want = {name: set(getattr(product, name)) for name in _FIELDS}
    differ = [name for name in _FIELDS if have[name] != want[name]]
    if len(differ) == 1 and not have[differ[0]] & want[differ[0]]:
        return differ[0]
    return None


def _extend(shape_set: Any, name: str, values: tuple[int, ...]) -> Any | None:
    """Extend one field of a set in place; a set to put in its place where its text must change."""
    current = shape_set.get(name)
    if isinstance(current, Array) and "\n" in current.as_string():  # its layout is the user's: append
        current.extend(values)
        return None
    old = [int(v) for v in current] if isinstance(current, Array) else [1 if current is None else int(current)]
    merged = sorted({*old, *values}) if old == sorted(old) else [*old, *values]
    item = _item(_value(tuple(merged)))
    if isinstance(current, Item) and current.trivia.comment:
        item.comment(current.trivia.comment.lstrip("# "))
    shape_set[name] = item
    if current is None and isinstance(shape_set, InlineTable):  # a key added: written as the others are
        fields = ", ".join(f"{k.key} = {v.as_string().strip()}" for k, v in shape_set.value.body if k is not None)
        return _item("{ " + fields + " }")
    return None


def _values(value: Any) -> set[int]:
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def _value(values: tuple[int, ...]) -> str:
    return str(values[0]) if len(values) == 1 else "[" + ", ".join(map(str, values)) + "]"


def _item(text: str) -> Any:
    """A TOML value with the layout written here (tomlkit's own puts no spaces inside braces)."""
    return tomlkit.parse(f"v = {text}\n")["v"]
