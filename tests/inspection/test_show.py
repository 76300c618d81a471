"""`neffbuild show`: a release's units as their bundles record them; a bundle's files; ref errors."""

from __future__ import annotations

import json
from pathlib import Path

from neffbuild.build.publish import publish_bundle
from neffbuild.documents.bundles import BundleRecord, Timings
from neffbuild.hashing import canonical_json, hash_bytes
from neffbuild.inspect.show import BundleView, ReleaseView, show
from neffbuild.store import open_store
from tests.conftest import run_cli
from tests.inspectkit import Target, target  # noqa: F401  (target: a fixture)


def test_a_release_shows_each_unit_as_its_bundle_records_it(target: Target) -> None:
    three = target.three
    view = show(target.store, "klein@1")  # the tag's previous release: v2
    assert isinstance(view, ReleaseView) and view.release_id == three.v2 and view.tag is None
    assert [u.unit_id for u in view.units] == ["klein/128x128x1", "klein/256x256x1"]
    for shown, unit in zip(view.units, three.units[three.v2], strict=True):
        assert shown.key == unit.key
        assert (shown.files, shown.bytes) == (len(unit.files), sum(len(d) for d in unit.files.values()))
        assert shown.shape == unit.normalized["shape"]
        assert (shown.pipeline, shown.dtype, shown.mode) == ("Flux2KleinPipeline", "float32", "full")
        assert shown.components == ("transformer", "vae.decode") and shown.model.startswith("local:")
        assert shown.timings == Timings(load_s=1.5, first_call_s=40.0, total_s=41.5)
        assert shown.counters == {"compiles": 3, "graphs.transformer": 1}
    assert view.files == 5 and view.bytes == sum(len(d) for u in three.units[three.v2] for d in u.files.values()) - len(
        b"common header " * 30
    )


def test_a_bundle_key_shows_its_files(target: Target) -> None:
    unit = target.three.units[target.three.v3][1]
    view = show(target.store, unit.key)
    assert isinstance(view, BundleView) and view.unit.unit_id == "klein/128x256x1"
    assert {f.path: f.size for f in view.files} == {p: len(d) for p, d in unit.files.items()}
    assert view.unit.fingerprint["torch"] == "2.14.1"


def test_cli_json_table_and_errors(target: Target) -> None:
    shown = run_cli("show", target.three.v1[:8], "--store", target.url, "--json", env=target.env)  # a prefix
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["kind"] == "release" and doc["release_id"] == target.three.v1 and len(doc["units"]) == 2
    table = run_cli("show", "canary", "--store", target.url, env={**target.env, "COLUMNS": "80"})
    assert table.returncode == 0 and "klein/128x256x1" in table.stdout and target.three.v3 in table.stdout
    missing = run_cli("show", "prod", "--store", target.url, env=target.env)
    assert missing.returncode == 8 and "tag 'prod' not found" in missing.stderr and "hint:" in missing.stderr
    gone = run_cli("show", "0" * 32, "--store", target.url, env=target.env)
    assert gone.returncode == 8 and "not found" in gone.stderr
    back = run_cli("show", "klein@9", "--store", target.url, env=target.env)
    assert back.returncode == 8 and "klein@2" in back.stderr  # the hint names the oldest


def test_an_ambiguous_prefix_is_an_input_error(tmp_path: Path) -> None:
    # Two bundle keys that share their first 6 hex digits: found by hashing units until two collide.
    seen: dict[str, dict] = {}
    for i in range(200_000):
        unit = {"n": i}
        key = hash_bytes(canonical_json(unit))
        if key[:6] in seen:
            pair = [seen[key[:6]], unit]
            break
        seen[key[:6]] = unit
    store = open_store(str(tmp_path / "store"), create=True)
    for unit in pair:
        record = BundleRecord(
            key=hash_bytes(canonical_json(unit)), unit_id="x/1x1x1", unit=unit, backend="inductor", fingerprint={},
            files=(), counters={}, timings=Timings(), created_at="2025-01-01T00:00:00+00:00", neffbuild_version="test",
        )  # fmt: skip
        publish_bundle(store, record, [], jobs=1)
    prefix = hash_bytes(canonical_json(pair[0]))[:6]
    result = run_cli("show", prefix, "--store", str(tmp_path / "store"))
    assert result.returncode == 2, result.stderr
    assert f"{prefix!r} is ambiguous: 2" in result.stderr and "hint: give more hex digits" in result.stderr
