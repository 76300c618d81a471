"""The fan-in (`neffbuild release`), the plan document and shard builds, without compiling: bundles
are published through the real publishing code from hand-made files, as a shard would publish
them, and every command runs as a real process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neffbuild.build.fanin import assemble_release, planned
from neffbuild.build.publish import publish_bundle
from neffbuild.build.report import Report, ReportUnit, write_report
from neffbuild.documents.bundles import BundleRecord, Timings
from neffbuild.documents.manifest import load_manifest
from neffbuild.documents.records import FileEntry
from neffbuild.hashing import blake3_bytes, hash_bytes
from neffbuild.store import open_store
from neffbuild.store.base import Store
from neffbuild.store.blobs import BlobSource
from neffbuild.units.plan import Plan, make_plan
from neffbuild.units.plandoc import plan_to_document, read_plan, write_plan
from tests.conftest import write_model_index
from tests.units.test_plan import MANIFEST, facts_provider


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    (tmp_path / "model" / "transformer").mkdir(parents=True)
    write_model_index(tmp_path / "model")
    (tmp_path / "m.toml").write_text(MANIFEST)
    return tmp_path / "m.toml"


def other_host_plan(manifest: Path) -> Plan:
    """The manifest planned with another host's facts (test_plan.FACTS): no key matches this host's."""
    return make_plan(load_manifest(manifest), {}, facts_provider())


def publish_unit(store: Store, work: Path, unit, seconds: float = 40.0, peak_rss: int = 0) -> BundleRecord:
    """A unit's bundle as its shard publishes it: a file of its own and one every unit shares."""
    files = {f"kernels/{unit.key}.so": unit.key.encode() * 40, "headers/common.h": b"common " * 30}
    sources, entries = [], []
    for path, data in sorted(files.items()):
        target = work / unit.key / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        sources.append(BlobSource(hash_bytes(data), len(data), target))
        entries.append(FileEntry(path, len(data), hash_bytes(data), blake3_bytes(data)))
    record = BundleRecord(
        key=unit.key, unit_id=unit.unit_id, unit=dict(unit.normalized), backend="inductor", fingerprint=dict(unit.fingerprint),
        files=tuple(entries), counters={"compiles": 2}, timings=Timings(1.0, seconds - 1.0, seconds),
        created_at="2026-01-01T00:00:00+00:00", neffbuild_version="test", peak_rss=peak_rss,
    )  # fmt: skip
    publish_bundle(store, record, sources, jobs=4)
    return record


def test_release_with_a_plan_made_on_another_host_releases_what_a_one_process_build_would(
    manifest: Path, tmp_path: Path, cli
) -> None:
    plan = other_host_plan(manifest)
    store = open_store(str(tmp_path / "store"), create=True)
    records = [publish_unit(store, tmp_path / "work", u) for u in plan.units]
    write_plan(tmp_path / "plan.json", plan_to_document(plan, {}))
    # This host's own keys differ (its facts are not FACTS): without the plan nothing matches.
    unplanned = cli("release", str(manifest), "--store", str(tmp_path / "store"))
    assert unplanned.returncode == 14, unplanned.stderr
    assert "2 of 2 units of tiny have no bundle" in unplanned.stderr and "klein/128x128x1" in unplanned.stderr
    result = cli(
        "release", str(manifest), "--store", str(tmp_path / "store"), "--plan", str(tmp_path / "plan.json"), "--json"
    )
    assert result.returncode == 0, result.stderr
    released = json.loads(result.stdout)
    # The same release id as the one-process build of these bundles would publish (the fan-in core).
    assert released["release_id"] == assemble_release(planned(plan), records).release_id
    assert released["missing"] == [] and released["tag"] == "tiny" and released["planned"] is True
    tag = json.loads((tmp_path / "store" / "tags" / "tiny.json").read_text())
    assert tag["release"] == released["release_id"]
    again = cli(
        "release", str(manifest), "--store", str(tmp_path / "store"), "--plan", str(tmp_path / "plan.json"), "--json"
    )
    assert json.loads(again.stdout)["release_id"] == released["release_id"]  # idempotent: the tag stays


def test_release_with_a_unit_missing_names_it_and_releases_nothing(manifest: Path, tmp_path: Path, cli) -> None:
    plan = other_host_plan(manifest)
    store = open_store(str(tmp_path / "store"), create=True)
    built, missing = plan.units
    publish_unit(store, tmp_path / "work", built)
    write_plan(tmp_path / "plan.json", plan_to_document(plan, {}))
    result = cli("release", str(manifest), "--store", str(tmp_path / "store"), "--plan", str(tmp_path / "plan.json"))
    assert result.returncode == 14, result.stderr
    assert f"error: 1 of 2 units of tiny have no bundle in {tmp_path / 'store'}: {missing.unit_id}" in result.stderr
    assert f"missing  {missing.unit_id}" in result.stdout and built.unit_id not in result.stderr
    assert "hint: build them" in result.stderr
    assert (
        list((tmp_path / "store").glob("releases/*")) == [] and not (tmp_path / "store" / "tags" / "tiny.json").exists()
    )
    as_json = cli(
        "release", str(manifest), "--store", str(tmp_path / "store"), "--plan", str(tmp_path / "plan.json"), "--json"
    )
    assert as_json.returncode == 14 and json.loads(as_json.stdout.split("\n}\n")[0] + "\n}")["missing"] == [
        missing.unit_id
    ]


def test_a_plan_of_another_manifest_version_is_refused(manifest: Path, tmp_path: Path, cli) -> None:
    write_plan(tmp_path / "plan.json", plan_to_document(other_host_plan(manifest), {}))
    manifest.write_text(MANIFEST.replace("num_inference_steps = 2", "num_inference_steps = 3"))
    result = cli("release", str(manifest), "--store", str(tmp_path / "store"), "--plan", str(tmp_path / "plan.json"))
    assert result.returncode == 2, result.stderr
    assert "planned from another version of" in result.stderr
    (tmp_path / "bad.json").write_text('{"format": "neffbuild.units.plan/1", "name": 3}')
    bad = cli("release", str(manifest), "--plan", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "invalid PlanDocument" in bad.stderr


def test_a_worker_whose_facts_differ_from_the_plan_fails_fast_naming_the_fields(
    manifest: Path, tmp_path: Path, cli
) -> None:
    write_plan(tmp_path / "plan.json", plan_to_document(other_host_plan(manifest), {}))
    result = cli(
        "build",
        str(manifest),
        "--store",
        str(tmp_path / "store"),
        "--plan",
        str(tmp_path / "plan.json"),
        "--shard",
        "0/2",
    )
    assert result.returncode == 7, result.stderr
    assert "this host's facts differ from the plan's (" in result.stderr
    assert "python.prefix: planned '/opt/venv', here" in result.stderr or "cpu.isa: planned" in result.stderr
    assert not (tmp_path / "store").exists()  # refused before the store was created


def test_plan_out_and_shards_then_shard_builds_of_present_units_then_release(
    manifest: Path, tmp_path: Path, cli
) -> None:
    """This host's plan document; bundles published for its keys (as two shards would); each
    shard then finds its units present, writes its report and releases nothing; release merges."""
    store_dir = str(tmp_path / "store")
    planned = cli("plan", str(manifest), "--out", str(tmp_path / "plan.json"), "--shards", "2")
    assert planned.returncode == 0, planned.stderr
    assert "2 shards (no durations recorded: balanced by unit count):" in planned.stdout
    assert "shard 0/2: 1 units: klein/" in planned.stdout and "shard 1/2: 1 units: klein/" in planned.stdout
    document = read_plan(tmp_path / "plan.json")
    assert document.shards == 2 and len(document.units) == 2 and document.format == "neffbuild.units.plan/1"
    plan = make_plan(load_manifest(manifest), dict(__import__("os").environ))
    assert [u.key for u in plan.units] == [u.key for u in document.units]
    store = open_store(store_dir, create=True)
    for unit in plan.units:
        publish_unit(store, tmp_path / "work", unit)
    summary = tmp_path / "summary.md"
    reports = []
    for index in ("0", "1"):
        env = {"JOB_COMPLETION_INDEX": index, "GITHUB_STEP_SUMMARY": str(summary)}
        report = tmp_path / f"shard{index}.json"
        shard = cli(
            "build",
            str(manifest),
            "--store",
            store_dir,
            "--plan",
            str(tmp_path / "plan.json"),
            "--report",
            str(report),
            "--json",
            env=env,
        )
        assert shard.returncode == 0, shard.stderr
        out = json.loads(shard.stdout)
        assert [o["status"] for o in out["outcomes"]] == ["present"] and out["shard"] == f"{index}/2"
        assert out["release_id"] is None and out["units_total"] == 2
        reports.append(report)
    assert not (tmp_path / "store" / "tags" / "tiny.json").exists()  # no shard moves the tag
    ids = [json.loads(r.read_text())["units"][0]["unit_id"] for r in reports]
    assert sorted(ids) == sorted(u.unit_id for u in plan.units)  # each unit in exactly one shard
    released = cli(
        "release", str(manifest), "--store", store_dir, "--plan", str(tmp_path / "plan.json"), "--report", str(tmp_path / "all.json"),
        *(a for r in reports for a in ("--shard-report", str(r))), "--json", env={"GITHUB_STEP_SUMMARY": str(summary)},
    )  # fmt: skip
    assert released.returncode == 0, released.stderr
    merged = json.loads((tmp_path / "all.json").read_text())
    assert merged["release_id"] == json.loads(released.stdout)["release_id"] and merged["shards"] == ["0/2", "1/2"]
    assert sorted((u["unit_id"], u["shard"]) for u in merged["units"]) == sorted(zip(ids, ["0/2", "1/2"], strict=True))
    text = summary.read_text()
    assert text.count("### neffbuild: tiny") == 3 and f"release `{merged['release_id']}`" in text
    assert "| unit | status | shard | time | peak memory |" in text


def test_merged_reports_prefer_the_build_that_made_the_bundle(tmp_path: Path) -> None:
    from neffbuild.build.report import markdown, merged

    a = ReportUnit(
        "m/a", "1" * 32, "failed", shard="0/2", killed="killed by SIGKILL", error="m/a: worker killed by SIGKILL"
    )
    rerun = ReportUnit("m/a", "1" * 32, "built", shard="0/2", seconds=40.0, peak_rss=512 << 20, attempts=2)
    b = ReportUnit("m/b", "2" * 32, "present", shard="1/2")
    first, second = Report("m", "s", (a,), ("0/2",)), Report("m", "s", (rerun,), ("0/2",))
    write_report(tmp_path / "r.json", first)
    units = [("m/a", "1" * 32), ("m/b", "2" * 32), ("m/c", "3" * 32)]
    out = merged([first, second, Report("m", "s", (b,), ("1/2",))], units, store="s", name="m", release_id="", tag="")
    assert [u.status for u in out.units] == ["built", "present", "missing"] and out.units[0].attempts == 2
    assert out.shards == ("0/2", "1/2")
    text = markdown(Report("m|x", "s", (a, rerun), ("0/2",)))
    assert "m\\|x" in text and "failed: killed by SIGKILL" in text and "512 MiB" in text


# -- assemble_release: merging the units' files into one cache-dir listing ---------------------------

D1, D2, D3 = "1" * 32, "2" * 32, "3" * 32


@pytest.fixture
def two_unit_plan(tmp_path: Path):
    from neffbuild.documents.manifest import load_manifest
    from neffbuild.units.plan import make_plan
    from tests.conftest import write_model_index
    from tests.units.test_plan import MANIFEST, facts_provider

    (tmp_path / "model" / "transformer").mkdir(parents=True)
    write_model_index(tmp_path / "model")
    (tmp_path / "m.toml").write_text(MANIFEST)
    plan = make_plan(load_manifest(tmp_path / "m.toml"), {}, facts_provider())
    assert len(plan.units) == 2
    return plan


def record_of(unit, files: dict[str, str], **fingerprint: str):
    from neffbuild.documents.bundles import BundleRecord, Timings
    from neffbuild.documents.records import FileEntry

    return BundleRecord(
        key=unit.key, unit_id=unit.unit_id, unit=dict(unit.normalized), backend="inductor",
        fingerprint={**unit.fingerprint, **fingerprint}, files=tuple(FileEntry(p, 1, d, "5" * 64) for p, d in sorted(files.items())),
        counters={}, timings=Timings(), created_at="2026-01-01T00:00:00Z", neffbuild_version="t",
    )  # fmt: skip


def test_assemble_release_refuses_two_files_at_one_path_that_is_no_content_key(two_unit_plan) -> None:
    from neffbuild.build.fanin import assemble_release, planned
    from neffbuild.errors import ConflictError

    a, b = two_unit_plan.units
    records = [record_of(a, {"model_config.json": D1}), record_of(b, {"model_config.json": D2})]
    with pytest.raises(
        ConflictError, match=rf"model_config.json: units {a.unit_id} and {b.unit_id} produced different files"
    ):
        assemble_release(planned(two_unit_plan), records)


def test_assemble_release_keeps_one_copy_of_a_shared_content_keyed_path(two_unit_plan) -> None:
    from neffbuild.build.fanin import assemble_release, planned
    from neffbuild.documents.records import SharedPath

    a, b = two_unit_plan.units
    kernel, entry = "ab/cabc123.so", "fxgraph/x/key/entry"
    records = [
        record_of(a, {kernel: D2, entry: D1, "a/only": D1}),
        record_of(b, {kernel: D1, entry: D1}, threads="4", **{"cpu.isa": "avx2"}),
    ]
    release = assemble_release(planned(two_unit_plan), records)
    assert [(f.path, f.digest) for f in release.files] == [
        ("a/only", D1),
        (kernel, D2 if a.key < b.key else D1),
        (entry, D1),
    ]
    kept = D2 if a.key < b.key else D1
    assert release.shared == (SharedPath(path=kernel, kept=kept, dropped=(D1 if kept == D2 else D2,)),)
    # The release's fingerprint holds only what every unit shares.
    assert "threads" not in release.fingerprint and "cpu.isa" not in release.fingerprint
    assert release.fingerprint == {k: v for k, v in a.fingerprint.items() if k not in ("threads", "cpu.isa")}
    assert [u.unit_id for u in release.units] == [a.unit_id, b.unit_id] and release.env == dict(
        two_unit_plan.runtime_env
    )
