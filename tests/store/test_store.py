"""The store protocol, run unchanged against the local store and the S3 store (real SeaweedFS)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neffbuild.errors import InputError, IntegrityError, NeffbuildError, NotFoundError, StoreError
from neffbuild.fs.confined import BlobTarget
from neffbuild.hashing import hash_bytes
from neffbuild.store import open_store
from neffbuild.store.base import MARKER, MARKER_MAX, STORE_FORMAT, ObjectInfo, Store, blob_key, check_marker, doc_key
from neffbuild.store.blobs import BlobSource
from tests.storekit import (
    corrupt_blob,
    keys_of,
    publish_release_of,
    s3_client,
    small_and_large,
    write_files,
)

DOC = b'{"format":"x"}'


# "s3" signs its reads itself (static credentials in the environment: store/s3/sigv4.py); "s3-profile"
# takes credentials from a profile in a credentials file, so botocore resolves and signs them.
@pytest.fixture(
    params=["local", pytest.param("s3", marks=pytest.mark.s3), pytest.param("s3-profile", marks=pytest.mark.s3)]
)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def env(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    if kind == "local":
        return {}
    s3_env = request.getfixturevalue("s3_env")
    if kind == "s3":
        return s3_env
    credentials = tmp_path / "aws-credentials"
    credentials.write_text(
        f"[neffbuild-test]\naws_access_key_id = {s3_env['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {s3_env['AWS_SECRET_ACCESS_KEY']}\n"
    )
    profile_env = {k: v for k, v in s3_env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    return {**profile_env, "AWS_PROFILE": "neffbuild-test", "AWS_SHARED_CREDENTIALS_FILE": str(credentials)}


@pytest.fixture
def store_url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    return str(tmp_path / "store") if kind == "local" else request.getfixturevalue("s3_url")


@pytest.fixture
def store(store_url: str, env: dict[str, str]) -> Store:
    return open_store(store_url, create=True, env=env)


def fetch_all(store: Store, sources: list[BlobSource], dest: Path, jobs: int = 8) -> list[BlobTarget]:
    targets = [BlobTarget(s.digest, s.size, dest / s.path.name) for s in sources]
    store.download_blobs(targets, jobs)
    return targets


# ---- opening and layout -------------------------------------------------------------------------


def test_a_new_store_holds_only_its_marker(store: Store, env: dict[str, str]) -> None:
    assert keys_of(store, env) == {MARKER}
    assert json.loads(_read(store, MARKER, env)) == {"format": STORE_FORMAT}


def test_opening_without_create_needs_an_existing_store(store_url: str, env: dict[str, str]) -> None:
    with pytest.raises(StoreError, match="no neffbuild store") as err:
        open_store(store_url, env=env)
    assert err.value.hint
    open_store(store_url, create=True, env=env)
    assert open_store(store_url, env=env).url == open_store(store_url, env=env).url  # opens twice, no error


CREATOR = """
import sys, time
from neffbuild.errors import NeffbuildError
from neffbuild.store import open_store
url, start, env = sys.argv[1], float(sys.argv[2]), dict(a.split("=", 1) for a in sys.argv[3:])
time.sleep(max(0.0, start - time.time()))
try:
    open_store(url, create=True, env=env)
except NeffbuildError as exc:
    sys.exit(f"{type(exc).__name__}: {exc.message}")
"""


@pytest.mark.parametrize("stagger", [0.0, 0.004])
def test_processes_creating_one_new_store_at_once_all_open_it(
    store_url: str, env: dict[str, str], stagger: float
) -> None:
    """CI shards and fleet workers open one new store at the same moment, or a few milliseconds
    apart (one sees no marker, then the other's marker when it looks whether the place is empty):
    whichever writes the marker first, the others open that store, not call it foreign."""
    if store_url.startswith("s3://"):  # a new bucket too: each creator finds none and makes it
        store_url = f"s3://new-{os.urandom(6).hex()}/store"
    start = time.time() + 2.0  # every process imported and waiting before the first starts
    creators = [
        subprocess.Popen(
            [sys.executable, "-c", CREATOR, store_url, str(start + i * stagger), *(f"{k}={v}" for k, v in env.items())],
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    failures = [err for c in creators for err in [c.communicate(timeout=120)[1]] if c.returncode]
    assert not failures, failures
    store = open_store(store_url, env=env)
    assert keys_of(store, env) == {MARKER}


def test_local_create_refuses_a_foreign_directory_but_not_a_killed_creators_temp_file(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="is not empty and not a neffbuild store"):
        open_store(str(foreign), create=True)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / f".{MARKER}.4242.0a1b2c3d4e.incomplete").write_bytes(b'{"form')  # its creator died mid-write
    open_store(str(killed), create=True)
    assert json.loads((killed / MARKER).read_text()) == {"format": STORE_FORMAT}
    assert open_store(str(killed)).url == str(killed.resolve())


def test_layout_contract(store: Store, env: dict[str, str], tmp_path: Path) -> None:
    [one] = write_files(tmp_path / "src", {"one.bin": 1000})
    assert store.put_blob(one.digest, one.path) == 1000
    assert store.put_doc("bundles", "b" * 32, DOC)
    assert store.put_doc("releases", "r" * 32, DOC)
    assert store.swap_tag("main", DOC, None)
    assert keys_of(store, env) == {
        MARKER, blob_key(one.digest), doc_key("bundles", "b" * 32), doc_key("releases", "r" * 32), doc_key("tags", "main"),
    }  # fmt: skip
    assert blob_key(one.digest) == f"blobs/{one.digest[:2]}/{one.digest}"
    if not store.url.startswith("s3://"):  # the local tag's versions, linked into place one by one
        assert sorted(p.name for p in (Path(store.url) / "tags" / ".main.v").iterdir()) == ["1"]
    assert _read(store, blob_key(one.digest), env) == one.path.read_bytes()


def test_documents_are_immutable(store: Store) -> None:
    assert store.put_doc("releases", "r1", b"first") is True
    assert store.put_doc("releases", "r1", b"second") is False
    assert store.get_doc("releases", "r1") == b"first"
    assert store.get_doc("releases", "absent") is None


def test_list_docs_names_documents_of_one_kind(store: Store) -> None:
    for name in ("b", "a", "c"):
        store.put_doc("bundles", name, DOC)
    store.put_doc("releases", "z", DOC)
    assert list(store.list_docs("bundles")) == ["a", "b", "c"]
    assert list(store.list_docs("tags")) == []


# ---- listing, reading many, deleting: what inspection and gc use --------------------------------


def test_list_objects_reports_every_key_with_its_size_and_time(
    store: Store, env: dict[str, str], tmp_path: Path
) -> None:
    before = time.time()
    [one] = write_files(tmp_path / "src", {"one.bin": 1000})
    store.put_blob(one.digest, one.path)
    store.put_doc("releases", "r2", b"22")
    store.put_doc("releases", "r1", b"1")
    store.swap_tag("main", DOC, None)
    listed = list(store.list_objects(""))
    assert [o.key for o in listed] == sorted(keys_of(store, env))  # in key order, as S3 lists
    assert all(isinstance(o, ObjectInfo) for o in listed)
    sizes = {o.key: o.size for o in listed}
    assert sizes[blob_key(one.digest)] == 1000 and sizes[doc_key("tags", "main")] == len(DOC)
    assert all(before - 2 <= o.mtime <= time.time() + 2 for o in listed)  # S3 keeps whole seconds
    assert [(o.key, o.size) for o in store.list_objects("releases/")] == [
        ("releases/r1.json", 1),
        ("releases/r2.json", 2),
    ]
    assert [o.key for o in store.list_objects(f"blobs/{one.digest[:2]}/{one.digest[:5]}")] == [blob_key(one.digest)]
    assert list(store.list_objects("releases/r3")) == [] and list(store.list_objects("locators/")) == []


def test_local_listing_leaves_out_locks_and_writes_in_flight(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"), create=True)
    assert store.swap_tag("main", DOC, None)  # its versions are hidden: the mirror tags/main.json is the object
    (tmp_path / "store" / "tags" / ".main.json.1.ab.incomplete").write_bytes(b"half")
    assert [o.key for o in store.list_objects("")] == [MARKER, doc_key("tags", "main")]
    with pytest.raises(InputError, match="not a folder of the store"):
        list(store.list_objects("../"))


def test_get_docs_reads_many_at_once(store: Store) -> None:
    names = [f"r{i}" for i in range(12)]
    for name in names:
        store.put_doc("releases", name, name.encode())
    got = store.get_docs("releases", [*names, "absent", "r0"], jobs=8)
    assert got == {**{n: n.encode() for n in names}, "absent": None}
    assert store.get_docs("releases", [], jobs=8) == {}
    with pytest.raises(InputError):
        store.get_docs("releases", ["../escape"], jobs=2)


def test_delete_objects_removes_exactly_the_keys_given(
    store: Store, env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neffbuild.store.s3 import store as s3

    monkeypatch.setattr(s3, "DELETE_BATCH", 2)  # several DeleteObjects requests on S3
    sources = write_files(tmp_path / "src", {f"{i}.bin": 100 + i for i in range(3)})
    for s in sources:
        store.put_blob(s.digest, s.path)
    for name in ("a", "b", "c", "d"):
        store.put_doc("releases", name, DOC)
    before = keys_of(store, env)
    doomed = [doc_key("releases", n) for n in ("a", "b", "c")] + [
        blob_key(sources[0].digest),
        blob_key(hash_bytes(b"never stored")),
    ]
    store.delete_objects(doomed)
    assert keys_of(store, env) == before - set(doomed)
    assert store.get_doc("releases", "a") is None and store.get_doc("releases", "d") == DOC
    assert store.missing_blobs({s.digest for s in sources}) == {sources[0].digest}
    store.delete_objects(doomed)  # absent already: no error
    store.delete_objects([])


@pytest.mark.parametrize(
    "key", [MARKER, "", "../x", "blobs/../neffbuild-store.json", "blobs//x", "locks/tag-main.lock", "/blobs/x"]
)
def test_delete_objects_refuses_what_is_no_store_object_and_deletes_nothing(
    store: Store, env: dict[str, str], key: str
) -> None:
    store.put_doc("releases", "r", DOC)
    before = keys_of(store, env)
    with pytest.raises(InputError, match="cannot delete"):
        store.delete_objects([doc_key("releases", "r"), key])
    assert keys_of(store, env) == before


def test_delete_objects_tries_every_key_then_names_what_failed(store: Store, tmp_path: Path) -> None:
    if store.url.startswith("s3://"):
        pytest.skip("a local fault: a folder where a document should be")
    store.put_doc("releases", "r", DOC)
    (tmp_path / "store" / "releases" / "dir.json").mkdir()
    with pytest.raises(StoreError, match="releases/dir.json: cannot delete it") as err:
        store.delete_objects([doc_key("releases", "dir"), doc_key("releases", "r")])
    assert err.value.exit_code == 3 and err.value.hint
    assert store.get_doc("releases", "r") is None  # the key after the failure was still deleted


@pytest.mark.s3
def test_s3_delete_objects_denied_is_a_store_error(s3_url: str, s3_env: dict[str, str]) -> None:
    from tests.s3server import READER_KEY, READER_SECRET

    open_store(s3_url, create=True, env=s3_env).put_doc("releases", "r", DOC)
    reader = open_store(s3_url, env={**s3_env, "AWS_ACCESS_KEY_ID": READER_KEY, "AWS_SECRET_ACCESS_KEY": READER_SECRET})
    with pytest.raises(StoreError, match="releases/r.json") as err:
        reader.delete_objects([doc_key("releases", "r")])
    assert err.value.hint
    assert reader.get_doc("releases", "r") == DOC


def test_a_reader_sees_a_deleted_blob_whole_or_not_at_all(store: Store, tmp_path: Path) -> None:
    [big] = write_files(tmp_path / "src", {"big.bin": 24 << 20})
    store.put_blob(big.digest, big.path)
    with store.open_blob(big.digest) as stream:
        head = stream.read(1 << 20)
        store.delete_objects([blob_key(big.digest)])
        try:
            rest = stream.read()
        except Exception:  # noqa: BLE001  # a server may cut the body: an error, never a short read
            rest = None
    assert rest is None or head + rest == big.path.read_bytes()
    assert store.missing_blobs({big.digest}) == {big.digest}


# ---- blobs --------------------------------------------------------------------------------------


def test_missing_blobs_and_idempotent_upload(store: Store, tmp_path: Path) -> None:
    sources = small_and_large(tmp_path / "src")
    digests = {s.digest for s in sources}
    assert store.missing_blobs(digests) == digests
    assert store.missing_blobs(set()) == set()
    uploaded = store.put_blobs(sources + sources[:3], jobs=8)  # duplicates travel once
    assert uploaded == sum(s.size for s in sources)
    absent = hash_bytes(b"never stored")
    assert store.missing_blobs(digests | {absent}) == {absent}
    assert store.put_blobs(sources, jobs=8) == 0
    assert store.put_blob(sources[0].digest, sources[0].path) == 0


@pytest.fixture(params=["ranges", "stream"])
def large_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """S3 fetches a few large blobs as parallel ranges and many as one stream each: test both."""
    from neffbuild.store.s3 import transfer as s3transfer

    if request.param == "stream":
        monkeypatch.setattr(s3transfer, "STREAM_MIN", 1)
    return request.param


def test_round_trip_many_small_and_a_large_blob(store: Store, tmp_path: Path, large_path: str) -> None:
    sources = small_and_large(tmp_path / "src", small=300)
    store.put_blobs(sources, jobs=8)
    dest = tmp_path / "cache"
    targets = fetch_all(store, sources, dest)
    twin = BlobTarget(sources[5].digest, sources[5].size, dest / "twin" / "same-bytes.bin")
    store.download_blobs([twin], jobs=2)  # one blob, two paths
    for s, t in zip(sources, targets, strict=True):
        assert t.dest.read_bytes() == s.path.read_bytes(), t.dest
    assert twin.dest.read_bytes() == sources[5].path.read_bytes()
    assert not [p for p in dest.rglob("*") if p.name.endswith(".incomplete")]


def test_open_blob_streams_bytes_or_raises_not_found(store: Store, tmp_path: Path) -> None:
    sources = small_and_large(tmp_path / "src", small=3)
    store.put_blobs(sources, jobs=4)
    for s in (sources[0], sources[-1]):
        with store.open_blob(s.digest) as stream:
            assert stream.read() == s.path.read_bytes()
    with pytest.raises(NotFoundError):
        with store.open_blob(hash_bytes(b"absent")) as stream:
            stream.read()


def test_download_of_an_absent_blob_names_it(store: Store, tmp_path: Path) -> None:
    absent = BlobTarget(hash_bytes(b"absent"), 6, tmp_path / "cache" / "x.bin")
    with pytest.raises(NotFoundError, match=absent.digest):
        store.download_blobs([absent], jobs=1)
    assert not absent.dest.exists()


def test_a_source_that_does_not_match_its_digest_is_not_stored(store: Store, tmp_path: Path) -> None:
    small, large = write_files(tmp_path / "src", {"small.bin": 5000, "large.bin": 9 << 20})
    for s in (small, large):
        lying = BlobSource(hash_bytes(b"other bytes"), s.size, s.path)
        with pytest.raises(IntegrityError, match="changed while publishing") as err:
            store.put_blobs([lying], jobs=2)
        assert (
            str(s.path) in err.value.message and f"{store.url}/" in err.value.message
        )  # the file and the store object
        assert store.missing_blobs({lying.digest}) == {lying.digest}


@pytest.mark.parametrize("which", ["small", "large"])
def test_a_corrupt_stored_blob_fails_closed_naming_the_file(
    store: Store, env: dict[str, str], tmp_path: Path, which: str, large_path: str
) -> None:
    sources = small_and_large(tmp_path / "src", small=10)
    store.put_blobs(sources, jobs=4)
    bad = sources[3] if which == "small" else sources[-1]
    corrupt_blob(store, bad.digest, env)
    dest = tmp_path / "cache"
    with pytest.raises(IntegrityError, match=bad.path.name) as err:
        store.download_blobs([BlobTarget(bad.digest, bad.size, dest / bad.path.name)], jobs=4)
    assert "that file was not written" in (err.value.hint or "")
    assert not dest.exists() or not list(dest.rglob("*.bin*"))  # no file, no temp file


def test_wrong_expected_digest_writes_nothing(store: Store, tmp_path: Path) -> None:
    [s] = write_files(tmp_path / "src", {"a.bin": 4000})
    store.put_blobs([s], jobs=1)
    wrong_size = BlobTarget(s.digest, s.size + 1, tmp_path / "cache" / "a.bin")
    with pytest.raises(IntegrityError):
        store.download_blobs([wrong_size], jobs=1)
    assert not list((tmp_path / "cache").rglob("*"))


# ---- tags ---------------------------------------------------------------------------------------


def test_tag_compare_and_swap(store: Store) -> None:
    assert store.read_tag("main") is None
    assert store.swap_tag("main", b"v1", None) is True
    assert store.swap_tag("main", b"lost", None) is False  # someone created it first
    data, version = store.read_tag("main")  # type: ignore[misc]
    assert data == b"v1"
    assert store.swap_tag("main", b"v2", version) is True
    assert store.swap_tag("main", b"stale", version) is False  # version moved on
    data2, version2 = store.read_tag("main")  # type: ignore[misc]
    assert data2 == b"v2" and version2 != version
    assert store.swap_tag("other", b"x", version2) is False  # expects a tag that is not there


# ---- S3 only: the server's checks and errors ----------------------------------------------------


@pytest.mark.s3
def test_s3_packs_small_blobs_with_an_index(s3_url: str, s3_env: dict[str, str], tmp_path: Path) -> None:
    from neffbuild.store import packs

    store = open_store(s3_url, create=True, env=s3_env)
    sources = small_and_large(tmp_path / "src", small=50)
    store.put_blobs(sources, jobs=4)
    keys = keys_of(store, s3_env)
    pack_keys = {k for k in keys if k.startswith("packs/")}
    [index_key] = [k for k in pack_keys if k.endswith(".idx.json")]
    pack_id = packs.pack_id_of_index_key(index_key)
    assert pack_keys == {packs.pack_key(pack_id), index_key}
    index = packs.decode_index(pack_id, _read(store, index_key, s3_env))
    small = {s.digest for s in sources if s.size < packs.SMALL_BLOB}
    assert {e.digest for e in index.entries} == small
    assert {k for k in keys if k.startswith("blobs/")} == {blob_key(s.digest) for s in sources if s.digest not in small}
    fresh = open_store(s3_url, env=s3_env)  # another process sees packed blobs as present
    assert fresh.missing_blobs({s.digest for s in sources}) == set()


@pytest.mark.s3
def test_s3_many_loose_blobs_are_checked_by_listing(
    s3_url: str, s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neffbuild.store.s3 import packs as s3packs

    store = open_store(s3_url, create=True, env=s3_env)
    sources = write_files(tmp_path / "src", {f"{i}.bin": 100 + i for i in range(5)})
    for s in sources[:3]:
        store.put_blob(s.digest, s.path)
    monkeypatch.setattr(s3packs, "HEAD_LIMIT", 1)
    assert store.missing_blobs({s.digest for s in sources}) == {s.digest for s in sources[3:]}


@pytest.mark.s3
def test_s3_upload_corrupted_in_flight_is_rejected(
    s3_url: str, s3_env: dict[str, str], s3_server, tmp_path: Path
) -> None:
    from tests.tcpproxy import TcpProxy

    open_store(s3_url, create=True, env=s3_env)
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    sources = small_and_large(tmp_path / "src", small=5)
    with TcpProxy(port, mode="flip-body", paths=("/blobs/", "/packs/")) as proxy:
        via_proxy = open_store(s3_url, env={**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint})
        with pytest.raises(IntegrityError, match="corrupted in transit|checksum"):
            via_proxy.put_blobs(sources, jobs=2)
        assert proxy.corrupted >= 1
    direct = open_store(s3_url, env=s3_env)
    assert direct.missing_blobs({s.digest for s in sources}) == {s.digest for s in sources}
    assert not [k for k in keys_of(direct, s3_env) if k.startswith(("blobs/", "packs/"))]


@pytest.mark.s3
def test_s3_refuses_a_server_without_conditional_writes(s3_url: str, s3_env: dict[str, str], s3_server) -> None:
    from tests.tcpproxy import TcpProxy

    open_store(s3_url, create=True, env=s3_env)
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    with TcpProxy(port, mode="ignore-preconditions") as proxy:
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        with pytest.raises(StoreError, match="ignores conditional writes") as err:
            open_store(s3_url, env=env).put_doc("releases", "r", DOC)
        assert "NEFFBUILD_S3_ALLOW_UNCONDITIONAL" in (err.value.hint or "")
        allowed = open_store(s3_url, env={**env, "NEFFBUILD_S3_ALLOW_UNCONDITIONAL": "1"})
        assert allowed.put_doc("releases", "r", DOC)
    assert open_store(s3_url, env=s3_env).get_doc("releases", "r") == DOC


def test_listings_follow_every_page(kind: str, store: Store) -> None:
    if kind == "local":
        pytest.skip("pages are S3's")
    names = [f"r{i}" for i in range(5)]
    for name in names:
        store.put_doc("releases", name, DOC)
    keys = store.reader.list("releases/", store.location.prefix, page_size=2)  # type: ignore[attr-defined]
    assert keys == [f"releases/{n}.json" for n in names]
    listed = store.reader.objects("releases/", store.location.prefix, page_size=2)  # type: ignore[attr-defined]
    assert [(o.key, o.size) for o in listed] == [(f"releases/{n}.json", len(DOC)) for n in names]
    assert list(store.list_docs("releases")) == names


@pytest.mark.s3
def test_s3_reads_with_static_credentials_never_import_botocore(
    s3_url: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    import subprocess
    import sys

    store = open_store(s3_url, create=True, env=s3_env)
    sources = small_and_large(tmp_path / "src", small=20)
    store.put_blobs(sources, jobs=4)
    store.put_doc("releases", "r", DOC)
    assert store.swap_tag("t", DOC, None)
    reader = f"""
import os, sys
from pathlib import Path
from neffbuild.fs.confined import BlobTarget
from neffbuild.store import open_store
store = open_store({s3_url!r}, env=os.environ)
assert store.read_tag("t")[0] == store.get_doc("releases", "r") == {DOC!r}
assert list(store.list_docs("releases")) == ["r"]
targets = [BlobTarget(d, n, Path({str(tmp_path)!r}) / "out" / d) for d, n in {[(s.digest, s.size) for s in sources]!r}]
store.download_blobs(targets, 4)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("botocore", "boto3", "awscrt")))
"""
    done = subprocess.run(
        [sys.executable, "-c", reader], env={**os.environ, **s3_env}, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(s.digest for s in sources)


@pytest.mark.s3
def test_s3_errors_are_typed_with_hints(s3_env: dict[str, str], s3_bucket: str) -> None:
    with pytest.raises(StoreError, match="does not exist") as err:
        open_store("s3://no-such-bucket-neffbuild/x", env=s3_env)
    assert "create" in (err.value.hint or "")
    with pytest.raises(StoreError, match="access denied") as err:
        open_store(f"s3://{s3_bucket}/x", env={**s3_env, "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert "credentials" in (err.value.hint or "")
    with pytest.raises(StoreError, match="cannot reach"):
        open_store(f"s3://{s3_bucket}/x", env={**s3_env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    with pytest.raises(StoreError, match="expected s3://bucket"):
        open_store("s3://", env=s3_env)


@pytest.mark.s3
def test_s3_create_makes_the_bucket_and_refuses_a_foreign_prefix(s3_env: dict[str, str], s3_server) -> None:
    import uuid

    bucket = f"new-{uuid.uuid4().hex[:12]}"
    store = open_store(f"s3://{bucket}/deep/prefix", create=True, env=s3_env)
    assert store.url == f"s3://{bucket}/deep/prefix"
    s3_client(s3_env).put_object(Bucket=bucket, Key="other/file", Body=b"x")
    with pytest.raises(StoreError, match="not empty"):
        open_store(f"s3://{bucket}/other", create=True, env=s3_env)


def _write(store: Store, key: str, data: bytes, env: dict[str, str]) -> None:
    """Replace a store object out of band (a damaged or hostile store)."""
    if not store.url.startswith("s3://"):
        path = Path(store.url) / key
        path.unlink(missing_ok=True)
        path.write_bytes(data)
        return
    bucket, _, prefix = store.url.removeprefix("s3://").partition("/")
    s3_client(env).put_object(Bucket=bucket, Key=f"{prefix}/{key}" if prefix else key, Body=data)


def _read(store: Store, key: str, env: dict[str, str]) -> bytes:
    if not store.url.startswith("s3://"):
        return (Path(store.url) / key).read_bytes()
    bucket, _, prefix = store.url.removeprefix("s3://").partition("/")
    return s3_client(env).get_object(Bucket=bucket, Key=f"{prefix}/{key}" if prefix else key)["Body"].read()


@pytest.mark.s3
def test_s3_downloads_survive_dropped_connections(
    s3_url: str, s3_env: dict[str, str], s3_server, tmp_path: Path, large_path: str
) -> None:
    from tests.tcpproxy import TcpProxy

    store = open_store(s3_url, create=True, env=s3_env)
    sources = small_and_large(tmp_path / "src", small=200)
    store.put_blobs(sources, jobs=4)
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    with TcpProxy(port, mode="cut-gets", paths=("/blobs/", "/packs/"), cuts=3) as proxy:
        via_proxy = open_store(s3_url, env={**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint})
        targets = fetch_all(via_proxy, sources, tmp_path / "cache", jobs=4)
        assert proxy.cuts == 0  # every planned cut happened
    for s, t in zip(sources, targets, strict=True):
        assert t.dest.read_bytes() == s.path.read_bytes(), t.dest


# ---- the marker: anything but ours is a one-line StoreError naming it ---------------------------

_GZIPPED = gzip.compress(json.dumps({"format": STORE_FORMAT}).encode())
BAD_MARKERS = {
    "empty": b"", "null": b"null", "list": b"[]", "number": b"3", "garbage": b"garbage\x00\xff", "gzip": _GZIPPED,
    "deep": b"[" * 100_000, "escaped-surrogate": b'{"format": "\\ud800"}', "raw-surrogate": b'{"format": "\xed\xa0\x80"}',
    "no-format": b'{"a": 1}', "other-format": b'{"format": "neffbuild.store/9"}',
    "huge": json.dumps({"format": STORE_FORMAT, "pad": "x" * (MARKER_MAX + 1)}).encode(),
}  # fmt: skip


@pytest.mark.parametrize("content", BAD_MARKERS.values(), ids=BAD_MARKERS.keys())
def test_a_damaged_marker_is_a_store_error_naming_it(
    store: Store, store_url: str, env: dict[str, str], content: bytes
) -> None:
    _write(store, MARKER, content, env)
    with pytest.raises(StoreError) as err:
        open_store(store_url, env=env)
    assert_one_line(err.value, f"{store.url}/{MARKER}", exit_code=3)
    assert "format" in f"{err.value.message} {err.value.hint}"


def assert_one_line(exc: NeffbuildError, names: str, *, exit_code: int) -> None:
    """A refusal as the CLI prints it: its exit code, one printable line naming the object, a hint."""
    assert exc.exit_code == exit_code and names in exc.message and exc.hint, exc.message
    assert "\n" not in exc.message and len(exc.message) < 600
    exc.message.encode("utf-8")  # no lone surrogate reaches the terminal


_text = st.text(st.characters(codec=None), max_size=8)  # lone surrogates included
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _text | st.just(STORE_FORMAT),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text | st.just("format"), inner, max_size=3),
    max_leaves=6,
)
_markers = st.one_of(
    st.binary(max_size=200),
    st.tuples(st.sampled_from([b"[", b'{"format":']), st.integers(1, 3000)).map(lambda t: t[0] * t[1]),
    st.tuples(_json, st.booleans()).map(lambda t: json.dumps(t[0], ensure_ascii=t[1]).encode("utf-8", "surrogatepass")),
    st.dictionaries(st.just("format") | _text, _json | st.just(STORE_FORMAT), max_size=3).map(
        lambda d: json.dumps(d).encode()
    ),
)


# 2,000 examples in CI: about 5 s on the suite's 2-core machine.
@settings(max_examples=2000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(_markers)
def test_fuzz_store_marker_parser(data: bytes) -> None:
    try:
        check_marker(data, "s3://bucket/p/neffbuild-store.json")
    except StoreError as exc:
        assert_one_line(exc, "s3://bucket/p/neffbuild-store.json", exit_code=3)
        return
    raw = json.loads(data)
    assert isinstance(raw, dict) and raw["format"] == STORE_FORMAT


# ---- locators: which packs hold a release's blobs ------------------------------------------------


def test_a_published_release_has_a_locator_where_the_store_packs(
    store: Store, env: dict[str, str], tmp_path: Path
) -> None:
    from neffbuild.store import packs

    sources = small_and_large(tmp_path / "src", small=30)
    release_id = publish_release_of(store, tmp_path / "src", sources)
    keys = keys_of(store, env)
    if not store.url.startswith("s3://"):
        assert not [k for k in keys if k.startswith(("locators/", "packs/"))]  # every blob is a file of its own
        return
    locator = packs.decode_locator(release_id, _read(store, packs.locator_key(release_id), env), "locator")
    small = {s.digest for s in sources if s.size < packs.SMALL_BLOB}
    [(pack_id, held)] = locator.packs.items()
    assert held == small and locator.loose == {s.digest for s in sources} - small
    assert packs.index_key(pack_id) in keys
    publish_release_of(store, tmp_path / "src", sources)  # an unchanged re-publish writes nothing
    assert keys_of(store, env) == keys


def test_only_the_s3_store_modules_import_botocore() -> None:
    import ast

    import neffbuild

    root = Path(neffbuild.__file__).parent
    importers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] in ("botocore", "boto3") for n in names):
                importers.add(path.relative_to(root).as_posix())
    assert importers and all(p.startswith("store/s3") for p in importers), importers
