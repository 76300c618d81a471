"""What commands print: tables that keep ids and keys whole at 80 columns, and progress with
each unit's phase and elapsed time (live on a terminal, plain lines without one), and where a
--fail-fast replay stopped."""

from __future__ import annotations

import io
import json
import re
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console as RichConsole

from neffbuild.cli.views import Console
from neffbuild.cli.views.console import fit_table
from tests.conftest import write_manifest

UNIT_COLUMNS = [("unit", True), ("key", True), ("mode", False), ("dtype", False), ("device", False)]


def render(table, width: int) -> str:
    console = RichConsole(file=io.StringIO(), width=width)
    console.print(table)
    return console.file.getvalue()


def test_plan_keeps_every_unit_id_and_key_whole_at_80_columns(tiny_model: Path, tmp_path: Path, cli) -> None:
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128,))
    text = (
        manifest.read_text()
        .replace('id = "klein"', 'id = "flux2-klein-4b-distilled"')
        .replace("batch = 1", "batch = [1, 2]")
    )
    manifest.write_text(text)
    planned = cli("plan", str(manifest), "--json")
    assert planned.returncode == 0, planned.stderr
    units = json.loads(planned.stdout)["units"]
    assert [u["unit_id"] for u in units] == ["flux2-klein-4b-distilled/128x128x1", "flux2-klein-4b-distilled/128x128x2"]
    shown = cli("plan", str(manifest), env={"COLUMNS": "80"})  # a pipe, as in CI logs
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    table = [line for line in lines if set(line) & set("┃│━─")]
    assert table and max(len(line) for line in table) <= 80
    for u in units:  # both ids (x1 and x2 told apart) and both keys, each whole on one row
        assert any(u["unit_id"] in line and u["key"] in line for line in lines), shown.stdout
    assert "left out at 80 columns: dtype, device (--json has all)" in shown.stdout


def test_fit_table_drops_other_columns_before_cutting_a_kept_one() -> None:
    rows = [("klein/1024x1024x2", "0123456789abcdef0123456789abcdef", "regional", "bfloat16", "cpu")]
    wide = render(fit_table("plan", UNIT_COLUMNS, rows, 120), 120)
    assert all(cell in wide for cell in rows[0]) and "left out" not in wide
    narrow = render(fit_table("plan", UNIT_COLUMNS, rows, 62), 62)
    assert rows[0][0] in narrow and rows[0][1] in narrow and "regional" not in narrow
    assert "left out at 62 columns: mode, dtype, device" in narrow
    assert fit_table("plan", UNIT_COLUMNS, rows, 50) is None  # ids and keys alone need more: rows become lines


def test_without_a_terminal_each_phase_change_is_one_line_with_the_units_elapsed_time(capfd) -> None:
    console = Console(as_json=False)
    assert not console.interactive
    now = [100.0]  # the injected clock: elapsed times are exact, whatever the machine's load
    with console.units_progress("building", 2, heartbeat_s=0.01, clock=lambda: now[0]) as notify:
        notify("klein/128x128x1", "loading")
        notify("klein/128x128x1", "loading")  # no change, no line
        now[0] = 100.3
        notify("klein/128x128x1", "compiling")
        now[0] = 160.6
        err = ""
        while "still compiling" not in err:  # the heartbeat runs on its own thread
            time.sleep(0.01)
            err += capfd.readouterr().err
        notify("klein/128x128x1", "built")
        notify("klein/128x256x1", "present")
    lines = (err + capfd.readouterr().err).splitlines()
    assert lines[0] == "klein/128x128x1: loading (after 0.0 s)"
    assert lines[1] == "klein/128x128x1: compiling (after 0.3 s)"
    assert "klein/128x128x1: still compiling (after 61 s)" in lines[2:-2], lines
    assert lines[-2] == "klein/128x128x1: built in 60.6 s"
    assert lines[-1] == "klein/128x256x1: present in 0.0 s"
    assert sum("loading" in line for line in lines) == 1


def test_on_a_terminal_each_running_unit_shows_its_phase_live() -> None:
    console = Console(as_json=False)
    console.interactive = True
    buffer = io.StringIO()
    console.err = RichConsole(file=buffer, force_terminal=True, width=100, highlight=False)
    with console.units_progress("building", 2) as notify:
        notify("klein/128x128x1", "loading")
        time.sleep(0.3)
        notify("klein/128x128x1", "compiling")
        notify("klein/128x256x1", "loading")
        time.sleep(0.3)
        notify("klein/128x128x1", "built")
        time.sleep(0.3)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buffer.getvalue())  # what a terminal shows, less its codes
    assert re.search(r"klein/128x128x1\s+compiling", shown), shown
    assert re.search(r"klein/128x256x1\s+loading", shown)
    assert "building" in shown and "1/2 done" in shown
    assert "klein/128x128x1: built in 0." in shown


def test_a_fail_fast_replay_says_where_it_stopped_and_which_units_it_did_not_replay(capfd) -> None:
    from neffbuild.cli.views import host as views
    from neffbuild.host.verify import ReplayReport, UnitReplay

    first = UnitReplay("klein/128x128x1", 1.5, 1, (), {"aot_autograd.autograd_cache_miss": 1}, stopped=True)
    report = ReplayReport(Path("/srv/cache"), (first,), fail_fast=True, not_replayed=("klein/128x256x1",))
    views.replay(Console(as_json=False), report)
    out = capfd.readouterr().out
    assert "klein/128x128x1: was stopped at its first compile and wrote no cache file" in out
    assert (
        "stopped at the first miss (--fail-fast): klein/128x128x1 at its first compile, before the compiler ran; "
        "not replayed: klein/128x256x1" in out
    )
    views.replay(Console(as_json=True), report)
    doc = json.loads(capfd.readouterr().out)
    assert doc["stopped_at"] == "klein/128x128x1" and doc["not_replayed"] == ["klein/128x256x1"]
    assert doc["units"][0]["stopped"] is True
    after_call = ReplayReport(Path("/srv/cache"), (replace(first, stopped=False),), fail_fast=True)
    views.replay(Console(as_json=False), after_call)
    assert "klein/128x128x1 after its call (no cache miss announced its compile before it ran)" in (
        capfd.readouterr().out
    )
