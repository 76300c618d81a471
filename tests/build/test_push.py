"""push: copy a release between stores, uploading only what the destination lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neffbuild.build.push import push
from neffbuild.documents.records import TagRecord, parse
from neffbuild.errors import NotFoundError
from neffbuild.host.pull import pull
from neffbuild.store import open_store
from tests.storekit import keys_of, publish_release_of, small_and_large


@pytest.fixture
def local_release(tmp_path: Path) -> tuple[str, str, int]:
    """A local store with a release tagged `main`: (store url, release id, unique blob bytes)."""
    url = str(tmp_path / "local")
    store = open_store(url, create=True)
    sources = small_and_large(tmp_path / "src", small=30)
    release_id = publish_release_of(store, tmp_path / "src", sources, name="tiny", tag="main")
    return url, release_id, sum({s.digest: s.size for s in sources}.values())


@pytest.mark.s3
def test_push_local_to_s3_then_an_unchanged_push_uploads_nothing(
    local_release: tuple[str, str, int], s3_url: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    url, release_id, size = local_release
    src, dst = open_store(url), open_store(s3_url, create=True, env=s3_env)
    first = push("main", src, dst, jobs=8)
    assert (first.release_id, first.tag, first.tag_moved) == (release_id, "main", True)
    assert first.bytes_uploaded == size and first.bundles_copied == 1
    again = push("main", src, open_store(s3_url, env=s3_env), jobs=8)
    assert (again.bytes_uploaded, again.blobs_uploaded, again.bundles_copied, again.tag_moved) == (0, 0, 0, False)
    report = pull(open_store(s3_url, env=s3_env), "main", tmp_path / "cache", jobs=8)
    assert report.release_id == release_id and report.files_fetched == report.files_total
    for rel in ("small/000.bin", "large.bin", "empty.bin"):
        assert (tmp_path / "cache" / rel).read_bytes() == (tmp_path / "src" / rel).read_bytes()


@pytest.mark.s3
def test_push_s3_to_local_copies_the_release(
    local_release: tuple[str, str, int], s3_url: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    url, release_id, _ = local_release
    push("main", open_store(url), open_store(s3_url, create=True, env=s3_env), jobs=8)
    back = open_store(str(tmp_path / "back"), create=True)
    result = push(release_id, open_store(s3_url, env=s3_env), back, jobs=8)
    assert result.tag is None and not result.tag_moved  # a release id moves no tag
    assert keys_of(back) == keys_of(open_store(url)) - {"tags/main.json"}


def test_push_between_local_stores_and_retag(local_release: tuple[str, str, int], tmp_path: Path) -> None:
    url, release_id, size = local_release
    dst = open_store(str(tmp_path / "copy"), create=True)
    assert push("main", open_store(url), dst, jobs=4).bytes_uploaded == size
    current = dst.read_tag("main")
    assert current is not None and parse(TagRecord, current[0], "main").release == release_id
    assert push("main", open_store(url), dst, jobs=4).bytes_uploaded == 0


def test_push_of_an_unknown_tag_fails_with_not_found(local_release: tuple[str, str, int], tmp_path: Path) -> None:
    url, _, _ = local_release
    with pytest.raises(NotFoundError, match="nope"):
        push("nope", open_store(url), open_store(str(tmp_path / "copy"), create=True), jobs=2)


def test_push_and_pull_of_a_release_whose_bundle_the_store_lacks_say_the_store_is_damaged(
    local_release: tuple[str, str, int], tmp_path: Path, cli
) -> None:
    url, release_id, _ = local_release
    [bundle] = Path(url, "bundles").rglob("*.json")
    bundle.unlink()
    where = f"{url}/releases/{release_id}.json"
    for args in (
        ("push", "main", "--from", url, "--to", str(tmp_path / "copy")),
        ("pull", "main", "--store", url, "--cache-dir", str(tmp_path / "cache")),
    ):
        result = cli(*args)
        assert result.returncode == 4, result.stderr
        assert (
            f"error: {where}: unit " in result.stderr
            and f"names bundle {bundle.stem}, which the store lacks" in result.stderr
        )
        assert "hint: the store is damaged" in result.stderr


@pytest.mark.s3
def test_cli_push_then_tag_rolls_back(
    local_release: tuple[str, str, int], s3_url: str, s3_env: dict[str, str], tmp_path: Path, cli
) -> None:
    url, release_id, size = local_release
    env = {k: v for k, v in s3_env.items() if k != "AWS_ENDPOINT_URL"}  # the flag supplies it
    endpoint = ["--endpoint-url", s3_env["AWS_ENDPOINT_URL"]]
    first = cli("push", "main", "--from", url, "--to", s3_url, *endpoint, "--json", env=env)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["bytes_uploaded"] == size
    again = cli("push", "main", "--from", url, "--to", s3_url, *endpoint, "--json", env=env)
    assert json.loads(again.stdout)["bytes_uploaded"] == 0

    local = open_store(url)
    newer = publish_release_of(
        local, tmp_path / "src2", small_and_large(tmp_path / "src2", small=3, seed=9), name="v2", tag="main"
    )
    assert cli("push", "main", "--from", url, "--to", s3_url, *endpoint, env=env).returncode == 0
    back = cli("tag", "main", release_id, "--store", s3_url, *endpoint, "--json", env=env)
    assert back.returncode == 0, back.stderr
    record = json.loads(back.stdout)
    assert record["release"] == release_id
    assert [e["release"] for e in record["history"]] == [release_id, newer, release_id]
    missing = cli("tag", "main", "0" * 32, "--store", s3_url, *endpoint, env=env)
    assert missing.returncode == 8 and "push it" in missing.stderr


@pytest.mark.s3
def test_endpoint_flag_beats_the_environment(
    local_release: tuple[str, str, int], s3_url: str, s3_env: dict[str, str], tmp_path: Path, cli
) -> None:
    """--endpoint-url reaches the store as a parameter: a wrong AWS_ENDPOINT_URL is not used."""
    url, release_id, _ = local_release
    env = {**s3_env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}  # nothing listens on the discard port
    endpoint = ["--endpoint-url", s3_env["AWS_ENDPOINT_URL"]]
    assert cli("push", "main", "--from", url, "--to", s3_url, *endpoint, env=env).returncode == 0
    pulled = cli("pull", "main", "--store", s3_url, *endpoint, "--cache-dir", str(tmp_path / "c"), "--json", env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["release_id"] == release_id
    without = cli("pull", "main", "--store", s3_url, "--cache-dir", str(tmp_path / "d"), env=env)
    assert without.returncode == 3, without.stderr
