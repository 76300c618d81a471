"""`build --unit-memory auto`: each unit's share is a recorded peak RSS with a margin, from the
unit's own bundle, the same entry's other bundles, or the tag's current release; else the
default. A real second build sizes its new unit from the peak the first build recorded."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from neffbuild.build.fanin import assemble_release, planned
from neffbuild.build.publish import move_tag, publish_release
from neffbuild.build.sizing import DEFAULT_UNIT_MEMORY, MARGIN, unit_shares
from neffbuild.documents.manifest import load_manifest
from neffbuild.store import open_store
from neffbuild.units.plan import make_plan
from tests.build.test_fanin import manifest, publish_unit  # noqa: F401  (a fixture)
from tests.build.test_faults import ENTRY, ENV

MIB = 1 << 20


def test_shares_come_from_the_units_own_peak_its_entrys_then_the_release_else_the_default(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    plan = make_plan(load_manifest(manifest), dict(os.environ))
    small, large = plan.units  # klein/128x128x1, klein/128x256x1
    store = open_store(str(tmp_path / "store"), create=True)
    assert {u: s.need for u, s in unit_shares(store, plan.units, plan.units, "tiny").items()} == {
        small.unit_id: DEFAULT_UNIT_MEMORY, large.unit_id: DEFAULT_UNIT_MEMORY,
    }  # fmt: skip
    # A release of another toolchain's keys for both units, as the tag's current release.
    old = [replace(u, key=f"{i + 1:032x}") for i, u in enumerate(plan.units)]
    records = [
        publish_unit(store, tmp_path / "old", u, peak_rss=p) for u, p in zip(old, (300 * MIB, 500 * MIB), strict=True)
    ]
    release = assemble_release(planned(replace(plan, units=tuple(old))), records)
    move_tag(store, "tiny", publish_release(store, release), by="test")
    shares = unit_shares(store, plan.units, plan.units, "tiny")
    assert shares[small.unit_id].need == int(300 * MIB * MARGIN)  # the same unit id, released
    assert shares[large.unit_id].need == int(500 * MIB * MARGIN)
    # This toolchain's bundle of the small unit: its entry's peak now sizes the large one too.
    publish_unit(store, tmp_path / "new", small, peak_rss=200 * MIB)
    shares = unit_shares(store, plan.units, [large], "tiny")
    assert shares[large.unit_id].need == int(200 * MIB * MARGIN)
    assert shares[large.unit_id].source == f"{MARGIN} x the 200 MiB peak of {small.unit_id}'s build"


@pytest.mark.slow  # real workers, about 20 s
def test_a_second_build_sizes_its_new_unit_from_the_peak_the_first_recorded(
    tiny_model: Path, tmp_path: Path, cli
) -> None:
    (tmp_path / "tiny").symlink_to(tiny_model)
    m = tmp_path / "neffbuild.toml"
    store, report = tmp_path / "store", tmp_path / "first.json"
    m.write_text('name = "sizing"\n' + ENTRY.format(id="good", model="tiny", width=32))
    first = cli("-v", "build", str(m), "--store", str(store), "--unit-memory", "auto", "--report", str(report), env=ENV)
    assert first.returncode == 0, first.stderr
    assert f"memory: good/32x32x1: {DEFAULT_UNIT_MEMORY // MIB} MiB (no peak recorded: the default)" in first.stderr
    (unit,) = json.loads(report.read_text())["units"]
    bundle = json.loads((store / "bundles" / f"{unit['key']}.json").read_text())
    assert bundle["peak_rss"] == unit["peak_rss"] > 0  # recorded in the store, as the report says
    phases = unit["phases"]  # where the unit's time went (bench/build.py reads these)
    assert set(phases) == {"queue", "load", "trace", "compile", "run", "publish"}
    assert phases["load"] > 0 and phases["trace"] > 0 and phases["compile"] > 0 and phases["publish"] > 0
    assert phases["trace"] + phases["compile"] + phases["run"] == pytest.approx(
        bundle["timings"]["first_call_s"], abs=0.01
    )
    # A new shape of the same entry: sized from that peak, with the margin.
    m.write_text('name = "sizing"\n' + ENTRY.format(id="good", model="tiny", width="[32, 64]"))
    second = cli("-v", "build", str(m), "--store", str(store), "--unit-memory", "auto", env=ENV)
    assert second.returncode == 0, second.stderr
    peak = bundle["peak_rss"]
    expected = f"memory: good/32x64x1: {int(peak * MARGIN) / MIB:.0f} MiB ({MARGIN} x the {peak / MIB:.0f} MiB peak of good/32x32x1's build)"
    assert expected in second.stderr, second.stderr
