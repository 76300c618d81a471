"""A bundle record: the cache files one build unit produced, and everything that keyed them.

A document of records.py's family (encoded, decoded and checked by its `dump` and `parse`), kept
in a module of its own so that what only reads releases and tags (a host's no-op pull at every
boot) does not build its classes (each frozen dataclass costs its module's import about 0.5 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neffbuild.documents.fields import checked, digest_problem, distinct_paths, reads_problem
from neffbuild.documents.records import BUNDLE_FORMAT, FileEntry


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds a unit's build spent loading, on its first call and in all."""

    load_s: float = 0.0
    first_call_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class BundleRecord:
    """The cache files one build unit produced, and everything that keyed them."""

    key: str = field(metadata=checked(digest_problem))
    unit_id: str
    unit: dict[str, Any]
    backend: str
    fingerprint: dict[str, str]
    files: tuple[FileEntry, ...] = field(metadata=checked(distinct_paths))
    counters: dict[str, int]
    timings: Timings
    created_at: str
    neffbuild_version: str
    format: str = BUNDLE_FORMAT
    # What each listed component received during the warmup, one line per distinct call
    # (shapes, dtypes, plain values): two bundles with equal inputs compiled the same graphs.
    inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Bytes: the build's worker's peak RSS (or its C++ compiler's), which sizes the next build's
    # `--unit-memory auto` share; 0 where not recorded (bundles from before it was).
    peak_rss: int = 0
    # Each environment variable the compiling process read (backends/envreads.py): name -> XXH3
    # of "NAME=value", "" where unset; and the compiler's own key inputs (config hashes) as
    # digests. Optional: bundles written before them keep their bytes.
    env_reads: dict[str, str] = field(default_factory=dict, metadata={"check": lambda v: reads_problem(v), "omit": {}})
    compiler_keys: dict[str, str] = field(default_factory=dict, metadata={"omit": {}})


@dataclass(frozen=True)
class ResolvedBundle:
    """A bundle a ref names, read from the store (documents/refs.py's resolve_any)."""

    key: str
    record: BundleRecord
    where: str
