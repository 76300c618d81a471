"""The documents neffbuild stores: releases and tags (bundle records: documents/bundles.py).

Bundles and releases are immutable and named by content (unit key, release digest); only tags
move. Each document carries a format string so a newer reader can refuse what it cannot read.

They are plain frozen dataclasses, decoded strictly by `parse`: `neffbuild pull` reads them on
every instance boot, and a validation library's import and schema build would cost more than the
whole parse. A document comes from a store that may be corrupt or hostile, so besides unknown
keys and wrong types, `parse` refuses (IntegrityError naming the document and the field):
- paths that could leave the cache dir or never settle in it: absolute, `..`, empty or `.`
  parts, backslashes, control characters, names longer than the filesystem takes, pull's own
  state dir (`.neffbuild/`) and temp-file shapes;
- file lists where one path is listed twice (with one digest or two), where a file is also the
  directory of another (`a` and `a/b`), or where two paths differ only in case (or Unicode
  normalisation): a host may serve from a case-insensitive filesystem;
- lone surrogates (`\ud800`) in any string or key, and nesting deeper than MAX_DEPTH.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from operator import itemgetter
from typing import Any

from neffbuild.documents.fields import (
    HEX32,
    HEX64,
    NAME_MAX,
    PATH_MAX,
    Columns,
    Doc,
    blake3_problem,
    column,
    distinct_paths,
    env_name_problem,
    file_size,
    from_columns,
    optional_field,
    reads_problem,
    tag_name,
)
from neffbuild.documents.fields import checked as checked  # the checks, named here too for the documents' users
from neffbuild.documents.fields import digest_problem as digest_problem
from neffbuild.documents.fields import env_problem as env_problem
from neffbuild.documents.fields import path_problem as path_problem
from neffbuild.errors import IntegrityError
from neffbuild.formats import FORMATS, kind_writing, writes
from neffbuild.hashing import canonical_json, hash_bytes
from neffbuild.names import INCOMPLETE_SUFFIX, STATE_DIR

# Version 2 of bundles and releases: every file entry also carries its BLAKE3 (what a signature
# can vouch for). Version 1 documents stay readable (and keep their ids: an entry without a
# BLAKE3 encodes as before); only a release whose every file has one can be signed. (Before any
# release of neffbuild, version 2 carried SHA-256 instead: such entries are refused as unknown keys.)
# The strings are data (neffbuild/formats.py): never renamed, every one ever written still read.
BUNDLE_FORMAT = writes("bundle")  # documents/bundles.py's BundleRecord, checked here (_whole)
RELEASE_FORMAT, RELEASE_FORMAT_1 = FORMATS["release"].writes
TAG_FORMAT, TAG_FORMAT_SIGNED = FORMATS["tag"].writes  # /2: with a signed tag statement (documents/signing.py)
UNIT_FORMAT = writes("unit key")

MAX_DEPTH = 16  # our documents nest 4 deep; a unit's free-form parts a few more


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One cache file: where it goes under the cache dir and what its bytes are."""

    path: str = field(metadata=checked(path_problem))
    size: int = field(metadata=checked(file_size))
    digest: str = field(metadata=checked(digest_problem))
    blake3: str = optional_field(blake3_problem, "")  # "" only in version 1 documents


@dataclass(frozen=True, slots=True)
class SharedPath:
    """A path two units both produced with different bytes; the backend said either serves."""

    path: str = field(metadata=checked(path_problem))
    kept: str = field(metadata=checked(digest_problem))
    dropped: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReleaseUnit:
    """One unit of a release: its id and the key of the bundle it was built into."""

    unit_id: str
    key: str = field(metadata=checked(digest_problem))


@dataclass(frozen=True, slots=True)
class Release:
    """Everything a host needs to materialise one manifest's cache: the merged file list."""

    name: str
    manifest_digest: str
    backend: str
    cache_env: str = field(metadata=checked(env_name_problem))
    env: dict[str, str] = field(metadata=checked(env_problem))
    fingerprint: dict[str, str]
    units: tuple[ReleaseUnit, ...]
    files: Sequence[FileEntry] = field(metadata=checked(distinct_paths))  # a tuple, or Columns (trusted_release)
    shared: tuple[SharedPath, ...] = ()
    format: str = RELEASE_FORMAT
    # What every unit's bundle agrees on of BundleRecord.env_reads and .compiler_keys (as the
    # fingerprint is their common part): what doctor checks with only the release at hand.
    env_reads: dict[str, str] = field(default_factory=dict, metadata={"check": lambda v: reads_problem(v), "omit": {}})
    compiler_keys: dict[str, str] = field(default_factory=dict, metadata={"omit": {}})

    @property
    def signable(self) -> bool:
        """Every file is bound by BLAKE3 (version 2): a signature over it vouches for bytes."""
        return self.format == RELEASE_FORMAT and all(f.blake3 for f in self.files)

    @property
    def release_id(self) -> str:
        """Content address: an unchanged build yields the same id, so re-publishing is a no-op."""
        return hash_bytes(dump(self))

    @property
    def total_size(self) -> int:
        return sum(column(self.files, "size"))


@dataclass(frozen=True, slots=True)
class TagEvent:
    """One move of a tag: the release it pointed at from then, when and by whom."""

    release: str = field(metadata=checked(digest_problem))
    at: str
    by: str


@dataclass(frozen=True, slots=True)
class Signature:
    """One signature of a DSSE envelope: keyid is the signing key's name (`ci.example-1`)."""

    keyid: str
    sig: str  # base64 of the Ed25519 signature over the envelope's PAE


@dataclass(frozen=True, slots=True)
class Envelope:
    """A DSSE envelope (github.com/secure-systems-lab/dsse), as in-toto tooling reads it: payload
    is the base64 of an in-toto Statement v1."""

    payloadType: str  # noqa: N815 (DSSE's own field names)
    payload: str
    signatures: tuple[Signature, ...]


@dataclass(frozen=True, slots=True)
class TagRecord:
    """A movable name for a release, with its history (newest last) for audit and rollback.
    A signed tag (format /2) carries a signed statement of (tag, release, version, expiry)."""

    name: str = field(metadata=checked(tag_name))
    release: str = field(metadata=checked(digest_problem))
    history: tuple[TagEvent, ...]
    format: str = TAG_FORMAT
    statement: Envelope | None = optional_field(lambda v: None, None)


def unit_key(unit: Mapping[str, Any], fingerprint: Mapping[str, str]) -> str:
    """A bundle's key: its normalised unit (plan.normalize_unit) and the environment fingerprint
    its backend reports. plan keys units with it; a host check recomputes a bundle's key with
    this host's fingerprint in place of the build's."""
    return hash_bytes(canonical_json({"format": UNIT_FORMAT, "unit": unit, "fingerprint": fingerprint}))


def to_json(doc: Any) -> dict[str, Any]:
    """A document as JSON-ready data (tuples become lists when serialised): what
    dataclasses.asdict gives, without its deep copy of every leaf (a 10,000-file release took
    0.2 s that way; our documents hold only str, int, float, bool, None, dicts and tuples)."""
    return _plain(doc)


def _plain(value: Any) -> Any:
    kind = type(value)
    if kind in (str, int, float, bool) or value is None:
        return value
    if kind is dict:
        return {k: _plain(v) for k, v in value.items()}
    if kind in (tuple, list, Columns):
        return (list if kind is list else tuple)(_plain(v) for v in value)
    if dataclasses.is_dataclass(kind):
        return {
            name: _plain(got)
            for name, omit in _field_names(kind)
            if (got := getattr(value, name)) is not omit and got != omit
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return copy.deepcopy(value)


_KEEP = object()  # a field always encoded


@cache
def _field_names(kind: type) -> tuple[tuple[str, Any], ...]:
    """(name, the value that leaves it out of the encoding, else _KEEP) of each field."""
    return tuple((f.name, f.metadata.get("omit", _KEEP)) for f in dataclasses.fields(kind))


def dump(doc: Any) -> bytes:
    return canonical_json(to_json(doc))


def parse(kind: type[Doc], data: bytes, where: str) -> Doc:
    """Parse a stored document; anything malformed is an IntegrityError naming the object."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(
            f"{where}: not valid JSON ({exc})", hint="the object is corrupt; rebuild or re-push it"
        ) from None
    except RecursionError:
        raise IntegrityError(
            f"{where}: nested too deeply", hint="the object is corrupt or forged; rebuild or re-push it"
        ) from None
    expected = typing.cast(str, _fields(typing.cast(type, kind))["format"].default)
    known = kind_writing(expected)
    if isinstance(raw, dict) and raw.get("format") not in (known.reads if known else (expected,)):
        found = raw.get("format")
        raise IntegrityError(
            f"{where}: format {found if not isinstance(found, str) else found[:80]!r} is not one this neffbuild"
            f" reads as a {known.kind if known else kind.__name__}",
            hint="written by another neffbuild version; upgrade neffbuild or rebuild",
        )
    try:
        return _whole(_decode(kind, raw, ()))
    except _Invalid as exc:
        raise IntegrityError(
            f"{where}: invalid {kind.__name__} at {_shown(exc.loc)}: {exc.msg}",
            hint="the object is corrupt or hand-edited; rebuild or re-push it",
        ) from None


def trusted_release(data: bytes) -> Release | None:
    """A release from bytes that a strict parse already accepted (a cache dir's state holds them
    exactly as the store serves them and the pull that wrote it checked them): every field but the
    file list decoded as strictly as parse, the file list held as columns without checking each
    entry again (its paths, digests and distinct paths: about 20 ms for 10,000 entries), its
    FileEntry built where one is read (fields.Columns). None where the bytes are not a current
    release's plain shape: parse them strictly then."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if type(raw) is not dict or raw.get("format") != RELEASE_FORMAT or type(files := raw.get("files")) is not list:
        return None
    try:  # each entry an object holding these four keys (not an object: TypeError) and no other
        columns = [list(map(itemgetter(k), files)) for k in ("path", "size", "digest", "blake3")]
    except (KeyError, TypeError):
        return None
    if sum(map(len, files)) != len(_FILE_ENTRY_KEYS_2) * len(files):
        return None
    try:
        head = decode_doc(Release, {**raw, "files": []}, "", field_path=())
    except IntegrityError:
        return None
    return dataclasses.replace(head, files=Columns(FileEntry, *columns))


def decode_doc(kind: type[Doc], raw: Any, where: str, *, field_path: tuple[str, ...] | None = None) -> Doc:
    """Already-parsed JSON as a document of kind, as strictly as parse (no format check: the
    caller's container carries the format). With field_path (where raw sits in its file), the
    error names only the field: `installed.units.0.key: ...`."""
    try:
        return _whole(_decode(kind, raw, field_path or ()))
    except _Invalid as exc:
        if field_path is not None:
            raise IntegrityError(f"{_shown(exc.loc)}: {exc.msg}") from None
        raise IntegrityError(f"{where}: invalid {kind.__name__} at {_shown(exc.loc)}: {exc.msg}") from None


Loc = tuple[str | int, ...]  # where in the document: keys and indices, shown only on error


def _whole(doc: Any) -> Any:
    """Checks across fields: a version 2 bundle or release lists every file with its BLAKE3 (their
    format strings are theirs alone: no other document has one of these)."""
    if getattr(doc, "format", None) in (RELEASE_FORMAT, BUNDLE_FORMAT):
        for i, entry in enumerate(doc.files):
            if not entry.blake3:
                raise _Invalid(("files", i, "blake3"), f"required in format {doc.format!r}")
    return doc


class _Invalid(Exception):
    def __init__(self, loc: Loc, msg: str) -> None:
        self.loc, self.msg = loc, msg


_PLAIN_KEY = r"[A-Za-z0-9_-]{1,64}"  # compiled where first used: only an error shows a loc


def _shown(loc: Loc) -> str:
    """loc on one printable line, whatever its keys hold."""
    parts = (str(k) if isinstance(k, int) or re.fullmatch(_PLAIN_KEY, k) else repr(k[:80]) for k in loc)
    return ".".join(parts) or "(top)"


@cache
def _fields(kind: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(kind)}


@cache
def _hints(kind: type) -> dict[str, Any]:
    # include_extras: the same hints (no document here is Annotated) without the walk that strips
    # Annotated from every hint, a few ms of every process's first decode.
    return typing.get_type_hints(kind, include_extras=True)


@cache
def _shape(tp: Any) -> tuple[str, Any]:
    """How to decode type tp: ("doc" | "tuple" | "dict" | "any" | "plain", item type)."""
    if dataclasses.is_dataclass(tp):
        return "doc", None
    origin = typing.get_origin(tp)
    if origin is types.UnionType and len(args := typing.get_args(tp)) == 2 and args[1] is type(None):
        return "optional", args[0]
    if origin is tuple or origin is Sequence:
        return "tuple", typing.get_args(tp)[0]
    if origin is dict:
        return "dict", typing.get_args(tp)[1]
    return ("any", None) if tp is Any else ("plain", None)


def _text(value: str, loc: Loc) -> str:
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:  # strict UTF-8 refuses exactly the surrogates
            raise _Invalid(loc, f"{value[:80]!r} holds a lone surrogate, which no file name or variable can") from None
    return value


def _decode(tp: Any, value: Any, loc: Loc) -> Any:
    """value (from JSON) as type tp, strictly: no coercion beyond int -> float."""
    shape, item = _shape(tp)
    if shape == "doc":
        return _decode_doc(tp, value, loc)
    if shape == "optional":
        return None if value is None else _decode(item, value, loc)
    if shape == "tuple":
        if not isinstance(value, list):
            raise _Invalid(loc, f"expected a list, got {type(value).__name__}")
        if item is FileEntry:
            return _file_entries(value, loc)
        if item is str and {*map(type, value)} <= {str} and "".join(value).isascii():
            return tuple(value)  # ASCII holds no lone surrogate: _text of each, at once (a unit's 10,000s of paths)
        return tuple(_decode(item, v, (*loc, i)) for i, v in enumerate(value))
    if shape == "dict":
        if not isinstance(value, dict):
            raise _Invalid(loc, f"expected an object, got {type(value).__name__}")
        # Values as JSON gave them, ASCII keys (no lone surrogate): at once (a state's 10,000s of files).
        if item is object and {*map(type, value)} <= {str} and "".join(value).isascii():
            return dict(value)
        return {_text(k, (*loc, k)): _decode(item, v, (*loc, k)) for k, v in value.items()}
    if shape == "any":
        return _free_form(value, loc, len(loc))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise _Invalid(loc, f"expected {tp.__name__}, got {type(value).__name__}")
    return _text(value, loc) if tp is str else value


_FILE_ENTRY_KEYS = {"path", "size", "digest"}
_FILE_ENTRY_KEYS_2 = {"path", "size", "digest", "blake3"}


# A column of safe ASCII paths, each ended by "\n" (which no path may hold): components of 1 to
# NAME_MAX bytes without "/", "\\" or control characters, none "." or "..". path_problem, a
# column at a time. Compiled where first used (re caches them): a no-op pull checks no file list.
_COMPONENT = rf"(?!\.\.?[/\n])[^/\x00-\x1f\x7f\\]{{1,{NAME_MAX}}}"
_PATH_COLUMN = rf"(?:{_COMPONENT}(?:/{_COMPONENT})*\n)*"
HEX32_COLUMN = r"(?:[0-9a-f]{32}\n)*"
_BLAKE3_COLUMN = r"(?:(?:[0-9a-f]{64})?\n)*"


def _file_entries(value: list[Any], loc: Loc) -> tuple[FileEntry, ...]:
    """A release's (or a state's) file list, as strictly as _file_entry one by one, checked a
    column at a time where every entry has the common shape: one C loop or one regex per check
    instead of one Python call per entry (a no-op pull reads 10,000s of them). Anything unusual
    takes the entry-by-entry path, which says where and why."""
    if all(type(v) is dict and v.keys() == _FILE_ENTRY_KEYS_2 for v in value):
        paths, sizes = [v["path"] for v in value], [v["size"] for v in value]
        digests, crypto = [v["digest"] for v in value], [v["blake3"] for v in value]
        if (
            all(type(p) is str for p in paths) and all(type(n) is int for n in sizes)
            and all(type(d) is str for d in digests) and all(type(c) is str for c in crypto)
            and _column_ok(paths, digests, crypto) and all(0 <= n < 1 << 63 for n in sizes)
        ):  # fmt: skip  # arguments packed by meaning, not one a line
            return from_columns(FileEntry, paths, sizes, digests, crypto)
    return tuple(_file_entry(v, (*loc, i)) for i, v in enumerate(value))


def _column_ok(paths: list[str], digests: list[str], crypto: list[str]) -> bool:
    joined = "\n".join(paths) + "\n" if paths else ""
    return (
        joined.isascii() and joined.count("\n") == len(paths)  # a "\n" inside a path would split it
        and INCOMPLETE_SUFFIX not in joined and f"\n{STATE_DIR}" not in f"\n{joined}"
        and max(map(len, paths), default=0) <= PATH_MAX and re.fullmatch(_PATH_COLUMN, joined) is not None
        and _column(HEX32_COLUMN, digests)
        and _column(_BLAKE3_COLUMN, crypto)
    )  # fmt: skip  # arguments packed by meaning, not one a line


def _column(pattern: str, values: list[str]) -> bool:
    joined = "\n".join(values) + "\n" if values else ""
    return joined.count("\n") == len(values) and re.fullmatch(pattern, joined) is not None


def _file_entry(value: Any, loc: Loc) -> FileEntry:
    """A FileEntry, as strictly as _decode_doc but about 5x faster for the common entry (releases
    and the cache state list thousands); anything unusual takes the general path, which says why."""
    if type(value) is dict and (value.keys() == _FILE_ENTRY_KEYS or value.keys() == _FILE_ENTRY_KEYS_2):
        path, size, digest, crypto = value["path"], value["size"], value["digest"], value.get("blake3", "")
        if (
            type(path) is str and path.isascii() and type(size) is int and type(digest) is str
            and 0 <= size < 1 << 63 and HEX32.fullmatch(digest) and path_problem(path) is None
            and type(crypto) is str and (not crypto or HEX64.fullmatch(crypto))
        ):  # fmt: skip  # arguments packed by meaning, not one a line
            return FileEntry(path, size, digest, crypto)
    return _decode_doc(FileEntry, value, loc)


def _free_form(value: Any, loc: Loc, depth: int) -> Any:
    """A JSON value of a free-form field, checked for depth and lone surrogates."""
    if depth > MAX_DEPTH:
        raise _Invalid(loc, f"nested deeper than {MAX_DEPTH}")
    if isinstance(value, str):
        return _text(value, loc)
    if isinstance(value, list):
        return [_free_form(v, (*loc, i), depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {_text(k, (*loc, k)): _free_form(v, (*loc, k), depth + 1) for k, v in value.items()}
    return value


def _decode_doc(kind: type, value: Any, loc: Loc) -> Any:
    if not isinstance(value, dict):
        raise _Invalid(loc, f"expected an object, got {type(value).__name__}")
    fields, hints = _fields(kind), _hints(kind)
    extra = sorted(value.keys() - fields.keys())
    if extra:
        raise _Invalid((*loc, extra[0]), "unknown field")
    args = {}
    for name, f in fields.items():
        if name not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Invalid((*loc, name), "field required")  # a field with a default was added later
            continue
        args[name] = _decode(hints[name], value[name], (*loc, name))
        check = f.metadata.get("check")
        if check is not None and (problem := check(args[name])) is not None:
            raise _Invalid((*loc, name), problem)
    return kind(**args)
