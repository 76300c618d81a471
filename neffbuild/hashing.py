"""XXH3-128 digests (the content address) and SHA-256 (the cryptographic binding a signature
covers), computed while bytes move: one pass reads, hashes with both, writes and counts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

CHUNK = 1 << 20
DIGEST_LEN = 32  # hex characters of an XXH3-128 digest
SHA256_LEN = 64  # hex characters of a SHA-256 digest


@dataclass(frozen=True, slots=True)
class Digest:
    """What identifies file content everywhere in neffbuild: XXH3-128 hex plus byte size, and
    its SHA-256 hex ("" where it was not asked for)."""

    hex: str
    size: int
    sha256: str = ""


class Hasher:
    """XXH3-128 and, if asked, SHA-256 of one stream, fed once. SHA-256 is what a signature can
    vouch for (XXH3 is not collision-resistant); both release the GIL on large chunks."""

    __slots__ = ("_sha", "_xxh")

    def __init__(self, *, sha256: bool = True) -> None:
        self._xxh = xxhash.xxh3_128()
        self._sha = hashlib.sha256() if sha256 else None

    def update(self, chunk: bytes | memoryview) -> None:
        self._xxh.update(chunk)
        if self._sha is not None:
            self._sha.update(chunk)

    def xxh3(self) -> str:
        return self._xxh.hexdigest()

    def sha256(self) -> str:
        return "" if self._sha is None else self._sha.hexdigest()


def hash_file(path: Path, *, sha256: bool = True) -> Digest:
    hasher = Hasher(sha256=sha256)
    size = 0
    with path.open("rb") as src:
        while chunk := src.read(CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return Digest(hasher.xxh3(), size, hasher.sha256())


def copy_hashing(src: BinaryIO, dst: BinaryIO) -> Digest:
    """Copy a stream to another, hashing on the way (XXH3 only: the store checks the address)."""
    hasher = Hasher(sha256=False)
    size = 0
    while chunk := src.read(CHUNK):
        hasher.update(chunk)
        dst.write(chunk)
        size += len(chunk)
    return Digest(hasher.xxh3(), size)


def hash_bytes(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> bytes:
    """Stable bytes for hashing and storing documents: sorted keys, no whitespace drift."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def is_digest(text: str) -> bool:
    return len(text) == DIGEST_LEN and all(c in "0123456789abcdef" for c in text)
