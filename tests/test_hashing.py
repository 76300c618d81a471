"""Digests are XXH3-128 (and BLAKE3, the cryptographic one) over the exact bytes, computed in one
pass while copying."""

from __future__ import annotations

import io
import os
from pathlib import Path

import blake3
import xxhash

from neffbuild.hashing import CHUNK, Hasher, blake3_bytes, canonical_json, copy_hashing, hash_file, is_digest


def test_file_digest_is_xxh3_128_of_its_bytes_across_chunk_boundaries(tmp_path: Path) -> None:
    for size in (0, 1, CHUNK - 1, CHUNK, 3 * CHUNK + 17):
        data = os.urandom(size)
        path = tmp_path / f"f{size}"
        path.write_bytes(data)
        digest = hash_file(path)
        assert (digest.hex, digest.size) == (xxhash.xxh3_128_hexdigest(data), size)
        assert digest.blake3 == blake3.blake3(data).hexdigest() == blake3_bytes(data)
        assert is_digest(digest.hex)


def test_the_cryptographic_digest_is_blake3_and_only_when_asked() -> None:
    # BLAKE3's published test vector for the empty input: the default, unkeyed 32-byte hash.
    assert Hasher().crypto() == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    hasher = Hasher(crypto=False)
    hasher.update(b"abc")
    assert hasher.crypto() == "" and hasher.xxh3() == xxhash.xxh3_128_hexdigest(b"abc")


def test_copy_hashing_copies_exactly_and_hashes_what_it_copied() -> None:
    data = os.urandom(2 * CHUNK + 5)
    out = io.BytesIO()
    digest = copy_hashing(io.BytesIO(data), out)
    assert out.getvalue() == data
    assert digest.hex == xxhash.xxh3_128_hexdigest(data) and digest.size == len(data)


def test_one_flipped_bit_changes_the_digest(tmp_path: Path) -> None:
    data = bytearray(os.urandom(4096))
    a = tmp_path / "a"
    a.write_bytes(data)
    data[100] ^= 1
    b = tmp_path / "b"
    b.write_bytes(data)
    assert hash_file(a).hex != hash_file(b).hex


def test_canonical_json_ignores_key_order() -> None:
    assert canonical_json({"b": 1, "a": [1, {"y": 2, "x": 1}]}) == canonical_json({"a": [1, {"x": 1, "y": 2}], "b": 1})
    assert not is_digest("g" * 32) and not is_digest("a" * 31)
