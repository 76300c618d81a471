"""gc on the local store and the real S3 server: exactly the unreachable objects go, the grace
period and --keep are honoured, a publish racing a gc (two real processes stopped at the dangerous
point) ends with every record's blobs present, and verify --store is clean afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neffbuild.build.publish import move_tag
from neffbuild.errors import ConflictError
from neffbuild.host.prune import prune_cache_dir
from neffbuild.host.pull import pull
from neffbuild.maint.gc import Policy, parse_duration, plan_gc, sweep
from neffbuild.maint.storecheck import check_store
from neffbuild.store import lease as fence
from neffbuild.store import open_store
from neffbuild.store.base import Store, blob_key
from tests.conftest import run_cli
from tests.gckit import age, publish, referenced, release
from tests.procs import wait_for
from tests.storekit import keys_of

ROOT = Path(__file__).resolve().parents[2]
DAY = 86400


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    if request.param == "s3":
        return request.getfixturevalue("s3_url"), request.getfixturevalue("s3_env")
    return str(tmp_path / "store"), {}


def is_local(store: Store) -> bool:
    return not store.url.startswith("s3://")


def history_store(store: Store, work: Path) -> dict[str, str]:
    """prod: r1 -> r2 -> r3; dev: r4 (shares own1 with r1 and b with r1); r0 never tagged.
    a is in r1, r2, r3; big (a loose object on S3) only in r0."""
    ids = {
        "r0": publish(store, work, "r0", {"g0.bin": "g0", "big.bin": "big0"}),
        "r1": publish(store, work, "r1", {"a.bin": "a", "b.bin": "b", "own.bin": "own1"}, tag="prod"),
        "r2": publish(store, work, "r2", {"a.bin": "a", "own.bin": "own2"}, tag="prod"),
        "r3": publish(store, work, "r3", {"a.bin": "a", "own.bin": "own3"}, tag="prod"),
        "r4": publish(store, work, "r4", {"b.bin": "b", "x/own.bin": "own1"}, tag="dev"),
    }
    return ids


def expected_garbage(store: Store, live: set[str], env: dict[str, str]) -> set[str]:
    """The oracle, from the records alone: what gc must delete when `live` releases are kept."""
    keys = keys_of(store, env)
    blobs = {f.digest for r in live for f in release(store, r).files}
    bundles = {u.key for r in live for u in release(store, r).units}
    indexes, _ = store.pack_indexes()
    live_packs = {p for p, i in indexes.items() if any(e.digest in blobs for e in i.entries)}
    garbage = set()
    for key in keys:
        name = key.rsplit("/", 1)[-1].split(".")[0]
        folder = key.split("/")[0]
        if (
            (folder in ("releases", "locators") and name not in live)
            or (folder == "bundles" and name not in bundles)
            or (folder == "blobs" and name not in blobs)
            or (folder == "packs" and name not in live_packs)
        ):
            garbage.add(key)
    return garbage


def old_enough(store: Store) -> Policy:
    """Local: every object is aged two days and gc keeps 24 h; S3 (no way to set LastModified): grace 0."""
    if is_local(store):
        age(store, 2 * DAY)
        return Policy(keep=0)
    return Policy(keep=0, grace_s=0)


@pytest.mark.parametrize("keep,live", [(0, {"r3", "r4"}), (1, {"r2", "r3", "r4"}), (3, {"r1", "r2", "r3", "r4"})])
def test_gc_deletes_exactly_the_unreachable_and_honours_keep(
    target: tuple[str, dict[str, str]], tmp_path: Path, keep: int, live: set[str]
) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    ids = history_store(store, tmp_path / "work")
    policy = Policy(keep=keep, grace_s=old_enough(store).grace_s)
    live_ids = {ids[r] for r in live}
    garbage = expected_garbage(store, live_ids, env)
    before = keys_of(store, env)
    grace = "24h" if is_local(store) else "0"
    done = run_cli("gc", "--store", url, "--keep", str(keep), "--grace", grace, "--yes", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert before - keys_of(store, env) == garbage
    assert json.loads(done.stdout)["deleted"] == len(garbage)
    assert garbage >= {f"releases/{ids['r0']}.json"} and all(k.startswith("tags/") is False for k in garbage)
    for rid in live_ids:  # every kept release is still whole and pullable
        pull(store, rid, tmp_path / "pulled" / rid, jobs=4)
    assert check_store(store, deep=True).clean
    assert plan_gc(store, policy).delete == ()  # nothing left to do


def test_dry_run_reports_counts_and_bytes_and_deletes_nothing(
    target: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    history_store(store, tmp_path / "work")
    old_enough(store)
    before = keys_of(store, env)
    sizes = {o.key: o.size for o in store.list_objects("")}
    grace = "24h" if is_local(store) else "0"
    done = run_cli("gc", "--store", url, "--keep", "0", "--grace", grace, "--dry-run", "--json", env=env)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert keys_of(store, env) == before
    assert plan["delete_objects"] == len(plan["delete"]) == sum(c["objects"] for c in plan["by_kind"])
    assert plan["delete_bytes"] == sum(sizes[k] for k in plan["delete"])
    order = [k.split("/")[0] + ("-idx" if k.endswith(".idx.json") else "") for k in plan["delete"]]
    ranks = {"releases": 0, "locators": 1, "bundles": 2, "packs-idx": 3, "packs": 4, "blobs": 5}
    assert [ranks[o] for o in order] == sorted(ranks[o] for o in order)  # records before what they reference
    refused = run_cli("gc", "--store", url, "--keep", "0", "--grace", grace, env=env)  # no terminal, no --yes
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert keys_of(store, env) == before


def test_grace_period_spares_young_objects(target: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    ids = history_store(store, tmp_path / "work")
    own2 = next(f.digest for f in release(store, ids["r2"]).files if f.path == "own.bin")
    if is_local(store):
        age(store, 2 * DAY)
        age(store, 60, {blob_key(own2)})  # written a minute ago: a publish may be about to use it
        plan = plan_gc(store, Policy(keep=0))
        assert blob_key(own2) not in plan.delete and plan.spared_objects == 1
        assert f"releases/{ids['r2']}.json" in plan.delete
        assert plan_gc(store, Policy(keep=0, grace_s=30)).delete_objects == plan.delete_objects + 1
    else:  # LastModified cannot be set: everything was just written
        assert plan_gc(store, Policy(keep=0, grace_s=parse_duration("1d"))).delete == ()
        assert plan_gc(store, Policy(keep=0, grace_s=0)).delete_objects > 0


def test_a_running_gc_holds_the_lease_and_a_dead_ones_expires(
    target: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    history_store(store, tmp_path / "work")
    held = fence.acquire(store, "someone else")
    done = run_cli("gc", "--store", url, "--keep", "0", "--grace", "0", "--yes", env=env)
    assert done.returncode == 9 and "another gc is running" in done.stderr
    fence.release(store, held)
    fence.acquire(store, "a gc that died", lease_s=-1)  # already expired
    policy = Policy(keep=0, grace_s=0)
    result = sweep(store, plan_gc(store, policy), policy)
    assert result.deleted and fence.read_lease(store) is None
    with pytest.raises(ConflictError, match="lease ends soon"):  # a gc stops before its lease ends
        publish(store, tmp_path / "more", "r5", {"c.bin": "c"}, tag="prod")
        move_tag(store, "prod", publish(store, tmp_path / "more", "r6", {"d.bin": "d"}))
        sweep(store, plan_gc(store, policy), policy, lease_s=fence.LEASE_MARGIN_S / 2)
    assert fence.read_lease(store) is None


# A publisher in its own process: release "new" reuses blob x (present, garbage for gc) and adds z.
# With BARRIER set it stops just before writing its bundle record, after its presence check.
PUBLISHER = """
import os, sys
from pathlib import Path
from neffbuild.store import open_store
from tests.gckit import Paused, publish

url, work, barrier = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
store = open_store(url, env=os.environ)
if barrier:
    store = Paused(store, "put_doc", Path(barrier), kind="bundles")
print(publish(store, work, "new", {"x.bin": "x", "z.bin": "z"}, tag="next"))
"""

# A gc in its own process that stops at its first delete (after it took the lease and planned).
GC = """
import os, sys
from pathlib import Path
from neffbuild.maint.gc import Policy, plan_gc, sweep
from neffbuild.store import open_store
from tests.gckit import Paused

url, grace, barrier = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
store = open_store(url, env=os.environ)
policy = Policy(keep=0, grace_s=grace)
print(len(sweep(Paused(store, "delete_objects", barrier), plan_gc(store, policy), policy).deleted))
"""


def racing_store(url: str, env: dict[str, str], work: Path) -> tuple[Store, str]:
    """A store where blob x is garbage (its only release fell out of the tag's history); x's digest."""
    store = open_store(url, create=True, env=env)
    old = publish(store, work, "old", {"x.bin": "x", "o.bin": "o"}, tag="t")
    publish(store, work, "other", {"q.bin": "q"}, tag="t")
    x = next(f.digest for f in release(store, old).files if f.path == "x.bin")
    return store, x


def spawn(script: str, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def assert_whole(store: Store) -> None:
    assert store.missing_blobs(referenced(store)) == set()
    check = check_store(store, deep=True)
    assert check.clean, (check.dangling, check.damaged)


def test_gc_between_a_publishs_presence_check_and_its_record(
    target: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    """The publisher finds x present and skips it; a whole gc run deletes x; then the record is written."""
    url, env = target
    store, x = racing_store(url, env, tmp_path / "work")
    grace = "24h"
    if is_local(store):
        age(store, 2 * DAY)
    else:
        grace = "0"
    barrier = tmp_path / "publisher"
    publisher = spawn(PUBLISHER, url, str(tmp_path / "pub"), str(barrier), env=env)
    assert wait_for(lambda: Path(f"{barrier}.reached").exists(), 60), publisher.stderr and publisher.stderr.read()
    assert store.missing_blobs({x}) == set()  # the publisher relies on it: present
    done = run_cli("gc", "--store", url, "--keep", "0", "--grace", grace, "--yes", env=env)
    assert done.returncode == 0, done.stderr
    assert store.missing_blobs({x}) == {x}  # the dangerous point: gc took it
    Path(f"{barrier}.go").touch()
    out, err = publisher.communicate(timeout=120)
    assert publisher.returncode == 0, err
    new = out.split()[-1]
    assert x in {f.digest for f in release(store, new).files}
    assert_whole(store)


def test_publish_waits_for_a_gc_that_planned_before_its_record(
    target: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    """gc plans (x is garbage) and stops before deleting; the publisher writes its records meanwhile."""
    url, env = target
    store, x = racing_store(url, env, tmp_path / "work")
    grace = 0.0
    if is_local(store):
        age(store, 2 * DAY)
        grace = DAY
    barrier = tmp_path / "gc"
    gc_proc = spawn(GC, url, str(grace), str(barrier), env=env)
    assert wait_for(lambda: Path(f"{barrier}.reached").exists(), 60), gc_proc.stderr and gc_proc.stderr.read()
    publisher = spawn(PUBLISHER, url, str(tmp_path / "pub"), "", env=env)
    time.sleep(3)
    assert publisher.poll() is None  # it wrote its bundle record and waits for gc's lease to go
    assert store.get_doc("bundles", next(iter(store.list_docs("bundles")))) is not None
    Path(f"{barrier}.go").touch()
    gc_out, gc_err = gc_proc.communicate(timeout=120)
    assert gc_proc.returncode == 0, gc_err
    out, err = publisher.communicate(timeout=120)
    assert publisher.returncode == 0, err
    assert int(gc_out.split()[-1]) > 0
    assert_whole(store)
    assert x in {f.digest for f in release(store, out.split()[-1]).files}


def test_gc_cache_dir_keeps_exactly_the_installed_release(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"), create=True)
    old = publish(store, tmp_path / "work", "one", {"m/a.bin": "a", "m/b.bin": "b"})
    new = publish(store, tmp_path / "work", "two", {"m/a.bin": "a", "n/c.bin": "c"})
    cache = tmp_path / "cache"
    pull(store, old, cache, jobs=2)
    pull(store, new, cache, jobs=2)  # m/b.bin stays behind from the old release
    (cache / "served" / "deep").mkdir(parents=True)
    (cache / "served" / "deep" / "kernel.so").write_bytes(b"written at serve time")
    outside = tmp_path / "precious.txt"
    outside.write_text("must survive")
    (cache / "link").symlink_to(outside)
    listed = {f.path: (cache / f.path).read_bytes() for f in release(store, new).files}
    dry = run_cli("gc", "--cache-dir", str(cache), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert sorted(json.loads(dry.stdout)["remove"]) == ["link", "m/b.bin", "served/deep/kernel.so"]
    assert (cache / "m" / "b.bin").exists()
    assert run_cli("gc", "--cache-dir", str(cache)).returncode == 2  # no terminal, no --yes
    done = run_cli("gc", "--cache-dir", str(cache), "--store", store.url, "--yes")
    assert done.returncode == 0, done.stderr
    assert {f.path: (cache / f.path).read_bytes() for f in release(store, new).files} == listed
    assert (
        not (cache / "m" / "b.bin").exists() and not (cache / "served").exists() and not (cache / "link").is_symlink()
    )
    assert outside.read_text() == "must survive" and (cache / ".neffbuild" / "state.json").exists()
    assert prune_cache_dir(cache).remove == ()
    assert pull(store, new, cache, jobs=2).files_fetched == 0  # still complete


@pytest.mark.parametrize(
    "text,seconds", [("24h", 86400), ("30m", 1800), ("90s", 90), ("2d", 172800), ("0", 0), ("1.5h", 5400)]
)
def test_grace_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_a_bad_grace_is_bad_input(tmp_path: Path) -> None:
    open_store(str(tmp_path / "s"), create=True)
    done = run_cli("gc", "--store", str(tmp_path / "s"), "--grace", "soon", "--dry-run")
    assert done.returncode == 2 and "--grace" in done.stderr


def test_gc_yes_with_stdout_closed_deletes_and_exits_0(tmp_path: Path) -> None:
    """A cron job with fd 1 closed: gc's plan and report cannot be printed, the deletion is what
    it was asked for (exit 0, a warning on stderr), not an internal error (exit 1)."""
    from tests.storekit import publish_release_of, write_files

    store = open_store(str(tmp_path / "store"), create=True)
    orphan = publish_release_of(store, tmp_path / "src", write_files(tmp_path / "src", {"a.bin": 10}), name="m")
    done = subprocess.run(
        [sys.executable, "-m", "neffbuild", "gc", "--store", str(tmp_path / "store"), "--yes", "--grace", "0"],
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False, preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert store.get_doc("releases", orphan) is None
    assert "could not be printed: stdout is closed" in done.stderr and "internal error" not in done.stderr
