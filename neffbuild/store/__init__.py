"""Stores behind one protocol; `open_store` picks one from a URL or a path."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from neffbuild.errors import InputError
from neffbuild.store.base import Store

DEFAULT_STORE = ".neffbuild/store"


def resolve_store_url(flag: str | None, env: Mapping[str, str], manifest_default: str | None = None) -> str:
    """--store beats NEFFBUILD_STORE beats the manifest's store beats .neffbuild/store."""
    return flag or env.get("NEFFBUILD_STORE") or manifest_default or DEFAULT_STORE


def open_store(
    url: str, *, create: bool = False, env: Mapping[str, str] | None = None, endpoint_url: str | None = None
) -> Store:
    """endpoint_url (--endpoint-url) beats env's AWS_ENDPOINT_URL for s3:// stores."""
    if url.startswith("s3://"):
        from neffbuild.store.s3.store import S3Store  # only this path imports boto3

        return S3Store.from_url(url, env=env or {}, create=create, endpoint_url=endpoint_url)
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise InputError(
            f"store {url!r}: unsupported scheme {scheme!r}", hint="use a directory path or s3://bucket/prefix"
        )
    from neffbuild.store.local import LocalStore

    return LocalStore(Path(url), create=create)


@dataclass(frozen=True)
class StoreChoice:
    """Where the user said the store is (--store, --endpoint-url), opened by the core."""

    url: str | None = None
    endpoint_url: str | None = None

    def open(self, env: Mapping[str, str], *, manifest_default: str | None = None, create: bool = False) -> Store:
        url = resolve_store_url(self.url, env, manifest_default)
        return open_store(url, create=create, env=env, endpoint_url=self.endpoint_url)
