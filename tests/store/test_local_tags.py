"""The local store's tag compare-and-swap holds without any lock: processes racing on one tag
lose no update, a tag written before versions existed is taken over, listings show one object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from neffbuild.store.local import LocalStore
from tests.conftest import ROOT

WRITERS = 6
MOVES = 25

# Each writer appends its own entries to the tag's list, MOVES times, by read + compare-and-swap
# (retrying a lost swap), as move_tag does. fcntl.flock is replaced by a no-op first: what a
# network filesystem without working locks gives.
_WRITER = """
import fcntl, json, sys
fcntl.flock = lambda *a, **k: None
from neffbuild.store.local import LocalStore
store, me = LocalStore(__import__("pathlib").Path(sys.argv[1])), sys.argv[2]
lost = 0
for i in range(int(sys.argv[3])):
    while True:
        current = store.read_tag("race")
        entries = json.loads(current[0]) if current else []
        if store.swap_tag("race", json.dumps([*entries, f"{me}-{i}"]).encode(), current[1] if current else None):
            break
        lost += 1
print(lost)
"""


def test_racing_processes_lose_no_update_without_a_lock(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", create=True)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(store.root), f"w{n}", str(MOVES)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for n in range(WRITERS)
    ]
    lost = [int(w.communicate(timeout=300)[0]) for w in writers]
    assert all(w.returncode == 0 for w in writers)
    current = store.read_tag("race")
    assert current is not None
    entries = json.loads(current[0])
    assert sorted(entries) == sorted(f"w{n}-{i}" for n in range(WRITERS) for i in range(MOVES))
    assert current[1] == f"v{WRITERS * MOVES}"
    # The mirror the listings show is the highest version; no lock file was made.
    assert (store.root / "tags" / "race.json").read_bytes() == current[0]
    assert [o.key for o in store.list_objects("tags/")] == ["tags/race.json"]
    assert not (store.root / "locks").exists()
    print(f"swaps lost and retried: {sum(lost)} of {WRITERS * MOVES}")


def test_a_tag_written_before_versions_is_taken_over_once(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", create=True)
    (store.root / "tags").mkdir()
    (store.root / "tags" / "old.json").write_bytes(b"legacy")
    current = store.read_tag("old")
    assert current is not None and current[0] == b"legacy" and current[1].startswith("v0-")
    assert store.swap_tag("old", b"new", current[1]) is True
    assert store.swap_tag("old", b"lost", current[1]) is False  # the same version 0, taken already
    assert store.read_tag("old") == (b"new", "v1") and store.get_doc("tags", "old") == b"new"
    store.delete_objects(["tags/old.json"])
    assert store.read_tag("old") is None
