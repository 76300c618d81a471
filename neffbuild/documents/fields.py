"""What the fields of a stored document must be: each check returns a problem, or None.

`parse` (documents/records.py) runs a field's check from its metadata (`checked`); these are
the checks, and the limits on paths that a cache dir must be able to hold. A list field whose
items were checked already is built a column at a time (`from_columns`), or held as its columns
until an item is read (`Columns`: a release's 10,000s of files, where a no-op pull reads two).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections import deque
from collections.abc import Sequence
from dataclasses import field
from itertools import repeat
from typing import Any, TypeVar

from neffbuild.names import reserved_problem, tag_problem

NAME_MAX = 255  # bytes in one path component (ext4, xfs, ...)
PATH_MAX = 1024  # bytes in a cache path: compilers' are well under 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def path_problem(path: str) -> str | None:
    # A bundle is input from the network: it must not write outside the cache dir.
    parts = path.split("/")
    if (
        not path
        or path[0] == "/"
        or "\\" in path
        or _CONTROL.search(path)
        or "" in parts
        or "." in parts
        or ".." in parts
    ):
        return f"unsafe path {path!r}: must be relative, normalised, inside the cache dir, without control characters"
    size = len(path) if path.isascii() else len(path.encode())
    if size > PATH_MAX or (size > NAME_MAX and any(len(p.encode()) > NAME_MAX for p in parts)):
        return f"path {path[:80]!r}... is too long: at most {PATH_MAX} bytes, {NAME_MAX} per component"
    return reserved_problem(path)


def _fold(path: str) -> str:
    """What a case-insensitive, normalisation-insensitive filesystem sees (Unicode caseless match)."""
    if path.isascii():
        return path.lower()
    import unicodedata  # only documents with non-ASCII paths pay for it

    return unicodedata.normalize("NFD", unicodedata.normalize("NFD", path).casefold())


def distinct_paths(files: tuple[Any, ...]) -> str | None:
    """Each path once, none also the directory of another, none differing from another only in case."""
    if _plainly_distinct([entry.path for entry in files]):
        return None
    return _why_not_distinct(files)


def _plainly_distinct(paths: list[str]) -> bool:
    """The common case, decided with sets: ASCII paths, distinct when folded, none a directory
    of another (directories are few: a release's 10,000 files sit in about 100)."""
    if not all(map(str.isascii, paths)):
        return False
    folded = {path.lower() for path in paths}
    if len(folded) != len(paths):
        return False
    dirs, todo = set(), {path.rpartition("/")[0] for path in folded}
    while todo:
        dirs |= todo
        todo = {d.rpartition("/")[0] for d in todo} - dirs
    return folded.isdisjoint(dirs)


def _why_not_distinct(files: tuple[Any, ...]) -> str | None:
    by_key: dict[str, Any] = {}
    for entry in files:
        key = _fold(entry.path)
        other = by_key.setdefault(key, entry)
        if other is entry:
            continue
        if other.path != entry.path:
            return f"{other.path!r} and {entry.path!r} differ only in case: one file on a case-insensitive filesystem"
        if other.digest != entry.digest:
            return f"{entry.path!r} is listed twice, with two digests"
        return f"{entry.path!r} is listed twice"
    for key, entry in by_key.items():
        parts = key.split("/")
        for depth in range(1, len(parts)):
            if (under := by_key.get("/".join(parts[:depth]))) is not None:
                return f"{under.path!r} is a file and also the directory of {entry.path!r}"
    return None


def env_problem(env: dict[str, str]) -> str | None:
    """Why env cannot be a process environment: a name that is no variable name, a NUL in a value."""
    bad = [name for name in env if not _ENV_NAME.fullmatch(name)]
    if bad:
        return f"{bad[0]!r} is not an environment variable name"
    nul = [name for name, value in env.items() if "\x00" in value]
    return f"{nul[0]}: the value holds a NUL character" if nul else None


def reads_problem(reads: dict[str, str]) -> str | None:
    bad = [n for n, d in reads.items() if not _ENV_NAME.fullmatch(n) or (d and not HEX32.fullmatch(d))]
    return f"{bad[0][:80]!r}: not a variable name with a digest" if bad else None


def env_name_problem(name: str) -> str | None:
    return None if _ENV_NAME.fullmatch(name) else f"{name!r} is not an environment variable name"


def tag_name(name: str) -> str | None:
    return tag_problem(name)


HEX32 = re.compile(r"[0-9a-f]{32}")
HEX64 = re.compile(r"[0-9a-f]{64}")


def digest_problem(value: str) -> str | None:
    return None if HEX32.fullmatch(value) else f"{value!r} is not a 32-digit lowercase hex digest"


def blake3_problem(value: str) -> str | None:
    return None if HEX64.fullmatch(value) else f"{value[:80]!r} is not a 64-digit lowercase hex BLAKE3 digest"


def _not_negative(value: int) -> str | None:
    return None if value >= 0 else f"{value} is negative"


def file_size(value: int) -> str | None:
    return _not_negative(value) or (None if value < 1 << 63 else f"{value} is larger than any file can be")


def checked(check: typing.Callable[[Any], str | None]) -> dict[str, typing.Callable[[Any], str | None]]:
    """A field's metadata, `field(metadata=checked(check))`: its value must also pass check (which
    returns a problem or None)."""
    return {"check": check}


def optional_field(check: typing.Callable[[Any], str | None], default: Any) -> Any:
    """A field added by a later format: left out of the encoding while it holds its default, so
    documents written before it keep their bytes (and a release its id)."""
    return field(default=default, metadata={"check": lambda v: None if v == default else check(v), "omit": default})


Doc = TypeVar("Doc")


def from_columns(kind: type[Doc], *columns: Sequence[Any]) -> tuple[Doc, ...]:
    """tuple(map(kind, *columns)) for a frozen slotted dataclass without __post_init__, from
    columns already checked: each field set as kind's own __init__ sets it (object.__setattr__,
    here its slot's), a column at a time, with no Python call per item (a no-op pull builds a
    release's 10,000s of FileEntry: half the time of that)."""
    slots = [vars(kind)[f.name] for f in dataclasses.fields(kind)]  # type: ignore[arg-type]
    if hasattr(kind, "__post_init__") or len(columns) != len(slots) or len({len(c) for c in columns}) > 1:
        raise ValueError(f"one column per field of {kind.__name__}, all of one length (and no __post_init__)")
    made = list(map(object.__new__, repeat(kind, len(columns[0]) if columns else 0)))
    for slot, values in zip(slots, columns, strict=True):
        deque(map(slot.__set__, made, values), maxlen=0)
    return tuple(made)


class Columns(Sequence[Doc]):
    """The tuple from_columns(kind, *columns) gives, built only once an item is asked for: its
    columns are read without it (`column`), and it is equal, hashed, shown and pickled as that
    tuple. A no-op pull reads a release's paths and sizes only: its 10,000s of FileEntry are
    never built."""

    __slots__ = ("_built", "_columns", "_kind")

    def __init__(self, kind: type[Doc], *columns: Sequence[Any]) -> None:
        if len(columns) != len(dataclasses.fields(kind)) or len({len(c) for c in columns}) > 1:  # type: ignore[arg-type]
            raise ValueError(f"one column per field of {kind.__name__}, all of one length")
        self._kind, self._columns = kind, columns
        self._built: tuple[Doc, ...] | None = None

    def column(self, name: str) -> Sequence[Any]:
        names = [f.name for f in dataclasses.fields(self._kind)]  # type: ignore[arg-type]
        return self._columns[names.index(name)]

    def built(self) -> tuple[Doc, ...]:
        if self._built is None:
            self._built = from_columns(self._kind, *self._columns)
        return self._built

    def __len__(self) -> int:
        return len(self._columns[0])

    @typing.overload
    def __getitem__(self, index: int) -> Doc: ...
    @typing.overload
    def __getitem__(self, index: slice) -> tuple[Doc, ...]: ...
    def __getitem__(self, index: int | slice) -> Doc | tuple[Doc, ...]:
        return self.built()[index]

    def __iter__(self) -> typing.Iterator[Doc]:
        return iter(self.built())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Columns):
            other = other.built()
        return self.built() == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.built())

    def __repr__(self) -> str:
        return repr(self.built())

    def __reduce__(self) -> tuple[type[tuple[Doc, ...]], tuple[tuple[Doc, ...]]]:
        return tuple, (self.built(),)


def column(items: Sequence[Any], name: str) -> Sequence[Any]:
    """The name field of each item, without building them where they are Columns."""
    return items.column(name) if isinstance(items, Columns) else [getattr(i, name) for i in items]
