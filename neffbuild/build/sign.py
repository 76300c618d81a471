"""Signing in CI: a detached signature over a release, written beside it in the store.

The release is read back from the store and signed as stored (the BLAKE3 of its bytes, and of
each unit's bundle document as stored: another store's bundle of the same key may differ in its
build time). Signing again with the same key writes nothing (Ed25519 signatures are
deterministic, so the same statement gives the same bytes).
"""

from __future__ import annotations

import logging

from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.records import Release
from neffbuild.documents.refs import checked_doc, doc_where, load_doc
from neffbuild.documents.signing import (
    BundleDigest,
    SigningKey,
    envelope_bytes,
    release_statement,
    sign_statement,
)
from neffbuild.errors import InputError, NotFoundError
from neffbuild.hashing import blake3_bytes
from neffbuild.store.base import Store

log = logging.getLogger(__name__)


def signature_name(release_id: str, key_name: str) -> str:
    return f"{release_id}.{key_name}"


def sign_release(store: Store, release_id: str, key: SigningKey) -> str:
    """Write the signature of release_id by key (unless present); its document name."""
    data = store.get_doc("releases", release_id)
    if data is None:
        raise NotFoundError(f"release {release_id} not found in {store.url}", hint="publish it before signing it")
    release = checked_doc(Release, data, doc_where(store, Release, release_id), release_id)
    if not release.signable:
        raise InputError(
            f"release {release_id} ({release.name}) lists files without BLAKE3 (format {release.format})",
            hint="its bundles were built by an older neffbuild: rebuild them (a new store, or gc them first), then sign",
        )
    bundles = []
    for unit in release.units:
        raw = store.get_doc("bundles", unit.key)
        if raw is None:
            load_doc(store, BundleRecord, unit.key)  # raises NotFoundError naming it
        assert raw is not None
        bundles.append(BundleDigest(unit.unit_id, unit.key, blake3_bytes(raw)))
    statement = release_statement(release_id, blake3_bytes(data), release, bundles)
    name = signature_name(release_id, key.name)
    written = store.put_doc("signatures", name, envelope_bytes(sign_statement(statement, key)))
    log.info("release %s signed by %s%s", release_id, key.name, "" if written else " (already)")
    return name
