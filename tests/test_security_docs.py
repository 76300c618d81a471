"""docs/security.md's S3 policies: the bucket policy denies the CI writer every unconditional
write S3 would let overwrite an immutable object or a tag, and denies none of the writes a real
publish, sign and tag move make (recorded as sent to SeaweedFS, headers included)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import pytest

from neffbuild.build.publish import move_tag
from neffbuild.documents.signing import Signing, generate_key
from neffbuild.store import open_store
from tests.conftest import ROOT
from tests.storekit import publish_release_of, write_files

ARN = "arn:aws:s3:::BUCKET/PREFIX/"
HEADERS = {"s3:if-none-match": "If-None-Match", "s3:if-match": "If-Match"}


def _policies() -> list[dict[str, Any]]:
    text = (ROOT / "docs" / "security.md").read_text()
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, re.S)]


def _bucket_policy() -> dict[str, Any]:
    (policy,) = [p for p in _policies() if any(s.get("Effect") == "Deny" for s in p["Statement"])]
    return policy


def denied(key: str, headers: set[str]) -> bool:
    """Whether the bucket policy's Deny statements refuse a PutObject of key (relative to the
    store's prefix) that carries these conditional headers (a Null condition holds when the
    header is absent; the keys of one Null block must all hold)."""
    for statement in _bucket_policy()["Statement"]:
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        if statement["Action"] != "s3:PutObject" or not any(fnmatchcase(ARN + key, r) for r in resources):
            continue
        nulls = statement["Condition"]["Null"]
        if all((HEADERS[k] not in headers) == (v == "true") for k, v in nulls.items()):
            return True
    return False


def test_every_policy_block_is_json_and_uses_the_condition_keys() -> None:
    policies = _policies()
    assert len(policies) == 3  # CI writer, its bucket policy, boot reader
    text = json.dumps(_bucket_policy())
    assert '"s3:if-none-match"' in text and '"s3:if-match"' in text


@pytest.mark.s3
def test_the_bucket_policy_denies_unconditional_overwrites_and_none_of_neffbuilds_writes(
    s3_url: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    store = open_store(s3_url, create=True, env=s3_env)
    prefix = s3_url.split("/", 3)[3] + "/"
    sent: list[tuple[str, set[str]]] = []

    def record(request: Any, **_: Any) -> None:
        path = request.url.split("?")[0].split(prefix, 1)[1]
        sent.append((path, {h for h in HEADERS.values() if h in request.headers}))

    store.client.meta.events.register("before-send.s3.PutObject", record)
    sources = write_files(tmp_path / "src", {"small.bin": 100, "large.bin": 9 << 20})
    release = publish_release_of(store, tmp_path / "src", sources, name="m")
    key = generate_key("ci.example-1")
    for _ in range(2):  # create the tag, then replace it (If-None-Match, then If-Match)
        move_tag(store, "prod", release, signing=Signing(key, datetime.now(UTC) + timedelta(days=1)))
    kinds = {path.split("/")[0] for path, _ in sent}
    assert {"blobs", "packs", "bundles", "locators", "releases", "signatures", "tags"} <= kinds, kinds
    assert [path for path, headers in sent if denied(path, headers)] == []
    # The same writes without their headers: S3 would overwrite; the policy refuses all but packs/.
    unconditional = {path for path, _ in sent if denied(path, set())}
    assert {path for path, _ in sent if not path.startswith("packs/")} == unconditional
