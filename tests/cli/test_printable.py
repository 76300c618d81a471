"""Data never controls the terminal: every string from a store, a state file or a path passes one
sanitiser before a human-readable line, is never read as rich markup, and the export lines that
carry data to a shell hold no byte a terminal acts on while `eval` still reads the exact value."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neffbuild.build.publish import move_tag, publish_bundle, publish_release, read_tag
from neffbuild.documents.bundles import BundleRecord, Timings
from neffbuild.documents.records import FileEntry, Release, ReleaseUnit, TagEvent, TagRecord, dump, unit_key
from neffbuild.hashing import blake3_bytes, hash_bytes
from neffbuild.host.exports import shell_lines, shell_word
from neffbuild.printable import printable
from neffbuild.store.base import Store
from neffbuild.store.blobs import BlobSource
from neffbuild.store.local import LocalStore
from tests.storekit import this_host

# What a terminal acts on: C0 but tab and newline, DEL, C1, and the bidi controls.
CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
OSC8 = "\x1b]8;;https://example.invalid\x1b\\link\x1b]8;;\x1b\\"
NASTY = f"\x1b[2J\x1b]0;title\x07{OSC8}[/][link=https://example.invalid]x[/link]\u202e"
PATH_NASTY = "[/]x/[link=https:example.invalid]y[/link]\u202e"  # a cache path holds no control character, no "//"


# ---- the sanitiser ------------------------------------------------------------------------------


def test_printable_escapes_what_a_terminal_acts_on_and_keeps_the_rest() -> None:
    assert printable("klein/128x128x1") == "klein/128x128x1"
    assert printable("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert printable("\x07\x9b\u202e\u2066x\ny\tz") == "\\x07\\x9b\\u202e\\u2066x\\x0ay\tz"
    assert printable("[/] [link=x]") == "[/] [link=x]"  # markup is harmless once never parsed
    assert printable("caf\u00e9 \u6f22") == "caf\u00e9 \u6f22"
    assert printable("\ud800") == "\\ud800"  # no terminal encoding could write it


@settings(max_examples=500, deadline=None)
@given(text=st.text())
def test_printable_leaves_no_control_character(text: str) -> None:
    shown = printable(text)
    assert CONTROLS.search(shown) is None and "\n" not in shown
    shown.encode("utf-8")  # never raises: lone surrogates are escaped


# ---- the shell form: eval in bash and dash reads the exact value --------------------------------

_values = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20)


@pytest.mark.parametrize("shell", ["bash", "dash"])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(values=st.lists(_values, min_size=1, max_size=8))
def test_export_lines_round_trip_through_eval_and_hold_no_control_byte(shell: str, values: list[str]) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    exports = {f"V{i}": v for i, v in enumerate(values)}
    lines = shell_lines(exports)
    assert CONTROLS.search(lines) is None
    names = " ".join(exports)
    script = f'eval "$1"; for n in {names}; do eval "printf \'%s\\0\' \\"\\${{$n}}\\""; done'
    out = subprocess.run([shell, "-c", script, shell, lines], capture_output=True, check=True).stdout
    assert out.split(b"\0")[:-1] == [v.encode() for v in values]


def test_shell_word_quotes_simple_values_as_before() -> None:
    assert shell_word("/var/cache/x") == "/var/cache/x"
    assert shell_word("a b") == "'a b'"
    assert shell_word("\x1b[2J") == "\"$(printf '\\033')\"'[2J'"


# ---- every command, on a store whose every printable field is hostile ----------------------------


@dataclass(frozen=True)
class Published:
    store: LocalStore
    v1: str
    v2: str
    bundle_key: str


def publish_with(store: Store, work: Path, text: str, path_text: str) -> Published:
    """Two releases of one unit each under tag `t`, every free string field holding text: release
    name, unit ids, the unit, fingerprint values (an informational one: pull and status still
    serve), env values, counters, versions, tag history `by` and `at`."""
    ids, keys = [], []
    for version in (1, 2):
        unit = {
            "name": text,
            "pipeline": text,
            "call": {"prompt": text},
            "shape": {"height": 128, "width": 128, "batch": version},
        }
        env = {"OMP_NUM_THREADS": "2", "TORCHINDUCTOR_NOTE": text}
        fingerprint = {**this_host(unit, env), "diffusers": text}
        data = f"kernel {version} {text}".encode()
        source = work / f"src{version}.so"
        source.write_bytes(data)
        entry = FileEntry(
            path=f"k{version}/{path_text}.so", size=len(data), digest=hash_bytes(data), blake3=blake3_bytes(data)
        )
        key = unit_key(unit, fingerprint)
        record = BundleRecord(
            key=key, unit_id=f"{text}/128x128x{version}", unit=unit, backend="inductor", fingerprint=fingerprint,
            files=(entry,), counters={text: 1, "graphs.transformer": 1}, timings=Timings(1.0, 2.0, 3.0),
            created_at="2026-01-01T00:00:00+00:00", neffbuild_version=text,
        )  # fmt: skip
        publish_bundle(store, record, [BlobSource(entry.digest, entry.size, source)], jobs=2)
        release = Release(
            name=text, manifest_digest="0" * 32, backend="inductor", cache_env="TORCHINDUCTOR_CACHE_DIR", env=env,
            fingerprint=fingerprint, units=(ReleaseUnit(record.unit_id, key),), files=(entry,),
        )  # fmt: skip
        ids.append(publish_release(store, release))
        keys.append(key)
        move_tag(store, "t", ids[-1], by=text)
    record, etag = read_tag(store, "t")  # type: ignore[misc]
    history = tuple(TagEvent(e.release, e.at + text, e.by) for e in record.history)
    assert store.swap_tag("t", dump(TagRecord(record.name, record.release, history)), etag)
    return Published(store, ids[0], ids[1], keys[0])  # type: ignore[arg-type]


def commands(p: Published, cache: Path) -> list[tuple[str, ...]]:
    s = ("--store", str(p.store.root))
    return [
        ("ls", *s), ("ls", "--tag", "t", *s), ("show", "t", *s), ("show", p.bundle_key, *s), ("diff", "t@1", "t", *s),
        ("diff", "--host", "t", *s), ("du", *s), ("gc", "--dry-run", *s), ("verify", *s),
        ("pull", "t", "--cache-dir", str(cache), *s), ("env", "--cache-dir", str(cache)), ("status", "--cache-dir", str(cache)),
        ("doctor", "--cache-dir", str(cache), "--release", "t", *s), ("tag", "t", p.v1, *s),
    ]  # fmt: skip


def run(args: tuple[str, ...], **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "CI")} | env
    return subprocess.run(
        [sys.executable, "-m", "neffbuild", *args], capture_output=True, text=True, env=full, check=False, timeout=120
    )


SGR = re.compile("\x1b\\[[0-9;]*m")  # neffbuild's own colours: the only escape a terminal may get


def run_on_terminal(args: tuple[str, ...], **env: str) -> subprocess.CompletedProcess[str]:
    """args with stdout and stderr each on a pseudo-terminal: colour on, rich's terminal path."""
    full = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "CI")} | {"TERM": "xterm-256color"} | env
    (out_main, out_sub), (err_main, err_sub) = pty.openpty(), pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "neffbuild", *args], stdin=subprocess.DEVNULL, stdout=out_sub, stderr=err_sub, env=full
    )
    os.close(out_sub)
    os.close(err_sub)
    read = {out_main: b"", err_main: b""}
    live = set(read)
    while live:
        for fd in select.select(list(live), [], [], 120)[0]:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:  # EIO: the child closed its side
                chunk = b""
            read[fd] += chunk
            if not chunk:
                live.discard(fd)
                os.close(fd)
    process.wait(timeout=120)
    text = {fd: data.decode().replace("\r\n", "\n") for fd, data in read.items()}
    return subprocess.CompletedProcess(args, process.returncode, text[out_main], text[err_main])


def test_no_command_writes_a_control_byte_from_a_hostile_store_and_each_exits_as_for_a_clean_one(
    tmp_path: Path,
) -> None:
    runs, moved = {}, {}
    for name, text, path_text, color, where in (
        ("clean", "clean-text", "clean-path", {}, "pipe"), ("hostile", NASTY, PATH_NASTY, {}, "pipe"),
        ("hostile", NASTY, PATH_NASTY, {"FORCE_COLOR": "1"}, "pipe"),
        # On a terminal colour is on (FORCE_COLOR or not): rich's terminal path, where markup in
        # data would become a hyperlink or end the command; only neffbuild's own SGR colours pass.
        ("hostile", NASTY, PATH_NASTY, {"FORCE_COLOR": "1"}, "terminal"),
    ):  # fmt: skip
        work = tmp_path / f"{name}{len(color)}{where}"
        work.mkdir()
        published = publish_with(
            LocalStore(work / "store", create=True), work, text, path_text
        )  # `tag` moves it: one each
        runner = run_on_terminal if where == "terminal" else run
        mode = (name, bool(color), where)
        runs[mode] = [(args, runner(args, **color)) for args in commands(published, work / "cache")]
        moved[mode] = read_tag(published.store, "t")[0].release == published.v1  # type: ignore[index]
    for mode, results in runs.items():
        for (args, result), (_, clean) in zip(results, runs["clean", False, "pipe"], strict=True):
            assert result.returncode == clean.returncode, (mode, args, result.stderr)
            assert "Traceback" not in result.stderr and "internal error" not in result.stderr
            for stream in (result.stdout, result.stderr):
                assert CONTROLS.search(SGR.sub("", stream)) is None, (mode, args, stream)
                assert mode[2] == "terminal" or "\x1b" not in stream, (mode, args, stream)
    assert all(moved.values()), moved
    assert any(SGR.search(r.stdout + r.stderr) for _, r in runs["hostile", True, "terminal"])  # colour was on
    hostile = dict((args[0] + (args[1] if args[0] == "ls" else ""), r) for args, r in runs["hostile", False, "pipe"])
    assert hostile["tag"].returncode == 0 and "\\x1b[2J" in hostile["tag"].stdout  # moved, and its report shown escaped
    assert "\\u202e" in hostile["show"].stdout and "[/]" in hostile["show"].stdout  # shown, never parsed
    assert hostile["pull"].returncode == 0 and 'TORCHINDUCTOR_NOTE="$(printf' in hostile["pull"].stdout


def test_json_keeps_the_exact_strings(tmp_path: Path) -> None:
    published = publish_with(LocalStore(tmp_path / "store", create=True), tmp_path, NASTY, PATH_NASTY)
    shown = run(("show", "t", "--store", str(published.store.root), "--json"))
    assert shown.returncode == 0 and "\x1b" not in shown.stdout  # JSON escapes it ...
    assert json.loads(shown.stdout)["name"] == NASTY  # ... and reads back exactly


# ---- in process, on arbitrary text: the views never fail and never pass a control byte -----------


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=24))
def test_views_on_arbitrary_text_hold_no_control_byte(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    from neffbuild.cli.views import Console, host
    from neffbuild.cli.views import store as output
    from neffbuild.inspect.du import disk_usage
    from neffbuild.inspect.ls import list_store, tag_history
    from neffbuild.inspect.show import show

    work = tmp_path_factory.mktemp("views")
    path_text = "".join(c for c in text if c not in "/\\" and CONTROLS.search(c) is None and c.isprintable()) or "p"
    published = publish_with(LocalStore(work / "store", create=True), work, text, path_text[:40])
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        console = Console(as_json=False)
        output.listing(console, list_store(published.store))
        output.tag_history(console, tag_history(published.store, "t"))
        output.shown_ref(console, show(published.store, "t"))
        output.shown_ref(console, show(published.store, published.bundle_key))
        output.usage(console, disk_usage(published.store))
        host.exports(console, {"TORCHINDUCTOR_NOTE": text})
    assert CONTROLS.search(out.getvalue() + err.getvalue()) is None


# ---- a command that changed something cannot fail in its report ---------------------------------


def test_tag_moves_and_exits_0_when_its_report_cannot_be_written(tmp_path: Path) -> None:
    published = publish_with(LocalStore(tmp_path / "store", create=True), tmp_path, NASTY, PATH_NASTY)
    reader, writer = os.pipe()
    os.close(reader)  # stdout is a pipe nobody reads: the report's write fails (EPIPE)
    try:
        moved = subprocess.run(
            [sys.executable, "-m", "neffbuild", "tag", "t", published.v1, "--store", str(published.store.root)],
            stdout=writer, stderr=subprocess.PIPE, text=True, check=False, timeout=60,
        )  # fmt: skip
    finally:
        os.close(writer)
    assert moved.returncode == 0, moved.stderr
    assert f"warning: tag t -> {published.v1}, but its report could not be printed: BrokenPipeError" in moved.stderr
    assert read_tag(published.store, "t")[0].release == published.v1  # type: ignore[index]


def test_a_debug_traceback_is_sanitised_like_every_other_line(tmp_path: Path) -> None:
    """--debug prints the traceback of the error, whose messages carry store strings: a store
    path with a terminal escape and a bidi override reaches it."""
    hostile = tmp_path / "store\x1b]0;owned\x07\u202e"
    shown = subprocess.run(
        [sys.executable, "-m", "neffbuild", "--debug", "ls", "--store", str(hostile)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert shown.returncode == 3, shown.stderr
    assert "Traceback (most recent call last)" in shown.stderr and "StoreError" in shown.stderr
    assert CONTROLS.search(shown.stderr) is None, shown.stderr
