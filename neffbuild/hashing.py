"""XXH3-128 digests, computed while bytes move (one pass: read, hash, write, count)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

CHUNK = 1 << 20
DIGEST_LEN = 32  # hex characters of an XXH3-128 digest


@dataclass(frozen=True, slots=True)
class Digest:
    """What identifies file content everywhere in neffbuild: XXH3-128 hex plus byte size."""

    hex: str
    size: int


def hash_file(path: Path) -> Digest:
    hasher = xxhash.xxh3_128()
    size = 0
    with path.open("rb") as src:
        while chunk := src.read(CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return Digest(hasher.hexdigest(), size)


def copy_hashing(src: BinaryIO, dst: BinaryIO) -> Digest:
    """Copy a stream to another, hashing on the way."""
    hasher = xxhash.xxh3_128()
    size = 0
    while chunk := src.read(CHUNK):
        hasher.update(chunk)
        dst.write(chunk)
        size += len(chunk)
    return Digest(hasher.hexdigest(), size)


def hash_bytes(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def canonical_json(value: Any) -> bytes:
    """Stable bytes for hashing and storing documents: sorted keys, no whitespace drift."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def is_digest(text: str) -> bool:
    return len(text) == DIGEST_LEN and all(c in "0123456789abcdef" for c in text)
