"""Presigned S3 URLs (AWS Signature Version 4, query authentication) from the standard library.

`neffbuild pull` runs on every instance boot, and botocore costs it about 0.3 s before the first
byte moves (its import, the S3 client's service model, its first signature). When everything a
request needs is in the environment (static credentials, a region or an endpoint, no config file
that could change addressing), the S3 store signs its reads here instead; anything else (profiles,
SSO, instance roles, FIPS or dual-stack endpoints) goes through botocore, which knows them all.

The algorithm is AWS's documented one ("Authenticating Requests: Using Query Parameters"):
https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-query-string-auth.html
"""

from __future__ import annotations

import hashlib
import hmac
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ALGORITHM = "AWS4-HMAC-SHA256"
# Regions of the commercial partition (amazonaws.com): others (China, GovCloud, ISO) use botocore.
_COMMERCIAL_REGION = re.compile(r"^(us|eu|ap|ca|sa|me|af|il|mx)-[a-z]+-\d+$")
_TRUE = ("true", "1")


@dataclass(frozen=True, slots=True)
class Credentials:
    access_key: str
    secret_key: str
    token: str | None = None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a bucket's objects are addressed: scheme://host<bucket_path>/<key>."""

    scheme: str
    host: str  # with the port when it is not the scheme's default
    bucket_path: str  # "/bucket" (path style) or "" (virtual-hosted)

    def url(self, key: str, query: str = "") -> str:
        return f"{self.scheme}://{self.host}{self.path(key)}" + (f"?{query}" if query else "")

    def path(self, key: str) -> str:
        """The URI path of an object ("" addresses the bucket itself, as for a listing)."""
        if not key:
            return self.bucket_path or "/"
        return f"{self.bucket_path}/{urllib.parse.quote(key, safe='/~')}"


@dataclass(frozen=True, slots=True)
class Signer:
    credentials: Credentials
    region: str
    endpoint: Endpoint

    def presign(
        self,
        method: str,
        key: str,
        params: Mapping[str, str] | None = None,
        *,
        expires: int = 3600,
        now: datetime | None = None,
    ) -> str:
        """A URL that performs method on key (with query params) until expires seconds from now."""
        when = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
        scope = f"{when[:8]}/{self.region}/s3/aws4_request"
        query = {
            **(params or {}),
            "X-Amz-Algorithm": ALGORITHM,
            "X-Amz-Credential": f"{self.credentials.access_key}/{scope}",
            "X-Amz-Date": when,
            "X-Amz-Expires": str(expires),
            "X-Amz-SignedHeaders": "host",
        }
        if self.credentials.token:
            query["X-Amz-Security-Token"] = self.credentials.token
        canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query.items()))
        request = "\n".join(
            [
                method,
                self.endpoint.path(key),
                canonical_query,
                f"host:{self.endpoint.host}\n",
                "host",
                "UNSIGNED-PAYLOAD",
            ]
        )
        to_sign = "\n".join([ALGORITHM, when, scope, hashlib.sha256(request.encode()).hexdigest()])
        signature = hmac.new(self._signing_key(when[:8]), to_sign.encode(), hashlib.sha256).hexdigest()
        return self.endpoint.url(key, f"{canonical_query}&X-Amz-Signature={signature}")

    def _signing_key(self, date: str) -> bytes:
        key = f"AWS4{self.credentials.secret_key}".encode()
        for part in (date, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        return key


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="-_.~")


def signer_from_env(bucket: str, endpoint_url: str | None, env: Mapping[str, str]) -> Signer | None:
    """A signer when the environment alone settles credentials, region and addressing, else None.

    Mirrors what botocore would do with the same environment: static credentials from
    AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (they beat every other source); path-style URLs on a
    custom endpoint (as store/s3/client.py configures botocore); virtual-hosted ones on AWS. A config file
    with content could set the endpoint, addressing or region for a profile, so then: None.
    """
    access, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret or _config_file_has_content(env):
        return None
    if any(env.get(flag, "").lower() in _TRUE for flag in ("AWS_USE_FIPS_ENDPOINT", "AWS_USE_DUALSTACK_ENDPOINT")):
        return None
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    credentials = Credentials(access, secret, env.get("AWS_SESSION_TOKEN") or None)
    if endpoint_url:
        parsed = urllib.parse.urlsplit(endpoint_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc or parsed.path not in ("", "/"):
            return None
        return Signer(credentials, region or "us-east-1", Endpoint(parsed.scheme, parsed.netloc, f"/{bucket}"))
    if not region or not _COMMERCIAL_REGION.match(region) or "." in bucket:
        return None  # no region: botocore finds the bucket's region by redirect; dotted names break TLS
    return Signer(credentials, region, Endpoint("https", f"{bucket}.s3.{region}.amazonaws.com", ""))


def _config_file_has_content(env: Mapping[str, str]) -> bool:
    path = Path(env.get("AWS_CONFIG_FILE") or Path(env.get("HOME") or Path.home()) / ".aws" / "config").expanduser()
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return True  # unreadable: let botocore decide and report
