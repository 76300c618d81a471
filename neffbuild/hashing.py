"""XXH3-128 digests (the content address) and BLAKE3 (the cryptographic binding a signature
covers), computed while bytes move: one pass reads, hashes with both, writes and counts.

Why BLAKE3 and not SHA-256: both are collision-resistant, but on the benchmark's large-file pull
SHA-256 (1.7 GB/s per core with SHA-NI) cost 1.37x the XXH3-only pull, BLAKE3 (5.7 GB/s) far
less (bench/RESULTS.md, "trust").
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

CHUNK = 1 << 20
DIGEST_LEN = 32  # hex characters of an XXH3-128 digest
BLAKE3_LEN = 64  # hex characters of a BLAKE3 digest (its default 32-byte output)
_DIGEST = re.compile(r"[0-9a-f]{32}")


def _blake3(data: bytes | memoryview = b"") -> Any:
    """A BLAKE3 hasher, its module imported on first use (a no-op pull hashes nothing)."""
    from blake3 import blake3

    return blake3(data)


@dataclass(frozen=True, slots=True)
class Digest:
    """What identifies file content everywhere in neffbuild: XXH3-128 hex plus byte size, and
    its BLAKE3 hex ("" where it was not asked for)."""

    hex: str
    size: int
    blake3: str = ""


class Hasher:
    """XXH3-128 and, if asked, the cryptographic digest (BLAKE3) of one stream, fed once. The
    cryptographic one is what a signature can vouch for (XXH3 is not collision-resistant); both
    release the GIL on large chunks."""

    __slots__ = ("_crypto", "_xxh")

    def __init__(self, *, crypto: bool = True) -> None:
        self._xxh = xxhash.xxh3_128()
        # One thread: on a pull, several blobs are hashed at once already (measured: bench/trust.py).
        self._crypto = _blake3() if crypto else None

    def update(self, chunk: bytes | memoryview) -> None:
        self._xxh.update(chunk)
        if self._crypto is not None:
            self._crypto.update(chunk)

    def xxh3(self) -> str:
        return self._xxh.hexdigest()

    def crypto(self) -> str:
        """The BLAKE3 hex, or "" if not asked for."""
        return "" if self._crypto is None else self._crypto.hexdigest()


def hash_file(path: Path, *, crypto: bool = True) -> Digest:
    hasher = Hasher(crypto=crypto)
    size = 0
    with path.open("rb") as src:
        while chunk := src.read(CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return Digest(hasher.xxh3(), size, hasher.crypto())


def hash_whole(data: bytes | memoryview, *, crypto: bool = True) -> tuple[str, str]:
    """(XXH3-128, BLAKE3 or "") of bytes already in memory: one call each, no hasher objects
    (most cache files are read whole in one read, and their per-file work is what verify pays)."""
    return xxhash.xxh3_128_hexdigest(data), _blake3(data).hexdigest() if crypto else ""


def copy_hashing(src: BinaryIO, dst: BinaryIO) -> Digest:
    """Copy a stream to another, hashing on the way (XXH3 only: the store checks the address)."""
    hasher = Hasher(crypto=False)
    size = 0
    while chunk := src.read(CHUNK):
        hasher.update(chunk)
        dst.write(chunk)
        size += len(chunk)
    return Digest(hasher.xxh3(), size)


def hash_bytes(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def blake3_bytes(data: bytes) -> str:
    return _blake3(data).hexdigest()


def canonical_json(value: Any) -> bytes:
    """Stable bytes for hashing and storing documents: sorted keys, no whitespace drift."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def is_digest(text: str) -> bool:
    # A regex, not a loop over the characters: the cache state checks one per file (10x faster).
    return _DIGEST.fullmatch(text) is not None


_DIGEST_COLUMN = re.compile(r"(?:[0-9a-f]{32}\n)*")


def all_digests(texts: Collection[str]) -> bool:
    """is_digest of each (all str), with one regex over them joined: 10,000s in a state file."""
    joined = "\n".join(texts) + "\n" if texts else ""
    return joined.count("\n") == len(texts) and _DIGEST_COLUMN.fullmatch(joined) is not None
