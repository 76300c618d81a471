"""The options several commands share, each handed to the command as one typed value where it
can be (a StoreChoice, a Signing, a Trust)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from neffbuild.errors import InputError

if TYPE_CHECKING:
    from neffbuild.documents.signing import Signing
    from neffbuild.host.trust import Trust
    from neffbuild.retry import Policy


_store_flag = click.option(
    "--store", "store_url", metavar="URL", help="Store directory or s3://bucket/prefix [env NEFFBUILD_STORE]."
)


endpoint_option = click.option(
    "--endpoint-url", metavar="URL", help="S3 endpoint for s3:// stores (S3-compatible servers) [env AWS_ENDPOINT_URL]."
)


def store_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """--store and --endpoint-url, for every command that opens a store: handed to the core as
    one StoreChoice (the flag beats NEFFBUILD_STORE; --endpoint-url beats AWS_ENDPOINT_URL)."""

    @functools.wraps(command)
    def run(*args: Any, store_url: str | None = None, endpoint_url: str | None = None, **kwargs: Any) -> Any:
        from neffbuild.store import StoreChoice

        return command(*args, store=StoreChoice(store_url, endpoint_url), **kwargs)

    return endpoint_option(_store_flag(run))


json_option = click.option("--json", "as_json", is_flag=True, help="Print a JSON document for machines.")


jobs_option = click.option("--jobs", "-j", type=click.IntRange(1, 256), default=None, help="Parallel workers.")


def signing_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--sign-key and --expires, handed to the core as one Signing (or None)."""

    @functools.wraps(command)
    def run(*args: Any, sign_key: Path | None = None, expires: str | None = None, **kwargs: Any) -> Any:
        return command(*args, signing=_signing(sign_key, expires), **kwargs)

    key = click.option(
        "--sign-key", type=click.Path(path_type=Path, dir_okay=False), metavar="PATH",
        help="Sign the release (a DSSE in-toto statement beside it in the store) and the tag's statement with this private key (`neffbuild keygen`).",
    )  # fmt: skip  # an option's names, type and help kept together
    expiry = click.option(
        "--expires", metavar="DURATION",
        help="With --sign-key: the signed tag statement expires after this long (7d, 12h, 30m) [default: 30d]; hosts with trusted keys refuse it after.",
    )  # fmt: skip  # an option's names, type and help kept together
    return key(expiry(run))


def _signing(sign_key: Path | None, expires: str | None) -> Signing | None:
    from neffbuild.documents.signing import DEFAULT_EXPIRY, Signing, parse_expiry, read_signing_key

    if sign_key is None:
        if expires is not None:
            raise InputError("--expires dates a signed tag statement", hint="add --sign-key PATH")
        return None
    return Signing(read_signing_key(sign_key), parse_expiry(expires or DEFAULT_EXPIRY))


def trust_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--trusted-key (repeatable; else NEFFBUILD_TRUSTED_KEYS), handed to the core as trust_keys."""
    return click.option(
        "--trusted-key", "trusted_keys", type=click.Path(path_type=Path, dir_okay=False), metavar="PUBFILE", multiple=True,
        help="Serve only releases and tags signed by this public key (repeatable: several during a rotation) [env NEFFBUILD_TRUSTED_KEYS: files separated by commas].",
    )(command)  # fmt: skip  # an option's names, type and help kept together


def trust(paths: tuple[Path, ...], pin: str | None = None) -> Trust | None:
    from neffbuild.names import TRUSTED_KEYS_ENV

    if not paths and pin is None and TRUSTED_KEYS_ENV not in os.environ:
        return None  # trust_from's answer then, without importing host/trust.py on every pull's start
    from neffbuild.host.trust import trust_from

    return trust_from(paths, os.environ, pin)


plan_file_option = click.option(
    "--plan", "plan_file", type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
    help="Use the units and keys of this plan document (`neffbuild plan --out`) instead of planning on this host.",
)  # fmt: skip  # an option's names, type and help kept together


allow_env_option = click.option(
    "--allow-env", "allow_env", metavar="NAME", multiple=True,
    help="Accept this variable in the release's environment although its backend does not declare it (repeatable) [also env NEFFBUILD_ALLOW_ENV: names separated by commas].",
)  # fmt: skip  # an option's names, type and help kept together


env_file_option = click.option(
    "--env-file", type=click.Path(path_type=Path, dir_okay=False), metavar="PATH",
    help="Also write the environment to PATH (atomically), for systemd's EnvironmentFile= or `set -a; source`.",
)  # fmt: skip  # an option's names, type and help kept together


# gc's policy: `du` reports what `gc` would free under the same flags, defaults included.
keep_option = click.option(
    "--keep",
    type=click.IntRange(0, 10**6),
    default=3,
    show_default=True,
    help="Releases of each tag's history kept besides its current one.",
)


grace_option = click.option(
    "--grace",
    default="24h",
    show_default=True,
    metavar="DURATION",
    help="Objects younger than this are kept (a publish may be in flight): 24h, 30m, 90s, 0.",
)


def retry_policy(env: Mapping[str, str]) -> Policy | None:
    """The retry policy NEFFBUILD_RETRY_SCALE asks for (every backoff and pacing time times it:
    tests and benchmarks run a storm of minutes in seconds); None: the default."""
    from neffbuild.retry.policy import DEFAULT, SCALE_ENV

    text = env.get(SCALE_ENV, "").strip()
    if not text:
        return None
    try:
        return DEFAULT.scaled(float(text))
    except ValueError:
        raise InputError(f"{SCALE_ENV}={text!r}: expected a positive number (1: the default timings)") from None
