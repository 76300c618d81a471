"""A serving host's commands: pull, env, status, doctor, verify, warmup."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from neffbuild import descriptors
from neffbuild.cli.options import (
    allow_env_option,
    env_file_option,
    jobs_option,
    json_option,
    retry_policy,
    store_option,
    trust,
    trust_options,
)
from neffbuild.cli.terminal import report_after_change
from neffbuild.cli.views import Console
from neffbuild.cli.views import host as views
from neffbuild.errors import InputError

if TYPE_CHECKING:
    from neffbuild.store import StoreChoice


@click.command()
@click.argument("ref", metavar="TAG_OR_RELEASE", required=False)
@click.option("--cache-dir", required=True, type=click.Path(path_type=Path, file_okay=False), help="Cache dir to fill.")
@store_option
@jobs_option
@allow_env_option
@env_file_option
@click.option(
    "--no-host-check",
    is_flag=True,
    help="Pull even if this host's environment differs from the build's in a field that changes kernels.",
)
@click.option(
    "--lock-timeout", type=click.FloatRange(min=0), default=300.0, show_default=True, metavar="SECONDS",
    help="Give up (exit 9) if another pull holds the cache dir's lock this long; 0: at once. A dead holder's lock is dropped by the kernel.",
)  # fmt: skip  # an option's names, type and help kept together
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    metavar="SECONDS",
    help="Give up (exit 3, saying what it was doing) once the whole pull has taken this long: every request, retry and stalled read counts.",
)
@click.option(
    "--allow-stale", is_flag=True,
    help="If the store is unreachable (exit 3 only), keep the release already fully installed in --cache-dir: exit 0 with a warning. With trusted keys, only until the tag's signed statement expires (else exit 16).",
)  # fmt: skip  # an option's names, type and help kept together
@click.option(
    "--allow-expired", is_flag=True,
    help="With --allow-stale and trusted keys: keep the installed release even past its signed tag statement's expiry.",
)  # fmt: skip  # an option's names, type and help kept together
@click.option(
    "--verify", type=click.Choice(["fast", "full"]), default="fast", show_default=True,
    help="fast: trust files whose (size, mtime) match what pull recorded; full: rehash every installed file and fetch again any that differ.",
)  # fmt: skip  # an option's names, type and help kept together
@trust_options
@click.option(
    "--release", "pin", metavar="ID",
    help="With trusted keys: pull this signed release (a whole id), reading no tag (TAG_OR_RELEASE then not needed).",
)  # fmt: skip  # an option's names, type and help kept together
@json_option
def pull(
    ref: str,
    cache_dir: Path,
    store: StoreChoice,
    jobs: int | None,
    allow_env: tuple[str, ...],
    env_file: Path | None,
    no_host_check: bool,
    lock_timeout: float,
    timeout: float,
    allow_stale: bool,
    allow_expired: bool,
    verify: str,
    trusted_keys: tuple[Path, ...],
    pin: str | None,
    as_json: bool,
) -> None:
    """Materialise a release's cache files into --cache-dir (only missing ones move), after
    checking that this host would hit them (exit 7 naming each field that differs) and, with
    trusted keys, that CI signed it (exit 16 naming what failed; nothing is written)."""
    if ref is None and pin is None:
        raise InputError(
            "pull needs TAG_OR_RELEASE", hint="give a tag or release id (or --release ID with trusted keys)"
        )
    from neffbuild.host.exports import host_allow
    from neffbuild.host.fallback import pull_or_stale
    from neffbuild.host.pull import PullOptions

    options = PullOptions(
        jobs=jobs or 16, allow_env=host_allow(allow_env, os.environ), env_file=env_file,
        host_env=None if no_host_check else os.environ, lock_timeout=lock_timeout, timeout=timeout, verify=verify,
        policy=retry_policy(os.environ), trust=trust(trusted_keys, pin),
    )  # fmt: skip  # arguments packed by meaning, not one a line
    report = pull_or_stale(
        lambda: store.open(os.environ), ref, cache_dir, options, allow_stale=allow_stale, allow_expired=allow_expired
    )
    report_after_change(
        lambda: views.pull(Console(as_json), report), f"pulled {report.release_id} into {report.cache_dir}"
    )


@click.command()
@click.argument("manifest", type=click.Path(path_type=Path), required=False)
@click.option("--cache-dir", type=click.Path(path_type=Path, file_okay=False), help="Cache dir to check.")
@click.option("--replay", is_flag=True, help="Run every unit's warmup in a fresh process; fail on any compile.")
@click.option(
    "--deep", is_flag=True, help="Without MANIFEST: also read back and hash every referenced blob of --store."
)
@store_option
@click.option(
    "--outputs", type=click.Path(path_type=Path, file_okay=False), help="Replay: save each output tensor here."
)
@click.option(
    "--in-place",
    is_flag=True,
    help="Replay against --cache-dir itself, as a server reading it read-only does; refused if this process can write it.",
)
@click.option(
    "--work-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Replay: where its private copy of the cache dir goes (created if absent) [default: temp dir].",
)
@click.option(
    "--trace",
    "trace_to",
    type=click.Path(path_type=Path, dir_okay=False),
    metavar="PATH",
    help="Replay: write which cache files each unit opened to PATH (JSON), for `neffbuild show REF --unused PATH`.",
)
@click.option(
    "--fail-fast",
    is_flag=True,
    help="Replay: stop at the first miss, at its first compile (exit 6); the units after it are not replayed.",
)
@trust_options
@json_option
def verify(
    manifest: Path | None,
    cache_dir: Path | None,
    replay: bool,
    deep: bool,
    store: StoreChoice,
    outputs: Path | None,
    in_place: bool,
    work_dir: Path | None,
    trace_to: Path | None,
    fail_fast: bool,
    trusted_keys: tuple[Path, ...],
    as_json: bool,
) -> None:
    """Prove --cache-dir serves MANIFEST: check its files against the store, or --replay it
    (against a private copy: the cache dir is never written). Without MANIFEST: check --store
    itself (every reference of every record; exit 4 if one dangles or an object is damaged)."""
    from neffbuild.host.verify import ReplayHow, files_error, miss_error, verify_files, verify_replay

    console = Console(as_json)
    if in_place and not replay:
        raise InputError("--in-place is a --replay option", hint="add --replay")
    if trace_to is not None and not replay:
        raise InputError("--trace is a --replay option", hint="add --replay")
    if fail_fast and not replay:
        raise InputError("--fail-fast is a --replay option", hint="add --replay")
    if manifest is None:
        from neffbuild.maint.storecheck import check_store, store_error

        result = check_store(store.open(os.environ), deep=deep)
        views.store_check(console, result)
        error = store_error(result)
    elif cache_dir is None:
        raise InputError(
            "verify MANIFEST needs --cache-dir", hint="or give no MANIFEST and a --store to check the store itself"
        )
    elif replay:
        progress = lambda total: console.units_progress("replaying", total)  # noqa: E731
        report = verify_replay(
            manifest,
            cache_dir,
            env=os.environ,
            work_dir=work_dir,
            outputs_dir=outputs,
            progress=progress,
            how=ReplayHow(in_place=in_place, fail_fast=fail_fast),
            trace_to=trace_to,
        )
        views.replay(console, report, trace_to)
        error = miss_error(report)
    else:
        check = verify_files(manifest, cache_dir, store, env=os.environ, trust=trust(trusted_keys))
        views.check(console, check.units)
        error = files_error(check)
    if error:
        raise error


@click.command()
@click.argument("manifest", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--cache-dir", required=True, type=click.Path(path_type=Path, file_okay=False), help="The pulled cache dir."
)
@click.option("--entry", help="Warm up this model entry only [default: every entry].")
@click.option(
    "--readiness-file", type=click.Path(path_type=Path, dir_okay=False), metavar="PATH",
    help="Removed first; written (atomically) once every listed shape hit: for a readinessProbe or ExecStartPost.",
)  # fmt: skip  # an option's names, type and help kept together
@allow_env_option
@json_option
def warmup(
    manifest: Path,
    cache_dir: Path,
    entry: str | None,
    readiness_file: Path | None,
    allow_env: tuple[str, ...],
    as_json: bool,
) -> None:
    """Warm up MANIFEST's pipelines in this process against --cache-dir, as a server does with
    neffbuild.serve (prepare, then one call per listed shape); exit 6 naming each shape that
    compiled. A server that imports neffbuild calls neffbuild.serve.warmup itself."""
    from neffbuild.host.exports import host_allow
    from neffbuild.serve.warmup import warmup_cache_dir, warmup_error

    reports = warmup_cache_dir(
        manifest,
        cache_dir,
        environ=os.environ,
        entry=entry,
        allow_env=host_allow(allow_env, os.environ),
        readiness_file=readiness_file,
    )
    views.warmup(Console(as_json), reports)
    error = warmup_error(reports)
    if error:
        raise error


@click.command("env")
@click.argument("ref", metavar="[TAG_OR_RELEASE]", required=False)
@click.option("--cache-dir", required=True, type=click.Path(path_type=Path, file_okay=False))
@store_option
@allow_env_option
@env_file_option
@json_option
def env_command(
    ref: str | None,
    cache_dir: Path,
    store: StoreChoice,
    allow_env: tuple[str, ...],
    env_file: Path | None,
    as_json: bool,
) -> None:
    """Print the environment a serving process needs for the release installed in --cache-dir
    (shell `export` lines), read from the cache dir: no store needed. REF, if given, must be it."""
    from neffbuild.host.exports import host_allow
    from neffbuild.host.pull import installed_exports

    # The store is opened only for a cache dir that recorded no release (older pulls).
    allowed = host_allow(allow_env, os.environ)
    views.exports(
        Console(as_json),
        installed_exports(
            cache_dir, ref, open_store=lambda: store.open(os.environ), allow_env=allowed, env_file=env_file
        ),
    )


@click.command()
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    help="Cache dir the server will use [default: the backend's variable, else the compiler's default].",
)
@click.option(
    "--backend",
    type=click.Choice([b.name for b in descriptors.by_specificity()]),
    help="Backend to check for [default: the release's, else neuron where torch_neuronx is installed, else inductor].",
)
@click.option(
    "--release",
    "release_ref",
    metavar="FILE|TAG",
    help="Compare with a release: its JSON file, or a tag or release id in --store.",
)
@click.option(
    "--neuron-selfcheck",
    is_flag=True,
    help="Instead: settle on a Trainium host what the neuron backend infers from torch_neuronx's source "
    "(import defaults, source paths in keys, TP keys, read-only serving); compiles a probe model, skips without torch_neuronx.",
)
@store_option
@json_option
def doctor(
    cache_dir: Path | None,
    backend: str | None,
    release_ref: str | None,
    neuron_selfcheck: bool,
    store: StoreChoice,
    as_json: bool,
) -> None:
    """Check this host before it serves: backend, devices, versions, cache dir, lock dir; exit 11 if any check fails."""
    from neffbuild.host.doctor import doctor as run_doctor
    from neffbuild.host.doctor import not_ready

    if neuron_selfcheck:
        from neffbuild.host.selfcheck import neuron_selfcheck as run_selfcheck

        report = run_selfcheck(env=os.environ)
    else:
        report = run_doctor(env=os.environ, cache_dir=cache_dir, backend=backend, release_ref=release_ref, store=store)
    views.doctor(Console(as_json), report)
    if error := not_ready(report):
        raise error


@click.command()
@click.argument("ref", metavar="[MANIFEST|TAG|RELEASE]", required=False)
@click.option(
    "--cache-dir",
    required=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="Cache dir the server will use.",
)
@store_option
@click.option("--verify", "verify_digests", is_flag=True, help="Also hash every file (default: sizes only).")
@allow_env_option
@trust_options
@json_option
def status(
    ref: str | None,
    cache_dir: Path,
    store: StoreChoice,
    verify_digests: bool,
    allow_env: tuple[str, ...],
    trusted_keys: tuple[Path, ...],
    as_json: bool,
) -> None:
    """Will this host hit? Per unit of REF's release (default: the one installed in --cache-dir):
    hit, missing, stale, mismatch (the fields that differ), absent. Exit 12 unless every unit hits.
    Reads the cache dir; the store only for a release other than the installed one."""
    from neffbuild.host.exports import host_allow
    from neffbuild.host.status import status_error, status_of

    report = status_of(
        ref, cache_dir, store, env=os.environ, verify=verify_digests, allow_env=host_allow(allow_env, os.environ),
        trust=trust(trusted_keys),
    )  # fmt: skip  # arguments packed by meaning, not one a line
    views.status(Console(as_json), report)
    if error := status_error(report):
        raise error


COMMANDS: tuple[click.Command, ...] = (pull, verify, warmup, env_command, doctor, status)
