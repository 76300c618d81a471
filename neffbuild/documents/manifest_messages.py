"""How a manifest's problems read: pydantic's errors turned into one line per problem that names
the file, the entry and the key as TOML writes them, with a hint."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _clean_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """Drop pydantic's union branch tags (`str`, `list[int]`, `ShapeSet`): not TOML keys."""
    tags = ("str", "int", "float", "bool", "ShapeSet")
    return tuple(
        p
        for p in loc
        if not (isinstance(p, str) and (p in tags or p.startswith(("list[", "constrained-", "function-"))))
    )


def describe_validation(
    path: Path, data: dict[str, Any], exc: ValidationError, root: type[BaseModel]
) -> tuple[str, tuple[str, ...]]:
    """The message and detail lines for exc, raised validating data (read from path) as root."""
    # A default computed from another field (device from backend) says nothing of its own.
    errors: list[dict[str, Any]] = [
        {**e, "loc": _clean_loc(e["loc"])} for e in exc.errors() if e["type"] != "default_factory_not_called"
    ]
    # A union reports every branch; where one branch got further, the others are noise.
    errors = [
        e
        for e in errors
        if not any(
            o is not e and len(o["loc"]) > len(e["loc"]) and o["loc"][: len(e["loc"])] == e["loc"] for o in errors
        )
    ]
    problems = []
    for err in _merge_union_branches(errors):
        where = location(data, err["loc"])
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key" + _did_you_mean(root, err["loc"])
        elif err["type"] == "missing":
            message = "required key is missing"
        elif message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")
        if err["type"] not in ("missing", "extra_forbidden") and "input" in err and _is_scalar(err["input"]):
            message += f" (got {short(err['input'])})"
        problems.append(f"{where}: {message}")
    return join_problems(path, problems)


def _merge_union_branches(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`height = 0` fails both branches of "a number or a list": report the bound, not "not a
    list"; `height = "128"` fails both on type: one message naming both accepted types."""
    by_loc: dict[tuple[int | str, ...], list[dict[str, Any]]] = {}
    for err in errors:
        by_loc.setdefault(err["loc"], []).append(err)
    merged = []
    for group in by_loc.values():
        kept = [e for e in group if not e["type"].endswith("_type")] or group
        if len(kept) > 1 and all(e["type"].endswith("_type") for e in kept):
            rest = [e["msg"].removeprefix("Input should be ") for e in kept[1:]]
            kept = [{**kept[0], "msg": ", or ".join([kept[0]["msg"], *rest])}]
        merged.extend(kept)
    return merged


def as_key(name: str) -> str:
    """A key as written where it is a plain name, quoted and cut short otherwise."""
    return name if IDENTIFIER.match(name) and len(name) <= 60 else short(name)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool))


def short(value: Any, limit: int = 60) -> str:
    """A value as a user typed it, cut short: never a whole entry dumped as a Python dict."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return f"an array of {len(value)}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "…" + text[-3:]


def join_problems(path: Path, problems: list[str]) -> tuple[str, tuple[str, ...]]:
    """A file's problems as a message and the lines under it: the one problem on the message's
    line, or a count there and each problem (once) on a line of its own. The message stays one
    line: the terminal sanitiser would show a newline inside it as an escape."""
    unique = list(dict.fromkeys(problems))
    if len(unique) == 1:
        return f"{path}: {unique[0]}", ()
    return f"{path}: {len(unique)} problems", tuple(f"  {p}" for p in unique)


def location(data: dict[str, Any], loc: tuple[int | str, ...]) -> str:
    """Render a pydantic location as TOML a user recognises: model[<id>].shapes.height."""
    parts: list[str] = []
    node: Any = data
    for part in loc:
        if isinstance(part, int):
            label = str(part)
            if isinstance(node, list) and part < len(node) and isinstance(node[part], dict):
                entry_id = node[part].get("id", part)
                label = entry_id if isinstance(entry_id, str) and _ENTRY_ID.match(entry_id) else str(part)
            parts[-1] = f"{parts[-1]}[{label}]" if parts else f"[{label}]"
        else:
            parts.append(str(part) if _ENTRY_KEY.match(str(part)) else short(str(part), 40))
        node = node[part] if isinstance(node, (dict, list)) and _has(node, part) else None  # type: ignore[index]  # _has: an int for a list
    return ".".join(parts) if parts else "(top level)"


_ENTRY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_ENTRY_KEY = re.compile(r"^[A-Za-z0-9_-]{1,60}$")


def _has(node: dict[str, Any] | list[Any], part: int | str) -> bool:
    if isinstance(node, list):
        return isinstance(part, int) and part < len(node)
    return part in node


def _did_you_mean(root: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    owner = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = owner.model_fields.get(part) or next((f for f in owner.model_fields.values() if f.alias == part), None)
        inner = _model_in(field.annotation) if field else None
        if inner is None:
            return ""
        owner = inner
    names = [f.alias or n for n, f in owner.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; expected one of {', '.join(sorted(names))}"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or getattr(annotation, "__metadata__", ()):
        found = _model_in(arg)
        if found:
            return found
    origin = getattr(annotation, "__origin__", None)
    return _model_in(origin) if origin not in (None, list, dict, tuple) else None


def validation_hint(exc: ValidationError) -> str:
    if any(e["type"] == "extra_forbidden" for e in exc.errors()):
        return "unknown keys are rejected so a typo cannot silently change a build; `neffbuild schema` prints every key"
    if any(e["type"].endswith("_type") and isinstance(e.get("input"), (str, float, bool)) for e in exc.errors()):
        return 'types are exact: write 128, not "128" or 128.0, and true/false only where a switch is expected'
    return "`neffbuild schema` prints every key with its type and limits"
