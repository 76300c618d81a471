"""What a host with trusted keys accepts: signed, fresh, never older, before anything is written.

With trusted keys (`--trusted-key PUBFILE`, repeatable, or NEFFBUILD_TRUSTED_KEYS: public key
files separated by commas, several during a rotation), a release is served only if:

1. it was named by a tag whose signed statement (in the tag document) verifies with a trusted
   key, names this tag and the release the tag points at, has not expired, and has a version no
   lower than the highest this cache dir accepted for the tag (its state records that, written
   only once the whole pull passed); or it was pinned by id (`--release ID`: no tag is read);
2. a signature by a trusted key over the release verifies, and its statement's subject is the
   BLAKE3 of the release document's bytes as stored, its files are the release's files with
   their BLAKE3 (each blob is then checked against it while it is written), and its bundles'
   BLAKE3 match the bundle documents as stored.

Every document is read once, from the bytes that were checked: nothing is read again after its
check (a store that changes between two reads cannot slip another version in).
Without trusted keys nothing here runs: the host trusts whoever can write the store.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.records import Release, TagRecord
from neffbuild.documents.refs import ResolvedRelease, checked_doc, doc_where, parse_ref, read_tag
from neffbuild.errors import InputError, NotFoundError, TrustError
from neffbuild.hashing import blake3_bytes, is_digest
from neffbuild.names import TRUSTED_KEYS_ENV, check_digest
from neffbuild.store.base import Store

if TYPE_CHECKING:  # signing is read only where keys are trusted: a pull without keys never imports it
    from neffbuild.documents.signing import PublicKey, ReleaseClaim, TagClaim


@dataclass(frozen=True, slots=True)
class Trust:
    """The keys a host trusts; pin: a release id to serve whatever the tags say (--release)."""

    keys: tuple[PublicKey, ...]
    pin: str | None = None

    @property
    def names(self) -> str:
        return ", ".join(repr(k.name) for k in self.keys)


def trust_from(paths: Sequence[Path], env: Mapping[str, str], pin: str | None = None) -> Trust | None:
    """The host's trust: --trusted-key files, else NEFFBUILD_TRUSTED_KEYS; None if neither (a
    --release pin alone is an InputError: pinning vouches for nothing without a key). The variable
    set to no file at all is a TrustError, never no verification."""
    files = list(paths) or [Path(p.strip()) for p in env.get(TRUSTED_KEYS_ENV, "").split(",") if p.strip()]
    if not files and not paths and TRUSTED_KEYS_ENV in env:
        # Set but empty (a template whose value did not expand): whoever set it meant to require
        # signatures, so it fails closed like any trust failure instead of turning checks off.
        raise TrustError(
            f"{TRUSTED_KEYS_ENV} is set but names no public key file: verification would be off",
            hint=f"list the trusted public key files (comma-separated), or unset {TRUSTED_KEYS_ENV} to trust"
            " whoever can write the store",
        )
    if not files:
        if pin is not None:
            raise InputError("--release pins a signed release", hint=f"give --trusted-key or set {TRUSTED_KEYS_ENV}")
        return None
    from neffbuild.documents.signing import read_public_key

    keys = tuple(read_public_key(p) for p in files)
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise InputError(f"two trusted keys are both named {sorted(n for n in names if names.count(n) > 1)[0]!r}")
    return Trust(keys, check_digest(pin, "--release") if pin is not None else None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Signed:
    """Who signed what, and until when: what `status` and `pull` report."""

    release_id: str
    signed_by: str
    tag: str | None
    tag_signed_by: str | None
    tag_version: int | None
    tag_expires: str | None


@dataclass(frozen=True, slots=True)
class Verified:
    """A release that passed every check, with the documents it was checked from."""

    resolved: ResolvedRelease
    bundles: tuple[BundleRecord, ...]  # in the release's unit order
    signer: str  # the trusted key whose release signature verified
    tag: TagClaim | None  # None: pinned by id
    tag_signer: str | None

    def summary(self) -> Signed:
        tag = self.tag
        return Signed(
            release_id=self.resolved.release_id,
            signed_by=self.signer,
            tag=tag.tag if tag else None,
            tag_signed_by=self.tag_signer,
            tag_version=tag.version if tag else None,
            tag_expires=tag.expires.isoformat() if tag else None,
        )

    def expires(self, before: Mapping[str, str]) -> dict[str, str]:
        """When each tag's accepted statement expires, once this pull completes (a stale boot
        checks it: host/fallback.py)."""
        if self.tag is None:
            return dict(before)
        return {**before, self.tag.tag: self.tag.expires.isoformat()}

    def accepted(self, before: Mapping[str, int]) -> dict[str, int]:
        """The highest tag versions accepted once this pull completes."""
        if self.tag is None:
            return dict(before)
        return {**before, self.tag.tag: max(before.get(self.tag.tag, 0), self.tag.version)}


def verify_release(
    store: Store, ref: str | None, trust: Trust, accepted: Mapping[str, int], now: datetime | None = None
) -> Verified:
    """REF (or trust.pin) checked as the module docstring says; TrustError naming what failed."""
    now = now or datetime.now(UTC)
    claim, tag_signer = (None, None) if trust.pin is not None else _tag(store, ref, trust, accepted, now)
    release_id = trust.pin or (claim.release_id if claim else _pinned_ref(ref))
    where = doc_where(store, Release, release_id)
    data = store.get_doc("releases", release_id)
    if data is None:
        raise NotFoundError(f"release {release_id} not found in {store.url}", hint="build or push it first")
    # Bytes that re-encode to the id pass checked_doc; the BLAKE3 of the bytes themselves is what was signed.
    crypto = blake3_bytes(data)
    if claim is not None and claim.blake3 != crypto:
        raise TrustError(
            f"{where}: its BLAKE3 is not the one tag {claim.tag!r}'s signed statement names",
            hint="the release document was replaced after signing: do not serve this store",
        )
    release = checked_doc(Release, data, where, release_id)
    signed, signer = _release_signature(store, release_id, trust)
    _check_release(signed, release_id, crypto, release, where)
    bundles = _bundles(store, release, signed, where)
    resolved = ResolvedRelease(release_id, release, claim.tag if claim else None, where)
    return Verified(resolved, bundles, signer, claim, tag_signer)


def _pinned_ref(ref: str | None) -> str:
    assert ref is not None
    return ref


def _tag(
    store: Store, ref: str | None, trust: Trust, accepted: Mapping[str, int], now: datetime
) -> tuple[TagClaim | None, str | None]:
    """The verified statement of REF's tag; (None, None) if REF is a whole release id."""
    if ref is None:
        raise InputError("name a tag or a release", hint="give TAG_OR_RELEASE, or --release ID")
    parsed = parse_ref(ref)
    if parsed.back is None and is_digest(parsed.name):
        return None, None
    if parsed.back is not None or not parsed.may_be_tag:
        raise InputError(
            f"{ref!r}: with trusted keys, name a tag or a whole release id",
            hint="TAG@N and id prefixes are not signed names: give the release id (or --release ID)",
        )
    found = read_tag(store, parsed.name)
    if found is None:
        raise NotFoundError(f"tag {parsed.name!r} not found in {store.url}", hint="check the tag, or --store")
    record = found[0]
    where = doc_where(store, TagRecord, record.name)
    if record.statement is None:
        raise TrustError(
            f"{where}: tag {record.name!r} has no signed statement (trusted keys: {trust.names})",
            hint="move the tag in CI with --sign-key, or pin a signed release with --release ID",
        )
    from neffbuild.documents.signing import open_envelope, tag_claim

    statement, signer = open_envelope(record.statement, trust.keys, f"{where} (tag statement)")
    claim = tag_claim(statement, f"{where} (tag statement)")
    if claim.tag != record.name or claim.release_id != record.release:
        raise TrustError(
            f"{where}: points at {record.release}, but its signed statement says tag {claim.tag!r} -> {claim.release_id}",
            hint="the tag was moved or copied without signing: do not serve it; move it again in CI with --sign-key",
        )
    if claim.expires <= now:
        raise TrustError(
            f"{where}: the signed statement of tag {record.name!r} expired at {claim.expires.isoformat()}",
            hint="CI must re-sign the tag (`neffbuild tag NAME RELEASE --sign-key K --expires 7d`) before it expires",
        )
    highest = accepted.get(record.name, 0)
    if claim.version < highest:
        raise TrustError(
            f"{where}: tag {record.name!r} statement version {claim.version} is lower than {highest}, "
            "the highest this cache dir accepted: a rollback",
            hint="someone restored an older signed tag; to go back on purpose, CI signs the old release anew (a higher version)",
        )
    return claim, signer


def _release_signature(store: Store, release_id: str, trust: Trust) -> tuple[ReleaseClaim, str]:
    """The claim of the first trusted key's signature present; TrustError naming the keys
    expected and those that did sign, if none is there."""
    from neffbuild.documents.signing import open_envelope, parse_envelope, release_claim

    for key in trust.keys:
        name = f"{release_id}.{key.name}"
        data = store.get_doc("signatures", name)
        if data is None:
            continue
        where = f"{store.url}/signatures/{name}.json"
        statement, signer = open_envelope(parse_envelope(data, where), (key,), where)
        return release_claim(statement, where), signer
    found = sorted(
        o.key.removeprefix(f"signatures/{release_id}.").removesuffix(".json")
        for o in store.list_objects(f"signatures/{release_id}.")
    )
    if found:
        raise TrustError(
            f"release {release_id} is signed by {', '.join(repr(f[:80]) for f in found[:8])}, "
            f"none of them trusted (trusted: {trust.names})",
            hint="add the signer's public key to --trusted-key / NEFFBUILD_TRUSTED_KEYS, or sign it with a trusted key",
        )
    raise TrustError(
        f"release {release_id} in {store.url} is not signed (trusted keys: {trust.names})",
        hint="sign it in CI (`--sign-key` on build, release, push or tag)",
    )


def _check_release(claim: ReleaseClaim, release_id: str, crypto: str, release: Release, where: str) -> None:
    if claim.release_id != release_id or claim.blake3 != crypto:
        raise TrustError(
            f"{where}: the release signature vouches for {claim.release_id} with another BLAKE3, not these bytes",
            hint="the release document was replaced after signing: do not serve this store",
        )
    files = {f.path: f.blake3 for f in release.files}
    if claim.files != files:
        bad = sorted(set(claim.files.items()) ^ set(files.items()))[0][0]
        raise TrustError(
            f"{where}: file {bad[:200]!r} differs from the signed statement's",
            hint="the release was altered after signing: do not serve this store",
        )


def _bundles(store: Store, release: Release, claim: ReleaseClaim, where: str) -> tuple[BundleRecord, ...]:
    signed = {(b.unit_id, b.key): b.blake3 for b in claim.bundles}
    wanted = [(u.unit_id, u.key) for u in release.units]
    if set(signed) != set(wanted):
        raise TrustError(
            f"{where}: its units are not the signed statement's", hint="the release was altered after signing"
        )
    found = store.get_docs("bundles", [key for _, key in wanted], jobs=16)
    records = []
    for unit_id, key in wanted:
        data = found.get(key)
        bundle_where = doc_where(store, BundleRecord, key)
        if data is None:
            raise NotFoundError(f"{bundle_where}: bundle of {unit_id} missing", hint="the store is damaged; push again")
        if blake3_bytes(data) != signed[(unit_id, key)]:
            raise TrustError(
                f"{bundle_where}: the bundle of {unit_id} is not the one signed (its BLAKE3 differs)",
                hint="the bundle document was altered after signing: do not serve this store",
            )
        records.append(checked_doc(BundleRecord, data, bundle_where, key))
    return tuple(records)


def key_names(keys: Collection[PublicKey]) -> tuple[str, ...]:
    return tuple(k.name for k in keys)
