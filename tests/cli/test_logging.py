"""The library logs through `logging`; the CLI decides how much and in which form (plain, JSON)."""

from __future__ import annotations

import json
from pathlib import Path

from neffbuild.store.local import LocalStore
from tests.conftest import run_cli
from tests.storekit import publish_release_of, write_files


def published(tmp_path: Path) -> tuple[str, str]:
    store = LocalStore(tmp_path / "store", create=True)
    sources = write_files(tmp_path / "src", {"a/one.so": 500, "b/two.bin": 700})
    return str(store.root), publish_release_of(store, tmp_path / "src", sources, tag="t")


def test_verbose_json_logs_are_one_object_per_line_from_the_module_that_acted(tmp_path: Path) -> None:
    store, release_id = published(tmp_path)
    result = run_cli("-v", "--log-format", "json", "pull", "t", "--store", store, "--cache-dir", str(tmp_path / "c"))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    pulled = [r for r in records if r["logger"] == "neffbuild.host.pull"]
    assert (
        pulled
        and pulled[0]["level"] == "info"
        and f"release {release_id}, fetching 2 of 2 files" in pulled[0]["message"]
    )
    assert all(set(r) == {"time", "level", "logger", "message"} for r in records)


def test_plain_logging_is_quiet_by_default_and_says_more_with_v(tmp_path: Path) -> None:
    store, release_id = published(tmp_path)
    for flags, expected in (((), False), (("-v",), True), (("-v", "-q"), False)):
        cache = tmp_path / f"c{len(flags)}"
        result = run_cli(*flags, "pull", "t", "--store", store, "--cache-dir", str(cache))
        assert result.returncode == 0, result.stderr
        assert (f"info: t: release {release_id}" in result.stderr) is expected, (flags, result.stderr)


def test_help_lists_commands_by_who_runs_them() -> None:
    text = run_cli("--help").stdout
    sections = ["CI: prebuild and publish:", "A serving host:", "The store:"]
    positions = [text.index(s) for s in sections]
    assert positions == sorted(positions)
    host = text[positions[1] : positions[2]]
    assert all(f"  {name} " in host for name in ("pull", "env", "status", "doctor", "verify"))
    assert "  build " in text[positions[0] : positions[1]] and "  gc " in text[positions[2] :]


def json_lines(stderr: str) -> list[dict[str, object]]:
    """Every line of stderr as a JSON object with the log record's fields (json.loads fails the test on any other line)."""
    records = [json.loads(line) for line in stderr.splitlines()]
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records), stderr
    return records


def test_json_logs_are_all_json_errors_summaries_and_warnings_included(tmp_path: Path) -> None:
    store, release_id = published(tmp_path)
    cache = ("--cache-dir", str(tmp_path / "c"))
    pulled = run_cli("-v", "--log-format", "json", "pull", "t", "--store", store, *cache)
    assert pulled.returncode == 0, pulled.stderr
    summary = json_lines(pulled.stderr)[-1]
    assert summary["level"] == "info" and "pulled t: 2 of 2 files fetched" in str(summary["message"])

    stale = run_cli("--log-format=json", "pull", "t", "--allow-stale", "--store", str(tmp_path / "gone"), *cache)
    assert stale.returncode == 0, stale.stderr
    warning = json_lines(stale.stderr)[0]
    assert warning["level"] == "warning" and str(warning["message"]).startswith("store unreachable (no neffbuild store")
    assert release_id in str(warning["message"])

    missing = run_cli("--debug", "--log-format", "json", "pull", "nosuch", "--store", store, *cache)
    assert missing.returncode == 8
    error = json_lines(missing.stderr)[-1]
    assert error["level"] == "error" and error["message"] == f"tag 'nosuch' not found in {store}"
    assert error["kind"] == "NotFoundError" and error["exit_code"] == 8 and error["hint"] == "known tags: t"
    assert "Traceback (most recent call last)" in str(error["traceback"])  # --debug: a field, not lines

    usage = run_cli("--log-format", "json", "pull", "--no-such-option")
    assert usage.returncode == 2
    (line,) = json_lines(usage.stderr)  # a usage error too
    assert line["level"] == "error" and line["kind"] == "NoSuchOption" and line["exit_code"] == 2
    plain = run_cli("pull", "nosuch", "--store", store, *cache)  # without it: the lines people read
    assert plain.stderr == f"error: tag 'nosuch' not found in {store}\nhint: known tags: t\n"
