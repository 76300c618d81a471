"""The documents neffbuild stores: bundle records, releases and tags.

Bundles and releases are immutable and named by content (unit key, release digest); only tags
move. Each document carries a format string so a newer reader can refuse what it cannot read.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from neffbuild.errors import IntegrityError
from neffbuild.hashing import canonical_json, hash_bytes

BUNDLE_FORMAT = "neffbuild.bundle/1"
RELEASE_FORMAT = "neffbuild.release/1"
TAG_FORMAT = "neffbuild.tag/1"
_HEX32 = r"^[0-9a-f]{32}$"


class _Doc(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FileEntry(_Doc):
    """One cache file: where it goes under the cache dir and what its bytes are."""

    path: str
    size: int = Field(ge=0)
    digest: str = Field(pattern=_HEX32)

    @field_validator("path")
    @classmethod
    def _inside_cache_dir(cls, path: str) -> str:
        # A bundle is input from the network: it must not write outside the cache dir.
        parts = path.split("/")
        if not path or path.startswith("/") or "\\" in path or "\x00" in path or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"unsafe path {path!r}: must be relative, normalised, inside the cache dir")
        return path


class Timings(_Doc):
    load_s: float = 0.0
    first_call_s: float = 0.0
    total_s: float = 0.0


class BundleRecord(_Doc):
    """The cache files one build unit produced, and everything that keyed them."""

    format: str = BUNDLE_FORMAT
    key: str = Field(pattern=_HEX32)
    unit_id: str
    unit: dict[str, Any]
    backend: str
    fingerprint: dict[str, str]
    files: tuple[FileEntry, ...]
    counters: dict[str, int]
    timings: Timings
    created_at: str
    neffbuild_version: str


class SharedPath(_Doc):
    """A path two units both produced with different bytes; the backend said either serves."""

    path: str
    kept: str = Field(pattern=_HEX32)
    dropped: tuple[str, ...]


class ReleaseUnit(_Doc):
    unit_id: str
    key: str = Field(pattern=_HEX32)


class Release(_Doc):
    """Everything a host needs to materialise one manifest's cache: the merged file list."""

    format: str = RELEASE_FORMAT
    name: str
    manifest_digest: str
    backend: str
    cache_env: str
    env: dict[str, str]
    fingerprint: dict[str, str]
    units: tuple[ReleaseUnit, ...]
    files: tuple[FileEntry, ...]
    shared: tuple[SharedPath, ...] = ()

    @property
    def release_id(self) -> str:
        """Content address: an unchanged build yields the same id, so re-publishing is a no-op."""
        return hash_bytes(canonical_json(self.model_dump(mode="json")))

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)


class TagEvent(_Doc):
    release: str = Field(pattern=_HEX32)
    at: str
    by: str


class TagRecord(_Doc):
    """A movable name for a release, with its history (newest last) for audit and rollback."""

    format: str = TAG_FORMAT
    name: str
    release: str = Field(pattern=_HEX32)
    history: tuple[TagEvent, ...]


Doc = TypeVar("Doc", bound=_Doc)


def dump(doc: _Doc) -> bytes:
    return canonical_json(doc.model_dump(mode="json"))


def parse(kind: type[Doc], data: bytes, where: str) -> Doc:
    """Parse a stored document; anything malformed is an IntegrityError naming the object."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{where}: not valid JSON ({exc})", hint="the object is corrupt; rebuild or re-push it") from None
    expected = kind.model_fields["format"].default
    if isinstance(raw, dict) and raw.get("format") != expected:
        raise IntegrityError(
            f"{where}: format {raw.get('format')!r}, expected {expected!r}",
            hint="written by another neffbuild version; upgrade neffbuild or rebuild",
        )
    try:
        return kind.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise IntegrityError(
            f"{where}: invalid {kind.__name__} at {loc or '(top)'}: {first['msg']}",
            hint="the object is corrupt or hand-edited; rebuild or re-push it",
        ) from None
