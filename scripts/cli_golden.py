"""The CLI's output, recorded: a refactor of the command line must leave every byte of it alone.

    .venv/bin/python scripts/cli_golden.py record DIR   # every call's exit code, stdout, stderr
    diff -r BEFORE AFTER                                # after the change, against the record before

It makes a store and a cache dir without compiling (bundles published from hand-made files for
this host's plan of the repo's tiny manifest, then released, pulled and tagged through the CLI),
then runs each command's --help and real calls (plain and --json, and the errors), one process
each, in a fixed order. Paths of the scratch dir, times and durations are normalised; nothing
else is.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Another scratch dir (NEFFBUILD_GOLDEN_SCRATCH) for a second record at once: of the same length, or
# tables wrap elsewhere.
SCRATCH = Path(os.environ.get("NEFFBUILD_GOLDEN_SCRATCH", "/tmp/neffbuild-cli-golden"))
COMMANDS = (
    "plan", "build", "release", "push", "tag", "keygen", "schema", "recipe", "suggest", "pull", "env", "status",
    "doctor", "verify", "warmup", "ls", "show", "diff", "du", "gc",
)  # fmt: skip
TIME = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d(:\d\d(\.\d+)?)?(Z|[+-]\d\d:?\d\d)?")  # ls shows minutes
DURATION = re.compile(r"\b\d+(\.\d+)? ?(s|ms|seconds?)\b")
# Seconds a JSON document reports (a push's, a pull's rate): times, whatever the key.
SECONDS = re.compile(r'("(?:\w+_s|seconds|mb_per_s)"): -?\d+(?:\.\d+)?(?:e-?\d+)?')
FREE = re.compile(r"\b\d+(\.\d+)? ?(B|KiB|MiB|GiB|TiB) free\b")  # doctor: the disk, as others fill it
AGO = re.compile(r"\b\d+ ?(s|m|h|d|seconds?|minutes?|hours?|days?) ago\b")


def fixture(root: Path) -> dict[str, str]:
    """The store (a release of this host's plan tagged `tiny`, another tagged `other`), names."""
    from neffbuild.build.publish import publish_bundle
    from neffbuild.documents.bundles import BundleRecord, Timings
    from neffbuild.documents.manifest import load_manifest
    from neffbuild.documents.records import FileEntry
    from neffbuild.hashing import blake3_bytes, hash_bytes
    from neffbuild.store import open_store
    from neffbuild.store.blobs import BlobSource
    from neffbuild.units.plan import make_plan
    from tests.conftest import write_manifest, write_model_index
    from tests.storekit import publish_release_of, write_files

    write_model_index(root / "model")
    manifest = write_manifest(root / "m.toml", root / "model")
    # The model by a relative path: the manifest's digest (in every release id) is the same in
    # any scratch dir.
    manifest.write_text(manifest.read_text().replace(f'"{root / "model"}"', '"./model"'))
    plan = make_plan(load_manifest(manifest), dict(os.environ))
    store = open_store(str(root / "store"), create=True)
    for unit in plan.units:
        files = {f"kernels/{unit.key}.so": unit.key.encode() * 40, "headers/common.h": b"common " * 30}
        sources, entries = [], []
        for path, data in sorted(files.items()):
            target = root / "work" / unit.key / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            sources.append(BlobSource(hash_bytes(data), len(data), target, blake3_bytes(data)))
            entries.append(FileEntry(path, len(data), hash_bytes(data), blake3_bytes(data)))
        record = BundleRecord(
            key=unit.key, unit_id=unit.unit_id, unit=dict(unit.normalized), backend="inductor",
            fingerprint=dict(unit.fingerprint), files=tuple(entries), counters={"compiles": 2},
            timings=Timings(1.0, 39.0, 40.0), created_at="2026-01-01T00:00:00+00:00", neffbuild_version="test",
            peak_rss=300 << 20,
        )  # fmt: skip
        publish_bundle(store, record, sources, jobs=2)
    other = publish_release_of(store, root / "other", write_files(root / "other", {"a.bin": 10, "b/c.bin": 2000}))
    return {"m": str(manifest), "other": other, "key": plan.units[0].key, "unit": plan.units[0].unit_id}


def cases(root: Path, names: dict[str, str]) -> list[tuple[str, ...]]:
    m, s, c = names["m"], str(root / "store"), str(root / "cache")
    s2, c2, empty = str(root / "store2"), str(root / "cache2"), str(root / "empty")
    missing = str(root / "nope.toml")
    out: list[tuple[str, ...]] = [(), ("--help",), ("-h",), ("--version",), ("bogus",), ("--log-format", "xml", "ls")]
    for command in COMMANDS:
        out += [(command, "--help"), (command, "-h")]
    out += [("build",), ("pull",), ("show",), ("tag", "x")]  # missing arguments: click's usage errors
    json_twins = [
        # CI
        ("plan", m),
        ("plan", m, "--shards", "2", "--store", s),
        ("plan", missing),
        ("build", m, "--store", s),  # every unit present: nothing compiles, the build releases
        ("build", m, "--store", s, "--shard", "1/2"),
        ("build", m, "--shard", "9/2", "--store", s),
        ("build", m, "--unit-memory", "lots", "--store", s),
        ("build", missing, "--store", s),
        ("release", m, "--store", s, "--report", str(root / "report.json")),
        ("release", m, "--store", s2),
        ("release", m, "--store", s, "--shard-report", str(root / "nope.json")),
        ("release", m, "--store", s, "--expires", "3d"),
        ("push", "tiny-flux2-klein", "--from", s, "--to", s2),
        ("push", "nope", "--from", s, "--to", s2),
        ("tag", "other", names["other"], "--store", s),
        ("tag", "nope", "0" * 32, "--store", s),
        ("suggest", m, str(root / "nope.jsonl")),
        ("suggest", m, str(root / "report.json")),
        # a serving host
        ("pull", "tiny-flux2-klein", "--cache-dir", c, "--store", s),
        ("pull", "tiny-flux2-klein", "--cache-dir", c, "--store", s),  # again: nothing to fetch
        ("pull", "other", "--cache-dir", c2, "--store", s),
        ("pull", "nope", "--cache-dir", c2, "--store", s),
        ("pull", "tiny-flux2-klein", "--cache-dir", c2),
        ("pull", "tiny-flux2-klein", "--cache-dir", c2, "--store", s, "--timeout", "-1"),
        ("env", "--cache-dir", c),
        ("env", "--cache-dir", empty),
        ("env", "tiny-flux2-klein", "--cache-dir", c, "--store", s),
        ("status", "--cache-dir", c),
        ("status", "--cache-dir", c, "--verify"),
        ("status", m, "--cache-dir", c, "--store", s),
        ("status", "--cache-dir", empty),
        ("doctor", "--cache-dir", c, "--store", s),
        ("doctor", "--backend", "bogus"),
        ("verify", "--cache-dir", c),
        ("verify", "--store", s),
        ("verify", m, "--cache-dir", c),
        ("verify", "--cache-dir", empty),
        ("warmup", m, "--cache-dir", empty),
        ("warmup", missing, "--cache-dir", c),
        # the store
        ("ls", "--store", s),
        ("ls", "--tag", "tiny-flux2-klein", "--store", s),
        ("ls", "--tag", "nope", "--store", s),
        ("ls", "--store", s2),
        ("ls",),
        ("show", "tiny-flux2-klein", "--store", s),
        ("show", "other", "--store", s),
        ("show", names["key"], "--store", s),
        ("show", "tiny-flux2-klein@1", "--store", s),
        ("show", "nope", "--store", s),
        ("diff", "tiny-flux2-klein", "other", "--store", s),
        ("diff", "other", "tiny-flux2-klein", "--store", s),
        ("diff", "--host", "tiny-flux2-klein", "--store", s),
        ("diff", "tiny-flux2-klein", "--store", s),
        ("du", "--store", s),
        ("du", "--store", s, "--keep", "0"),
        ("gc", "--store", s, "--dry-run"),
        ("gc", "--store", s, "--grace", "bogus", "--dry-run"),
        ("gc", "--store", s),  # no terminal, no --yes: refused
        ("gc", "--cache-dir", c2, "--dry-run"),
    ]
    for args in json_twins:
        out += [args, (*args, "--json")]
    out += [
        ("schema",),
        ("recipe", m),
        ("recipe", m, "--entry", "nope"),
        ("recipe", missing),
        ("keygen", "ci", str(root / "key")),
        ("keygen", "ci", str(root / "key")),  # exists: refused
        ("release", m, "--store", s, "--sign-key", str(root / "key"), "--tag", "signed"),
        ("status", "--cache-dir", c, "--trusted-key", str(root / "key.pub")),
        ("-q", "ls", "--store", s),
        ("-v", "ls", "--store", s),
        ("--log-format", "json", "-v", "show", "nope", "--store", s),
        ("--debug", "show", "nope", "--store", s),
        ("gc", "--store", s, "--yes", "--keep", "1", "--grace", "0s"),
        ("gc", "--cache-dir", c, "--yes"),
        ("ls", "--store", s, "--json"),
    ]
    return out


# NEFFBUILD_GOLDEN_LIGHT=1: only the calls that plan nothing (seconds each, where a plan imports the
# compile stack), the release made once in the fixture instead.
PLANNING = ("plan", "build", "release", "recipe", "warmup", "suggest")


def light(calls: list[tuple[str, ...]], manifest: str) -> list[tuple[str, ...]]:
    return [c for c in calls if not (c[:1] and c[0] in PLANNING) and c[1:2] != (manifest,)]


def normalised(text: str, root: Path) -> str:
    text = text.replace(str(root), "<ROOT>").replace(str(ROOT), "<REPO>")
    text = TIME.sub("<TIME>", text)
    text = AGO.sub("<AGO>", text)
    text = SECONDS.sub(r"\1: <NUM>", text)
    text = FREE.sub("<SIZE> free", text)
    return DURATION.sub("<DUR>", text)


def record(out: Path) -> int:
    shutil.rmtree(SCRATCH, ignore_errors=True)
    SCRATCH.mkdir(parents=True)
    (SCRATCH / "empty").mkdir()
    names = fixture(SCRATCH)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEFFBUILD_", "AWS_", "GITHUB_"))}
    env.update(PYTHONPATH=str(ROOT), COLUMNS="100", LINES="40", TERM="dumb", NO_COLOR="1", TZ="UTC")
    out.mkdir(parents=True, exist_ok=True)
    calls = cases(SCRATCH, names)
    if os.environ.get("NEFFBUILD_GOLDEN_LIGHT"):
        from neffbuild.build.fanin import release_manifest
        from neffbuild.store import StoreChoice

        release_manifest(Path(names["m"]), StoreChoice(str(SCRATCH / "store")), env=dict(os.environ))
        calls = light(calls, names["m"])
    for i, args in enumerate(calls):
        done = subprocess.run(
            [sys.executable, "-m", "neffbuild", *args],
            capture_output=True, text=True, env=env, cwd=SCRATCH, stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
        text = (
            f"$ neffbuild {' '.join(args)}\nexit {done.returncode}\n--- stdout\n{done.stdout}--- stderr\n{done.stderr}"
        )
        (out / f"{i:03d}.txt").write_text(normalised(text, SCRATCH))
    print(f"{len(calls)} calls recorded in {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "record":
        sys.exit(__doc__)
    sys.exit(record(Path(sys.argv[2])))
