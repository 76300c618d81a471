"""What a cache dir records about itself: `.neffbuild/state.json`, written by pull, read by
pull, `status` and `env` without a store.

Format `neffbuild.cache-state/2`:

    {"format": "neffbuild.cache-state/2",
     "installed": {"release_id", "tag" ("" if pulled by id), "store" (its URL), "installed_at",
                   "release" (the release document itself), "exports" (what pull printed),
                   "units": [{"unit_id", "key", "backend", "unit", "fingerprint", "paths"}]  (from the bundles)},
     "files": {path: [size, mtime_ns, digest]},   (what pull wrote: saves re-hashing)
     "accepted": {tag: version}}   (only with trusted keys: the highest signed tag statement version
                                    a pull accepted, written once that pull passed every check;
                                    left out while empty)

Format `neffbuild.cache-state/3` is /2 with `"expires": {tag: ISO 8601 time}`: when the signed
statement a pull accepted for the tag expires (what a stale boot checks, host/fallback.py).

Format `neffbuild.cache-state/4` (written today) holds each path once, in the release: /3 with
`files` replaced by `"mtimes": [mtime_ns or null, ...]`, one per file of installed.release in its
order (null: not recorded; a recorded file's size and digest are the release's), and each unit's
`paths` given as indices into installed.release.files (a path the release does not list stays a
string). `expires` is left out while empty. A no-op pull compares the mtimes column with what it
found in one go, without building a table of 10,000s of entries (`Recorded`). A state of an
earlier format is read as before and rewritten as /4 by the next pull (a no-op included, once).

`installed` answers "which release is this, and what did it set" with no store round trip (a tag
may have moved since); its units carry what a key is made of, so `status` can recompute each
unit's key for this host. `files` is only a cache of hashes and stays lenient: a malformed entry
is dropped and costs one re-hash. `installed` is strict: one malformed field, a release document
that does not match its id, or another format drops all of it, and the cache dir reads as
"installed release unknown" (status and env then need a store and a REF; the next pull rewrites it).
Only pull, holding the store's bytes of the release REF names now, reads an installed release
that is byte for byte those bytes without decoding its entries again (parse_state's Vouched):
the pull that recorded them parsed them strictly, and any other bytes are parsed strictly.

Version 1 (before this format, no `format` field: {"release", "tag", "files"}) is read, not
migrated in place: its files serve as before and its release id is kept (enough to tell a stale
cache from a current one), the release document is unknown. The next pull that changes anything
writes format /4; a pull into a complete v1 cache writes it once (then never again).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from neffbuild.documents.fields import column
from neffbuild.documents.records import (
    FileEntry,
    Release,
    checked,
    decode_doc,
    digest_problem,
    env_problem,
    path_problem,
    to_json,
)
from neffbuild.errors import IntegrityError, StateCorrupt
from neffbuild.formats import FORMATS
from neffbuild.hashing import all_digests, canonical_json, hash_bytes, is_digest
from neffbuild.names import tag_problem
from neffbuild.printable import printable

(STATE_FORMAT,) = FORMATS["cache state"].writes  # /4
STATE_FORMAT_2, STATE_FORMAT_3 = FORMATS["cache state"].reads[:2]  # read, no longer written
STATE_FILE = "state.json"

Files = Mapping[str, tuple[int, int, str]]  # path -> (size, mtime_ns, digest) of what pull wrote


class Recorded(Mapping[str, tuple[int, int, str]]):
    """A /4 state's file table: the installed release's entries and the mtime recorded for each
    (None: not recorded), read as path -> (size, mtime_ns, digest). The table is built only when
    asked for; a no-op pull compares the columns instead (host/scan.py)."""

    __slots__ = ("_columns", "_count", "_table", "entries", "mtimes")

    def __init__(self, entries: Sequence[FileEntry], mtimes: list[int | None]) -> None:
        self.entries, self.mtimes = entries, mtimes
        self._table: dict[str, tuple[int, int, str]] | None = None
        self._columns: tuple[list[str], list[int]] | None = None
        self._count = len(mtimes) - mtimes.count(None)  # len (and bool) without the table

    def columns(self) -> tuple[list[str], list[int]]:
        """(the entries' paths, their sizes), in their order (without building Columns' entries)."""
        if self._columns is None:
            self._columns = (list(column(self.entries, "path")), list(column(self.entries, "size")))
        return self._columns

    def _dict(self) -> dict[str, tuple[int, int, str]]:
        if self._table is None:
            self._table = {
                f.path: (f.size, m, f.digest) for f, m in zip(self.entries, self.mtimes, strict=True) if m is not None
            }
        return self._table

    def __getitem__(self, path: str) -> tuple[int, int, str]:
        return self._dict()[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"Recorded({self._dict()!r})"


@dataclass(frozen=True, slots=True)
class InstalledUnit:
    """One unit of the installed release, as its bundle recorded it (what its key is made of)."""

    unit_id: str
    key: str = field(metadata=checked(digest_problem))
    backend: str
    unit: dict[str, Any]
    fingerprint: dict[str, str]
    paths: tuple[str, ...]  # checked by _installed: the release's own paths were checked with it
    # What the compiling process read from the environment (bundles.BundleRecord.env_reads).
    env_reads: dict[str, str] = field(default_factory=dict, metadata={"omit": {}})


@dataclass(frozen=True, slots=True)
class Installed:
    """The release a pull installed, and how."""

    release_id: str
    tag: str  # "" when pulled by release id
    store: str
    installed_at: str
    release: Release
    exports: dict[str, str]  # what that pull printed: a record, never a permission (exports.py)
    units: tuple[InstalledUnit, ...]


@dataclass(frozen=True)
class CacheState:
    """The state file as read: what it says, or why it is corrupt."""

    files: Files = field(default_factory=dict)  # a dict, or Recorded (format /4)
    installed: Installed | None = None  # None: unknown (no state, version 1, corrupt or a newer format)
    release_id: str | None = None  # the installed release's id, known from version 1 too
    tag: str | None = None
    version: int = 0  # 0: no state, corrupt or a newer format; 2: formats /2 and /3; 4: /4
    problem: str | None = None  # why the state file is corrupt (then all else is unknown)
    accepted: dict[str, int] = field(default_factory=dict)  # tag -> highest signed version accepted
    expires: dict[str, str] = field(default_factory=dict)  # tag -> when the statement accepted expires (ISO 8601)

    def trusted(self, path: Path) -> CacheState:
        """self, unless the file is corrupt: then StateCorrupt naming it. Commands that only read
        a cache dir stop here; pull reads a corrupt state as nothing known, and rewrites it."""
        if self.problem is not None:
            raise StateCorrupt(
                f"{path}: {self.problem}",
                hint=f"edited or damaged: `neffbuild pull REF --cache-dir {path.parent.parent}` re-verifies every file and rewrites it",
            )
        return self


@dataclass(frozen=True, slots=True)
class Vouched:
    """A release this process has in hand: its id, the store's bytes of it (which hash to that id)
    and its document. A state whose installed release is exactly these bytes is read with this
    document in place of decoding them again."""

    release_id: str
    data: bytes
    release: Release


def parse_state(data: bytes, vouched: Vouched | None = None) -> CacheState:
    """The state file's content, decoded strictly; never raises. Every field is checked with its
    type and as pull checked it when it wrote the file (names, paths, digests, sizes, the release
    document by its id, the units against it); anything else is a corrupt state: nothing known,
    with `problem` naming the field. With vouched, an installed release that is byte for byte
    vouched.data is that document (everything else is checked as strictly)."""
    if vouched is not None and (state := _parse_vouched(data, vouched)) is not None:
        return state
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return corrupt_state("not valid JSON")
    except RecursionError:
        return corrupt_state("nested too deeply")
    if not isinstance(raw, dict):
        return corrupt_state(f"expected a JSON object, got {type(raw).__name__}")
    try:
        if "format" not in raw:
            return _version_1(raw)
        if raw["format"] in (STATE_FORMAT_2, STATE_FORMAT_3):
            return _version_2(raw)
        if raw["format"] == STATE_FORMAT:
            return _version_4(raw)
    except IntegrityError as exc:
        return corrupt_state(exc.message)
    found = raw["format"]
    if isinstance(found, str) and re.fullmatch(_NEWER, found):
        return CacheState()  # a newer neffbuild's: its hashes may mean something else; it is not ours to judge
    return corrupt_state(f"format {printable(str(found)[:80])!r} is not one neffbuild writes")


_NEWER = r"neffbuild\.cache-state/[1-9][0-9]*"  # compiled where first used (re caches it): rarely
# How encode_state lays out the installed release: sorted keys, so "release" ends where
# "release_id" starts (no other key before "units" holds an object: exports' values are strings).
_RELEASE_KEY, _RELEASE_ID_KEY = b',"release":', b',"release_id":"'


def release_in(data: bytes) -> tuple[str, int, int] | None:
    """(the installed release's id, where its bytes start and end in data) where the state file
    is laid out as encode_state writes it, found by their keys without parsing the file; None
    otherwise. Nothing is checked: parse_state with Vouched uses these bytes only where they equal
    bytes it already trusts (holds_release). Not a copy: they are most of the file, and a copy of
    1.6 MB (10,000 files) faults in 400 fresh pages, about a ms of a no-op pull each time."""
    start = data.find(_RELEASE_KEY)
    end = data.find(_RELEASE_ID_KEY, start)
    if start < 0 or end < 0:
        return None
    at = end + len(_RELEASE_ID_KEY)
    release_id = data[at : at + 33]
    if len(release_id) != 33 or release_id[32:] != b'"' or not release_id[:32].isascii():
        return None
    return release_id[:32].decode(), start + len(_RELEASE_KEY), end


def holds_release(data: bytes, found: tuple[str, int, int], release_id: str, release: bytes) -> bool:
    """Whether the release data holds where found says (release_in's) is release_id with exactly
    those bytes, compared in place."""
    return found[0] == release_id and found[2] - found[1] == len(release) and data.startswith(release, found[1])


def _parse_vouched(data: bytes, vouched: Vouched) -> CacheState | None:
    """parse_state with the installed release's bytes cut out and vouched.release put in their
    place, where those bytes are vouched.data; None where the file is not so (parse it strictly)."""
    found = release_in(data)
    if found is None or not holds_release(data, found, vouched.release_id, vouched.data):
        return None
    try:
        raw = json.loads(b"%snull%s" % (data[: found[1]], data[found[2] :]))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    installed = raw.get("installed") if type(raw) is dict else None
    # The null must be the release the parse took (a second "release" key would override it).
    if type(installed) is not dict or "release" not in installed or installed["release"] is not None:
        return None
    if raw.get("format") not in (STATE_FORMAT, STATE_FORMAT_2, STATE_FORMAT_3):
        return None
    try:
        return _version_4(raw, vouched) if raw["format"] == STATE_FORMAT else _version_2(raw, vouched)
    except IntegrityError as exc:
        return corrupt_state(exc.message)


def corrupt_state(problem: str) -> CacheState:
    return CacheState(problem=problem)


@dataclass(frozen=True, slots=True)
class _Version1:
    """The state file of version 1 (before `format`), as decoded."""

    release: str = field(metadata=checked(digest_problem))
    tag: str | None = None
    files: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Version2:
    """The state file of formats /2 and /3, as decoded."""

    format: str
    # object, not Any: taken as JSON gave them, not walked here, since _installed and _files check
    # every value strictly next (a walk of their 10,000s of entries cost half the parse).
    installed: dict[str, object]
    files: dict[str, object]
    accepted: dict[str, int] = field(metadata=checked(lambda got: _accepted_problem(got)))
    expires: dict[str, str] = field(metadata=checked(lambda got: _expires_problem(got)))


@dataclass(frozen=True, slots=True)
class _Version4:
    """The state file of format /4, as decoded."""

    format: str
    installed: dict[str, object]
    mtimes: object  # checked by _mtimes, a column at a time
    accepted: dict[str, int] = field(metadata=checked(lambda got: _accepted_problem(got)))
    expires: dict[str, str] = field(metadata=checked(lambda got: _expires_problem(got)))


@dataclass(frozen=True, slots=True)
class _Head:
    """Installed without its release (which is checked against its id first)."""

    release_id: str = field(metadata=checked(digest_problem))
    tag: str = field(metadata=checked(lambda tag: tag_problem(tag) if tag else None))
    store: str = field(metadata=checked(lambda url: None if url else "empty"))
    installed_at: str = field(metadata=checked(lambda at: _time_problem(at)))
    exports: dict[str, str] = field(metadata=checked(lambda env: env_problem(env)))
    units: tuple[InstalledUnit, ...]


def _version_1(raw: dict[str, Any]) -> CacheState:
    v1 = decode_doc(_Version1, raw, STATE_FILE, field_path=())
    if v1.tag is not None and (problem := tag_problem(v1.tag)):
        raise IntegrityError(f"tag: {problem}")
    return CacheState(_files(v1.files), release_id=v1.release, tag=v1.tag or None, version=1)


def _version_2(raw: dict[str, Any], vouched: Vouched | None = None) -> CacheState:
    if raw["format"] == STATE_FORMAT_2 and "expires" in raw:
        raise IntegrityError(f"expires: not a field of format {STATE_FORMAT_2!r}")
    v2 = decode_doc(_Version2, {"accepted": {}, "expires": {}, **raw}, STATE_FILE, field_path=())
    installed = _installed(v2.installed, vouched)
    files = _files(v2.files, checked={f.path for f in installed.release.files})
    return CacheState(
        files, installed, installed.release_id, installed.tag or None, version=2, accepted=v2.accepted,
        expires=v2.expires,
    )  # fmt: skip  # arguments packed by meaning, not one a line


def _version_4(raw: dict[str, Any], vouched: Vouched | None = None) -> CacheState:
    v4 = decode_doc(_Version4, {"accepted": {}, "expires": {}, **raw}, STATE_FILE, field_path=())
    installed = _installed(v4.installed, vouched, indexed=True)
    mtimes = _mtimes(v4.mtimes, len(installed.release.files))
    return CacheState(
        Recorded(installed.release.files, mtimes), installed, installed.release_id, installed.tag or None, version=4,
        accepted=v4.accepted, expires=v4.expires,
    )  # fmt: skip  # arguments packed by meaning, not one a line


_MTIME_TYPES = frozenset({int, type(None)})


def _mtimes(value: object, count: int) -> list[int | None]:
    """The mtimes column: a list of one int or null per file of the installed release."""
    if type(value) is not list or len(value) != count or not _MTIME_TYPES.issuperset(map(type, value)):
        raise IntegrityError(f"mtimes: expected a list of {count} mtimes (ns) or nulls, one per file of the release")
    return value


def _indexed_paths(units: object, paths: Sequence[str], strays: list[str]) -> object:
    """The units of a /4 state with their paths as names: an index stands for that file of the
    release, a string for a path it does not list (added to strays: checked once decoded, as every
    path is); anything else is corrupt. Units not as expected are left for the decoder to name."""
    if type(units) is not list:
        return units
    named = []
    for i, unit in enumerate(units):
        if type(unit) is not dict or type(got := unit.get("paths")) is not list:
            named.append(unit)
            continue
        if not got or (set(map(type, got)) == {int} and min(got) >= 0 and max(got) < len(paths)):
            named.append({**unit, "paths": [paths[p] for p in got]})
            continue
        for p in got:
            if not (type(p) is str or (type(p) is int and 0 <= p < len(paths))):
                raise IntegrityError(f"installed.units.{i}.paths: {printable(str(p)[:40])!r} is no file of the release")
        strays.extend(p for p in got if type(p) is str)
        named.append({**unit, "paths": [paths[p] if type(p) is int else p for p in got]})
    return named


def _expires_problem(expires: dict[str, str]) -> str | None:
    for tag, at in expires.items():
        if (problem := tag_problem(tag) or _time_problem(at)) is not None:
            return problem
        if datetime.fromisoformat(at).tzinfo is None:
            return f"{tag}: {at!r} has no time zone"
    return None


def _accepted_problem(accepted: dict[str, int]) -> str | None:
    for tag, version in accepted.items():
        if (problem := tag_problem(tag)) is not None:
            return problem
        if version < 0:
            return f"{tag}: version {version} is negative"
    return None


def _files(value: dict[str, Any], checked: frozenset[str] | set[str] = frozenset()) -> Files:
    """path -> [size, mtime_ns, digest], each checked (a bool is no size); checked: paths known
    safe already (the installed release's, parsed strictly)."""
    if _files_ok(value, checked):  # the common case, a column at a time (a no-op pull reads 10,000s)
        return {path: (entry[0], entry[1], entry[2]) for path, entry in value.items()}
    files = {}
    for path, entry in value.items():
        if not (
            type(entry) is list and len(entry) == 3 and type(entry[0]) is int and type(entry[1]) is int
            and type(entry[2]) is str and 0 <= entry[0] < 1 << 63 and is_digest(entry[2])
        ):  # fmt: skip  # arguments packed by meaning, not one a line
            raise IntegrityError(f"files.{printable(path[:80])!r}: expected [size, mtime_ns, digest]")
        if path not in checked and (problem := path_problem(path)) is not None:
            raise IntegrityError(f"files: {problem}")
        files[path] = (entry[0], entry[1], entry[2])
    return files


def _files_ok(value: dict[str, Any], checked: frozenset[str] | set[str]) -> bool:
    """Whether every entry is as _files requires, where all their paths are in checked."""
    if not (checked.issuperset(value) and all(type(e) is list and len(e) == 3 for e in value.values())):
        return False
    sizes, mtimes, digests = zip(*value.values(), strict=True) if value else ((), (), ())
    return (
        all(type(n) is int and 0 <= n < 1 << 63 for n in sizes) and all(type(m) is int for m in mtimes)
        and all(type(d) is str for d in digests) and all_digests(digests)
    )  # fmt: skip  # arguments packed by meaning, not one a line


def _installed(value: dict[str, object], vouched: Vouched | None = None, *, indexed: bool = False) -> Installed:
    """The installed record: its release document must hash to its id (the bytes pull parsed
    strictly from the store: a mismatch is an edit), then decodes as strictly as from a store;
    its units must be that release's. vouched: the release cut out of the file (_parse_vouched).
    indexed: format /4, whose units name the release's files by index (_indexed_paths)."""
    release = value.get("release")
    trusted = vouched is not None and release is None and value.get("release_id") == vouched.release_id
    if not trusted:
        _hashed(release, value.get("release_id"))
    head_raw = {k: v for k, v in value.items() if k != "release"}
    if indexed:  # the fields before units first, as in /2: the decoder names the first it meets
        decode_doc(_Head, {**head_raw, "units": []}, STATE_FILE, field_path=("installed",))
    else:
        head = decode_doc(_Head, head_raw, STATE_FILE, field_path=("installed",))
    if vouched is not None and trusted:
        decoded = vouched.release
    else:
        decoded = decode_doc(Release, release, STATE_FILE, field_path=("installed", "release"))
    strays: list[str] = []  # /4: the units' paths the release does not list
    if indexed:
        head_raw["units"] = _indexed_paths(head_raw.get("units"), column(decoded.files, "path"), strays)
        head = decode_doc(_Head, head_raw, STATE_FILE, field_path=("installed",))
    if [(u.unit_id, u.key) for u in head.units] != [(u.unit_id, u.key) for u in decoded.units]:
        raise IntegrityError("installed.units: not the units of installed.release")
    known = {f.path for f in decoded.files} if not indexed or strays else set()
    for path in strays if indexed else (p for unit in head.units for p in unit.paths):
        if path not in known and (problem := path_problem(path)) is not None:
            raise IntegrityError(f"installed.units: {problem}")
    return Installed(**{f: getattr(head, f) for f in _Head.__slots__}, release=decoded)


def _hashed(release: object, release_id: object) -> None:
    """That release is an object whose canonical dump hashes to release_id."""
    if not isinstance(release, dict):
        raise IntegrityError("installed.release: expected an object")
    try:
        encoded = canonical_json(release)
    except UnicodeEncodeError:  # a lone surrogate: JSON reads it, UTF-8 cannot hold it
        raise IntegrityError("installed.release: holds a lone surrogate, which no release can") from None
    if hash_bytes(encoded) != release_id:
        raise IntegrityError("installed.release does not hash to installed.release_id (edited by hand?)")


def _time_problem(at: str) -> str | None:
    try:
        datetime.fromisoformat(at)
    except ValueError:
        return f"{printable(at[:40])!r} is not an ISO 8601 time"
    return None


def encode_state(
    installed: Installed,
    files: Mapping[str, tuple[int, int, str]],
    accepted: Mapping[str, int] | None = None,
    expires: Mapping[str, str] | None = None,
) -> bytes:
    """The state file's bytes (format /4): equal inputs give equal bytes (pull writes only when
    they change). Only files of the installed release, as it lists them, are recorded."""
    entries = installed.release.files
    index = {f.path: i for i, f in enumerate(entries)}
    doc: dict[str, Any] = {"format": STATE_FORMAT, "installed": to_json(installed), "mtimes": _column(entries, files)}
    for unit in doc["installed"]["units"]:
        unit["paths"] = [index.get(path, path) for path in unit["paths"]]
    if accepted:
        doc["accepted"] = dict(accepted)
    if expires:
        doc["expires"] = dict(expires)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _column(entries: Sequence[FileEntry], files: Mapping[str, tuple[int, int, str]]) -> list[int | None]:
    """Each entry's recorded mtime where files records it with the entry's size and digest, else None."""
    column: list[int | None] = []
    for f in entries:
        got = files.get(f.path)
        column.append(got[1] if got is not None and got[0] == f.size and got[2] == f.digest else None)
    return column
