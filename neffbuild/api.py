"""The Python API for serving code that pulls in-process: `neffbuild.ensure_cache`, `neffbuild.apply_exports`.

Unlike the CLI it prints nothing, reads no environment variable to find the store, changes no
os.environ and leaves the garbage collector alone; failures are the typed errors of
neffbuild.errors (StoreError, IntegrityError, EnvironmentMismatch, NotFoundError, DiskError...).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Collection, Mapping, MutableMapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypedDict, Unpack

from neffbuild.host.pull import PullOptions, PullReport
from neffbuild.retry import Policy
from neffbuild.store.base import Store


class EnsureCacheOptions(TypedDict, total=False):
    """ensure_cache's optional keywords, each as its docstring describes it."""

    timeout: float | None
    allow_stale: bool
    allow_expired: bool
    host_check: bool
    env: Mapping[str, str] | None
    verify: str
    allow_env: Collection[str]
    policy: Policy | None
    trusted_keys: Collection[str | os.PathLike[str]]
    release: str | None


@dataclass(frozen=True, kw_only=True)
class _Ensure:
    """EnsureCacheOptions with their defaults."""

    timeout: float | None = None
    allow_stale: bool = False
    allow_expired: bool = False
    host_check: bool = True
    env: Mapping[str, str] | None = None
    verify: str = "fast"
    allow_env: Collection[str] = ()
    policy: Policy | None = None
    trusted_keys: Collection[str | os.PathLike[str]] = ()
    release: str | None = None


def ensure_cache(
    ref: str, *, store: str | Store, cache_dir: str | os.PathLike[str], **options: Unpack[EnsureCacheOptions]
) -> PullReport:
    """Make cache_dir hold REF's release (a tag or release id) from store (a URL or an open Store);
    a complete cache fetches nothing. The report's `exports` are what the server must export.
    The options (EnsureCacheOptions; a keyword it does not name is a TypeError):

    timeout: seconds, a wall-clock deadline on opening the store and the whole pull (pull
    --timeout): every request's socket timeouts end at it, a stalled or trickling response is cut
    when it passes, and it caps the wait for another pull's lock; past it, DeadlineExceeded (a
    StoreError). None (default): no deadline. allow_stale (default False): an unreachable store
    (StoreError) returns the release cache_dir already holds, if it is REF's and complete, with
    `stale` set; with trusted keys, only until the tag's accepted signed statement expires, unless
    allow_expired (default False; docs/security.md). host_check (default True): compare this host (env, default os.environ, read
    only) with the release first. env also holds the S3 settings when store is a URL
    (AWS_ENDPOINT_URL, credentials).
    verify: "fast" (default) trusts files whose (size, mtime) pull recorded; "full" rehashes every file.
    allow_env (default none): variables this host accepts in the release's environment beyond
    those its backend declares (pull --allow-env), with those env's NEFFBUILD_ALLOW_ENV lists; a
    stale fallback makes its exports again under the same allow, never from what the cache dir's
    state says.
    policy: how requests are retried and paced (neffbuild.retry.Policy; None: the default). The
    report counts what the store put the pull through: retries, throttled (503 SlowDown or 429
    answers), waited_s (backoff and pacing: paced_s + backoff_s), in_flight_s and paced_to (the
    rate it ended at, if throttled).
    trusted_keys: public key files (else env's NEFFBUILD_TRUSTED_KEYS): serve only what CI signed,
    fresh and never older (TrustError before anything is written; docs/security.md); release: a
    signed release id to pull instead of REF's tag (pull --release).
    """
    from neffbuild.host.exports import host_allow
    from neffbuild.host.fallback import pull_or_stale
    from neffbuild.host.trust import trust_from
    from neffbuild.store import open_store

    o = _Ensure(**_known(options))
    environ = dict(os.environ if o.env is None else o.env)  # a copy: nothing here may change the caller's

    def opened() -> Store:
        return open_store(store, env=environ) if isinstance(store, str) else store

    pull_options = PullOptions(
        allow_env=host_allow(o.allow_env, environ), host_env=environ if o.host_check else None, timeout=o.timeout,
        verify=o.verify, policy=o.policy, trust=trust_from([Path(k) for k in o.trusted_keys], environ, o.release),
    )  # fmt: skip  # arguments packed by meaning, not one a line
    return pull_or_stale(
        opened, ref, Path(cache_dir), pull_options, allow_stale=o.allow_stale, allow_expired=o.allow_expired
    )


def _known(options: EnsureCacheOptions) -> EnsureCacheOptions:
    """options, if ensure_cache has every keyword they name; else the TypeError Python raises
    for a keyword a function lacks (with the closest one it has)."""
    names = [f.name for f in fields(_Ensure)]
    for name in options:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"ensure_cache() got an unexpected keyword argument {name!r}{hint}")
    return options


def apply_exports(report: PullReport, environ: MutableMapping[str, str] | None = None) -> None:
    """Set the report's exports in environ (default os.environ). Call it before the compiler
    (torch, torch_neuronx) is imported: they read their cache variables when they load.
    The exports are checked again first (IntegrityError): variable names, no NUL, and nothing
    that decides what code runs (LD_*, PYTHON*, PATH, ...) unless the pull's host allowed it."""
    from neffbuild.host.exports import check_exports

    (os.environ if environ is None else environ).update(check_exports(report.exports, report.allowed))
