"""Our SigV4 presigner: the same URLs as botocore's, and used only when the environment settles
everything; the store tests run it against a real server (SeaweedFS checks signatures)."""

from __future__ import annotations

import urllib.parse
from datetime import UTC, datetime
from pathlib import Path

import pytest

from neffbuild.store.s3.sigv4 import Credentials, Endpoint, Signer, signer_from_env

botocore_session = pytest.importorskip("botocore.session")
CREDS = Credentials("AKIDEXAMPLE", "secret/with+chars", "tok/en+=")


def botocore_url(endpoint_url: str | None, region: str, operation: str, params: dict) -> str:
    from botocore.config import Config

    client = botocore_session.Session().create_client(
        "s3", region_name=region, endpoint_url=endpoint_url, aws_access_key_id=CREDS.access_key,
        aws_secret_access_key=CREDS.secret_key, aws_session_token=CREDS.token,
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"} if endpoint_url else {}),
    )  # fmt: skip
    return client.generate_presigned_url(operation, Params={"Bucket": "bkt", **params}, ExpiresIn=900)


def parts(url: str) -> tuple[str, str, dict[str, str]]:
    split = urllib.parse.urlsplit(url)
    return split.netloc, split.path, dict(urllib.parse.parse_qsl(split.query))


@pytest.mark.parametrize(
    ("endpoint_url", "endpoint"),
    [
        ("http://127.0.0.1:8333", Endpoint("http", "127.0.0.1:8333", "/bkt")),
        (None, Endpoint("https", "bkt.s3.amazonaws.com", "")),
    ],
)
@pytest.mark.parametrize(
    ("operation", "params", "key", "query"),
    [
        ("get_object", {"Key": "pre fix/blobs/ab/x+y~z=.json"}, "pre fix/blobs/ab/x+y~z=.json", {}),
        ("list_objects_v2", {"Prefix": "p/packs/ x", "ContinuationToken": "a+b/c=", "EncodingType": "url"}, "",
         {"list-type": "2", "prefix": "p/packs/ x", "continuation-token": "a+b/c=", "encoding-type": "url"}),
    ],
)  # fmt: skip
def test_signature_equals_botocores(endpoint_url, endpoint, operation, params, key, query) -> None:
    theirs = botocore_url(endpoint_url, "eu-west-1", operation, params)
    when = datetime.strptime(parts(theirs)[2]["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    ours = Signer(CREDS, "eu-west-1", endpoint).presign("GET", key, query, expires=900, now=when)
    assert parts(ours) == parts(theirs)


def test_a_different_secret_or_key_changes_the_signature() -> None:
    endpoint = Endpoint("http", "h:1", "/b")
    now = datetime(2026, 1, 1, tzinfo=UTC)
    base = parts(Signer(CREDS, "us-east-1", endpoint).presign("GET", "k", now=now))[2]["X-Amz-Signature"]
    other_secret = Signer(Credentials("AKIDEXAMPLE", "other"), "us-east-1", endpoint).presign("GET", "k", now=now)
    other_key = Signer(CREDS, "us-east-1", endpoint).presign("GET", "k2", now=now)
    assert base not in other_secret and base not in other_key


STATIC = {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_CONFIG_FILE": "/nonexistent/config"}


def test_environment_that_settles_everything_gets_our_signer() -> None:
    custom = signer_from_env("bkt", "http://127.0.0.1:9000", STATIC)
    assert (
        custom is not None
        and custom.endpoint == Endpoint("http", "127.0.0.1:9000", "/bkt")
        and custom.region == "us-east-1"
    )
    aws = signer_from_env("bkt", None, {**STATIC, "AWS_REGION": "eu-central-1", "AWS_SESSION_TOKEN": "T"})
    assert aws is not None and aws.endpoint.host == "bkt.s3.eu-central-1.amazonaws.com" and aws.credentials.token == "T"


@pytest.mark.parametrize(
    "change",
    [
        {"AWS_ACCESS_KEY_ID": ""},  # the credential chain (profiles, SSO, instance role) is botocore's
        {"AWS_REGION": ""},  # no region: botocore follows the bucket's region redirect
        {"AWS_REGION": "cn-north-1"},  # another partition
        {"AWS_USE_FIPS_ENDPOINT": "true"},
        {"AWS_USE_DUALSTACK_ENDPOINT": "true"},
        {"BUCKET": "dotted.bucket"},  # virtual-hosted TLS does not cover dotted names
    ],
)
def test_anything_else_is_left_to_botocore(change: dict[str, str]) -> None:
    env = {**STATIC, "AWS_REGION": "eu-west-1", **change}
    assert signer_from_env(env.pop("BUCKET", "bkt"), None, env) is None


def test_a_config_file_with_content_is_left_to_botocore(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("[default]\nregion = eu-west-1\n")
    assert signer_from_env("bkt", "http://h:1", {**STATIC, "AWS_CONFIG_FILE": str(config)}) is None
    config.write_text("")
    assert signer_from_env("bkt", "http://h:1", {**STATIC, "AWS_CONFIG_FILE": str(config)}) is not None
