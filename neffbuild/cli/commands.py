"""The command line: parse, call one core function, print. Errors leave through `main` only."""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from neffbuild.cli.views import Console, printed_document
from neffbuild.errors import InputError, NeffbuildError
from neffbuild.printable import printable
from neffbuild.version import __version__

if TYPE_CHECKING:
    from neffbuild.build.compile import BuildOptions
    from neffbuild.documents.signing import Signing
    from neffbuild.host.trust import Trust
    from neffbuild.retry import Policy
    from neffbuild.store import StoreChoice

_DEBUG = {"on": False}

_store_flag = click.option(
    "--store", "store_url", metavar="URL", help="Store directory or s3://bucket/prefix [env NEFFBUILD_STORE]."
)
_endpoint_flag = click.option(
    "--endpoint-url", metavar="URL", help="S3 endpoint for s3:// stores (S3-compatible servers) [env AWS_ENDPOINT_URL]."
)


def store_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """--store and --endpoint-url, for every command that opens a store: handed to the core as
    one StoreChoice (the flag beats NEFFBUILD_STORE; --endpoint-url beats AWS_ENDPOINT_URL)."""

    @functools.wraps(command)
    def run(*args: Any, store_url: str | None = None, endpoint_url: str | None = None, **kwargs: Any) -> Any:
        from neffbuild.store import StoreChoice

        return command(*args, store=StoreChoice(store_url, endpoint_url), **kwargs)

    return _endpoint_flag(_store_flag(run))


json_option = click.option("--json", "as_json", is_flag=True, help="Print a JSON document for machines.")
jobs_option = click.option("--jobs", "-j", type=click.IntRange(1, 256), default=None, help="Parallel workers.")


# `neffbuild --help` lists the commands by who runs them, in the order they run.
SECTIONS = (
    ("CI: prebuild and publish", ("plan", "build", "release", "push", "tag", "keygen", "schema", "recipe", "suggest")),
    ("A serving host", ("pull", "env", "status", "doctor", "verify", "warmup")),
    ("The store", ("ls", "show", "diff", "du", "gc")),
)


class _ByUser(click.Group):
    """A group whose help lists commands in SECTIONS (any other command last, under "Other")."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        listed = {name for _, names in SECTIONS for name in names}
        sections = [*SECTIONS, ("Other", tuple(sorted(set(self.commands) - listed)))]
        width = formatter.width - 6 - max(map(len, self.commands), default=0)
        for title, names in sections:
            rows = [(n, self.commands[n].get_short_help_str(width)) for n in names if n in self.commands]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


@click.group(cls=_ByUser, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="neffbuild")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors (and log everything).")
@click.option("-v", "--verbose", count=True, help="Log what each step does (-vv: and its details).")
@click.option("-q", "--quiet", is_flag=True, help="Log errors only.")
@click.option(
    "--log-format", type=click.Choice(["plain", "json"]), default="plain", show_default=True,
    help="json: one object per line (time, level, logger, message), for journald or CloudWatch agents.",
)  # fmt: skip
def cli(debug: bool, verbose: int, quiet: bool, log_format: str) -> None:
    """Build, publish and pull compiled-model caches for static-shape pipelines.

    manifest -> units -> bundles -> release -> tag -> cache dir
    """
    _DEBUG["on"] = debug
    level = logging.ERROR if quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose + 2 * debug, 2)]
    _log_to_stderr(level, log_format)


def signing_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--sign-key and --expires, handed to the core as one Signing (or None)."""

    @functools.wraps(command)
    def run(*args: Any, sign_key: Path | None = None, expires: str | None = None, **kwargs: Any) -> Any:
        return command(*args, signing=_signing(sign_key, expires), **kwargs)

    key = click.option(
        "--sign-key", type=click.Path(path_type=Path, dir_okay=False), metavar="PATH",
        help="Sign the release (a DSSE in-toto statement beside it in the store) and the tag's statement with this private key (`neffbuild keygen`).",
    )  # fmt: skip
    expiry = click.option(
        "--expires", metavar="DURATION",
        help="With --sign-key: the signed tag statement expires after this long (7d, 12h, 30m) [default: 30d]; hosts with trusted keys refuse it after.",
    )  # fmt: skip
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
    )(command)  # fmt: skip


def _trust(paths: tuple[Path, ...], pin: str | None = None) -> Trust | None:
    from neffbuild.host.trust import trust_from

    return trust_from(paths, os.environ, pin)


_plan_file_option = click.option(
    "--plan", "plan_file", type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
    help="Use the units and keys of this plan document (`neffbuild plan --out`) instead of planning on this host.",
)  # fmt: skip


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path))
@click.option("--entry", "entry_id", metavar="ID", help="The entry to print [default: the manifest's only entry].")
def recipe(manifest: Path, entry_id: str | None) -> None:
    """Print an entry's compile recipe as plain Python, for a server that does not import neffbuild.

    \b
    Writing it by hand instead: what must match the build: the callables compiled and
    torch.compile's mode, options, dynamic (omitted = 'auto') and fullgraph=True, the module
    changes before it, and the process settings.
    """
    from neffbuild.units.plan import recipe_code

    click.echo(recipe_code(manifest, entry_id, os.environ), nl=False)


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path))
@click.option(
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    metavar="FILE",
    help="Write the plan document (units, keys, fingerprint, manifest digest, durations) for `build --plan` and `release --plan`.",
)
@click.option(
    "--shards",
    type=click.IntRange(1, 4096),
    metavar="N",
    help="Show which units each of N shards builds and its predicted time (durations from the store's tag).",
)
@click.option("--tag", help="Tag whose release holds the durations to balance by [default: the manifest's name].")
@store_option
@json_option
def plan(
    manifest: Path, out: Path | None, shards: int | None, tag: str | None, store: StoreChoice, as_json: bool
) -> None:
    """Show the build units of MANIFEST and their keys, without compiling."""
    if out is None and shards is None:
        from neffbuild.documents.manifest import load_manifest
        from neffbuild.units.plan import make_plan
        from neffbuild.units.plancache import cache_dir

        Console(as_json).plan(make_plan(load_manifest(manifest), os.environ, cache=cache_dir(os.environ)))
        return
    from neffbuild.build.fleet import plan_fleet
    from neffbuild.cli.views.ci import print_fleet_plan

    print_fleet_plan(Console(as_json), plan_fleet(manifest, store, env=os.environ, shards=shards, out=out, tag=tag))


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path))
@store_option
@click.option("--tag", help="Tag to move when every unit is built [default: the manifest's name].")
@jobs_option
@click.option(
    "--work-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Scratch space for compiles (created if absent); failed units' logs go to its logs/ [default: temp dir; logs in .neffbuild/logs].",
)
@click.option("--keep-work", is_flag=True, help="Keep each unit's scratch dir (cache, job, log).")
@click.option(
    "--shard",
    "shard_text",
    metavar="I/N",
    help="Build only shard I (from 0) of N; the release is left to `neffbuild release` [default: from JOB_COMPLETION_INDEX or AWS_BATCH_JOB_ARRAY_INDEX].",
)
@click.option(
    "--shards",
    "shard_count",
    type=click.IntRange(1, 4096),
    metavar="N",
    help="The shard count, with the index from the engine's environment (JOB_COMPLETION_INDEX) [default: NEFFBUILD_SHARDS, AWS_BATCH_JOB_ARRAY_SIZE, or --plan's].",
)
@click.option(
    "--plan", "plan_file", type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
    help="The fleet's plan document (`neffbuild plan --out`): this host must give its keys (exit 7 naming the facts that differ); its durations balance the shards.",
)  # fmt: skip
@click.option(
    "--retries",
    type=click.IntRange(0, 100),
    default=0,
    show_default=True,
    help="Build a failing unit again up to this many times.",
)
@click.option(
    "--report",
    "report_file",
    type=click.Path(path_type=Path, dir_okay=False),
    metavar="FILE",
    help="Write a JSON report of every unit (also appended as Markdown to $GITHUB_STEP_SUMMARY when set).",
)
@click.option(
    "--unit-memory", metavar="SIZE|auto",
    help="Memory one unit's compile needs (e.g. 6GiB; auto: each unit's recorded peak + 25%, else 8GiB): a worker starts only while the units running fit in the memory budget [default: bounded by --jobs only].",
)  # fmt: skip
@click.option(
    "--memory-budget", metavar="SIZE",
    help="Memory the units may share, with --unit-memory [default: what is available when the build starts, within the cgroup's limit].",
)  # fmt: skip
@click.option(
    "--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
    help="Build each unit as a task on a Ray cluster (ADDRESS, e.g. auto or ray://head:10001; alone: a local Ray instance), then release [needs neffbuild[ray]].",
)  # fmt: skip
@signing_options
@json_option
def build(
    manifest: Path, store: StoreChoice, tag: str | None, jobs: int | None, work_dir: Path | None, keep_work: bool,
    shard_text: str | None, shard_count: int | None, plan_file: Path | None, retries: int, report_file: Path | None,
    unit_memory: str | None, memory_budget: str | None, ray_address: str | None, signing: Signing | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Warmup-compile every unit of MANIFEST (or one shard's), publish bundles; a build of every
    unit then publishes a release and moves its tag."""
    from neffbuild.build.compile import BuildOptions, FleetChoice, build_manifest, failure
    from neffbuild.runner.memory import parse_size
    from neffbuild.units.shards import parse_shard

    console = Console(as_json)
    if memory_budget is not None and unit_memory is None:
        raise InputError("--memory-budget: it bounds --unit-memory's shares", hint="give --unit-memory SIZE too")
    options = BuildOptions(
        tag=tag, jobs=jobs or 1, work_dir=work_dir, keep_work=keep_work, retries=retries,
        unit_memory=parse_size(unit_memory, "--unit-memory") if unit_memory and unit_memory != "auto" else None,
        memory_auto=unit_memory == "auto",
        memory_budget=parse_size(memory_budget, "--memory-budget") if memory_budget is not None else None,
        signing=signing,
    )  # fmt: skip
    if ray_address is not None:
        if shard_text or shard_count or plan_file:
            raise InputError("--ray: Ray places every unit itself", hint="drop --shard, --shards and --plan")
        _build_on_ray(manifest, store, options, ray_address, report_file, Console(as_json))
        return
    fleet = FleetChoice(
        shard=parse_shard(shard_text) if shard_text is not None else None,
        shard_count=shard_count,
        plan_file=plan_file,
        report_file=report_file,
    )
    report = build_manifest(
        manifest,
        store,
        env=os.environ,
        options=options,
        fleet=fleet,
        progress=lambda total: console.units_progress("building", total),
    )
    console.build(report)
    if report.failed:
        raise failure(report)


def _build_on_ray(
    manifest: Path, store: StoreChoice, options: BuildOptions, address: str, report_file: Path | None, console: Console
) -> None:
    from neffbuild.build.fanin import incomplete
    from neffbuild.build.rayfleet import build_on_ray

    result = build_on_ray(manifest, store, env=os.environ, options=options, address=address, report_file=report_file)
    if result.release.missing:
        console.release(result.release)
        raise incomplete(result.release)
    _report_after_change(lambda: console.release(result.release), f"released {result.release.release_id}")


@cli.command("release")
@click.argument("manifest", type=click.Path(path_type=Path))
@store_option
@click.option("--tag", help="Tag to move [default: the manifest's name].")
@_plan_file_option
@click.option(
    "--shard-report",
    "shard_reports",
    type=click.Path(path_type=Path, dir_okay=False),
    multiple=True,
    metavar="FILE",
    help="A shard's `build --report` (repeatable): merged into --report and the step summary.",
)
@click.option(
    "--report",
    "report_file",
    type=click.Path(path_type=Path, dir_okay=False),
    metavar="FILE",
    help="Write the merged JSON report (also appended as Markdown to $GITHUB_STEP_SUMMARY when set).",
)
@signing_options
@json_option
def release_command(
    manifest: Path,
    store: StoreChoice,
    tag: str | None,
    plan_file: Path | None,
    shard_reports: tuple[Path, ...],
    report_file: Path | None,
    signing: Signing | None,
    as_json: bool,
) -> None:
    """Fan-in: once every unit of MANIFEST has a bundle in the store (from any shard), publish the
    release and move the tag; otherwise name the units still missing (exit 14), releasing nothing."""
    from neffbuild.build.fanin import incomplete, release_and_report

    result = release_and_report(
        manifest,
        store,
        env=os.environ,
        tag=tag,
        plan_file=plan_file,
        shard_reports=shard_reports,
        report_file=report_file,
        signing=signing,
    )
    if result.missing:
        Console(as_json).release(result)
        raise incomplete(result)
    _report_after_change(lambda: Console(as_json).release(result), f"released {result.release_id}")


_allow_env_option = click.option(
    "--allow-env", "allow_env", metavar="NAME", multiple=True,
    help="Accept this variable in the release's environment although its backend does not declare it (repeatable) [also env NEFFBUILD_ALLOW_ENV: names separated by commas].",
)  # fmt: skip
_env_file_option = click.option(
    "--env-file", type=click.Path(path_type=Path, dir_okay=False), metavar="PATH",
    help="Also write the environment to PATH (atomically), for systemd's EnvironmentFile= or `set -a; source`.",
)  # fmt: skip


@cli.command()
@click.argument("ref", metavar="TAG_OR_RELEASE", required=False)
@click.option("--cache-dir", required=True, type=click.Path(path_type=Path, file_okay=False), help="Cache dir to fill.")
@store_option
@jobs_option
@_allow_env_option
@_env_file_option
@click.option(
    "--no-host-check",
    is_flag=True,
    help="Pull even if this host's environment differs from the build's in a field that changes kernels.",
)
@click.option(
    "--lock-timeout", type=click.FloatRange(min=0), default=300.0, show_default=True, metavar="SECONDS",
    help="Give up (exit 9) if another pull holds the cache dir's lock this long; 0: at once. A dead holder's lock is dropped by the kernel.",
)  # fmt: skip
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
)  # fmt: skip
@click.option(
    "--allow-expired", is_flag=True,
    help="With --allow-stale and trusted keys: keep the installed release even past its signed tag statement's expiry.",
)  # fmt: skip
@click.option(
    "--verify", type=click.Choice(["fast", "full"]), default="fast", show_default=True,
    help="fast: trust files whose (size, mtime) match what pull recorded; full: rehash every installed file and fetch again any that differ.",
)  # fmt: skip
@trust_options
@click.option(
    "--release", "pin", metavar="ID",
    help="With trusted keys: pull this signed release (a whole id), reading no tag (TAG_OR_RELEASE then not needed).",
)  # fmt: skip
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
        policy=retry_policy(os.environ), trust=_trust(trusted_keys, pin),
    )  # fmt: skip
    report = pull_or_stale(
        lambda: store.open(os.environ), ref, cache_dir, options, allow_stale=allow_stale, allow_expired=allow_expired
    )
    _report_after_change(lambda: Console(as_json).pull(report), f"pulled {report.release_id} into {report.cache_dir}")


def retry_policy(env: Mapping[str, str]) -> Policy | None:
    """The retry policy NEFFBUILD_RETRY_SCALE asks for (every backoff and pacing time times it:
    tests and benchmarks run a storm of minutes in seconds); None: the default."""
    from neffbuild.retry import DEFAULT, SCALE_ENV

    text = env.get(SCALE_ENV, "").strip()
    if not text:
        return None
    try:
        return DEFAULT.scaled(float(text))
    except ValueError:
        raise InputError(f"{SCALE_ENV}={text!r}: expected a positive number (1: the default timings)") from None


@cli.command()
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
    trusted_keys: tuple[Path, ...],
    as_json: bool,
) -> None:
    """Prove --cache-dir serves MANIFEST: check its files against the store, or --replay it
    (against a private copy: the cache dir is never written). Without MANIFEST: check --store
    itself (every reference of every record; exit 4 if one dangles or an object is damaged)."""
    from neffbuild.host.verify import files_error, miss_error, verify_files, verify_replay

    console = Console(as_json)
    if in_place and not replay:
        raise InputError("--in-place is a --replay option", hint="add --replay")
    if trace_to is not None and not replay:
        raise InputError("--trace is a --replay option", hint="add --replay")
    if manifest is None:
        from neffbuild.cli.views.host import print_store_check
        from neffbuild.maint.storecheck import check_store, store_error

        result = check_store(store.open(os.environ), deep=deep)
        print_store_check(console, result)
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
            in_place=in_place,
            trace_to=trace_to,
        )
        console.replay(report, trace_to)
        error = miss_error(report)
    else:
        check = verify_files(manifest, cache_dir, store, env=os.environ, trust=_trust(trusted_keys))
        console.check(check.units)
        error = files_error(check)
    if error:
        raise error


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--cache-dir", required=True, type=click.Path(path_type=Path, file_okay=False), help="The pulled cache dir."
)
@click.option("--entry", help="Warm up this model entry only [default: every entry].")
@click.option(
    "--readiness-file", type=click.Path(path_type=Path, dir_okay=False), metavar="PATH",
    help="Removed first; written (atomically) once every listed shape hit: for a readinessProbe or ExecStartPost.",
)  # fmt: skip
@_allow_env_option
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
    Console(as_json).warmup(reports)
    error = warmup_error(reports)
    if error:
        raise error


@cli.command("env")
@click.argument("ref", metavar="[TAG_OR_RELEASE]", required=False)
@click.option("--cache-dir", required=True, type=click.Path(path_type=Path, file_okay=False))
@store_option
@_allow_env_option
@_env_file_option
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
    from neffbuild.host.pull import serving_env

    # The store is opened only for a cache dir that recorded no release (older pulls).
    allowed = host_allow(allow_env, os.environ)
    Console(as_json).exports(
        serving_env(cache_dir, ref, open_store=lambda: store.open(os.environ), allow_env=allowed, env_file=env_file)
    )


@cli.command()
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    help="Cache dir the server will use [default: the backend's variable, else the compiler's default].",
)
@click.option(
    "--backend",
    type=click.Choice(["neuron", "inductor"]),
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
    Console(as_json).doctor(report)
    if error := not_ready(report):
        raise error


@cli.command()
@click.argument("ref", metavar="TAG_OR_RELEASE")
@click.option("--from", "from_url", required=True, metavar="URL", help="Store to copy from (directory or s3://).")
@click.option("--to", "to_url", required=True, metavar="URL", help="Store to copy to; created if absent.")
@_endpoint_flag
@jobs_option
@signing_options
@json_option
def push(
    ref: str,
    from_url: str,
    to_url: str,
    endpoint_url: str | None,
    jobs: int | None,
    signing: Signing | None,
    as_json: bool,
) -> None:
    """Copy a release, its signatures and its tag to another store, uploading only what that store lacks."""
    from neffbuild.build.push import push_between
    from neffbuild.store import StoreChoice

    result = push_between(
        ref, StoreChoice(from_url, endpoint_url), StoreChoice(to_url, endpoint_url), env=os.environ, jobs=jobs or 16,
        signing=signing,
    )  # fmt: skip
    _report_after_change(lambda: Console(as_json).push(result), f"pushed release {result.release_id}")


@cli.command()
@click.argument("name")
@click.argument("release_id", metavar="RELEASE")
@store_option
@signing_options
@json_option
def tag(name: str, release_id: str, store: StoreChoice, signing: Signing | None, as_json: bool) -> None:
    """Point tag NAME at RELEASE (a release id, e.g. from the tag's history): rollback. With
    --sign-key, also (re-)sign it: a new statement version, a new expiry."""
    from neffbuild.build.publish import move_tag

    record = move_tag(store.open(os.environ), name, release_id, signing=signing)
    _report_after_change(lambda: Console(as_json).tag(record), f"tag {record.name} -> {record.release}")


@cli.command()
@click.argument("name")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
def keygen(name: str, path: Path) -> None:
    """Write a new Ed25519 signing key NAME (e.g. ci.example-1; bump the suffix on rotation) to
    PATH (mode 0600) and its public key to PATH.pub, both one line NAME:base64."""
    from neffbuild.documents.signing import generate_key, write_key_pair

    public = write_key_pair(generate_key(name), path)
    click.echo(
        f"wrote {printable(str(path))} (private: give it to CI's --sign-key) and {printable(str(public))} (to hosts' --trusted-key)",
        err=True,
    )


@cli.command()
def schema() -> None:
    """Print the manifest's JSON schema."""
    from neffbuild.documents.manifest import manifest_json_schema

    click.echo(json.dumps(manifest_json_schema(), indent=2))


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path))
@click.argument("events", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--write", is_flag=True, help="Apply the change to MANIFEST in place (comments and layout kept).")
@json_option
def suggest(manifest: Path, events: tuple[Path, ...], write: bool, as_json: bool) -> None:
    """Turn serving hosts' compile events (neffbuild.serve.guard's EVENTS files) into the shapes
    MANIFEST lacks: a TOML diff on stdout, a summary (and what no shape explains) on stderr. Exit 0
    whether or not there is something to add."""
    from neffbuild.maint.suggest import suggest as suggest_shapes

    result = suggest_shapes(manifest, events, env=os.environ, write=write)
    if result.written:
        _report_after_change(lambda: Console(as_json).suggestion(result), f"wrote {manifest}")
    else:
        Console(as_json).suggestion(result)


# ---- status -------------------------------------------------------------------------------


@cli.command()
@click.argument("ref", metavar="[MANIFEST|TAG|RELEASE]", required=False)
@click.option(
    "--cache-dir",
    required=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="Cache dir the server will use.",
)
@store_option
@click.option("--verify", "verify_digests", is_flag=True, help="Also hash every file (default: sizes only).")
@_allow_env_option
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
    from neffbuild.cli.views.host import print_status
    from neffbuild.host.exports import host_allow
    from neffbuild.host.status import status_error, status_of

    report = status_of(
        ref, cache_dir, store, env=os.environ, verify=verify_digests, allow_env=host_allow(allow_env, os.environ),
        trust=_trust(trusted_keys),
    )  # fmt: skip
    print_status(Console(as_json), report)
    if error := status_error(report):
        raise error


# ---- inspection: ls, show, diff, du (neffbuild/inspect/) -----------------------------------------


@cli.command("ls")
@click.option("--tag", "tag_name", metavar="NAME", help="Show this tag's history (NAME@N names each release) instead.")
@store_option
@json_option
def ls_command(tag_name: str | None, store: StoreChoice, as_json: bool) -> None:
    """List the store's tags and releases, newest first."""
    from neffbuild.cli.views import store as output
    from neffbuild.inspect.ls import list_store, tag_history

    opened = store.open(os.environ)
    if tag_name is not None:
        output.tag_history(Console(as_json), tag_history(opened, tag_name))
    else:
        output.listing(Console(as_json), list_store(opened))


@cli.command("show")
@click.argument("ref", metavar="REF")
@click.option(
    "--unused",
    "trace",
    type=click.Path(path_type=Path, dir_okay=False),
    metavar="TRACE",
    help="List REF's files that no unit opened in this replay trace (`verify --replay --trace TRACE`), largest first.",
)
@store_option
@json_option
def show_command(ref: str, trace: Path | None, store: StoreChoice, as_json: bool) -> None:
    """Show a release's units (REF: TAG, TAG@N, release id or prefix) or a bundle's files (its key)."""
    from neffbuild.cli.views import store as output

    if trace is not None:
        from neffbuild.inspect.unused import unused

        output.unused_files(Console(as_json), unused(store.open(os.environ), ref, trace))
        return
    from neffbuild.inspect.show import show

    output.shown_ref(Console(as_json), show(store.open(os.environ), ref))


@cli.command("diff")
@click.argument("old_ref", metavar="A", required=False)
@click.argument("new_ref", metavar="B", required=False)
@click.option(
    "--host",
    "host_ref",
    metavar="REF",
    help="Compare release REF with this host instead (as `status` judges it), no A and B.",
)
@store_option
@json_option
def diff_command(
    old_ref: str | None, new_ref: str | None, host_ref: str | None, store: StoreChoice, as_json: bool
) -> None:
    """What changed from release A to release B (or bundle to bundle): units, the fields behind each
    changed key (old -> new), files. With --host REF: each unit's fingerprint fields that differ
    between REF's build and this host (with the release's exports applied), breaking or not."""
    from neffbuild.cli.views import store as output
    from neffbuild.inspect.diff import diff, diff_host

    if host_ref is not None:
        if old_ref is not None:
            raise InputError(
                f"diff --host {host_ref} takes no A or B (got {old_ref!r})",
                hint="neffbuild diff --host REF, or neffbuild diff A B",
            )
        output.host_differences(Console(as_json), diff_host(store.open(os.environ), host_ref, os.environ))
        return
    if old_ref is None or new_ref is None:
        raise InputError(
            "diff needs two references A and B, or --host REF",
            hint="e.g. neffbuild diff klein@1 klein, or neffbuild diff --host klein",
        )
    output.differences(Console(as_json), diff(store.open(os.environ), old_ref, new_ref))


# gc's policy: `du` reports what `gc` would free under the same flags, defaults included.
_keep_option = click.option(
    "--keep",
    type=click.IntRange(0, 10**6),
    default=3,
    show_default=True,
    help="Releases of each tag's history kept besides its current one.",
)
_grace_option = click.option(
    "--grace",
    default="24h",
    show_default=True,
    metavar="DURATION",
    help="Objects younger than this are kept (a publish may be in flight): 24h, 30m, 90s, 0.",
)


@cli.command("du")
@store_option
@_keep_option
@_grace_option
@json_option
def du_command(store: StoreChoice, keep: int, grace: str, as_json: bool) -> None:
    """Bytes the store holds by tag, release, model entry and toolchain, what dedup saves, and
    what `gc` would free under --keep and --grace."""
    from neffbuild.cli.views import store as output
    from neffbuild.inspect.du import disk_usage
    from neffbuild.maint.gc import Policy, parse_duration, reclaimable

    policy = Policy(keep=keep, grace_s=parse_duration(grace))
    output.usage(Console(as_json), disk_usage(store.open(os.environ), reclaim=reclaimable(policy)))


# ---- gc and verify --store ------------------------------------------------------------------


@cli.command("gc")
@store_option
@_keep_option
@_grace_option
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Prune this host cache dir to its installed release instead of a store.",
)
@click.option("--dry-run", is_flag=True, help="Print what would be deleted; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Delete without asking (required without a terminal).")
@jobs_option
@json_option
def gc_command(
    store: StoreChoice,
    keep: int,
    grace: str,
    cache_dir: Path | None,
    dry_run: bool,
    yes: bool,
    jobs: int | None,
    as_json: bool,
) -> None:
    """Delete what no tag reaches (mark and sweep), or prune a host's --cache-dir."""
    from neffbuild.cli.views.store import print_cache_prune, print_gc_plan, print_gc_result

    console = Console(as_json)
    if cache_dir is not None:
        from neffbuild.host.prune import prune_cache_dir

        opened = store.open(os.environ) if store.url else None
        planned = prune_cache_dir(cache_dir, store=opened, dry_run=True)
        if (
            not dry_run
            and planned.remove
            and _confirmed(yes, f"delete {len(planned.remove)} files from {planned.cache_dir}?")
        ):
            planned = prune_cache_dir(cache_dir, store=opened)
        _report_after_change(lambda: print_cache_prune(console, planned), f"pruned {planned.cache_dir}")
        return
    from neffbuild.maint.gc import Policy, parse_duration, plan_gc, sweep

    policy = Policy(keep=keep, grace_s=parse_duration(grace))
    opened = store.open(os.environ)
    plan = plan_gc(opened, policy, jobs=jobs or 32)
    if dry_run or not plan.delete:
        _report_after_change(lambda: print_gc_plan(console, plan), f"planned gc of {plan.store}")
        return
    if not as_json:  # what it is about to delete: not printable (stdout closed) is no reason to stop
        _report_after_change(lambda: print_gc_plan(console, plan), f"planned deleting {plan.delete_objects} objects")
    if _confirmed(yes, f"delete {plan.delete_objects} objects from {plan.store}?"):
        result = sweep(opened, plan, policy, jobs=jobs or 32)
        _report_after_change(
            lambda: print_gc_result(console, result), f"deleted {len(result.deleted)} objects from {plan.store}"
        )


def _confirmed(yes: bool, question: str) -> bool:
    """--yes, or a yes typed at a terminal; without a terminal and without --yes: bad input (2)."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise InputError(
            "refusing to delete without confirmation: no terminal to ask on",
            hint="pass --yes, or --dry-run to see the plan",
        )
    return click.confirm(printable(question), default=False, err=True)


def _stdout_to_devnull() -> None:
    """What is left in stdout's buffer goes nowhere: flushing it into a closed pipe at exit
    would make Python itself exit 120."""
    if sys.stdout is None:  # started with fd 1 closed: Python has no stdout at all
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _lines(text: str) -> str:
    """Multi-line text (a traceback, a log record) with each line sanitised."""
    return "\n".join(printable(line) for line in text.splitlines())


class _PrintableFormatter(logging.Formatter):
    """Log records name stores, paths and units: each line passes the sanitiser."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return _lines(text)


class _JsonFormatter(logging.Formatter):
    """One JSON object per record and line; the strings exact (JSON escapes what a terminal acts on)."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["traceback"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def _log_to_stderr(level: int, log_format: str = "plain") -> None:
    """The library logs through `logging` (never prints): the CLI shows its records on stderr."""
    logger = logging.getLogger("neffbuild")
    handler = next((h for h in logger.handlers if getattr(h, "neffbuild_cli", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.neffbuild_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    handler.setFormatter(_JsonFormatter() if log_format == "json" else _PrintableFormatter())
    logger.setLevel(level)
    # diffusers imports torchao where it is installed (the quantize extra), and that import warns
    # on every plan, through three libraries' own handlers: torchao's CUDA-only kernels did not
    # load on a CPU host, torch deprecates its Enum pytree constant, diffusers 0.42 misses a
    # torchao 0.18 class it only needs to load torchao checkpoints. None is this command's news.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    for name in _IMPORT_NOISE:
        noisy = logging.getLogger(name)
        if not any(isinstance(f, _ImportNoise) for f in noisy.filters):
            noisy.addFilter(_ImportNoise())


_IMPORT_NOISE = {
    "torch.utils._pytree": "register_constant() on Enum subclasses",
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects",
}


class _ImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _IMPORT_NOISE.get(record.name, "\0") not in record.getMessage()


class _StdoutClosed(Exception):
    """The process started with no stdout (fd 1 closed)."""


def _report_after_change(show: Callable[[], None], done: str) -> None:
    """Print a command's report after it changed a store or a cache dir: a failure to print
    (a closed pipe, an encoding) is said on stderr and the command still exits 0, since the
    exit code says what happened to the data, and that happened."""
    try:
        if sys.stdout is None:
            raise _StdoutClosed
        show()
        sys.stdout.flush()  # here, not at exit: a closed pipe is this command's to report
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a printing failure (rich exits 1 on a closed pipe)
        if _DEBUG["on"] and not isinstance(exc, _StdoutClosed):
            _print_traceback()
        _stdout_to_devnull()
        try:
            why = (
                "BrokenPipeError: stdout was closed"
                if isinstance(exc, SystemExit)
                else "stdout is closed"
                if isinstance(exc, _StdoutClosed)
                else f"{type(exc).__name__}: {exc}"
            )
            sys.stderr.write(printable(f"warning: {done}, but its report could not be printed: {why}") + "\n")
        except Exception:  # noqa: BLE001, S110 - stderr is gone too: the exit code is all that is left
            pass


def main(argv: list[str] | None = None) -> None:
    """The one exit point: typed errors become one line plus a hint and their exit code."""
    # What start-up imported lives as long as the process: keep it out of every later garbage
    # collection (those run often while thousands of small files land, and scanned it all).
    gc.freeze()
    args = sys.argv[1:] if argv is None else argv
    code = _run(lambda: cli.main(args=args, prog_name="neffbuild", standalone_mode=False), as_json="--json" in args)
    sys.exit(code)


def _run(invoke: Callable[[], Any], *, as_json: bool = False) -> int:
    try:
        invoke()
        return 0
    except NeffbuildError as exc:
        _print_error(exc.message, exc.hint, exc.details, exc.debug_detail)
        if (
            as_json and not printed_document()
        ):  # machines read stdout: the failure as a document too (the lines above stay for logs)
            error = {"error": exc.message, "kind": type(exc).__name__, "exit_code": exc.exit_code, "hint": exc.hint}
            if exc.details:
                error["details"] = [line.strip() for line in exc.details]
            sys.stdout.write(json.dumps(error, indent=2) + "\n")
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    except Exception as exc:  # noqa: BLE001 - the last resort keeps output to one line
        _print_error(
            f"internal error: {type(exc).__name__}: {exc}", "rerun with --debug for a traceback, and report it"
        )
        return 1


def _print_traceback() -> None:
    """The traceback being handled, each line sanitised: its messages carry store strings too."""
    sys.stderr.write(_lines(traceback.format_exc().rstrip()) + "\n")


def _print_error(
    message: str, hint: str | None, details: tuple[str, ...] = (), debug_detail: str | None = None
) -> None:
    if _DEBUG["on"]:
        _print_traceback()
        if debug_detail:
            click.echo(f"the worker's traceback:\n{_lines(debug_detail.rstrip())}", err=True)
    # Messages carry names from stores, state files and paths: each line passes the sanitiser.
    click.secho(f"error: {printable(message)}", fg="red", err=True)
    for line in details:
        click.echo(printable(line), err=True)
    if hint:
        click.echo(f"hint: {printable(hint)}", err=True)
