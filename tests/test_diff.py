"""`neffbuild diff`: exactly the fields that differ, nothing else; a release against itself is empty."""

from __future__ import annotations

import json
from pathlib import Path

from neffbuild.inspect.diff import FieldChange, diff
from tests.conftest import run_cli
from tests.inspectkit import CHANGED, FINGERPRINT, Target, Unit, klein_unit, publish_units, target, unit_of  # noqa: F401


def test_a_changed_fingerprint_names_exactly_its_fields(target: Target) -> None:
    three = target.three
    result = diff(target.store, three.v1, three.v3)
    assert (result.added, result.removed, result.unchanged, result.release) == ((), (), (), ())
    expected = tuple(FieldChange(k, FINGERPRINT[k], CHANGED[k]) for k in sorted(CHANGED))
    assert [(c.unit_id, c.fields) for c in result.changed] == [("klein/128x128x1", expected), ("klein/128x256x1", expected)]
    old, new = three.units[three.v1], three.units[three.v3]
    assert [(c.old_key, c.new_key) for c in result.changed] == [(o.key, n.key) for o, n in zip(old, new, strict=True)]
    # The kernels were rebuilt at the same paths; the shared header is byte-identical.
    assert sorted(f.path for f in result.files_changed) == ["aot/128x128x1.bin", "aot/128x256x1.bin", "kernels/128x128x1.so", "kernels/128x256x1.so"]
    assert (result.files_added, result.files_removed) == ((), ())
    for f in result.files_changed:
        assert (f.old_size, f.new_size) == (len(old[0].files.get(f.path) or old[1].files[f.path]), len(new[0].files.get(f.path) or new[1].files[f.path]))


def test_units_pair_by_entry_and_shape_not_by_key(target: Target) -> None:
    three = target.three
    result = diff(target.store, "klein@2", "klein@1")  # v1 -> v2
    assert (result.unchanged, result.added, result.removed, result.changed) == (("klein/128x128x1",), ("klein/256x256x1",), ("klein/128x256x1",), ())
    assert {f.path: f.new_size for f in result.files_added} == {p: len(d) for p, d in three.units[three.v2][1].files.items() if p != "headers/common.h"}
    assert {f.path: f.old_size for f in result.files_removed} == {p: len(d) for p, d in three.units[three.v1][1].files.items() if p != "headers/common.h"}
    assert result.files_changed == ()


def test_a_release_against_itself_is_empty(target: Target) -> None:
    result = diff(target.store, "klein", target.three.v3)
    assert result.identical and result.unchanged == ("klein/128x128x1", "klein/128x256x1") and result.changed == ()


def test_unit_fields_are_dotted_paths(target: Target, tmp_path: Path) -> None:
    # A manifest that sets OMP_NUM_THREADS = 4: the unit's env and the fingerprint's env field move.
    base = klein_unit(128, 128)
    threads = Unit(
        base.unit_id, unit_of("klein", 128, 128, env={"OMP_NUM_THREADS": "4"}), {**FINGERPRINT, "env.OMP_NUM_THREADS": "4"}, base.files
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
    assert doc["identical"] is False and [f["path"] for f in doc["changed"][0]["fields"]] == ["cpu.isa", "threads", "torch"]
    text = run_cli("diff", three.v1, "canary", "--store", target.url, env=target.env)
    assert "  cpu.isa -avx512f\n" in text.stdout and "  torch 2.13.0 -> 2.14.1\n" in text.stdout and "  threads 2 -> 4\n" in text.stdout
    same = run_cli("diff", "canary", "klein", "--store", target.url, "--json", env=target.env)
    assert json.loads(same.stdout)["identical"] is True
    mixed = run_cli("diff", klein_unit(128, 128).key, "klein", "--store", target.url, env=target.env)
    assert mixed.returncode == 2 and "one is a release, the other a bundle" in mixed.stderr
    missing = run_cli("diff", "klein", "prod", "--store", target.url, env=target.env)
    assert missing.returncode == 8 and "tag 'prod' not found" in missing.stderr
