"""A fleet booting at once: many `neffbuild pull` processes against one throttling store (a
TcpProxy in "limit" mode in front of the S3 test server). Shared by tests/host/test_storm.py and
bench/storm.py.

Each pull is its own process and cache dir, as each host of a fleet is; `storm` starts them
together and collects what each did (exit status, its `--json` report or error, its time) and
what the proxy let through or throttled.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from neffbuild.names import INCOMPLETE_SUFFIX, STATE_DIR
from neffbuild.store.base import Store
from tests.storekit import publish_release_of, write_files
from tests.tcpproxy import TcpProxy


def publish_fleet_release(
    store: Store, root: Path, *, small: int, large: int, large_size: int = 9 << 20
) -> dict[str, bytes]:
    """Publish a release tagged "prod": `small` files of up to 200 KiB (packed) and `large` ones
    of large_size (objects of their own); its files' bytes by path."""
    sizes = {f"small/{i:04d}.bin": 1 + (i * 7919) % 200_000 for i in range(small)} | {
        f"large/{j}.neff": large_size + j for j in range(large)
    }
    publish_release_of(store, root, write_files(root, sizes), name="prod", tag="prod")
    return {rel: (root / rel).read_bytes() for rel in sizes}


@dataclass(frozen=True)
class Pull:
    """One pull of a storm: how it ended and what it said."""

    code: int
    seconds: float  # from the storm's start to this process's exit
    report: dict  # its --json document: the PullReport, or the error
    stderr: str


@dataclass(frozen=True)
class Storm:
    pulls: list[Pull]
    forwarded: int  # requests the proxy let through to the server
    slowed: int  # requests it answered 503 SlowDown
    seconds: float

    @property
    def completed(self) -> int:
        return sum(p.code == 0 for p in self.pulls)

    @property
    def ratio(self) -> float:
        """503s per request forwarded."""
        return self.slowed / max(self.forwarded, 1)

    def quantile(self, q: float) -> float:
        times = sorted(p.seconds for p in self.pulls)
        return times[min(len(times) - 1, max(0, round(q * len(times)) - 1))]

    @property
    def median(self) -> float:
        return statistics.median(p.seconds for p in self.pulls)


def storm(
    proxy: TcpProxy, store_url: str, env: Mapping[str, str], caches: list[Path], *, timeout: float, extra: tuple[str, ...] = (),
    code: Path | None = None, command: Sequence[str] | None = None,
) -> Storm:  # fmt: skip
    """One `neffbuild pull prod --json` per cache dir, all started together through proxy; code:
    the checkout whose neffbuild they run (its root is their working dir: `python -m` puts that
    first on sys.path), default this one; command: another one to run instead (given --cache-dir)."""
    command = command or [
        sys.executable,
        "-m",
        "neffbuild",
        "pull",
        "prod",
        "--store",
        store_url,
        "--json",
        "--timeout",
        f"{timeout:g}",
        "--no-host-check",
        *extra,
    ]
    full_env = {**os.environ, **env, "AWS_ENDPOINT_URL": proxy.endpoint}
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [*command, "--cache-dir", str(c)],
            env=full_env,
            cwd=code,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for c in caches
    ]
    ended: dict[int, float] = {}
    while len(ended) < len(procs):  # each one's own end, not the order we wait in
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic() - started
        time.sleep(0.05)
    pulls = []
    for i, p in enumerate(procs):
        out, err = p.communicate()
        pulls.append(Pull(p.returncode, ended[i], json.loads(out) if out.strip() else {}, err))
    proxy.settled()
    return Storm(pulls, proxy.forwarded, len(proxy.slowed), time.monotonic() - started)


def partial_files(cache: Path, files: Mapping[str, bytes]) -> list[str]:
    """What in cache is not a whole file of the release: a temp file, a file with other bytes,
    anything the release does not name (the state dir aside)."""
    bad = []
    for path in cache.rglob("*"):
        rel = path.relative_to(cache).as_posix()
        if STATE_DIR in path.relative_to(cache).parts or path.is_dir():
            continue
        if path.name.endswith(INCOMPLETE_SUFFIX) or rel not in files or path.read_bytes() != files[rel]:
            bad.append(rel)
    return bad


def holds(cache: Path, files: Mapping[str, bytes]) -> bool:
    """Whether cache holds every file of the release, whole."""
    return all((cache / rel).is_file() and (cache / rel).read_bytes() == data for rel, data in files.items())
