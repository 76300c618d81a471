"""One host of `bench/storm.py --client adaptive`: the requests one `neffbuild pull` made (recorded
by bench/storm.py from a pull through an unthrottled proxy), sent again with botocore's own
adaptive retry mode (its client-side rate limiter, and its backoff between tries), as a fleet
would with an SDK's adaptive mode instead of neffbuild's pacer. The first requests (the tag, the
release, its bundles: each needs the one before) go one after another, then the downloads (packs,
blobs) on `jobs` threads, as a pull does. Exit 0 if every request got its whole body in time,
3 past the deadline, 1 otherwise; stdout: a JSON line with what it did.

    python bench/_adaptive.py PLAN.json --timeout 600 --cache-dir DIR   (DIR: unused, the storm's)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
from botocore.config import Config

DOWNLOADS = ("/packs/", "/blobs/")  # keys a pull fetches in parallel


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("plan", type=Path)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--jobs", type=int, default=16)
    p.add_argument("--cache-dir", type=Path)
    args = p.parse_args()
    plan = json.loads(args.plan.read_text())  # [[path, range or null], ...]
    # max_attempts: enough to throttle until the deadline (botocore's default, 3, gives up in seconds)
    client = boto3.client(
        "s3", config=Config(retries={"mode": "adaptive", "max_attempts": 1000}, s3={"addressing_style": "path"})
    )
    started = time.monotonic()
    first = next((i for i, step in enumerate(plan) if any(d in step[0] for d in DOWNLOADS)), len(plan))
    try:
        for step in plan[:first]:
            fetch(client, step, started + args.timeout)
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda s: fetch(client, s, started + args.timeout), plan[first:]))
    except TimeoutError as e:
        print(json.dumps({"error": str(e), "kind": "DeadlineExceeded"}))
        return 3
    except Exception as e:  # noqa: BLE001 - what failed is the report
        print(json.dumps({"error": f"{type(e).__name__}: {e}"[:300]}))
        return 1
    print(json.dumps({"requests": len(plan), "seconds": round(time.monotonic() - started, 3)}))
    return 0


def fetch(client, step: list, deadline: float) -> None:  # noqa: ANN001 - a boto3 client
    path, byte_range = step
    if time.monotonic() > deadline:
        raise TimeoutError(f"past the deadline before {path}")
    bucket, _, key = urllib.parse.unquote(urllib.parse.urlsplit(path).path).lstrip("/").partition("/")
    extra = {"Range": byte_range} if byte_range else {}
    answer = client.get_object(Bucket=bucket, Key=key, **extra)
    body = answer["Body"].read()
    if len(body) != answer["ContentLength"]:
        raise ValueError(f"{path}: {len(body)} bytes of {answer['ContentLength']}")


if __name__ == "__main__":
    sys.exit(main())
