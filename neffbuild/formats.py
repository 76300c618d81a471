"""Every format string neffbuild ever persisted, with what writes it now and what reads it.

A format string is data: it sits in the bytes of stores, cache dirs and CI files that every
earlier neffbuild wrote, and renaming it makes them unreadable (a layout move once rewrote
`neffbuild.bundle/1` as if it were the module path `neffbuild.documents.records/1`, and `pull`
refused every bundle built before). The rule (docs/architecture.md, "Persisted formats"): a string
here is never renamed or removed; a change of format adds a new string, which writers may take up,
and readers keep accepting every older one. Some strings look like module paths: they are not,
and a module move leaves them alone. tests/documents/test_formats.py reads a fixture written by
each earlier neffbuild (tests/fixtures/formats/, one folder per commit that wrote it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Format:
    """One kind of persisted document: what a person calls it, the formats written today (the
    first is the default), every format ever written (oldest first), and who decodes it."""

    kind: str
    writes: tuple[str, ...]
    reads: tuple[str, ...]
    readers: tuple[str, ...]


FORMATS: dict[str, Format] = {
    f.kind: f
    for f in (
        Format("store marker", ("neffbuild.store/1",), ("neffbuild.store/1",), ("store.base.check_marker",)),
        Format(
            "bundle",
            ("neffbuild.documents.records/2",),
            ("neffbuild.bundle/1", "neffbuild.documents.records/1", "neffbuild.documents.records/2"),
            ("documents.records.parse",),
        ),
        Format(
            "release",
            ("neffbuild.release/2", "neffbuild.release/1"),  # /1: of bundles built before BLAKE3
            ("neffbuild.release/1", "neffbuild.release/2"),
            ("documents.records.parse",),
        ),
        Format(
            "tag",
            ("neffbuild.tag/1", "neffbuild.tag/2"),  # /2: with a signed tag statement
            ("neffbuild.tag/1", "neffbuild.tag/2"),
            ("documents.records.parse",),
        ),
        Format("pack index", ("neffbuild.pack/1",), ("neffbuild.pack/1",), ("store.packs.decode_index",)),
        Format("locator", ("neffbuild.locator/1",), ("neffbuild.locator/1",), ("store.packs.decode_locator",)),
        Format(
            "gc lease",
            ("neffbuild.maint.gc-lease/1",),  # what publishers of 0.1.0 since the layout move read
            ("neffbuild.gc-lease/1", "neffbuild.maint.gc-lease/1"),
            ("store.lease._decode",),
        ),
        # Version 1 of the state had no format field: host.state reads it as such.
        Format(
            "cache state",
            ("neffbuild.cache-state/4",),  # /4: each path once (host/state.py)
            ("neffbuild.cache-state/2", "neffbuild.cache-state/3", "neffbuild.cache-state/4"),  # /3: with expiries
            ("host.state.parse_state",),
        ),
        Format(
            "plan",
            ("neffbuild.units.plan/1",),
            ("neffbuild.plan/1", "neffbuild.units.plan/1"),
            ("units.plandoc.read_plan",),
        ),
        Format(
            "build report",
            ("neffbuild.build.compile-report/1",),
            ("neffbuild.build-report/1", "neffbuild.build.compile-report/1"),
            ("build.report.read_reports",),
        ),
        Format(
            "replay trace", ("neffbuild.replay-trace/1",), ("neffbuild.replay-trace/1",), ("host.trace.read_trace",)
        ),
        # Hashed into every unit's key, never read back: a new one re-keys (rebuilds) every unit.
        # A cache (units/plancache.py): an unknown or older format is a miss, never an error.
        Format("plan cache", ("neffbuild.plan-cache/1",), ("neffbuild.plan-cache/1",), ("units.plancache.lookup",)),
        Format(
            "weights memo",
            ("neffbuild.weights-memo/1",),
            ("neffbuild.weights-memo/1",),
            ("units.weights.weights_digest",),
        ),
        Format("unit key", ("neffbuild.unit/2",), ("neffbuild.unit/2",), ("documents.records.unit_key",)),
        # Two JSON-lines formats carry an integer version under their own key instead.
        Format("readiness line", ("neffbuild_ready=1",), ("neffbuild_ready=1",), ("serve.warmup",)),
        Format("compile event", ("neffbuild_event=1",), ("neffbuild_event=1",), ("maint.events",)),
    )
}


def writes(kind: str) -> str:
    """The format a writer of kind puts in a new document."""
    return FORMATS[kind].writes[0]


def kind_writing(fmt: str) -> Format | None:
    """The kind whose writers use fmt, if any: how a reader that knows its default format finds
    every format it must accept."""
    return next((f for f in FORMATS.values() if fmt in f.writes), None)
