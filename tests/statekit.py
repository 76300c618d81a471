"""A cache dir's state document read or rewritten in the tests' terms, whatever its format."""

from __future__ import annotations

import copy
from typing import Any


def recorded_files(doc: dict[str, Any]) -> dict[str, list[Any]]:
    """path -> [size, mtime_ns, digest] as the state records them (formats /2 to /4)."""
    if "files" in doc:
        return dict(doc["files"])
    entries = doc["installed"]["release"]["files"]
    return {
        e["path"]: [e["size"], m, e["digest"]] for e, m in zip(entries, doc["mtimes"], strict=True) if m is not None
    }


def unit_paths(doc: dict[str, Any], unit: dict[str, Any]) -> list[str]:
    """A unit's paths as names (format /4 gives the release's files by index)."""
    entries = doc["installed"]["release"]["files"]
    return [entries[p]["path"] if type(p) is int else p for p in unit["paths"]]


def as_v2(doc: dict[str, Any]) -> dict[str, Any]:
    """A /4 state document as format /2 (or /3, with expiries) wrote it: each path in the release,
    in each unit and in the file table. Earlier formats are still read: tests edit them too."""
    out = copy.deepcopy(doc)
    for unit in out["installed"]["units"]:
        unit["paths"] = unit_paths(out, unit)
    out["files"] = recorded_files(out)
    del out["mtimes"]
    out["format"] = "neffbuild.cache-state/3" if out.get("expires") else "neffbuild.cache-state/2"
    return out
