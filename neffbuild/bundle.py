"""The documents neffbuild stores: bundle records, releases and tags.

Bundles and releases are immutable and named by content (unit key, release digest); only tags
move. Each document carries a format string so a newer reader can refuse what it cannot read.

They are plain frozen dataclasses, decoded strictly by `parse` (unknown keys, wrong types and
unsafe paths are refused): `neffbuild pull` reads them on every instance boot, and a validation
library's import and schema build would cost more than the whole parse.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any, TypeVar

from neffbuild.errors import IntegrityError
from neffbuild.hashing import canonical_json, hash_bytes, is_digest

BUNDLE_FORMAT = "neffbuild.bundle/1"
RELEASE_FORMAT = "neffbuild.release/1"
TAG_FORMAT = "neffbuild.tag/1"


def _safe_path(path: str) -> str | None:
    # A bundle is input from the network: it must not write outside the cache dir.
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or "\x00" in path or any(p in ("", ".", "..") for p in parts):
        return f"unsafe path {path!r}: must be relative, normalised, inside the cache dir"
    return None


def _digest(value: str) -> str | None:
    return None if is_digest(value) else f"{value!r} is not a 32-digit lowercase hex digest"


def _not_negative(value: int) -> str | None:
    return None if value >= 0 else f"{value} is negative"


def _checked(check: typing.Callable[[Any], str | None]) -> Any:
    """A field whose value must also pass check (which returns a problem or None)."""
    return field(metadata={"check": check})


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One cache file: where it goes under the cache dir and what its bytes are."""

    path: str = _checked(_safe_path)
    size: int = _checked(_not_negative)
    digest: str = _checked(_digest)


@dataclass(frozen=True, slots=True)
class Timings:
    load_s: float = 0.0
    first_call_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class BundleRecord:
    """The cache files one build unit produced, and everything that keyed them."""

    key: str = _checked(_digest)
    unit_id: str
    unit: dict[str, Any]
    backend: str
    fingerprint: dict[str, str]
    files: tuple[FileEntry, ...]
    counters: dict[str, int]
    timings: Timings
    created_at: str
    neffbuild_version: str
    format: str = BUNDLE_FORMAT


@dataclass(frozen=True, slots=True)
class SharedPath:
    """A path two units both produced with different bytes; the backend said either serves."""

    path: str
    kept: str = _checked(_digest)
    dropped: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReleaseUnit:
    unit_id: str
    key: str = _checked(_digest)


@dataclass(frozen=True, slots=True)
class Release:
    """Everything a host needs to materialise one manifest's cache: the merged file list."""

    name: str
    manifest_digest: str
    backend: str
    cache_env: str
    env: dict[str, str]
    fingerprint: dict[str, str]
    units: tuple[ReleaseUnit, ...]
    files: tuple[FileEntry, ...]
    shared: tuple[SharedPath, ...] = ()
    format: str = RELEASE_FORMAT

    @property
    def release_id(self) -> str:
        """Content address: an unchanged build yields the same id, so re-publishing is a no-op."""
        return hash_bytes(dump(self))

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True, slots=True)
class TagEvent:
    release: str = _checked(_digest)
    at: str
    by: str


@dataclass(frozen=True, slots=True)
class TagRecord:
    """A movable name for a release, with its history (newest last) for audit and rollback."""

    name: str
    release: str = _checked(_digest)
    history: tuple[TagEvent, ...]
    format: str = TAG_FORMAT


Doc = TypeVar("Doc")


def to_json(doc: Any) -> dict[str, Any]:
    """A document as JSON-ready data (tuples become lists when serialised)."""
    return dataclasses.asdict(doc)


def dump(doc: Any) -> bytes:
    return canonical_json(to_json(doc))


def parse(kind: type[Doc], data: bytes, where: str) -> Doc:
    """Parse a stored document; anything malformed is an IntegrityError naming the object."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{where}: not valid JSON ({exc})", hint="the object is corrupt; rebuild or re-push it") from None
    expected = _fields(kind)["format"].default
    if isinstance(raw, dict) and raw.get("format") != expected:
        raise IntegrityError(
            f"{where}: format {raw.get('format')!r}, expected {expected!r}",
            hint="written by another neffbuild version; upgrade neffbuild or rebuild",
        )
    try:
        return _decode(kind, raw, "")
    except _Invalid as exc:
        raise IntegrityError(
            f"{where}: invalid {kind.__name__} at {exc.loc or '(top)'}: {exc.msg}",
            hint="the object is corrupt or hand-edited; rebuild or re-push it",
        ) from None


class _Invalid(Exception):
    def __init__(self, loc: str, msg: str) -> None:
        self.loc, self.msg = loc, msg


@cache
def _fields(kind: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(kind)}


@cache
def _hints(kind: type) -> dict[str, Any]:
    return typing.get_type_hints(kind)


def _decode(tp: Any, value: Any, loc: str) -> Any:
    """value (from JSON) as type tp, strictly: no coercion beyond int -> float."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _decode_doc(tp, value, loc)
    if origin is tuple:
        if not isinstance(value, list):
            raise _Invalid(loc, f"expected a list, got {type(value).__name__}")
        item = typing.get_args(tp)[0]
        return tuple(_decode(item, v, f"{loc}.{i}".lstrip(".")) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise _Invalid(loc, f"expected an object, got {type(value).__name__}")
        item = typing.get_args(tp)[1]
        return {k: _decode(item, v, f"{loc}.{k}".lstrip(".")) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise _Invalid(loc, f"expected {tp.__name__}, got {type(value).__name__}")
    return value


def _decode_doc(kind: type, value: Any, loc: str) -> Any:
    if not isinstance(value, dict):
        raise _Invalid(loc, f"expected an object, got {type(value).__name__}")
    fields, hints = _fields(kind), _hints(kind)
    extra = sorted(value.keys() - fields.keys())
    if extra:
        raise _Invalid(f"{loc}.{extra[0]}".lstrip("."), "unknown field")
    args = {}
    for name, f in fields.items():
        at = f"{loc}.{name}".lstrip(".")
        if name not in value:
            if f.default is dataclasses.MISSING:
                raise _Invalid(at, "field required")
            continue
        args[name] = _decode(hints[name], value[name], at)
        check = f.metadata.get("check")
        if check is not None and (problem := check(args[name])) is not None:
            raise _Invalid(at, problem)
    return kind(**args)
