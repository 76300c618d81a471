"""What publishing and pack planning hand the store, and what it answers about packs: plain
records with no store behind them, in a module of their own so that reading a store's documents
(a host's no-op pull at every boot) builds none of their classes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class BlobSource:
    """A local file to publish as a blob, already hashed."""

    digest: str
    size: int
    path: Path
    blake3: str = ""  # its BLAKE3, where the build computed one (recorded in the bundle)


# A pack's index (store/packs.py encodes and plans them): here, as Store.pack_indexes returns it.
@dataclass(frozen=True, slots=True)
class PackEntry:
    """One blob inside a pack: where its bytes are."""

    digest: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class PackIndex:
    """A pack's index: the blobs it holds, and where."""

    pack_id: str
    size: int
    entries: tuple[PackEntry, ...]
