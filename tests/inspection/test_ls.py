"""`neffbuild ls`: tags and releases newest first, with counts from the documents; a tag's history."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neffbuild.documents.records import Release, parse
from neffbuild.inspect.ls import list_store, tag_history
from tests.conftest import run_cli
from tests.inspectkit import Target, klein_unit, publish_units, target  # noqa: F401  (target: a fixture)


def test_releases_newest_first_with_counts_from_their_documents(target: Target, tmp_path: Path) -> None:
    three = target.three
    untagged = publish_units(
        target.store, tmp_path / "old", "old", [klein_unit(64, 64)], created_at="2024-05-01T10:00:00+00:00"
    )
    listing = list_store(target.store)
    assert [r.release_id for r in listing.releases] == [three.v3, three.v2, three.v1, untagged]
    for row in listing.releases:
        doc = parse(Release, target.store.get_doc("releases", row.release_id) or b"", row.release_id)
        assert (row.units, row.files, row.bytes) == (len(doc.units), len(doc.files), sum(f.size for f in doc.files))
    by_id = {r.release_id: r for r in listing.releases}
    assert by_id[three.v3].tags == ("canary", "klein") and by_id[three.v1].tags == ()
    assert by_id[three.v3].toolchain.startswith("torch 2.14.1,") and by_id[three.v1].toolchain.startswith(
        "torch 2.13.0,"
    )
    # Untagged: its time is its bundles' (the release document has none, so rebuilds keep their id).
    assert (by_id[untagged].created, by_id[untagged].created_from) == ("2024-05-01T10:00:00+00:00", "bundles")
    assert {by_id[r].created_from for r in (three.v1, three.v2, three.v3)} == {"tag"}


def test_tags_and_a_tags_history(target: Target) -> None:
    three = target.three
    tags = {t.name: t for t in list_store(target.store).tags}
    assert set(tags) == {"klein", "canary"}
    assert (tags["klein"].release, tags["klein"].history, tags["klein"].by) == (three.v3, 3, "ci-c")
    assert (tags["canary"].release, tags["canary"].history) == (three.v3, 1)
    history = tag_history(target.store, "klein")
    assert [(e.ref, e.release, e.by) for e in history.events] == [
        ("klein@0", three.v3, "ci-c"), ("klein@1", three.v2, "ci-b"), ("klein@2", three.v1, "ci-a"),
    ]  # fmt: skip


def test_cli_json_parses_and_errors_name_the_culprit(target: Target, tmp_path: Path) -> None:
    listed = run_cli("ls", "--store", target.url, "--json", env=target.env)
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    assert [r["release_id"] for r in doc["releases"]] == [target.three.v3, target.three.v2, target.three.v1]
    history = run_cli("ls", "--tag", "canary", "--store", target.url, "--json", env=target.env)
    assert [e["release"] for e in json.loads(history.stdout)["events"]] == [target.three.v3]
    missing = run_cli("ls", "--tag", "prod", "--store", target.url, env=target.env)
    assert missing.returncode == 8
    assert "tag 'prod' not found" in missing.stderr and "hint: known tags: canary, klein" in missing.stderr
    assert run_cli("ls", "--tag", "../x", "--store", target.url, env=target.env).returncode == 2


def test_a_directory_that_is_not_a_store_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "neffbuild-store.json").write_text('{"format": "something else"}')
    result = run_cli("ls", "--store", str(tmp_path))
    assert result.returncode == 3 and "store format 'something else'" in result.stderr and "hint:" in result.stderr
    assert run_cli("ls", "--store", str(tmp_path / "absent")).returncode == 3


def test_table_on_a_terminal_width(target: Target) -> None:
    shown = run_cli("ls", "--store", target.url, env={**target.env, "COLUMNS": "80"})
    assert shown.returncode == 0, shown.stderr
    assert target.three.v3 in shown.stdout and "left out at 80 columns" in shown.stdout
    assert all(
        len(line) <= 80 for line in shown.stdout.splitlines() if line[:1] in "┏┃┡│└"
    )  # titles name the store: long


@pytest.mark.s3
def test_an_s3_prefix_without_a_store_is_a_store_error(s3_url: str, s3_env: dict[str, str]) -> None:
    result = run_cli("ls", "--store", s3_url, env=s3_env)
    assert result.returncode == 3, result.stderr
    assert s3_url in result.stderr and "hint:" in result.stderr
