"""`neffbuild diff`: exactly the fields that differ, nothing else; a release against itself is empty."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from neffbuild.documents.records import unit_key
from neffbuild.host.fielddiff import FieldDiff
from neffbuild.inspect.diff import FieldChange, diff, diff_host
from neffbuild.store import open_store
from neffbuild.store.base import Store
from tests.conftest import run_cli
from tests.inspectkit import CHANGED, FINGERPRINT, Target, Unit, klein_unit, publish_units, target, unit_of  # noqa: F401
from tests.storekit import this_host


def test_a_changed_fingerprint_names_exactly_its_fields(target: Target) -> None:
    three = target.three
    result = diff(target.store, three.v1, three.v3)
    assert (result.added, result.removed, result.unchanged, result.release) == ((), (), (), ())
    expected = tuple(FieldChange(k, FINGERPRINT[k], CHANGED[k]) for k in sorted(CHANGED))
    assert [(c.unit_id, c.fields) for c in result.changed] == [
        ("klein/128x128x1", expected),
        ("klein/128x256x1", expected),
    ]
    old, new = three.units[three.v1], three.units[three.v3]
    assert [(c.old_key, c.new_key) for c in result.changed] == [(o.key, n.key) for o, n in zip(old, new, strict=True)]
    # The kernels were rebuilt at the same paths; the shared header is byte-identical.
    assert sorted(f.path for f in result.files_changed) == [
        "aot/128x128x1.bin",
        "aot/128x256x1.bin",
        "kernels/128x128x1.so",
        "kernels/128x256x1.so",
    ]
    assert (result.files_added, result.files_removed) == ((), ())
    for f in result.files_changed:
        assert (f.old_size, f.new_size) == (
            len(old[0].files.get(f.path) or old[1].files[f.path]),
            len(new[0].files.get(f.path) or new[1].files[f.path]),
        )


def test_units_pair_by_entry_and_shape_not_by_key(target: Target) -> None:
    three = target.three
    result = diff(target.store, "klein@2", "klein@1")  # v1 -> v2
    assert (result.unchanged, result.added, result.removed, result.changed) == (
        ("klein/128x128x1",),
        ("klein/256x256x1",),
        ("klein/128x256x1",),
        (),
    )
    assert {f.path: f.new_size for f in result.files_added} == {
        p: len(d) for p, d in three.units[three.v2][1].files.items() if p != "headers/common.h"
    }
    assert {f.path: f.old_size for f in result.files_removed} == {
        p: len(d) for p, d in three.units[three.v1][1].files.items() if p != "headers/common.h"
    }
    assert result.files_changed == ()


def test_a_release_against_itself_is_empty(target: Target) -> None:
    result = diff(target.store, "klein", target.three.v3)
    assert result.identical and result.unchanged == ("klein/128x128x1", "klein/128x256x1") and result.changed == ()


def test_unit_fields_are_dotted_paths(target: Target, tmp_path: Path) -> None:
    # A manifest that sets OMP_NUM_THREADS = 4: the unit's env and the fingerprint's env field move.
    base = klein_unit(128, 128)
    threads = Unit(
        base.unit_id,
        unit_of("klein", 128, 128, env={"OMP_NUM_THREADS": "4"}),
        {**FINGERPRINT, "env.OMP_NUM_THREADS": "4"},
        base.files,
    )
    rid = publish_units(target.store, tmp_path / "t", "klein", [threads, klein_unit(128, 256)])
    result = diff(target.store, target.three.v1, rid)
    assert [c.fields for c in result.changed] == [
        (FieldChange("unit.env.OMP_NUM_THREADS", "2", "4"), FieldChange("env.OMP_NUM_THREADS", None, "4")),
    ]  # fmt: skip
    assert result.unchanged == ("klein/128x256x1",) and result.files_changed == ()
    # Two bundles compare field by field, whatever their identity: here a shape.
    shapes = diff(target.store, klein_unit(128, 256).key, klein_unit(256, 256).key)
    assert [c.fields for c in shapes.changed] == [(FieldChange("unit.shape.height", 128, 256),)]


def test_cli_json_and_errors(target: Target) -> None:
    three = target.three
    shown = run_cli("diff", three.v1, "canary", "--store", target.url, "--json", env=target.env)
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["identical"] is False and [f["path"] for f in doc["changed"][0]["fields"]] == [
        "cpu.isa",
        "threads",
        "torch",
    ]
    text = run_cli("diff", three.v1, "canary", "--store", target.url, env=target.env)
    assert (
        "  cpu.isa -avx512f\n" in text.stdout
        and "  torch 2.13.0 -> 2.14.1\n" in text.stdout
        and "  threads 2 -> 4\n" in text.stdout
    )
    same = run_cli("diff", "canary", "klein", "--store", target.url, "--json", env=target.env)
    assert json.loads(same.stdout)["identical"] is True
    mixed = run_cli("diff", klein_unit(128, 128).key, "klein", "--store", target.url, env=target.env)
    assert mixed.returncode == 2 and "one is a release, the other a bundle" in mixed.stderr
    missing = run_cli("diff", "klein", "prod", "--store", target.url, env=target.env)
    assert missing.returncode == 8 and "tag 'prod' not found" in missing.stderr


def test_bundles_whose_components_received_the_same_inputs_are_same_graphs(tmp_path: Path) -> None:
    """Keys differ (another call argument), inputs recorded at build agree: diff says the graphs
    are the same; other inputs, or a bundle that recorded none, say nothing of the kind."""
    store = open_store(str(tmp_path / "store"), create=True, env={})
    seen = {"transformer": ("float32[2, 16, 64]",), "vae.decode": ("float32[1, 32, 8, 8]",)}
    base = klein_unit(128, 128)

    def variant(call: dict[str, Any], inputs: dict[str, tuple[str, ...]]) -> Unit:
        return Unit(base.unit_id, unit_of("klein", 128, 128, call=call), base.fingerprint, base.files, inputs)

    old = variant({"max_sequence_length": 64, "guidance_scale": 5.0}, seen)
    same = variant({"max_sequence_length": 64, "guidance_scale": 7.5}, seen)
    other = variant({"max_sequence_length": 128}, {**seen, "transformer": ("float32[2, 32, 64]",)})
    for n, unit in enumerate((old, same, other, base)):
        publish_units(store, tmp_path / "w", f"r{n}", [unit])
    assert len({old.key, same.key, other.key, base.key}) == 4
    judged = {u.key: [c.same_graphs for c in diff(store, old.key, u.key).changed] for u in (same, other, base)}
    assert judged == {same.key: [True], other.key: [False], base.key: [None]}
    text = run_cli("diff", old.key, same.key, "--store", str(tmp_path / "store"))
    assert text.returncode == 0, text.stderr
    assert f"key {old.key} -> {same.key} (same graphs: every component received the same inputs)" in text.stdout
    assert "same graphs" not in run_cli("diff", old.key, other.key, "--store", str(tmp_path / "store")).stdout


# ---- diff --host: a release against this host (local store) -------------------------------------


def _host_release(store: Store, work: Path, name: str, **changed: str) -> tuple[str, list[Unit]]:
    """Two units recorded with this host's fingerprint (for the release's exports), with `changed`
    fields over it; tagged `name`."""
    units = []
    for height, width in ((128, 128), (128, 256)):
        base = klein_unit(height, width)
        units.append(
            Unit(
                base.unit_id,
                base.normalized,
                {**this_host(base.normalized, {"OMP_NUM_THREADS": "2"}), **changed},
                base.files,
            )
        )
    return publish_units(store, work, name, units, tag=name), units


@pytest.fixture
def local(tmp_path: Path) -> Store:
    return open_store(str(tmp_path / "store"), create=True, env={})


def test_host_diff_of_a_release_built_here_is_empty(local: Store, tmp_path: Path) -> None:
    rid, units = _host_release(local, tmp_path / "w", "here")
    result = diff_host(local, "here", os.environ)
    assert result.identical and (result.release_id, result.tag) == (rid, "here")
    assert [(u.unit_id, u.key, u.host_key, u.diffs) for u in result.host.units] == [
        (u.unit_id, u.key, u.key, ()) for u in units
    ]
    shown = run_cli("diff", "--host", rid[:12], "--store", local.url, "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert (doc["identical"], doc["breaking"], doc["release_id"]) == (True, [], rid)
    text = run_cli("diff", "--host", "here", "--store", local.url)
    assert "0 of 2 units differ" in text.stdout and "same     klein/128x256x1" in text.stdout


def test_host_diff_names_exactly_the_changed_fields(local: Store, tmp_path: Path) -> None:
    here = this_host(unit_of("klein", 128, 128), {"OMP_NUM_THREADS": "2"})
    flags = here["cpu.isa"].split(",")
    fewer = ",".join(flags[1:])  # the build lacked this host's first flag
    _, units = _host_release(
        local, tmp_path / "w", "other", **{"cpu.isa": fewer, "torch": "9.9.9", "diffusers": "0.1.0"}
    )
    result = diff_host(local, "other", os.environ)
    expected = (
        FieldDiff("cpu.isa", fewer, here["cpu.isa"], True), FieldDiff("diffusers", "0.1.0", here["diffusers"], False),
        FieldDiff("torch", "9.9.9", here["torch"], True),
    )  # fmt: skip
    assert [(u.unit_id, u.diffs) for u in result.host.units] == [(u.unit_id, expected) for u in units]
    assert [u.host_key for u in result.host.units] == [_here_key(u) for u in units]
    assert not result.identical and [d.name for d in result.host.breaking] == ["cpu.isa", "torch"]
    shown = run_cli("diff", "--host", "other", "--store", local.url, "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["breaking"] == ["cpu.isa", "torch"] and [d["name"] for d in doc["host"]["units"][0]["diffs"]] == [
        "cpu.isa",
        "diffusers",
        "torch",
    ]
    text = run_cli("diff", "--host", "other", "--store", local.url, env={"COLUMNS": "100"}).stdout
    assert "2 of 2 units differ; 2 breaking, 1 informational fields" in text
    assert f"  breaking cpu.isa +{flags[0]}\n" in text and f"  breaking torch 9.9.9 -> {here['torch']}\n" in text
    assert f"  info     diffusers 0.1.0 -> {here['diffusers']}\n" in text
    both = run_cli("diff", "other", "--host", "other", "--store", local.url)
    assert both.returncode == 2 and "takes no A or B" in both.stderr


def _here_key(unit: Unit) -> str:
    """The key this host gives the unit: its own fingerprint here."""
    return unit_key(unit.normalized, this_host(unit.normalized, {"OMP_NUM_THREADS": "2"}))
