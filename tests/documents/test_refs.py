"""References (TAG, TAG@N, release id, id prefix, bundle key) resolve the same on every store."""

from __future__ import annotations

from pathlib import Path

import pytest

from neffbuild.build.push import push
from neffbuild.documents.bundles import BundleRecord, ResolvedBundle
from neffbuild.documents.records import Release, TagRecord
from neffbuild.documents.refs import (
    ResolvedRelease,
    find_doc,
    load_doc,
    parse_ref,
    resolve,
    resolve_any,
)
from neffbuild.errors import InputError, IntegrityError, NotFoundError
from neffbuild.host.exports import serving_dirs
from neffbuild.store import open_store
from neffbuild.store.base import Store
from tests.storekit import publish_release_of, write_files


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return open_store(str(tmp_path / "store"), create=True)
    return open_store(request.getfixturevalue("s3_url"), create=True, env=request.getfixturevalue("s3_env"))


def publish_three(store: Store, root: Path) -> list[str]:
    """Three releases, tag `prod` moved to each in turn; their ids, oldest first."""
    ids = []
    for seed in range(3):
        sources = write_files(root / str(seed), {"a.bin": 100 + seed, f"b{seed}.bin": 10}, seed=seed)
        ids.append(publish_release_of(store, root / str(seed), sources, name=f"r{seed}", tag="prod"))
    return ids


def test_tag_and_its_history(store: Store, tmp_path: Path) -> None:
    ids = publish_three(store, tmp_path)
    assert resolve(store, "prod").release_id == ids[2] and resolve(store, "prod").tag == "prod"
    assert resolve(store, "prod@0") == resolve(store, "prod")
    older = resolve(store, "prod@1")
    assert (older.release_id, older.tag, older.release.name) == (ids[1], None, "r1")
    assert resolve(store, "prod@2").release_id == ids[0]
    with pytest.raises(NotFoundError, match="tag 'prod' has 2 earlier releases, not 3") as info:
        resolve(store, "prod@3")
    assert info.value.exit_code == 8 and info.value.hint == "`prod@2` is its oldest"


def test_full_id_and_unique_prefix(store: Store, tmp_path: Path) -> None:
    ids = publish_three(store, tmp_path)
    by_id = resolve(store, ids[0])
    assert (by_id.release_id, by_id.tag, by_id.where) == (ids[0], None, f"{store.url}/releases/{ids[0]}.json")
    assert resolve(store, ids[1][:6]).release_id == ids[1]
    assert resolve(store, ids[2][:20]).release_id == ids[2]


def test_unknown_references_are_not_found_with_a_hint(store: Store, tmp_path: Path) -> None:
    ids = publish_three(store, tmp_path)
    absent = next(c * 6 for c in "0123456789abcdef" if not any(i.startswith(c * 6) for i in ids))
    with pytest.raises(NotFoundError, match=f"no tag, and no release id starting with '{absent}'") as info:
        resolve(store, absent)
    assert info.value.exit_code == 8 and "neffbuild tag" in (info.value.hint or "")
    with pytest.raises(NotFoundError, match="tag 'nope' not found") as info:
        resolve(store, "nope")
    assert info.value.hint == "known tags: prod"
    with pytest.raises(NotFoundError, match=f"release {'f' * 32} not found"):
        resolve(store, "f" * 32)
    with pytest.raises(NotFoundError, match="tag 'abcde' not found"):  # 5 hex digits: only a tag name
        resolve(store, "abcde")


def test_ambiguous_prefix_counts_the_candidates(store: Store, tmp_path: Path) -> None:
    publish_three(store, tmp_path)
    for tail in ("1" * 26, "2" * 26, "3" * 26):  # listing is what is tested: the documents need not parse
        store.put_doc("releases", "abcdef" + tail, b"{}")
    with pytest.raises(InputError, match="'abcdef' is ambiguous: 3 release ids in .* start with it") as info:
        resolve(store, "abcdef")
    assert info.value.exit_code == 2 and info.value.hint == "give more hex digits, or the whole id"
    with pytest.raises(IntegrityError):  # one more digit makes it unique: the document itself is then read
        resolve(store, "abcdef1")


def test_a_tag_wins_over_a_prefix(store: Store, tmp_path: Path) -> None:
    ids = publish_three(store, tmp_path)
    other = next(i for i in ids if i != ids[0])
    publish_release_of(
        store,
        tmp_path / "0",
        write_files(tmp_path / "0", {"a.bin": 100, "b0.bin": 10}, seed=0),
        name="r0",
        tag=other[:8],
    )
    assert resolve(store, other[:8]).release_id == ids[0]


def test_bundles_resolve_through_resolve_any_only(store: Store, tmp_path: Path) -> None:
    ids = publish_three(store, tmp_path)
    key = load_doc(store, Release, ids[0]).units[0].key
    found = resolve_any(store, key)
    assert (
        isinstance(found, ResolvedBundle) and found.record.key == key and found.where.endswith(f"/bundles/{key}.json")
    )
    assert isinstance(resolve_any(store, key[:10]), ResolvedBundle)
    assert isinstance(resolve_any(store, "prod"), ResolvedRelease)
    assert isinstance(resolve_any(store, ids[1][:10]), ResolvedRelease)
    with pytest.raises(NotFoundError, match="no tag, and no release id starting with"):
        resolve(store, key[:10])
    with pytest.raises(NotFoundError, match=f"release or bundle {'e' * 32} not found"):
        resolve_any(store, "e" * 32)


def test_loader_checks_a_document_is_what_its_name_says(store: Store, tmp_path: Path) -> None:
    ids = publish_three(store, tmp_path)
    release = load_doc(store, Release, ids[0])
    key = release.units[0].key
    store.put_doc("bundles", "d" * 32, store.get_doc("bundles", key) or b"")
    with pytest.raises(IntegrityError, match=f"bundles/{'d' * 32}.json: holds the bundle of key {key}"):
        find_doc(store, BundleRecord, "d" * 32)
    store.put_doc("releases", "c" * 32, store.get_doc("releases", ids[0]) or b"")
    with pytest.raises(IntegrityError, match="does not match its name"):
        resolve(store, "c" * 32)
    assert (
        find_doc(store, TagRecord, "prod") == find_doc(store, TagRecord, "prod")
        and find_doc(store, TagRecord, "x") is None
    )
    with pytest.raises(NotFoundError, match="bundle " + "9" * 32 + " not found") as info:
        load_doc(store, BundleRecord, "9" * 32, hint="rebuild")
    assert info.value.hint == "rebuild"


@pytest.mark.parametrize("ref", ["prod@", "prod@x", "@1", "ab/cd", "prod@-1", "abcdef@1" + "0" * 8, "a" * 32 + "@1"])
def test_malformed_references_are_input_errors(ref: str) -> None:
    with pytest.raises(InputError, match="is neither a tag name nor a release id"):
        parse_ref(ref)


def test_push_of_an_old_release_copies_it_and_leaves_the_tag(tmp_path: Path) -> None:
    src = open_store(str(tmp_path / "src"), create=True)
    dst = open_store(str(tmp_path / "dst"), create=True)
    ids = publish_three(src, tmp_path / "files")
    result = push("prod@2", src, dst)
    assert (result.release_id, result.tag, result.tag_moved) == (ids[0], None, False)
    assert find_doc(dst, TagRecord, "prod") is None and find_doc(dst, Release, ids[0]) is not None


def test_cli_pulls_by_tag_history_and_prefix(tmp_path: Path, cli) -> None:
    store = open_store(str(tmp_path / "store"), create=True)
    ids = publish_three(store, tmp_path / "files")
    result = cli("pull", "prod@1", "--store", store.url, "--cache-dir", str(tmp_path / "c"), "--json")
    assert result.returncode == 0, result.stderr
    # Beside the release's files: the state dir and the dirs its backend's server writes on a hit.
    kept = {".neffbuild", *serving_dirs(find_doc(store, Release, ids[1]).backend)}
    assert sorted(p.name for p in (tmp_path / "c").iterdir() if p.name not in kept) == ["a.bin", "b1.bin"]
    result = cli("env", ids[1][:7], "--store", store.url, "--cache-dir", str(tmp_path / "c"))
    assert result.returncode == 0, result.stderr
    # A prefix of another release resolves too, and env refuses it: the cache dir holds ids[1].
    result = cli("env", ids[2][:7], "--store", store.url, "--cache-dir", str(tmp_path / "c"))
    assert result.returncode == 8 and f"is release {ids[2]}, but" in result.stderr
    absent = next(c * 6 for c in "0123456789abcdef" if not any(i.startswith(c * 6) for i in ids))
    result = cli("pull", absent, "--store", store.url, "--cache-dir", str(tmp_path / "d"))
    assert result.returncode == 8 and f"no tag, and no release id starting with '{absent}'" in result.stderr
    assert "hint: check the id" in result.stderr and not (tmp_path / "d").exists()
