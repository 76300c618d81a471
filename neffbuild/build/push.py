"""Copy a release between two stores (local -> S3 after an offline build, one region -> another).

Only what the destination lacks moves, in the publish order (blobs, bundle, release, tag), so the
destination never holds a document that points at absent bytes. A bundle record already in the
destination proves its blobs are there (it was written after them), so an unchanged re-push reads
a few documents and uploads nothing. Blobs travel through a staging directory: the source verifies
each one as it lands there (write_verified), the destination checks it again as it uploads.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from neffbuild.build.publish import move_tag, publish_bundle, publish_release
from neffbuild.build.sign import sign_release
from neffbuild.documents.records import FileEntry
from neffbuild.documents.refs import parse_ref, read_tag, release_bundle, resolve
from neffbuild.documents.signing import Signing
from neffbuild.fs.confined import BlobTarget
from neffbuild.store import StoreChoice
from neffbuild.store.base import Store
from neffbuild.store.blobs import BlobSource


@dataclass(frozen=True, slots=True)
class PushResult:
    release_id: str
    tag: str | None
    source: str
    destination: str
    bundles_copied: int
    blobs_uploaded: int
    bytes_uploaded: int
    tag_moved: bool


def push_between(
    ref: str,
    src: StoreChoice,
    dst: StoreChoice,
    *,
    env: Mapping[str, str],
    jobs: int = 16,
    signing: Signing | None = None,
) -> PushResult:
    """`neffbuild push`: open both stores (the destination is created if absent, once ref is known
    to be well formed) and push."""
    parse_ref(ref)
    source = src.open(env)
    return push(ref, source, dst.open(env, create=True), jobs=jobs, signing=signing)


def push(
    ref: str,
    src: Store,
    dst: Store,
    *,
    jobs: int = 16,
    staging_dir: Path | None = None,
    by: str | None = None,
    signing: Signing | None = None,
) -> PushResult:
    """Copy the release `ref` (see neffbuild.documents.refs) from src to dst; move the tag there too if ref
    is a tag (TAG@N names an old release: it is copied, the tag is not moved). The release's
    signatures go along; with signing, dst's copy is signed (and its tag statement) by that key."""
    resolved = resolve(src, ref)
    release = resolved.release
    copied = blobs = uploaded = 0
    with tempfile.TemporaryDirectory(prefix="neffbuild-push-", dir=staging_dir) as tmp:
        staging = Path(tmp)
        for unit in release.units:
            if dst.get_doc("bundles", unit.key) is not None:
                continue  # written after its blobs: nothing of this bundle is missing
            record = release_bundle(src, resolved, unit)
            sources = _stage_missing(record.files, src, dst, staging, jobs, resolved.release_id)
            uploaded += publish_bundle(dst, record, sources, jobs)
            blobs += len(sources)
            copied += 1
            _clear(sources)
        # Normally every release file came from a bundle; a hand-made release may list others.
        extra = _stage_missing(release.files, src, dst, staging, jobs, resolved.release_id)
        uploaded += dst.put_blobs(extra, jobs)
        blobs += len(extra)
    publish_release(dst, release)
    _copy_signatures(src, dst, resolved.release_id)
    if signing is not None:
        sign_release(dst, resolved.release_id, signing.key)
    moved = resolved.tag is not None and (signing is not None or _tag_target(dst, resolved.tag) != resolved.release_id)
    if moved:
        move_tag(dst, resolved.tag, resolved.release_id, by=by, signing=signing)  # type: ignore[arg-type]
    return PushResult(resolved.release_id, resolved.tag, src.url, dst.url, copied, blobs, uploaded, moved)


def _copy_signatures(src: Store, dst: Store, release_id: str) -> None:
    """The release's signatures, as src holds them (a host checks them against dst's documents)."""
    for info in src.list_objects(f"signatures/{release_id}."):
        name = info.key.removeprefix("signatures/").removesuffix(".json")
        data = src.get_doc("signatures", name)
        if data is not None:
            dst.put_doc("signatures", name, data)


def _stage_missing(
    files: Iterable[FileEntry], src: Store, dst: Store, staging: Path, jobs: int, release_id: str
) -> list[BlobSource]:
    """Bring the blobs dst lacks from src into staging (verified); the sources to upload."""
    sizes = {f.digest: f.size for f in files}
    missing = sorted(dst.missing_blobs(sizes))
    targets = [BlobTarget(d, sizes[d], staging / d, fsync=False) for d in missing]  # scratch copies
    src.download_blobs(targets, jobs, release=release_id)
    return [BlobSource(t.digest, t.size, t.dest) for t in targets]


def _clear(sources: Iterable[BlobSource]) -> None:
    for s in sources:
        s.path.unlink(missing_ok=True)


def _tag_target(store: Store, name: str) -> str | None:
    current = read_tag(store, name)
    return None if current is None else current[0].release
