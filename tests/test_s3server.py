"""The suite's S3 server (tests/s3server.py) is the same on every machine: how many buckets it
takes writes for must not depend on the free disk space of the machine it runs on."""

from __future__ import annotations

import json
import shutil
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.s3server import MAX_VOLUMES, S3Server, S3Settings, client_for, weed_binary

pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(weed_binary() is None, reason="no `weed` binary (scripts/test.sh installs it)"),
]


def test_the_volume_cap_is_fixed_not_taken_from_the_free_disk_space(tmp_path: Path) -> None:
    """Left to itself, `weed mini` caps its volumes (one or more per bucket) at the free disk space
    over the volume size: ~30 here, ~20 on a CI machine with less free, where writes then failed."""
    server = S3Server(tmp_path / "weed")
    with server:
        assert server.master_url is not None
        with urllib.request.urlopen(f"{server.master_url}/dir/status", timeout=10) as response:
            topology = json.load(response)["Topology"]
    free_gib = shutil.disk_usage(tmp_path).free // 2**30
    assert topology["Max"] == MAX_VOLUMES, (topology["Max"], f"{free_gib} GiB free")


def test_every_bucket_takes_writes_past_one_per_free_gibibyte(s3_server: S3Settings) -> None:
    """More buckets than a test module per worker creates (~25), each written: with the cap taken
    from the free space, the bucket past it got HTTP 500 InternalError on every PUT."""
    client = client_for(s3_server)
    run = uuid.uuid4().hex[:8]
    for i in range(40):
        bucket = f"volumes-{run}-{i:02d}"
        client.create_bucket(Bucket=bucket)
        client.put_object(Bucket=bucket, Key="k", Body=b"x")
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"x"
