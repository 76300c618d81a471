"""The no-op pull's entry: a host's boot answered without click, printing what the full command
prints; every other command line and every pull with something to do is the full command's."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from neffbuild.cli.quick import parse
from neffbuild.store.local import LocalStore
from tests.storekit import publish_release_of, write_files

# `neffbuild ARGS` through the console entry (cli/entry.py's main), saying on its last line
# whether click was imported, that is whether the full command ran.
ENTRY = """
import sys
from neffbuild.cli.entry import main
try:
    main()
finally:
    sys.stderr.write("click imported: %s" % ("click" in sys.modules))
"""
FULL = "from neffbuild.cli.main import main; main()"  # the full command, as before the entry


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False, env={**os.environ, **(env or {})}
    )  # fmt: skip


def _entry(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], bool]:
    """The entry's process, and whether it ran the full command (its marker line taken off)."""
    done = _run(ENTRY, *args, env=env)
    stderr, _, marker = done.stderr.rpartition("\n") if "\n" in done.stderr else ("", "", done.stderr)
    assert marker.startswith("click imported: "), done.stderr
    done.stderr = stderr + "\n" if stderr else ""
    return done, marker.endswith("True")


def _same(fast: subprocess.CompletedProcess[str], full: subprocess.CompletedProcess[str], *paths: Path) -> None:
    """Equal exit codes and output, but for the seconds a pull took and the cache dirs' names."""

    def norm(text: str) -> str:
        for path in paths:
            text = text.replace(str(path), "<dir>")
        return re.sub(r" in \d+\.\d\d s|\"seconds\": [0-9.e-]+", "<seconds>", text)

    assert (fast.returncode, norm(fast.stdout), norm(fast.stderr)) == (
        full.returncode,
        norm(full.stdout),
        norm(full.stderr),
    )


@pytest.fixture
def pulled(tmp_path: Path) -> tuple[Path, Path]:
    """(a store whose tag t names a 30-file release, a cache dir that holds it, pulled by the CLI)."""
    sizes = {f"d{i % 3}/f{i:02d}.bin": 100 + i for i in range(30)}
    store = tmp_path / "store"
    publish_release_of(LocalStore(store, create=True), tmp_path / "src", write_files(tmp_path / "src", sizes), tag="t")
    cache = tmp_path / "cache"
    first = _run(FULL, "pull", "t", "--store", str(store), "--cache-dir", str(cache))
    assert first.returncode == 0, first.stderr
    return store, cache


def test_a_no_op_pull_is_answered_without_click_as_the_full_command_answers_it(pulled: tuple[Path, Path], tmp_path: Path) -> None:  # fmt: skip
    store, cache = pulled
    for extra in ((), ("--no-host-check", "--allow-stale")):
        args = ("pull", "t", f"--store={store}", "--cache-dir", str(cache), *extra)
        fast, full_ran = _entry(*args, "--env-file", str(tmp_path / "fast.env"))
        assert not full_ran and fast.returncode == 0
        full = _run(FULL, *args, "--env-file", str(tmp_path / "full.env"))
        _same(fast, full)
        assert "pulled t: 0 of 30 files fetched" in fast.stderr and f"={cache}" in fast.stdout
        assert (tmp_path / "fast.env").read_text() == (tmp_path / "full.env").read_text() != ""
    # The store named by the environment, as the full command reads it.
    fast, full_ran = _entry("pull", "t", "--cache-dir", str(cache), env={"NEFFBUILD_STORE": str(store)})
    assert not full_ran
    _same(fast, _run(FULL, "pull", "t", "--cache-dir", str(cache), env={"NEFFBUILD_STORE": str(store)}))


# Modules whose classes only other commands build (bundles, blobs and packs, `env`'s target, a
# build's component calls): a no-op pull's process imports none of them, nor click.
NOT_ON_A_NO_OP = ("neffbuild.documents.bundles", "neffbuild.store.blobs", "neffbuild.host.target", "neffbuild.backends.components", "click")  # fmt: skip
IMPORTED = """
import sys
from neffbuild.cli.entry import main
try:
    main()
finally:
    sys.stderr.write("imported: " + " ".join(sorted(sys.modules)))
"""


def test_a_no_op_pull_imports_nothing_only_other_commands_use(pulled: tuple[Path, Path]) -> None:
    store, cache = pulled
    done = _run(IMPORTED, "pull", "t", "--store", str(store), "--cache-dir", str(cache))
    assert done.returncode == 0 and "pulled t: 0 of 30 files fetched" in done.stderr, done.stderr
    imported = set(done.stderr.rpartition("imported: ")[2].split())
    assert "neffbuild.host.noop" in imported and not imported & set(NOT_ON_A_NO_OP)
    assert all(importlib.util.find_spec(name) is not None for name in NOT_ON_A_NO_OP)  # each is still there to import
    # A pull with work to do is the full command's: it imports them as it needs them.
    (cache / "d0" / "f00.bin").unlink()
    done = _run(IMPORTED, "pull", "t", "--store", str(store), "--cache-dir", str(cache))
    assert done.returncode == 0 and "click" in done.stderr.rpartition("imported: ")[2].split(), done.stderr


def _twins(cache: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Two copies of the cache dir, mtimes kept (the state's record of them still holds)."""
    a, b = tmp_path / "a" / "cache", tmp_path / "b" / "cache"
    shutil.copytree(cache, a)
    shutil.copytree(cache, b)
    return a, b


@pytest.mark.parametrize("damage", ["missing", "edited", "moved_tag", "corrupt_state", "no_cache_dir"])
def test_a_pull_with_work_to_do_is_the_full_commands(pulled: tuple[Path, Path], tmp_path: Path, damage: str) -> None:
    store, cache = pulled
    a, b = _twins(cache, tmp_path)
    for twin in (a, b):
        if damage == "missing":
            (twin / "d1" / "f04.bin").unlink()
        elif damage == "edited":
            os.utime(twin / "d2" / "f05.bin", ns=(0, 1))  # same size, another mtime: rehashed
        elif damage == "corrupt_state":
            (twin / ".neffbuild" / "state.json").write_text("{")
        elif damage == "no_cache_dir":
            shutil.rmtree(twin)
    if damage == "moved_tag":
        src = tmp_path / "src2"
        publish_release_of(LocalStore(store), src, write_files(src, {"other.bin": 7}), name="rel2", tag="t")
    fast, full_ran = _entry("pull", "t", "--store", str(store), "--cache-dir", str(a))
    full = _run(FULL, "pull", "t", "--store", str(store), "--cache-dir", str(b))
    assert full_ran and fast.returncode == 0
    _same(fast, full, a, b)
    assert ("pulled t: 0 of" in fast.stderr) == (damage in ("edited", "corrupt_state"))  # rehashed, nothing fetched
    again, full_ran = _entry("pull", "t", "--store", str(store), "--cache-dir", str(a))
    assert not full_ran and "pulled t: 0 of" in again.stderr  # repaired: a no-op again


def test_errors_and_options_it_does_not_know_are_the_full_commands(pulled: tuple[Path, Path], tmp_path: Path) -> None:
    store, cache = pulled
    cases = [
        ("pull", "t", "--store", str(tmp_path / "nowhere"), "--cache-dir", str(cache)),  # store unreachable: exit 3
        ("pull", "nope", "--store", str(store), "--cache-dir", str(cache)),  # no such tag
        ("pull", "t", "--store", str(store), "--cache-dir", str(cache), "--json"),
        ("pull", "t", "--store", str(store), "--cache-dir", str(cache), "--verify", "full"),
        ("-q", "pull", "t", "--store", str(store), "--cache-dir", str(cache)),
        ("pull", "t", "--store", str(store), "--cache-dir", str(cache / "d0" / "f00.bin")),  # a file: a usage error
    ]
    for args in cases:
        fast, full_ran = _entry(*args)
        assert full_ran, args
        _same(fast, _run(FULL, *args))
    codes = [_entry(*args)[0].returncode for args in cases[:2]]
    assert codes[0] == 3 and codes[1] != 0
    # Trusted keys (here unusable) are checked by the full command only.
    fast, full_ran = _entry("pull", "t", "--store", str(store), "--cache-dir", str(cache), env={"NEFFBUILD_TRUSTED_KEYS": str(tmp_path / "k.pub")})  # fmt: skip
    assert full_ran and fast.returncode != 0


def test_a_closed_stdout_is_said_as_the_full_command_says_it(pulled: tuple[Path, Path]) -> None:
    store, cache = pulled
    args = ("pull", "t", "--store", str(store), "--cache-dir", str(cache))
    code = "import os, sys; os.close(1); sys.stdout = None\n"
    fast = _run(code + ENTRY, *args)  # the entry imports cli/terminal.py (click) only to say this
    full = _run(code + FULL, *args)
    fast.stderr = fast.stderr.rpartition("\n")[0] + "\n"
    _same(fast, full)
    assert fast.returncode == 0 and "report could not be printed" in fast.stderr


@pytest.mark.parametrize(
    ("args", "parsed"),
    [
        (["pull", "t", "--cache-dir", "c"], {"ref": "t", "--cache-dir": "c"}),
        (
            ["pull", "--store=s", "t", "--cache-dir=c", "--no-host-check"],
            {"ref": "t", "--store": "s", "--cache-dir": "c", "--no-host-check": ""},
        ),
        (
            ["pull", "--cache-dir", "c", "t", "--env-file", "e", "--allow-stale"],
            {"ref": "t", "--cache-dir": "c", "--env-file": "e", "--allow-stale": ""},
        ),
        (["pull", "--cache-dir", "c"], None),  # no REF
        (["pull", "t", "u", "--cache-dir", "c"], None),  # two
        (["pull", "t", "--cache-dir", "c", "--cache-dir", "d"], None),  # twice: click takes the last
        (["pull", "t", "--cache-dir"], None),
        (["pull", "t", "--cache-dir", "--store", "s"], None),
        (["pull", "t", "--cache-dir="], None),
        (["pull", "t", "--no-host-check=1"], None),
        (["pull", "t", "--", "--cache-dir", "c"], None),
        (["pull", "-t", "--cache-dir", "c"], None),
        (["-v", "pull", "t", "--cache-dir", "c"], None),
        (["status", "--cache-dir", "c"], None),
        ([], None),
    ],
)
def test_parse_knows_only_the_boot_forms(args: list[str], parsed: dict[str, str] | None) -> None:
    assert parse(args) == parsed


class _Refusing:
    """A TCP endpoint that accepts each connection and closes it at once (a store that is down in
    the way that is retried), counting the connections."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.sock.getsockname()[1]}", "AWS_ACCESS_KEY_ID": "k",
            "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true",
        }  # fmt: skip  # one endpoint's settings, packed


def test_a_store_that_is_down_is_tried_once_before_the_full_commands_retries(pulled: tuple[Path, Path]) -> None:
    _, cache = pulled
    server = _Refusing()
    args = ("pull", "t", "--store", "s3://bucket/prefix", "--cache-dir", str(cache))
    full = _run(FULL, *args, env=server.env)
    alone = server.accepted
    fast, full_ran = _entry(*args, env=server.env)
    server.sock.close()
    assert full.returncode == 3 and full_ran and alone > 1, (full.stderr, alone)
    # As the full command alone says it (how the connection ended varies: reset or closed).
    assert fast.returncode == 3 and fast.stderr.splitlines()[1:] == full.stderr.splitlines()[1:], fast.stderr
    assert "(6 tries, pulling t: opening the store)" in fast.stderr, fast.stderr
    # The attempt made one request and gave up; the full command then retried as it does alone.
    assert server.accepted - alone == alone + 1, (alone, server.accepted)


def test_a_first_boot_asks_the_store_only_once(tmp_path: Path) -> None:
    # No state in the cache dir: nothing is installed, so the attempt leaves the store to the full
    # command and the entry makes the very requests the full command makes alone.
    server = _Refusing()
    args = ("pull", "t", "--store", "s3://bucket/prefix", "--cache-dir")
    full = _run(FULL, *args, str(tmp_path / "one"), env=server.env)
    alone = server.accepted
    fast, full_ran = _entry(*args, str(tmp_path / "two"), env=server.env)
    server.sock.close()
    assert full.returncode == fast.returncode == 3 and full_ran and alone > 1, (full.stderr, alone)
    assert server.accepted - alone == alone, (alone, server.accepted)
