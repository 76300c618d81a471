"""`verify --replay --trace` and `show REF --unused TRACE`: the trace document (strict decoding of
what may be an edited or foreign file), the unused files of a release against it, and (slow) a real
replay of the tiny release tracing what it opened, with a file added by hand showing up unused."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from neffbuild.documents.records import to_json
from neffbuild.errors import InputError
from neffbuild.host.trace import TRACE_FORMAT, ReplayTrace, TracedFile, UnitTrace, read_trace, write_trace
from neffbuild.inspect.unused import unused
from tests.conftest import run_cli, write_manifest
from tests.inspectkit import Target, target  # noqa: F401  (target: a fixture)


def trace_of(files: dict[str, int], opened: list[str], release_id: str | None = None) -> ReplayTrace:
    return ReplayTrace(
        cache_dir="/srv/cache", backend="inductor", release_id=release_id, tag=None,
        files=tuple(TracedFile(p, n) for p, n in sorted(files.items())), loading=(),
        units=(UnitTrace("klein/128x128x1", tuple(sorted(opened))),), opened=tuple(sorted(opened)),
    )  # fmt: skip


def test_a_trace_reads_back_as_written(tmp_path: Path) -> None:
    trace = trace_of({"a/b.so": 10, "c.py": 3}, ["a/b.so"], "0" * 32)
    write_trace(tmp_path / "t.json", trace)
    assert json.loads((tmp_path / "t.json").read_text())["format"] == TRACE_FORMAT
    assert read_trace(tmp_path / "t.json") == trace


GOOD = to_json(trace_of({"a": 1}, ["a"]))


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "expected an object, got list"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "format"}).encode(), "format None"),
        (json.dumps({**GOOD, "format": "neffbuild.replay-trace/9"}).encode(), "format 'neffbuild.replay-trace/9'"),
        (json.dumps({**GOOD, "opened": ["../../etc/passwd"]}).encode(), "at opened: unsafe path"),
        (json.dumps({**GOOD, "units": [{"unit_id": "u", "opened": ["/abs"]}]}).encode(), "units.0.opened: unsafe"),
        (json.dumps({**GOOD, "files": [{"path": "a", "size": -1}]}).encode(), "files.0.size: -1 is no file size"),
        (json.dumps({**GOOD, "files": [{"path": "a", "size": "1"}]}).encode(), "expected int, got str"),
        (json.dumps({**GOOD, "release_id": "not-a-digest"}).encode(), "release_id"),
        (json.dumps({**GOOD, "extra": 1}).encode(), "extra: unknown field"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "units"}).encode(), "units: field required"),
        (json.dumps({**GOOD, "tag": "\ud800"}).encode(), "lone surrogate"),
    ],
)
def test_a_bad_trace_is_an_input_error_naming_the_file_and_the_flaw(tmp_path: Path, content: bytes, says: str) -> None:
    (tmp_path / "t.json").write_bytes(content)
    with pytest.raises(InputError) as raised:
        read_trace(tmp_path / "t.json")
    assert str(tmp_path / "t.json") in raised.value.message and says in raised.value.message
    assert "\n" not in raised.value.message and raised.value.hint


def test_unused_lists_the_releases_unopened_files_largest_first_and_ignores_the_traces_others(
    target: Target, tmp_path: Path
) -> None:
    v1 = target.three.v1
    sizes = {p: len(d) for u in target.three.units[v1] for p, d in u.files.items()}
    opened = ["kernels/128x128x1.so", "headers/common.h", "not/in/the/release.so"]
    write_trace(tmp_path / "t.json", trace_of({**sizes, "not/in/the/release.so": 5}, opened, v1))
    report = unused(target.store, v1, tmp_path / "t.json")
    expected = sorted(((p, n) for p, n in sizes.items() if p not in opened), key=lambda f: (-f[1], f[0]))
    assert [(f.path, f.size) for f in report.unused] == expected and report.mismatch == ()
    assert report.unused_bytes == sum(n for _, n in expected) and report.opened == 2
    assert report.files == len(sizes) and report.bytes == sum(sizes.values())


def test_a_trace_of_another_release_says_so(target: Target, tmp_path: Path) -> None:
    three = target.three
    sizes = {p: len(d) for u in three.units[three.v1] for p, d in u.files.items()}
    write_trace(tmp_path / "t.json", trace_of(sizes, list(sizes), three.v1))
    report = unused(target.store, three.v3, tmp_path / "t.json")  # v3: other bytes at the same paths
    assert report.mismatch[0] == f"the traced cache dir held release {three.v1}, not {three.v3}"
    assert (
        "2 of its 5 files were not in the traced cache dir"
        in unused(target.store, three.v2, tmp_path / "t.json").mismatch
    )


def test_the_cli_refuses_a_bad_trace_in_one_line_with_exit_2(target: Target, tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text('{"format": "neffbuild.replay-trace/1", "opened": ["\\u001b]0;owned\\u0007"]}')
    result = run_cli("show", "klein", "--store", target.url, "--unused", str(tmp_path / "t.json"), env=target.env)
    assert result.returncode == 2 and result.stdout == ""
    first = result.stderr.splitlines()[0]
    assert str(tmp_path / "t.json") in first and "\x1b" not in result.stderr
    result = run_cli("show", "klein", "--store", target.url, "--unused", str(tmp_path / "absent.json"), env=target.env)
    assert result.returncode == 2 and "cannot read it" in result.stderr


def test_the_cli_lists_unused_files_sanitised_and_as_json(target: Target, tmp_path: Path) -> None:
    v2 = target.three.v2
    sizes = {p: len(d) for u in target.three.units[v2] for p, d in u.files.items()}
    write_trace(tmp_path / "t.json", trace_of(sizes, ["headers/common.h"], v2))
    result = run_cli("show", "klein@1", "--store", target.url, "--unused", str(tmp_path / "t.json"), env=target.env)
    assert result.returncode == 0, result.stderr
    assert "kernels/256x256x1.so" in result.stdout and "4 of 5 files unused" in result.stdout
    result = run_cli("show", v2, "--store", target.url, "--unused", str(tmp_path / "t.json"), "--json", env=target.env)
    doc = json.loads(result.stdout)
    listed = [(-f["size"], f["path"]) for f in doc["unused"]]
    assert listed == sorted(listed) and len(listed) == 4 and doc["mismatch"] == []
    assert doc["unused_bytes"] == sum(n for p, n in sizes.items() if p != "headers/common.h")


def test_trace_is_a_replay_option_written_outside_the_checked_dir(tiny_model: Path, tmp_path: Path) -> None:
    manifest = str(write_manifest(tmp_path / "m.toml", tiny_model, widths=(128,)))
    cache = tmp_path / "cache"
    cache.mkdir()
    for args, says in [
        (("--trace", str(tmp_path / "t.json")), "--trace is a --replay option"),
        (("--replay", "--trace", str(cache / "t.json")), "inside the checked cache dir"),
        (("--replay", "--trace", str(tmp_path / "absent" / "t.json")), "its directory does not exist"),
    ]:
        result = run_cli("verify", manifest, "--cache-dir", str(cache), *args)
        assert result.returncode == 2 and says in result.stderr, result.stderr
    assert list(cache.iterdir()) == []


# ---- a real replay of the tiny release (the suite's shared build) ------------------------------


def with_extra_file(store_path: Path, tag: str, work: Path, path: str, data: bytes) -> str:
    """A release of tag's release with one more file, added by hand (in no unit's bundle); its id."""
    from neffbuild.build.publish import publish_release
    from neffbuild.documents.records import FileEntry
    from neffbuild.documents.refs import resolve
    from neffbuild.hashing import blake3_bytes, hash_bytes
    from neffbuild.store import open_store
    from neffbuild.store.blobs import BlobSource

    store = open_store(str(store_path))
    release = resolve(store, tag).release
    work.mkdir(parents=True, exist_ok=True)
    (work / "extra").write_bytes(data)
    store.put_blobs([BlobSource(hash_bytes(data), len(data), work / "extra", blake3_bytes(data))], jobs=1)
    entry = FileEntry(path, len(data), hash_bytes(data), blake3_bytes(data))
    files = tuple(sorted((*release.files, entry), key=lambda f: f.path))
    return publish_release(store, dataclasses.replace(release, files=files))


@pytest.mark.slow
def test_a_traced_replay_lists_what_each_unit_opened_and_a_file_added_by_hand_is_unused(
    built_store: Path, tiny_manifest: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(built_store, store)  # the shared store stays as the other tests expect it
    extra = "fxgraph/added-by-hand.bin"
    release_id = with_extra_file(store, "tiny-flux2-klein", tmp_path / "work", extra, b"dead weight " * 1000)
    cache = tmp_path / "cache"
    pulled = run_cli("pull", release_id, "--store", str(store), "--cache-dir", str(cache))
    assert pulled.returncode == 0, pulled.stderr
    assert (cache / extra).stat().st_size == 12000

    trace_file = tmp_path / "trace.json"
    replayed = run_cli("verify", str(tiny_manifest), "--cache-dir", str(cache), "--replay", "--trace", str(trace_file))
    assert replayed.returncode == 0, replayed.stderr
    trace = read_trace(trace_file)
    assert trace.release_id == release_id and trace.backend == "inductor"
    assert [u.unit_id for u in trace.units] == ["klein/128x128x1", "klein/128x256x1"]
    release_paths = {f.path for f in trace.files}
    assert extra in release_paths and extra not in trace.opened
    for unit in trace.units:  # each call opened cache files, all of them files of the release (or its locks)
        cached = {p for p in unit.opened if not p.startswith("locks/")}
        assert cached and cached <= release_paths, unit
    assert set(trace.opened) == set(trace.loading).union(*(u.opened for u in trace.units))
    assert "the replay opened" in replayed.stdout and str(trace_file) in replayed.stdout

    shown = run_cli("show", release_id, "--store", str(store), "--unused", str(trace_file), "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert {"path": extra, "size": 12000} in report["unused"] and report["mismatch"] == []
    # opened counts the release's files only: the trace also lists locks/ and what a compile left beside them
    assert report["opened"] == len(release_paths & set(trace.opened)) > 0 and report["files"] == len(release_paths)
    text = run_cli("show", release_id, "--store", str(store), "--unused", str(trace_file))
    assert extra in text.stdout and "files unused" in text.stdout
    # The tag's release lacks the extra file: the trace is of another release, and show says so.
    other = run_cli("show", "tiny-flux2-klein", "--store", str(store), "--unused", str(trace_file))
    assert other.returncode == 0 and f"the traced cache dir held release {release_id}" in other.stderr
    assert extra not in other.stdout
