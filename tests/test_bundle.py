"""Stored documents: strict decoding (they arrive from the network) and stable content ids."""

from __future__ import annotations

import json

import pytest

from neffbuild.bundle import (
    FileEntry,
    Release,
    ReleaseUnit,
    TagEvent,
    TagRecord,
    dump,
    parse,
)
from neffbuild.errors import IntegrityError

DIGEST = "0123456789abcdef0123456789abcdef"


def release(**changes: object) -> Release:
    fields: dict = {
        "name": "m", "manifest_digest": DIGEST, "backend": "inductor", "cache_env": "TORCHINDUCTOR_CACHE_DIR",
        "env": {"OMP_NUM_THREADS": "2"}, "fingerprint": {"torch": "2.13.0"},
        "units": (ReleaseUnit(unit_id="m/1x1x1", key=DIGEST),),
        "files": (FileEntry(path="ab/c.so", size=3, digest=DIGEST),),
    }  # fmt: skip
    return Release(**{**fields, **changes})


def test_round_trip_keeps_the_document_and_its_id() -> None:
    doc = release()
    back = parse(Release, dump(doc), "r.json")
    assert back == doc and back.release_id == doc.release_id


def test_release_id_is_the_digest_of_canonical_json() -> None:
    # Pinned: a change here would rename every release ever published (and re-upload them).
    doc = release()
    assert dump(doc).startswith(b'{"backend":"inductor","cache_env"')
    assert doc.release_id != release(env={"OMP_NUM_THREADS": "4"}).release_id


def mutated(edit) -> bytes:
    raw = json.loads(dump(release()))
    edit(raw)
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.update(extra=1), "at extra: unknown field"),
        (lambda r: r.pop("files"), "at files: field required"),
        (lambda r: r.update(files={}), "at files: expected a list"),
        (lambda r: r["files"][0].update(size="3"), "at files.0.size: expected int, got str"),
        (lambda r: r["files"][0].update(size=True), "at files.0.size: expected int, got bool"),
        (lambda r: r["files"][0].update(size=-1), "at files.0.size: -1 is negative"),
        (lambda r: r["files"][0].update(digest="ABC"), "at files.0.digest: 'ABC' is not a 32-digit"),
        (lambda r: r["files"][0].update(path="../etc/passwd"), "unsafe path '../etc/passwd'"),
        (lambda r: r["files"][0].update(path="/abs"), "unsafe path '/abs'"),
        (lambda r: r["files"][0].update(path="a//b"), "unsafe path 'a//b'"),
        (lambda r: r["env"].update(X=1), "at env.X: expected str, got int"),
        (lambda r: r["units"][0].update(key=None), "at units.0.key: expected str, got NoneType"),
    ],
)
def test_malformed_documents_are_integrity_errors_naming_the_field(edit, message: str) -> None:
    with pytest.raises(IntegrityError) as info:
        parse(Release, mutated(edit), "s3://b/releases/r.json")
    assert info.value.message.startswith("s3://b/releases/r.json: invalid Release")
    assert message in info.value.message


def test_wrong_format_and_broken_json_are_refused() -> None:
    with pytest.raises(IntegrityError, match="format 'neffbuild.release/9'"):
        parse(Release, mutated(lambda r: r.update(format="neffbuild.release/9")), "r.json")
    with pytest.raises(IntegrityError, match="not valid JSON"):
        parse(Release, b'{"name": ', "r.json")
    with pytest.raises(IntegrityError, match="expected an object"):
        parse(TagRecord, b"[]", "t.json")


def test_tag_history_decodes_nested_records_and_defaults() -> None:
    event = TagEvent(release=DIGEST, at="2026-01-01T00:00:00+00:00", by="ci")
    raw = json.loads(dump(TagRecord(name="prod", release=DIGEST, history=(event,))))
    raw.pop("format")  # an absent field with a default takes it... then the format check refuses None
    with pytest.raises(IntegrityError, match="format None"):
        parse(TagRecord, json.dumps(raw).encode(), "t.json")
    raw["format"] = "neffbuild.tag/1"
    tag = parse(TagRecord, json.dumps(raw).encode(), "t.json")
    assert tag.history == (event,) and isinstance(tag.history, tuple)
