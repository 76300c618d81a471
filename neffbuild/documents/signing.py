"""Ed25519 keys and the signed statements CI writes and hosts check.

Keys are named Nix-style, one line `NAME:base64`: the private key file holds the 32-byte seed
followed by the 32-byte public key (as Nix's `nix key generate-secret`), the public one the
32-byte key. NAME (`ci.example-1`, the suffix bumped on rotation) is the keyid of every
signature it makes and part of the signature's store name.

Both statements are in-toto Statement v1 in a DSSE envelope (payloadType
application/vnd.in-toto+json; the signature is over DSSE's pre-authentication encoding), so
in-toto tooling reads them:

- release (signatures/<release id>.<key name>.json): subject the release id with the BLAKE3 of
  the release document's stored bytes; predicate the files with their BLAKE3 (`resources`, the
  shape OpenSSF model-signing uses) and the BLAKE3 of each unit's bundle document.
  The digest name is `blake3`: lowercase hex of BLAKE3's default 32-byte output (in-toto's
  DigestSet lets producers add algorithms so named; OpenSSF model-signing hashes with it too).
- tag (inside the signed TagRecord): subject the release again; predicate the tag, the release,
  a version that only grows and an expiry time.

The signature is detached: a release's id does not change when it is signed (or signed again).
`cryptography` is imported only when a key is used: a host without trusted keys never loads it.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from neffbuild.documents.records import Envelope, Release, Signature, decode_doc, dump
from neffbuild.errors import InputError, IntegrityError, TrustError
from neffbuild.names import key_problem

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
RELEASE_PREDICATE = "https://neffbuild.dev/release/v1"
TAG_PREDICATE = "https://neffbuild.dev/tag/v1"
KEY_FILE_MAX = 4096
_BLAKE3 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class PublicKey:
    name: str
    raw: bytes  # 32 bytes

    def text(self) -> str:
        return f"{self.name}:{base64.b64encode(self.raw).decode()}"


@dataclass(frozen=True, slots=True)
class SigningKey:
    name: str
    seed: bytes  # 32 bytes
    public: PublicKey

    def text(self) -> str:
        return f"{self.name}:{base64.b64encode(self.seed + self.public.raw).decode()}"


def check_key_name(name: str) -> str:
    if (problem := key_problem(name)) is not None:
        raise InputError(f"key name: {problem}", hint="name keys like `ci.example-1` (bump the suffix on rotation)")
    return name


def generate_key(name: str) -> SigningKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    seed = os.urandom(32)
    return SigningKey(check_key_name(name), seed, PublicKey(name, _public_of(Ed25519PrivateKey, seed)))


def write_key_pair(key: SigningKey, path: Path) -> Path:
    """The private key at path (mode 0600, never replacing a file), the public one at path.pub."""
    public = path.with_name(path.name + ".pub")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise InputError(f"{path}: already exists", hint="keys are never overwritten: choose another PATH") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot create it ({exc.strerror or exc})") from None
    with os.fdopen(fd, "w") as out:
        out.write(key.text() + "\n")
    public.write_text(key.public.text() + "\n")
    return public


def read_signing_key(path: Path) -> SigningKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    name, raw = _key_line(_read_key_file(path), path, 64)
    public = _public_of(Ed25519PrivateKey, raw[:32])
    if public != raw[32:]:
        raise InputError(f"{path}: its public half does not match its seed", hint="the key file is damaged")
    return SigningKey(name, raw[:32], PublicKey(name, public))


def read_public_key(path: Path) -> PublicKey:
    name, raw = _key_line(_read_key_file(path), path, 32)
    return PublicKey(name, raw)


def parse_public_key(text: str, where: str) -> PublicKey:
    name, raw = _key_line(text, where, 32)
    return PublicKey(name, raw)


def _read_key_file(path: Path) -> str:
    try:
        with path.open("rb") as f:
            data = f.read(KEY_FILE_MAX + 1)
    except OSError as exc:
        raise InputError(f"{path}: cannot read the key ({exc.strerror or exc})") from None
    if len(data) > KEY_FILE_MAX:
        raise InputError(f"{path}: over {KEY_FILE_MAX} bytes, not a key file", hint="a key is one line NAME:base64")
    return data.decode("ascii", errors="replace")


def _key_line(text: str, where: object, size: int) -> tuple[str, bytes]:
    name, sep, b64 = text.strip().partition(":")
    what = "public" if size == 32 else "private"
    if not sep or key_problem(name) is not None:
        raise InputError(
            f"{where}: not a {what} key (expected one line NAME:base64)",
            hint="`neffbuild keygen NAME PATH` writes both",
        )
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != size:
        raise InputError(
            f"{where}: key {name!r} is not a {size}-byte Ed25519 {what} key",
            hint="pass the .pub file to hosts, the private one to --sign-key",
        )
    return name, raw


def _public_of(kind: Any, seed: bytes) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return kind.from_private_bytes(seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


# ---- DSSE --------------------------------------------------------------------------------


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is signed (the type cannot be swapped)."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(body), body)


def sign_statement(statement: Mapping[str, Any], key: SigningKey) -> Envelope:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    body = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    sig = Ed25519PrivateKey.from_private_bytes(key.seed).sign(pae(PAYLOAD_TYPE, body))
    return Envelope(
        payloadType=PAYLOAD_TYPE,
        payload=base64.b64encode(body).decode(),
        signatures=(Signature(keyid=key.name, sig=base64.b64encode(sig).decode()),),
    )


def envelope_bytes(envelope: Envelope) -> bytes:
    return dump(envelope)


def parse_envelope(data: bytes, where: str) -> Envelope:
    """A stored envelope, decoded strictly; TrustError (not IntegrityError: with trusted keys the
    signature is what failed) if it is not one."""
    try:
        return decode_doc(Envelope, json.loads(data), where)
    except (ValueError, RecursionError, IntegrityError) as exc:
        raise TrustError(f"{where}: not a DSSE envelope ({_cut(exc)})", hint=_RESIGN) from None


def open_envelope(envelope: Envelope, trusted: Sequence[PublicKey], where: str) -> tuple[dict[str, Any], str]:
    """(the statement, the name of the trusted key whose signature verified): each signature
    whose keyid names a trusted key is checked with that key; none verifying is a TrustError
    naming the keys expected and the keys found."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if envelope.payloadType != PAYLOAD_TYPE:
        raise TrustError(f"{where}: payload type {envelope.payloadType[:80]!r}, not {PAYLOAD_TYPE!r}", hint=_RESIGN)
    try:
        body = base64.b64decode(envelope.payload, validate=True)
    except (binascii.Error, ValueError):
        raise TrustError(f"{where}: the payload is not base64", hint=_RESIGN) from None
    by_name = {k.name: k for k in trusted}
    found = [s.keyid for s in envelope.signatures]
    for signature in envelope.signatures:
        key = by_name.get(signature.keyid)
        if key is None:
            continue
        try:
            Ed25519PublicKey.from_public_bytes(key.raw).verify(
                base64.b64decode(signature.sig, validate=True), pae(envelope.payloadType, body)
            )
        except (InvalidSignature, binascii.Error, ValueError):
            raise TrustError(
                f"{where}: the signature by {_names([key.name])} does not verify with the trusted key of that name",
                hint="forged, damaged, or signed by another key reusing the name: do not serve it; re-sign in CI",
            ) from None
        return _statement(body, where), key.name
    raise TrustError(
        f"{where}: signed by {_names(found) or 'no key'}, none of them trusted (trusted: {_names(by_name)})",
        hint="sign it with a trusted key, or add the signer's public key to --trusted-key / NEFFBUILD_TRUSTED_KEYS",
    )


def _statement(body: bytes, where: str) -> dict[str, Any]:
    try:
        statement = json.loads(body)
    except (ValueError, RecursionError):
        raise TrustError(f"{where}: the signed payload is not JSON", hint=_RESIGN) from None
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise TrustError(f"{where}: the signed payload is not an in-toto Statement v1", hint=_RESIGN)
    return statement


_RESIGN = "the signature is damaged or forged: do not serve it; sign the release again in CI"


def _names(names: Sequence[str] | Mapping[str, Any]) -> str:
    return ", ".join(repr(n[:80]) for n in list(names)[:8])


def _cut(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


# ---- the two statements ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BundleDigest:
    unit_id: str
    key: str
    blake3: str


@dataclass(frozen=True, slots=True)
class ReleaseClaim:
    """What a release signature vouches for."""

    release_id: str
    blake3: str  # of the release document's stored bytes
    files: dict[str, str]  # path -> BLAKE3
    bundles: tuple[BundleDigest, ...]


@dataclass(frozen=True, slots=True)
class TagClaim:
    """What a signed tag statement vouches for."""

    tag: str
    release_id: str
    blake3: str
    version: int
    expires: datetime


def _subject(release_id: str, blake3: str) -> list[dict[str, Any]]:
    return [{"name": release_id, "digest": {"blake3": blake3}}]


def release_statement(
    release_id: str, release_blake3: str, release: Release, bundles: Sequence[BundleDigest]
) -> dict[str, Any]:
    return {
        "_type": STATEMENT_TYPE,
        "subject": _subject(release_id, release_blake3),
        "predicateType": RELEASE_PREDICATE,
        "predicate": {
            "release": {"name": release.name, "format": release.format},
            "serialization": {"method": "files", "hash_type": "blake3", "allow_symlinks": False},
            "resources": [{"name": f.path, "algorithm": "blake3", "digest": f.blake3} for f in release.files],
            "bundles": [{"unit": b.unit_id, "key": b.key, "algorithm": "blake3", "digest": b.blake3} for b in bundles],
        },
    }


def tag_statement(tag: str, release_id: str, release_blake3: str, version: int, expires: datetime) -> dict[str, Any]:
    return {
        "_type": STATEMENT_TYPE,
        "subject": _subject(release_id, release_blake3),
        "predicateType": TAG_PREDICATE,
        "predicate": {
            "tag": tag,
            "release": release_id,
            "version": version,
            "expires": expires.astimezone(UTC).isoformat(timespec="seconds"),
        },
    }


def release_claim(statement: Mapping[str, Any], where: str) -> ReleaseClaim:
    """The claim of a verified release statement, every field checked (TrustError if malformed)."""
    try:
        release_id, digest = _subject_of(statement, RELEASE_PREDICATE)
        predicate = statement["predicate"]
        files = {}
        for r in predicate["resources"]:
            if r["algorithm"] != "blake3" or not _BLAKE3.fullmatch(r["digest"]) or not isinstance(r["name"], str):
                raise ValueError("a resource without a blake3 digest")
            files[r["name"]] = r["digest"]
        bundles = tuple(
            BundleDigest(_text(b["unit"]), _text(b["key"]), _blake3(b["digest"])) for b in predicate["bundles"]
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TrustError(f"{where}: a malformed release statement ({_cut(exc)})", hint=_RESIGN) from None
    return ReleaseClaim(release_id, digest, files, bundles)


def tag_claim(statement: Mapping[str, Any], where: str) -> TagClaim:
    try:
        release_id, digest = _subject_of(statement, TAG_PREDICATE)
        predicate = statement["predicate"]
        version = predicate["version"]
        if type(version) is not int or version < 0:
            raise ValueError(f"version {version!r} is not a whole number")
        expires = datetime.fromisoformat(_text(predicate["expires"]))
        if expires.tzinfo is None:
            raise ValueError("expires has no time zone")
        if predicate["release"] != release_id:
            raise ValueError("its release is not its subject")
        claim = TagClaim(_text(predicate["tag"]), release_id, digest, version, expires)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TrustError(f"{where}: a malformed tag statement ({_cut(exc)})", hint=_RESIGN) from None
    return claim


def _subject_of(statement: Mapping[str, Any], predicate_type: str) -> tuple[str, str]:
    if statement.get("predicateType") != predicate_type:
        raise ValueError(f"predicate type {str(statement.get('predicateType'))[:80]!r}, not {predicate_type!r}")
    subjects = statement["subject"]
    if len(subjects) != 1:
        raise ValueError("expected one subject")
    return _text(subjects[0]["name"]), _blake3(subjects[0]["digest"]["blake3"])


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _blake3(value: Any) -> str:
    if not isinstance(value, str) or not _BLAKE3.fullmatch(value):
        raise ValueError(f"{str(value)[:80]!r} is not a BLAKE3 digest")
    return value


def parse_expiry(text: str, now: datetime | None = None) -> datetime:
    """`7d`, `12h`, `30m` or `90s` from now: when a tag statement stops being accepted."""
    match = re.fullmatch(r"([1-9][0-9]{0,5})([smhd])", text.strip())
    if match is None:
        raise InputError(f"--expires {text!r}: expected a duration such as 7d, 12h or 30m")
    seconds = int(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]
    from datetime import timedelta

    return (now or datetime.now(UTC)) + timedelta(seconds=seconds)


DEFAULT_EXPIRY = "30d"


@dataclass(frozen=True, slots=True)
class Signing:
    """What CI signs with (--sign-key) and how long a tag statement it signs stays fresh (--expires)."""

    key: SigningKey
    expires: datetime
