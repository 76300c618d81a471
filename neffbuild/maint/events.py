"""Read the event files `neffbuild.serve.guard` writes on serving hosts (one JSON line per compile).

The format is a contract between two processes on different hosts and versions (docs/manifest.md,
"Shapes from serving"). Everything in a file is untrusted: each line is decoded strictly (exact
types, bounded sizes, no unknown field); a line that fails is reported as FILE:LINE and skipped, so
one damaged host does not hide what the others saw. A last line without its newline is a write the
guard's process did not finish (killed mid-append): skipped with a warning of its own. A file
written in another format version stops the read: its events cannot be judged by this reader.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, BinaryIO, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator

from neffbuild.errors import InputError

EVENT_VERSION = 1
MAX_LINE = 1 << 20  # bytes in one event line; a real one is a few KiB (its fingerprint, inputs)
MAX_FIELDS = 256  # entries in counters and fingerprint, items in inputs
_TEXT = 4096

Text = Annotated[str, Field(max_length=_TEXT)]
Count = Annotated[int, Strict(), Field(ge=0, le=2**63 - 1)]
Size = Annotated[int, Strict(), Field(ge=1, le=2**31 - 1)]  # bounded again by the manifest's limits


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class CallSize(_Strict):
    """The pipeline call's size, each part absent where the guard could not recover it."""

    height: Size | None = None
    width: Size | None = None
    batch: Size | None = None


class Event(_Strict):
    """One compile a guard saw in a serving process (format version 1)."""

    neffbuild_event: Literal[1]
    time: Annotated[str, Field(max_length=64)]
    host: Annotated[str, Field(min_length=1, max_length=255)]
    pid: Count
    mode: Literal["record", "warn", "fail"]
    manifest: Text
    manifest_name: Annotated[str, Field(max_length=100)]
    entry: Annotated[str, Field(max_length=100)] | None
    pipeline: Annotated[str, Field(max_length=200)]
    dtype: Annotated[str, Field(max_length=100)]
    backend: Annotated[str, Field(max_length=100)]
    component: Annotated[str, Field(max_length=200)] | None
    inputs: Annotated[list[Text], Field(max_length=MAX_FIELDS)]
    call: CallSize
    compile_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | Count
    counters: Annotated[
        dict[Annotated[str, Field(max_length=200)], Annotated[int, Strict(), Field(ge=-(2**63), le=2**63 - 1)]],
        Field(max_length=MAX_FIELDS),
    ]
    compiles: Count
    refused: bool = False  # mode "fail" refused the compile before it ran (so `compiles` is 0)
    # "package": a package loader had no package for the call (refused in every mode, no compile)
    artifact: Literal["package"] | None = None
    fingerprint: Annotated[dict[Annotated[str, Field(max_length=200)], Text], Field(max_length=MAX_FIELDS)]

    @field_validator("time")
    @classmethod
    def _utc_time(cls, value: str) -> str:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError("not an ISO 8601 time") from None
        if parsed.utcoffset() is None:
            raise ValueError("a time without its UTC offset")
        return value


@dataclass(frozen=True)
class Located:
    """An event and where it was read: FILE:LINE names it in every report."""

    file: Path
    line: int
    event: Event

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Skipped:
    file: Path
    line: int
    why: str
    torn: bool = False  # the last line, without its newline: an append cut short

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class EventsRead:
    files: tuple[Path, ...]
    events: tuple[Located, ...]
    skipped: tuple[Skipped, ...]

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(sorted({e.event.host for e in self.events}))


def read_events(paths: Sequence[Path]) -> EventsRead:
    """Every event of every file, in order; malformed lines skipped and named. InputError (exit 2)
    for a file that cannot be read, holds lines but no valid one, or has another format version."""
    events: list[Located] = []
    skipped: list[Skipped] = []
    for path in paths:
        found, lost = _read_file(path)
        if lost and not found and any(not s.torn for s in lost):
            first = next(s for s in lost if not s.torn)
            raise InputError(
                f"{first.where}: not an events file: no valid event in {len(lost)} line(s) ({first.why})",
                hint="pass the files neffbuild.serve.guard(events=PATH) writes, one JSON object per line",
            )
        events += found
        skipped += lost
    return EventsRead(files=tuple(paths), events=tuple(events), skipped=tuple(skipped))


def _read_file(path: Path) -> tuple[list[Located], list[Skipped]]:
    found: list[Located] = []
    lost: list[Skipped] = []
    try:
        with path.open("rb") as stream:
            for number, raw, complete in _lines(stream):
                try:
                    if raw is None:
                        raise _Malformed(f"longer than {MAX_LINE} bytes")
                    found.append(Located(path, number, decode_line(raw)))
                except _Malformed as exc:
                    if not complete:
                        lost.append(Skipped(path, number, f"torn last line ({exc.why})", torn=True))
                    else:
                        lost.append(Skipped(path, number, exc.why))
                except _OtherVersion as exc:
                    raise InputError(
                        f"{path}:{number}: events format version {exc.version} (this neffbuild reads {EVENT_VERSION})",
                        hint="read it with the neffbuild version the serving hosts run, or upgrade this one",
                    ) from None
    except IsADirectoryError:
        raise InputError(f"{path}: a directory, not an events file", hint="pass the files themselves") from None
    except FileNotFoundError:
        raise InputError(f"{path}: no such events file", hint="check the path") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})", hint="check the path") from None
    return found, lost


def _lines(stream: BinaryIO) -> Iterator[tuple[int, bytes | None, bool]]:
    """(number, line without its newline or None if overlong, whether it had one): at most
    MAX_LINE bytes of a line are held, so one hostile line cannot fill memory."""
    readline = stream.readline
    number = 0
    while True:
        raw: bytes = readline(MAX_LINE + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # the rest of an overlong line
                raw = readline(MAX_LINE)
            yield number, None, raw.endswith(b"\n")
            continue
        yield number, raw.removesuffix(b"\n"), raw.endswith(b"\n")


class _Malformed(Exception):
    def __init__(self, why: str) -> None:
        self.why = why


class _OtherVersion(Exception):
    def __init__(self, version: str) -> None:
        self.version = version


def decode_line(raw: bytes) -> Event:
    """One line as an Event; _Malformed saying why not, _OtherVersion for another format."""
    if not raw.strip():
        raise _Malformed("an empty line")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise _Malformed("not UTF-8") from None
    except RecursionError:
        raise _Malformed("nested too deeply") from None
    except ValueError as exc:
        raise _Malformed(f"not JSON ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(data, dict):
        raise _Malformed(f"a JSON {type(data).__name__}, not an object")
    version = data.get("neffbuild_event")
    if version is None:
        raise _Malformed("no neffbuild_event field: not a neffbuild event")
    if version != EVENT_VERSION or isinstance(version, bool):
        if isinstance(version, int) and not isinstance(version, bool):
            raise _OtherVersion(str(version)[:20])
        raise _Malformed("neffbuild_event is not a version number")
    try:
        return Event.model_validate(data)
    except ValidationError as exc:
        raise _Malformed(_first_problem(exc)) from None


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _first_problem(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and "[" in p)) or "(top level)"
    message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where[:120]}: {message[:160]}{more}"
