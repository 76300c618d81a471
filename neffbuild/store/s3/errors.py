"""botocore's exceptions as neffbuild's typed errors (the write path; store/s3/responses.py maps the
HTTP answers of reads). botocore is imported only when an error is being translated."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from neffbuild.errors import IntegrityError, NeffbuildError, NotFoundError, StoreError
from neffbuild.retry import Transient
from neffbuild.store.s3 import responses

if TYPE_CHECKING:
    from neffbuild.store.s3.location import S3Location

DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403"}
CORRUPT = {"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "XAmzContentSHA256Mismatch"}
LOST_RACE = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}  # a conditional write did not hold
ABSENT_BUCKET = ("404", "NoSuchBucket", "NotFound")
THROTTLED = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestTimeout",
    "InternalError",
}
SLOW_DOWN = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
}  # the store is up


@contextmanager
def translated(location: S3Location, rel: str, *, transient: bool = False) -> Iterator[None]:
    """botocore's exceptions become our typed errors, one line each, naming the object. With
    transient, throttling, 5xx and dropped connections become retry.Transient instead (for a
    call made under the retry policy: S3Medium._sent)."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        HTTPClientError,
        NoCredentialsError,
        PartialCredentialsError,
        ProfileNotFound,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    where = f"{location.url}/{rel}".rstrip("/")
    try:
        yield
    except NeffbuildError:
        raise
    except ClientError as exc:
        code = error_code(exc)
        message = exc.response.get("Error", {}).get("Message", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if transient and (code in THROTTLED or status == 429 or status >= 500):
            raise Transient(
                f"HTTP {status} {code}".rstrip(), throttled=code in SLOW_DOWN or status in (429, 503)
            ) from None
        if code == "NoSuchBucket":
            raise StoreError(
                f"bucket {location.bucket!r} does not exist",
                hint="create it (e.g. aws s3 mb), or open the store with create=True as publishing commands do",
            ) from None
        if code in DENIED:
            raise StoreError(f"access denied to {where} ({code})", hint=responses.CREDENTIALS_HINT) from None
        if code in CORRUPT:
            raise IntegrityError(
                f"upload of {where} was rejected by the server: its checksum did not match ({code})",
                hint="the bytes were corrupted in transit; retry, and check proxies on the way to the endpoint",
            ) from None
        if code in ("NoSuchKey", "404"):
            raise NotFoundError(f"{where} not found") from None
        raise StoreError(f"{where}: {code}: {message}".rstrip(": ")) from None
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise StoreError(f"no AWS credentials for {location.url} ({exc})", hint=responses.CREDENTIALS_HINT) from None
    except ProfileNotFound as exc:
        raise StoreError(str(exc), hint="check AWS_PROFILE and ~/.aws/config") from None
    except (BotoConnectionError, HTTPClientError) as exc:
        if transient:  # refused, dropped or timed out
            raise Transient(str(exc), hint="check --endpoint-url / AWS_ENDPOINT_URL and the network") from None
        raise StoreError(
            f"cannot reach S3 for {where}: {exc}", hint="check --endpoint-url / AWS_ENDPOINT_URL and the network"
        ) from None
    except BotoCoreError as exc:
        raise StoreError(f"{where}: {exc}") from None


def error_code(exc: Any) -> str:  # a botocore ClientError
    return str(exc.response.get("Error", {}).get("Code", ""))


def client_error() -> type[Exception]:
    """botocore's ClientError, for an `except` clause: evaluated (and botocore imported) only
    when an exception is being matched."""
    from botocore.exceptions import ClientError

    return ClientError
