"""Names from the command line and from documents are checked before they become store keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from neffbuild.build.publish import move_tag
from neffbuild.documents.refs import parse_ref
from neffbuild.errors import InputError
from neffbuild.names import key_problem, reserved_problem, tag_problem
from neffbuild.store.base import doc_key
from neffbuild.store.local import LocalStore
from tests.fs.test_confined import snapshot
from tests.host.test_pull import FILES, publish_files

TRAVERSING = [
    "../../../outside",
    "../releases/x",
    "a/b",
    "/abs",
    "..",
    ".hidden",
    "-flag",
    "a\nb",
    "a b",
    "x" * 129,
    "\ud800",
    "",
]


@pytest.mark.parametrize("name", TRAVERSING)
def test_tag_names_that_could_leave_tags_are_refused(name: str) -> None:
    assert tag_problem(name) is not None and key_problem(name) is not None
    with pytest.raises(InputError):
        doc_key("tags", name)


def test_good_names_pass_and_a_digest_is_not_a_tag() -> None:
    for name in ("prod", "flux2-klein.v3", "A_b-1.2", "x" * 128):
        assert tag_problem(name) is None and doc_key("tags", name) == f"tags/{name}.json"
    digest = "0123456789abcdef" * 2
    assert (
        tag_problem(digest) is not None
        and parse_ref(digest).name == digest
        and doc_key("releases", digest) == f"releases/{digest}.json"
    )


def test_reserved_cache_paths() -> None:
    assert reserved_problem(".neffbuild/state.json") is not None
    assert reserved_problem("a/.x.so.123.0123456789.incomplete") is not None
    assert reserved_problem("a/.neffbuild/x") is None and reserved_problem("a/x.incomplete") is None


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "deep" / "er" / "store", create=True)


def test_tag_command_cannot_write_above_the_store_root(store: LocalStore, tmp_path: Path, cli) -> None:
    release_id = publish_files(store, FILES, tmp_path)
    before = snapshot(tmp_path)
    result = cli("tag", "../../../outside", release_id, "--store", str(store.root))
    assert result.returncode == InputError.exit_code, result.stderr
    assert "'../../../outside' is not a tag name" in result.stderr and "Traceback" not in result.stderr
    assert snapshot(tmp_path) == before


def test_tag_command_checks_the_release_id(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, FILES, tmp_path)
    result = cli("tag", "prod", "../bundles/x", "--store", str(store.root))
    assert (
        result.returncode == InputError.exit_code
        and "release: '../bundles/x' is not a 32-hex-digit id" in result.stderr
    )


@pytest.mark.parametrize("command", ["pull", "env"])
def test_a_path_is_not_read_as_a_tag(store: LocalStore, tmp_path: Path, cli, command: str) -> None:
    release_id = publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    result = cli(command, f"../releases/{release_id}", "--store", str(store.root), "--cache-dir", str(cache))
    assert result.returncode == InputError.exit_code and "is neither a tag name nor a release id" in result.stderr
    assert not cache.exists()


def test_push_checks_its_ref(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, FILES, tmp_path)
    result = cli("push", "../tags/t", "--from", str(store.root), "--to", str(tmp_path / "other"))
    assert result.returncode == InputError.exit_code and not (tmp_path / "other").exists()


def test_move_tag_checks_in_the_core_too(store: LocalStore, tmp_path: Path) -> None:
    release_id = publish_files(store, FILES, tmp_path)
    before = sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*"))
    with pytest.raises(InputError, match="is not a tag name"):
        move_tag(store, "../x", release_id)
    assert sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*")) == before  # nothing written
    assert not (store.root / "x.json").exists() and "tags/t.json" in before


def test_a_tag_document_must_name_its_tag(store: LocalStore, tmp_path: Path, cli) -> None:
    """A tag copied to another name (or forged) is not followed."""
    publish_files(store, FILES, tmp_path)
    tags = store.root / "tags"
    (tags / "other.json").write_bytes((tags / "t.json").read_bytes())
    result = cli("pull", "other", "--store", str(store.root), "--cache-dir", str(tmp_path / "c"))
    assert result.returncode == 4 and "tags/other.json: names tag 't'" in result.stderr
