"""Persisted formats are data: what each earlier neffbuild wrote still reads (fixtures written by
that commit's own code, tests/fixtures/formats/<commit>/), and the table names every format."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from neffbuild.build.report import read_reports
from neffbuild.formats import FORMATS
from neffbuild.hashing import hash_file
from neffbuild.store.lease import read_lease
from neffbuild.store.local import LocalStore
from neffbuild.units.plandoc import read_plan
from tests.conftest import ROOT, run_cli

FIXTURES = ROOT / "tests" / "fixtures" / "formats"
# Stores written by publish_release_of (tests/storekit.py) of that commit, then tagged `prod`:
# 54e8b0e is the parent of the layout move (bundle format neffbuild.bundle/1, gc lease
# neffbuild.gc-lease/1), 13084fc the parent of the BLAKE3 formats (neffbuild.documents.records/1).
STORES = ("54e8b0e", "13084fc")


def _formats_in(folder: Path) -> set[str]:
    found = set()
    for path in folder.rglob("*.json"):
        raw = json.loads(path.read_bytes())
        found.add(raw["format"])
    return found


@pytest.mark.parametrize("commit", STORES)
def test_a_store_written_by_an_earlier_neffbuild_shows_and_pulls(commit: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(FIXTURES / commit / "store", store)
    shown = run_cli("show", "prod", "--store", str(store))
    assert shown.returncode == 0, shown.stderr
    checked = run_cli("verify", "--store", str(store))
    assert checked.returncode == 0, checked.stderr
    cache = tmp_path / "cache"
    for verify in ("fast", "full"):  # full re-reads the bundles and re-hashes every file
        pulled = run_cli("pull", "prod", "--store", str(store), "--cache-dir", str(cache), "--no-host-check", "--verify", verify)  # fmt: skip
        assert pulled.returncode == 0, pulled.stderr
    for rel in ("a.bin", "sub/b.bin"):
        digest = hash_file(cache / rel).hex
        assert (store / "blobs" / digest[:2] / digest).read_bytes() == (cache / rel).read_bytes()


@pytest.mark.parametrize("commit", STORES)
def test_an_earlier_gc_lease_is_read_as_a_lease(commit: str, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", create=True)
    (store.root / "gc").mkdir()
    shutil.copy(FIXTURES / commit / "gc-lease.json", store.root / "gc" / "lease.json")
    lease = read_lease(store)  # a publisher that cannot read it would take it for damage
    assert lease is not None and lease.by == "ci@builder" and lease.expires == 1764979500.0


def test_an_earlier_plan_and_report_read() -> None:
    plan = read_plan(FIXTURES / "9bea93d" / "plan.json")
    assert plan.format == "neffbuild.plan/1" and plan.unit_ids == ("fixture/unit",)
    (report,) = read_reports([FIXTURES / "9bea93d" / "report.json"])
    assert report.format == "neffbuild.build-report/1" and report.units[0].status == "built"


def test_every_fixture_format_and_every_format_in_the_source_is_in_the_table() -> None:
    read = {f for spec in FORMATS.values() for f in spec.reads}
    for spec in FORMATS.values():
        assert set(spec.writes) <= set(spec.reads), spec
    assert _formats_in(FIXTURES) <= read
    # The older strings are the fixtures' (written by their own commits), not copied from the table.
    assert {"neffbuild.bundle/1", "neffbuild.documents.records/1", "neffbuild.gc-lease/1"} <= _formats_in(FIXTURES)
    literal = re.compile(r"neffbuild\.[a-z][a-z.-]*/[0-9]+")
    for path in (ROOT / "neffbuild").rglob("*.py"):
        for found in literal.findall(path.read_text()):
            assert found in read, f"{path.relative_to(ROOT)}: {found} is not in neffbuild/formats.py"


def test_an_unknown_format_names_the_kind_not_a_module_path(tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(FIXTURES / STORES[0] / "store", store)
    (bundle,) = (store / "bundles").iterdir()
    raw = json.loads(bundle.read_bytes())
    bundle.chmod(0o644)
    bundle.write_text(json.dumps({**raw, "format": "neffbuild.bundle/9"}))
    shown = run_cli("show", "prod", "--store", str(store))
    assert shown.returncode == 4
    assert "'neffbuild.bundle/9' is not one this neffbuild reads as a bundle" in shown.stderr
    assert "documents.records" not in shown.stderr
