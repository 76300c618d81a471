"""Where an S3 store lives: a bucket and a key prefix (the client and the error mapping both name it)."""

from __future__ import annotations

from dataclasses import dataclass

from neffbuild.errors import StoreError


@dataclass(frozen=True, slots=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> S3Location:
        rest = url.removeprefix("s3://")
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not bucket or url == rest:
            raise StoreError(f"store {url!r}: expected s3://bucket[/prefix]", hint="e.g. s3://my-bucket/neffbuild")
        return cls(bucket, f"{prefix}/" if prefix else "")

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, rel: str) -> str:
        return self.prefix + rel
