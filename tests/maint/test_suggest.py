"""`neffbuild suggest`: events from serving hosts become exactly the shapes that explain them.

Real files throughout: the repo's tiny manifest copied beside a model directory that plans (its
model_index.json), events written as neffbuild.serve.guard writes them (JSON lines, appended),
and the fingerprint the plan computes for the entry. Nothing compiles.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neffbuild.documents.manifest import load_manifest
from neffbuild.errors import DiskError, InputError
from neffbuild.maint.events import read_events
from neffbuild.maint.suggest import judge, suggest
from neffbuild.units.plan import make_plan
from tests.conftest import TINY_MANIFEST, write_model_index
from tests.units.test_plan import FACTS, facts_provider

PROVIDER = facts_provider()
ENV: Mapping[str, str] = {}


def copy_manifest(root: Path, comment: str = "") -> Path:
    """The repo's tiny manifest, its model pointed at a directory that plans (no weights)."""
    write_model_index(root / "model")
    text = TINY_MANIFEST.read_text().replace('"../.neffbuild/models/tiny-flux2-klein"', '"./model"')
    assert '"./model"' in text, "the repo manifest's layout changed; update copy_manifest"
    if comment:
        text = text.replace("shapes = ", f"{comment}\nshapes = ", 1)
    path = root / "tiny.toml"
    path.write_text(text)
    return path


def planned_fingerprint(manifest: Path) -> dict[str, str]:
    return dict(make_plan(load_manifest(manifest), ENV, PROVIDER).units[0].fingerprint)


def event(fingerprint: Mapping[str, str], height: int | None, width: int | None, batch: int | None = 1, **changes: Any) -> dict[str, Any]:  # fmt: skip
    call = {k: v for k, v in (("height", height), ("width", width), ("batch", batch)) if v is not None}
    return {
        "neffbuild_event": 1,
        "time": "2026-12-06T04:30:00.123456+00:00",
        "host": "ip-10-0-0-1",
        "pid": 1234,
        "mode": "record",
        "manifest": "/srv/manifests/tiny-flux2-klein.toml",
        "manifest_name": "tiny-flux2-klein",
        "entry": "klein",
        "pipeline": "Flux2KleinPipeline",
        "dtype": "float32",
        "backend": "inductor",
        "component": "transformer",
        "inputs": ["hidden_states=float32[1, 64, 32]"],
        "call": call,
        "compile_s": 12.34,
        "counters": {"inductor.fxgraph_cache_miss": 1, "graphs.transformer": 1},
        "compiles": 1,
        "fingerprint": dict(fingerprint),
        **changes,
    }


def append(path: Path, *lines: dict[str, Any] | str) -> Path:
    """As the guard appends: one write of one line each (O_APPEND)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for line in lines:
            os.write(fd, ((line if isinstance(line, str) else json.dumps(line)) + "\n").encode())
    finally:
        os.close(fd)
    return path


def shapes_of(manifest: Path) -> set[str]:
    return {u.unit_id for u in make_plan(load_manifest(manifest), ENV, PROVIDER).units}


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    return copy_manifest(tmp_path, "# shapes the service sees most (keep this comment)")


def test_the_diff_adds_exactly_the_observed_shapes_and_duplicates_across_hosts_collapse(
    manifest: Path, tmp_path: Path
) -> None:
    fp = planned_fingerprint(manifest)
    a = append(tmp_path / "a.jsonl", event(fp, 128, 384), event(fp, 192, 128), event(fp, 192, 128))
    b = append(tmp_path / "b.jsonl", event(fp, 192, 128, host="ip-10-0-0-2"), event(fp, 256, 128, host="ip-10-0-0-2"))
    before = manifest.read_text()

    got = suggest(manifest, [a, b], env=ENV, facts_provider=PROVIDER)

    assert manifest.read_text() == before and not got.written
    assert (got.events, got.hosts) == (5, ("ip-10-0-0-1", "ip-10-0-0-2"))
    [entry] = got.entries
    assert sorted(entry.added) == ["128x384x1", "192x128x1", "256x128x1"]
    assert entry.events == 5 and not got.unexplained
    # In the manifest's product syntax: one list extended (adds 128x384 alone), one new set.
    added = [line for line in got.diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in got.diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert removed == ["-shapes = { height = 128, width = [128, 256], batch = 1 }"]
    assert added == [
        "+shapes = [",
        "+    { height = 128, width = [128, 256, 384], batch = 1 },",
        "+    { height = [192, 256], width = 128, batch = 1 },",
        "+]",
    ]


def test_write_keeps_comments_and_the_manifest_plans_to_old_plus_new_shapes(manifest: Path, tmp_path: Path) -> None:
    fp = planned_fingerprint(manifest)
    old = shapes_of(manifest)
    events = append(tmp_path / "e.jsonl", event(fp, 192, 128), event(fp, 128, 384, batch=None))
    mode = stat.S_IMODE(manifest.stat().st_mode)

    got = suggest(manifest, [events], env=ENV, write=True, facts_provider=PROVIDER)

    text = manifest.read_text()
    assert got.written and text == got.after
    assert "# shapes the service sees most (keep this comment)" in text
    assert '"./model"' in text and "# relative to this file" in text
    assert shapes_of(manifest) == old | {"klein/192x128x1", "klein/128x384x1"}
    assert stat.S_IMODE(manifest.stat().st_mode) == mode
    again = suggest(manifest, [events], env=ENV, write=True, facts_provider=PROVIDER)
    assert not again.changed and not again.entries and again.covered == 0
    assert [u.reason for u in again.unexplained] == [
        f"{s} is listed, yet it compiled: not explained by a shape (`neffbuild status` says whether the host's cache dir serves it)"
        for s in ("192x128x1", "128x384x1")
    ]


def test_a_shape_that_extends_a_set_adds_nothing_else(tmp_path: Path) -> None:
    """Extending width of { height = [128, 256], width = 128 } by 384 would add 256x384 too: a new set instead."""
    manifest = copy_manifest(tmp_path)
    manifest.write_text(
        manifest.read_text().replace("height = 128, width = [128, 256]", "height = [128, 256], width = 128")
    )
    fp = planned_fingerprint(manifest)
    got = suggest(manifest, [append(tmp_path / "e.jsonl", event(fp, 128, 384))], env=ENV, facts_provider=PROVIDER)
    assert got.entries[0].written == ("shapes: add { height = 128, width = 384, batch = 1 }",)
    manifest.write_text(got.after)
    assert shapes_of(manifest) == {"klein/128x128x1", "klein/256x128x1", "klein/128x384x1"}


def test_another_dtype_or_fingerprint_is_unexplained_with_the_differing_field(manifest: Path, tmp_path: Path) -> None:
    fp = planned_fingerprint(manifest)
    events = append(
        tmp_path / "e.jsonl",
        event(fp, 192, 128, dtype="bfloat16"),
        event({**fp, "torch": "2.14.0+cpu", "env.OMP_NUM_THREADS": "8"}, 192, 128),
        event(fp, 192, None),
        event(fp, 200, 128),
        event(fp, 192, 128, entry="other"),
    )
    got = suggest(manifest, [events], env=ENV, facts_provider=PROVIDER)
    assert not got.changed and not got.entries
    reasons = {u.reason: u for u in got.unexplained}
    dtype = reasons["the event's entry differs from this manifest's"]
    assert [(c.name, c.planned, c.event) for c in dtype.changes] == [("dtype", "float32", "bfloat16")]
    host = reasons["not explained by a shape: the serving host differs from the plan"]
    assert next((c.name, c.planned, c.event) for c in host.changes) == ("env.OMP_NUM_THREADS", "2", "8")
    assert ("torch", FACTS["torch"], "2.14.0+cpu") in [(c.name, c.planned, c.event) for c in host.changes]
    assert [c.breaking for c in host.changes] == sorted((c.breaking for c in host.changes), reverse=True)
    assert "call size not recovered (the guard saw no height and width)" in reasons
    assert "200x128x1: not a multiple of 16, which Flux2KleinPipeline needs (shape_multiple)" in reasons
    assert reasons["no such entry in this manifest"].entry == "other"
    assert {u.first for u in got.unexplained} == {f"{events}:{n}" for n in range(1, 6)}


def test_malformed_lines_are_skipped_with_file_and_line(manifest: Path, tmp_path: Path) -> None:
    fp = planned_fingerprint(manifest)
    events = append(
        tmp_path / "e.jsonl",
        event(fp, 192, 128),
        "{not json",
        json.dumps(event(fp, 192, 128, pid="1234")),
        json.dumps(event(fp, 192, 128, extra=1)),
        json.dumps([1, 2]),
    )
    with events.open("a") as torn:
        torn.write(json.dumps(event(fp, 256, 128))[:50])  # the guard killed mid-append

    read = read_events([events])

    assert len(read.events) == 1
    assert [(s.line, s.torn) for s in read.skipped] == [(2, False), (3, False), (4, False), (5, False), (6, True)]
    assert read.skipped[1].why.startswith("pid: ")
    assert read.skipped[2].why == "extra: unknown field"
    assert read.skipped[4].where == f"{events}:6" and read.skipped[4].why.startswith("torn last line")


def test_a_file_without_a_valid_line_or_of_another_version_is_refused(tmp_path: Path) -> None:
    junk = append(tmp_path / "junk.jsonl", "name = 'tiny'", "[[model]]")
    with pytest.raises(InputError, match=r"junk.jsonl:1: not an events file: no valid event in 2 line"):
        read_events([junk])
    newer = append(tmp_path / "newer.jsonl", json.dumps({"neffbuild_event": 2}))
    with pytest.raises(InputError, match=r"newer.jsonl:1: events format version 2 \(this neffbuild reads 1\)"):
        read_events([newer])
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")  # a host that compiled nothing
    assert read_events([empty]).events == ()


def test_write_on_a_read_only_manifest_fails_and_leaves_it_unchanged(manifest: Path, tmp_path: Path, cli: Any) -> None:
    fp = {**planned_fingerprint(manifest)}
    events = append(tmp_path / "e.jsonl", event(fp, 192, 128))
    before = manifest.read_bytes()
    manifest.chmod(0o444)
    with pytest.raises(DiskError, match="read-only; nothing written"):
        suggest(manifest, [events], env=ENV, write=True, facts_provider=PROVIDER)
    assert manifest.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.jsonl", "model", "tiny.toml"]  # no temp file left


def test_the_cli_sanitises_event_strings_and_prints_the_diff(tmp_path: Path, cli: Any) -> None:
    """A subprocess, as a user runs it: this host's own facts plan the fingerprint, as the guard's would."""
    manifest = copy_manifest(tmp_path)
    fp = dict(make_plan(load_manifest(manifest), os.environ).units[0].fingerprint)
    hostile = "ip-\x1b]0;owned\x07\u202e"
    events = append(
        tmp_path / "e.jsonl",
        event(fp, 192, 128, host=hostile),
        event(fp, 192, 128, host=hostile, dtype="bfloat16\x1b[2J"),
        "\x1b[31mnot json",
    )
    manifest.chmod(0o444)

    shown = cli("suggest", str(manifest), str(events))
    written = cli("suggest", str(manifest), str(events), "--write")

    assert shown.returncode == 0, shown.stderr
    assert "+    { height = 192, width = 128, batch = 1 }," in shown.stdout
    assert "\x1b" not in shown.stdout + shown.stderr and "\u202e" not in shown.stderr
    assert "ip-\\x1b]0;owned\\x07\\u202e" in shown.stderr and "'bfloat16\\x1b[2J'" in shown.stderr
    assert f"warning: {events}:3: not JSON" in shown.stderr
    assert written.returncode == 10
    assert written.stderr.splitlines()[-2:] == [
        f"error: {manifest.resolve()}: read-only; nothing written",
        "hint: make it writable (chmod u+w), or apply the printed diff elsewhere (drop --write)",
    ]
    assert "{ height = 192" not in manifest.read_text()


@functools.cache
def _judging() -> tuple[Any, Any, dict[str, str]]:
    root = Path(tempfile.mkdtemp(prefix="suggest-"))
    manifest = copy_manifest(root)
    loaded = load_manifest(manifest)
    plan = make_plan(loaded, ENV, PROVIDER)
    return loaded, plan, dict(plan.units[0].fingerprint)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(
        st.one_of(
            _json.map(json.dumps),
            # an event with one field replaced by anything: decoding must judge each field
            st.tuples(st.sampled_from(sorted(event({}, 1, 1))), _json).map(
                lambda kv: json.dumps({**event(FACTS, 128, 128), kv[0]: kv[1]})
            ),
            st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
        ),
        max_size=6,
    )
)
def test_arbitrary_lines_never_raise_anything_but_the_typed_error(lines: list[str], tmp_path: Path) -> None:
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))
    try:
        read = read_events([path])
    except InputError:
        return
    loaded, plan, _ = _judging()
    judge(read, loaded, plan)  # whatever decoded is judged without an exception
