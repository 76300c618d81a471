"""A local model's weights key the units whose compiled result holds them (units/weights.py)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from neffbuild.documents.manifest import load_manifest
from neffbuild.units.plan import make_plan
from neffbuild.units.weights import MEMO
from tests.units.test_plan import MANIFEST, facts_provider, keys

RECIPES = {
    "package": '\n[model.compile]\nartifact = "package"\n',
    "freezing": "\n[model.compile.inductor]\nfreezing = true\n",
}


def _model(root: Path, weights: bytes) -> None:
    from tests.conftest import write_model_index

    (root / "transformer").mkdir(parents=True)
    write_model_index(root)
    (root / "transformer" / "config.json").write_text('{"num_layers": 2}')
    (root / "transformer" / "weights.safetensors").write_bytes(weights)


@pytest.fixture
def twins(tmp_path: Path) -> tuple[Path, Path]:
    """Two manifests over two model dirs with the same configs and other weights."""
    paths = []
    for name, weights in (("a", b"\0" * 64), ("b", b"\1" * 64)):
        _model(tmp_path / name / "model", weights)
        paths.append(tmp_path / name / "m.toml")
        paths[-1].write_text(MANIFEST)
    return paths[0], paths[1]


@pytest.mark.parametrize("recipe", ["package", "freezing"])
def test_other_weights_key_apart_where_the_compiled_result_holds_them(twins: tuple[Path, Path], recipe: str) -> None:
    a, b = twins
    assert keys(a) == keys(b)  # the cache path: the graphs take the weights as inputs
    for path in twins:
        path.write_text(path.read_text() + RECIPES[recipe])
    assert set(keys(a).values()).isdisjoint(keys(b).values())
    shutil.copy(a.parent / "model/transformer/weights.safetensors", b.parent / "model/transformer/weights.safetensors")
    assert keys(a) == keys(b)  # the same bytes: the same keys, wherever they lie


def test_a_rewritten_weights_file_changes_the_key_with_the_memo_in_place(
    twins: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = twins
    a.write_text(a.read_text() + RECIPES["package"])
    memo = tmp_path / "plans"

    def planned() -> dict[str, str]:
        plan = make_plan(load_manifest(a), {}, facts_provider(), cache=memo)
        return {u.unit_id: u.key for u in plan.units}

    before = planned()
    files = json.loads((memo / MEMO).read_bytes())["files"]
    assert [Path(p).name for p in files] == ["weights.safetensors"]  # configs are keyed apart
    assert planned() == before
    (a.parent / "model/transformer/weights.safetensors").write_bytes(b"\2" * 64)
    after = planned()
    assert set(after.values()).isdisjoint(before.values())
    assert after == {u: k for u, k in keys(a).items()}  # the memo's key is the one hashed afresh


def test_a_corrupt_memo_is_ignored_with_a_line_and_rewritten(
    twins: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, _ = twins
    a.write_text(a.read_text() + RECIPES["package"])
    memo = tmp_path / "plans"
    memo.mkdir()
    (memo / MEMO).write_bytes(b"{not json")
    with caplog.at_level(logging.WARNING, logger="neffbuild.units.weights"):
        plan = make_plan(load_manifest(a), {}, facts_provider(), cache=memo)
    assert {u.unit_id: u.key for u in plan.units} == keys(a)
    assert any("weights memo" in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)
    assert json.loads((memo / MEMO).read_bytes())["format"].startswith("neffbuild.weights-memo/")


def test_a_memo_written_by_the_commit_that_introduced_it_still_reads(tmp_path: Path) -> None:
    """tests/fixtures/formats/2b15c9d/weights.json was written by 2b15c9d's own weights_digest for
    one 32-byte model.safetensors, which returned OLD_DIGEST. Here a file of other bytes gets the
    recorded stamp (path and inode are this run's, the document's layout is the fixture's): the
    digest that comes back is the memo's, so today's reader took the old document as a hit."""
    from neffbuild.units.weights import weights_digest
    from tests.conftest import ROOT

    old_digest = "bd794c701b0993e38468f2e69e1dc1b7"  # what 2b15c9d's weights_digest returned
    doc = json.loads((ROOT / "tests/fixtures/formats/2b15c9d" / MEMO).read_bytes())
    ((_, (size, mtime_ns, _, digest)),) = doc["files"].items()
    model, memo = tmp_path / "model", tmp_path / "memo"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"other bytes of the very same size"[:size])
    (model / "config.json").write_text("{}")

    def is_config(p: Path) -> bool:
        return p.suffix == ".json"

    fresh = weights_digest(model, is_config, None)
    os.utime(weights, ns=(mtime_ns, mtime_ns))
    doc["files"] = {str(weights.resolve()): [size, mtime_ns, weights.stat().st_ino, digest]}
    memo.mkdir()
    (memo / MEMO).write_text(json.dumps(doc))
    assert weights_digest(model, is_config, memo) == old_digest != fresh
