"""The release a command means for a cache dir (`env`, `status`): host/cachedir.py's find_target
answers one. A module of its own so that a pull, which names its release itself, does not build
the class."""

from __future__ import annotations

from dataclasses import dataclass

from neffbuild.documents.records import Release
from neffbuild.host.state import InstalledUnit


@dataclass(frozen=True, slots=True)
class Target:
    """A release named for a cache dir (the installed one, or REF's), with its units' key parts."""

    release_id: str
    release: Release
    tag: str | None
    units: tuple[InstalledUnit, ...]
    source: str
