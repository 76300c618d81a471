"""Where an S3 store lies and how its botocore client is made.

botocore signs writes (uploads, conditional puts, deletes, bucket creation); it is imported when
the first client is made, so a read-only process with static credentials never imports it (reads
are presigned by store/s3/sigv4.py and sent by store/s3/dataplane.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neffbuild.retry import CONNECT_S
from neffbuild.store.s3.errors import translated
from neffbuild.store.s3.location import S3Location

__all__ = ["S3Location", "botocore_client", "bucket_region", "endpoint_of"]

WRITE_READ_S = 60.0  # botocore's default: an upload's answer waiting this long is Transient


def endpoint_of(flag: str | None, env: Mapping[str, str]) -> str | None:
    """--endpoint-url beats AWS_ENDPOINT_URL_S3 beats AWS_ENDPOINT_URL; None: AWS itself."""
    return flag or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None


def botocore_client(location: S3Location, endpoint: str | None, env: Mapping[str, str]) -> Any:
    """An S3 client on botocore's session: boto3's credential chain (env, config files, SSO,
    instance role) without boto3's import cost."""
    import botocore.session

    with translated(location, ""):
        session = botocore.session.Session(profile=None if env.get("AWS_ACCESS_KEY_ID") else env.get("AWS_PROFILE"))
        for variable, name in (("config_file", "AWS_CONFIG_FILE"), ("credentials_file", "AWS_SHARED_CREDENTIALS_FILE")):
            if env.get(name):  # botocore reads os.environ; the env we were given wins
                session.set_config_variable(variable, env[name])
        return session.create_client(
            "s3",
            region_name=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
            endpoint_url=endpoint,
            aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
            aws_session_token=env.get("AWS_SESSION_TOKEN"),
            config=_client_config(endpoint),
        )


def _client_config(endpoint: str | None) -> Any:
    """botocore retries nothing itself: S3Medium._sent retries each call under neffbuild/retry/'s
    policy, so writes back off and give up like reads. A call in flight is bounded by the socket
    timeouts here; the deadline is checked before each try and bounds the sleeps between them."""
    from botocore.config import Config

    return Config(
        signature_version="s3v4",
        retries={"mode": "standard", "total_max_attempts": 1},
        connect_timeout=CONNECT_S,
        read_timeout=WRITE_READ_S,
        max_pool_connections=64,
        # We send our own CRC32C and verify XXH3 on read: skip botocore's extra checksums and the
        # SHA-256 of every payload it would compute on plain-http endpoints.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"payload_signing_enabled": False, **({"addressing_style": "path"} if endpoint else {})},
    )


def bucket_region(client: Any) -> dict[str, Any]:
    """create_bucket's arguments for the client's region (us-east-1 takes none)."""
    region = client.meta.region_name
    return {} if region in (None, "us-east-1") else {"CreateBucketConfiguration": {"LocationConstraint": region}}
