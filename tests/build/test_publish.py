"""Publishing on both stores: two real processes racing on one tag lose no update; rollback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neffbuild.build.publish import move_tag
from neffbuild.documents.records import TagRecord, parse
from neffbuild.store import open_store
from neffbuild.store.base import Store
from tests.storekit import publish_release_of, write_files

ROOT = Path(__file__).resolve().parents[2]
MOVES = 6  # tag moves per process: enough that the two really interleave

# Each publisher: two releases of its own (blobs, bundle, release), then MOVES moves of the shared
# tag between them, starting with the other publisher (a go-file) so their compare-and-swaps collide.
PUBLISHER = """
import os, sys, time
from pathlib import Path
from neffbuild.build.publish import move_tag
from neffbuild.store import open_store
from tests.storekit import publish_release_of, write_files

url, name, work, go, moves = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
store = open_store(url, env=os.environ)
releases = []
for v in range(2):
    sources = write_files(work / str(v), {f"{name}-{i}.bin": 2000 + i for i in range(5)}, seed=hash((name, v)) % 1000)
    releases.append(publish_release_of(store, work / str(v), sources, name=f"{name}-{v}"))
while not go.exists():
    time.sleep(0.005)
for i in range(moves):  # alternate: a move to the release the tag already names records nothing
    move_tag(store, "ci", releases[i % 2], by=name)
print(" ".join(releases))
"""


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    if request.param == "s3":
        return request.getfixturevalue("s3_url"), request.getfixturevalue("s3_env")
    return str(tmp_path / "store"), {}


def test_two_processes_moving_one_tag_lose_no_update(target: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PUBLISHER, url, name, str(tmp_path / name), str(go), str(MOVES)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        )
        for name in ("job-a", "job-b")
    ]
    time.sleep(0.5)  # both import and publish their release, then race
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    releases = {r for out, _ in outs for r in out.split()}
    tag = _tag(store, "ci")
    assert len(tag.history) == 2 * MOVES  # every move is recorded: none overwritten
    assert {e.release for e in tag.history} == releases
    assert sorted(e.by for e in tag.history) == ["job-a"] * MOVES + ["job-b"] * MOVES
    assert tag.release == tag.history[-1].release


def test_rollback_moves_the_tag_back_and_keeps_history(target: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    old = publish_release_of(
        store, tmp_path / "v1", write_files(tmp_path / "v1", {"a.bin": 10}, seed=1), name="v1", tag="prod"
    )
    new = publish_release_of(
        store, tmp_path / "v2", write_files(tmp_path / "v2", {"a.bin": 10}, seed=2), name="v2", tag="prod"
    )
    assert _tag(store, "prod").release == new
    move_tag(store, "prod", old, by="oncall")
    tag = _tag(store, "prod")
    assert tag.release == old
    assert [e.release for e in tag.history] == [old, new, old]
    assert tag.history[-1].by == "oncall"


def _tag(store: Store, name: str) -> TagRecord:
    current = store.read_tag(name)
    assert current is not None
    return parse(TagRecord, current[0], name)


def test_a_tag_moved_to_a_release_a_gc_deleted_meanwhile_moves_back(tmp_path: Path) -> None:
    from neffbuild.documents.refs import read_tag
    from neffbuild.errors import ConflictError
    from neffbuild.store.local import LocalStore

    class DeletedAfterTheCheck(LocalStore):
        """The release is there for move_tag's first look, gone (a gc) once the tag has moved."""

        looks = 0

        def get_doc(self, kind, name):  # type: ignore[no-untyped-def]
            if kind == "releases" and name == v2:
                self.looks += 1
                if self.looks > 1:
                    return None
            return super().get_doc(kind, name)

    store = LocalStore(tmp_path / "store", create=True)
    v1, v2 = (
        publish_release_of(store, tmp_path / f"s{v}", write_files(tmp_path / f"s{v}", {f"f{v}.bin": 100}), name=f"r{v}")
        for v in (1, 2)
    )
    before = move_tag(store, "prod", v1, by="ci")
    with pytest.raises(ConflictError, match=f"a gc deleted release {v2} while the tag moved to it"):
        move_tag(DeletedAfterTheCheck(tmp_path / "store"), "prod", v2, by="ci")
    after = read_tag(store, "prod")
    assert after is not None and after[0] == before  # moved back: the release and the history it had


WRITERS = 3  # besides the stalled one
WRITER_MOVES = 8  # each: 24 moves in all while one writer stalls, above TAG_VERSIONS_KEPT


def test_a_writer_stalled_across_more_moves_than_pruning_keeps_loses_no_told_success(
    target: tuple[str, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One writer stops between its compare and its write (a barrier where the local store links
    its version, or just before S3's conditional PUT) while the others move the tag more times
    than the local store keeps versions; then it resumes. Every move reported done is in the
    history: the stalled one's swap is refused and retried, never reported done and lost."""
    import threading

    import neffbuild.store.local as local

    url, env = target
    store = open_store(url, create=True, env=env)
    assert WRITERS * WRITER_MOVES > local.TAG_VERSIONS_KEPT
    releases = {}
    for name in ["stalled", *(f"w{n}" for n in range(WRITERS))]:
        releases[name] = [
            publish_release_of(
                store,
                tmp_path / name / str(v),
                write_files(tmp_path / name / str(v), {"a.bin": 100}, seed=v),
                name=f"{name}-{v}",
            )
            for v in range(2)
        ]
    move_tag(store, "ci", releases["w0"][1], by="first")
    reached, resume = threading.Event(), threading.Event()

    def stall_once() -> None:
        if threading.current_thread().name == "stalled" and not reached.is_set():
            reached.set()
            assert resume.wait(120)

    real_write = local.write_atomic

    def write_atomic(path, content, **kw):  # type: ignore[no-untyped-def]
        if path.parent.name.endswith(".v"):  # a tag version: between the compare and the link
            stall_once()
        return real_write(path, content, **kw)

    monkeypatch.setattr(local, "write_atomic", write_atomic)
    stalled_store = open_store(url, env=env)
    if url.startswith("s3://"):
        real_swap = stalled_store.swap_tag

        def swap_tag(name: str, data: bytes, expected: str | None) -> bool:
            stall_once()
            return real_swap(name, data, expected)

        monkeypatch.setattr(stalled_store, "swap_tag", swap_tag)
    told: list[str] = []
    errors: list[BaseException] = []

    def writer(name: str, moves: int, on: Store) -> None:
        try:
            for i in range(moves):
                move_tag(on, "ci", releases[name][i % 2], by=f"{name}-{i}")
                told.append(f"{name}-{i}")
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    stalled = threading.Thread(target=writer, args=("stalled", 1, stalled_store), name="stalled")
    stalled.start()
    assert reached.wait(60)
    others = [
        threading.Thread(target=writer, args=(f"w{n}", WRITER_MOVES, open_store(url, env=env))) for n in range(WRITERS)
    ]
    for t in others:
        t.start()
    for t in others:
        t.join(120)
    resume.set()
    stalled.join(120)
    assert not errors, errors
    assert sorted(told) == sorted(["stalled-0", *(f"w{n}-{i}" for n in range(WRITERS) for i in range(WRITER_MOVES))])
    tag = _tag(store, "ci")
    assert sorted(e.by for e in tag.history) == sorted(["first", *told])  # each once: none lost, none twice
    assert tag.history[-1].by == "stalled-0" and tag.release == releases["stalled"][0]
