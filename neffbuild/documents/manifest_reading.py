"""Reading the files a manifest check reads, bounded: the manifest's TOML (depth, NUL) and a local
model's JSON configs; every failure a ManifestError naming the file."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from neffbuild.documents.manifest_messages import location
from neffbuild.documents.manifest_types import MAX_DEPTH
from neffbuild.errors import ManifestError


def read_toml(path: Path, text: str | None = None) -> dict[str, Any]:
    try:
        raw_bytes = path.read_bytes() if text is None else text.encode("utf-8", "surrogatepass")
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest", hint="check the path, e.g. manifests/<name>.toml") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest ({exc.strerror or exc})") from None
    try:
        data = tomllib.loads(raw_bytes.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}", hint="see https://toml.io for the syntax") from None
    except RecursionError:
        data = None
    problem = _shape_problem(data)
    if problem:
        raise ManifestError(f"{path}: {problem}", hint=f"a manifest nests at most {MAX_DEPTH} levels and holds no NUL")
    assert data is not None
    return data


def _shape_problem(data: Any) -> str | None:
    """Depth and NUL check over the parsed document, without recursion (it may be hostile)."""
    if data is None:
        return f"nested deeper than {MAX_DEPTH} levels"
    stack: list[tuple[Any, tuple[int | str, ...]]] = [(data, ())]
    while stack:
        node, loc = stack.pop()
        if len(loc) > MAX_DEPTH:
            return f"{location(data, loc[:MAX_DEPTH])}: nested deeper than {MAX_DEPTH} levels"
        items: list[tuple[int | str, Any]] = []
        if isinstance(node, dict):
            items = list(node.items())
        elif isinstance(node, list):
            items = list(enumerate(node))
        for key, value in items:
            if (isinstance(key, str) and "\0" in key) or (isinstance(value, str) and "\0" in value):
                return f"{location(data, (*loc, key))}: contains a NUL character"
            if isinstance(value, (dict, list)):
                stack.append((value, (*loc, key)))
    return None


def source_digest(data: dict[str, Any]) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(json.dumps(data, sort_keys=True, default=str).encode())


def read_json_object(path: Path) -> dict[str, Any]:
    """A model's JSON config, which must be an object; ManifestError naming the file otherwise."""
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read ({exc.strerror or exc})", hint="check the model directory") from None
    except (ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0][:120] if not isinstance(exc, RecursionError) else "nested too deeply"
        raise ManifestError(
            f"{path}: not valid JSON ({reason})", hint="the model directory is damaged: save it again"
        ) from None
    if not isinstance(data, dict):
        raise ManifestError(
            f"{path}: not a JSON object (found {type(data).__name__})",
            hint="the model directory is damaged: save it again",
        )
    return data
