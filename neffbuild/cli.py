"""The command line: parse, call one core function, print. Errors leave through `main` only."""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from neffbuild import __version__
from neffbuild.errors import InputError, NeffbuildError
from neffbuild.output import Console

_DEBUG = {"on": False}

_store_flag = click.option(
    "--store", "store_url", metavar="URL", help="Store directory or s3://bucket/prefix [env NEFFBUILD_STORE]."
)
_endpoint_flag = click.option(
    "--endpoint-url", metavar="URL", help="S3 endpoint for s3:// stores (S3-compatible servers) [env AWS_ENDPOINT_URL]."
)


def _with_endpoint(command: Callable[..., Any]) -> Callable[..., Any]:
    """Commands pass os.environ to open_store; --endpoint-url enters there, beating AWS_ENDPOINT_URL."""

    @functools.wraps(command)
    def run(*args: Any, endpoint_url: str | None = None, **kwargs: Any) -> Any:
        if endpoint_url:
            os.environ["AWS_ENDPOINT_URL"] = endpoint_url
        return command(*args, **kwargs)

    return run


def store_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """--store and --endpoint-url, for every command that opens a store."""
    return _endpoint_flag(_with_endpoint(_store_flag(command)))


json_option = click.option("--json", "as_json", is_flag=True, help="Print a JSON document for machines.")
jobs_option = click.option("--jobs", "-j", type=click.IntRange(1, 256), default=None, help="Parallel workers.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="neffbuild")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def cli(debug: bool) -> None:
    """Build, publish and pull compiled-model caches for static-shape pipelines.

    manifest -> units -> bundles -> release -> tag -> cache dir
    """
    _DEBUG["on"] = debug


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path))
@json_option
def plan(manifest: Path, as_json: bool) -> None:
    """Show the build units of MANIFEST and their keys, without compiling."""
    from neffbuild.manifest import load_manifest
    from neffbuild.plan import make_plan

    the_plan = make_plan(load_manifest(manifest), os.environ)
    Console(as_json).plan(the_plan)


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
@json_option
def build(manifest: Path, store_url: str | None, tag: str | None, jobs: int | None, work_dir: Path | None, keep_work: bool, as_json: bool) -> None:
    """Warmup-compile every unit of MANIFEST, publish bundles, then a release and its tag."""
    from neffbuild.build import build as run_build
    from neffbuild.build import failure
    from neffbuild.manifest import load_manifest
    from neffbuild.plan import check_buildable, make_plan
    from neffbuild.store import open_store, resolve_store_url

    loaded = load_manifest(manifest)
    the_plan = make_plan(loaded, os.environ)
    check_buildable(the_plan)  # before the store is created: a refused build leaves nothing behind
    store = open_store(resolve_store_url(store_url, os.environ, loaded.manifest.store), create=True, env=os.environ)
    console = Console(as_json)
    with console.units_progress("building", len(the_plan.units)) as notify:
        report = run_build(
            the_plan,
            store,
            env=os.environ,
            tag=tag,
            jobs=jobs or 1,
            work_dir=work_dir,
            keep_work=keep_work,
            logs_dir=_logs_dir(work_dir),
            notify=notify,
        )
    console.build(report)
    if report.failed:
        raise failure(report)


def _logs_dir(work_dir: Path | None) -> Path:
    from neffbuild.jobs import DEFAULT_LOGS_DIR

    return work_dir / "logs" if work_dir else DEFAULT_LOGS_DIR


_allow_env_option = click.option(
    "--allow-env", "allow_env", metavar="NAME", multiple=True,
    help="Accept this variable in the release's environment although its backend does not declare it (repeatable).",
)  # fmt: skip
_env_file_option = click.option(
    "--env-file", type=click.Path(path_type=Path, dir_okay=False), metavar="PATH",
    help="Also write the environment to PATH (atomically), for systemd's EnvironmentFile= or `set -a; source`.",
)  # fmt: skip


@cli.command()
@click.argument("ref", metavar="TAG_OR_RELEASE")
@click.option("--cache-dir", required=True, type=click.Path(path_type=Path, file_okay=False), help="Cache dir to fill.")
@store_option
@jobs_option
@_allow_env_option
@_env_file_option
@json_option
def pull(ref: str, cache_dir: Path, store_url: str | None, jobs: int | None, allow_env: tuple[str, ...], env_file: Path | None, as_json: bool) -> None:
    """Materialise a release's cache files into --cache-dir (only missing ones move)."""
    from neffbuild.pull import pull as run_pull
    from neffbuild.store import open_store, resolve_store_url

    store = open_store(resolve_store_url(store_url, os.environ), env=os.environ)
    report = run_pull(store, ref, cache_dir, jobs=jobs or 16, allow_env=allow_env, env_file=env_file)
    Console(as_json).pull(report)


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path), required=False)
@click.option("--cache-dir", type=click.Path(path_type=Path, file_okay=False), help="Cache dir to check.")
@click.option("--replay", is_flag=True, help="Run every unit's warmup in a fresh process; fail on any compile.")
@click.option("--deep", is_flag=True, help="Without MANIFEST: also read back and hash every referenced blob of --store.")
@store_option
@click.option("--outputs", type=click.Path(path_type=Path, file_okay=False), help="Replay: save each output tensor here.")
@click.option(
    "--work-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Replay: where its private copy of the cache dir goes (created if absent) [default: temp dir].",
)
@json_option
def verify(
    manifest: Path | None, cache_dir: Path | None, replay: bool, deep: bool, store_url: str | None, outputs: Path | None, work_dir: Path | None, as_json: bool
) -> None:
    """Prove --cache-dir serves MANIFEST: check its files against the store, or --replay it
    (against a private copy: the cache dir is never written). Without MANIFEST: check --store
    itself (every reference of every record; exit 4 if one dangles or an object is damaged)."""
    if manifest is None:
        return _verify_store(store_url, deep, as_json)
    if cache_dir is None:
        raise InputError("verify MANIFEST needs --cache-dir", hint="or give no MANIFEST and a --store to check the store itself")
    from neffbuild.manifest import load_manifest
    from neffbuild.plan import make_plan

    loaded = load_manifest(manifest)
    the_plan = make_plan(loaded, os.environ)
    if not cache_dir.is_dir():
        raise InputError(f"--cache-dir {cache_dir}: no such directory", hint="pull into it first")
    console = Console(as_json)
    if replay:
        from neffbuild.verify import miss_error
        from neffbuild.verify import replay as run_replay

        with console.units_progress("replaying", len(the_plan.units)) as notify:
            report = run_replay(
                the_plan, cache_dir, env=os.environ, work_dir=work_dir, outputs_dir=outputs, logs_dir=_logs_dir(work_dir), notify=notify
            )
        console.replay(report)
        if error := miss_error(report):
            raise error
        return
    from neffbuild.store import open_store, resolve_store_url
    from neffbuild.verify import check_files, files_error

    store = open_store(resolve_store_url(store_url, os.environ, loaded.manifest.store), env=os.environ)
    results = check_files(the_plan, store, cache_dir)
    console.check(results)
    if error := files_error(results, cache_dir, store.url):
        raise error


@cli.command("env")
@click.argument("ref", metavar="TAG_OR_RELEASE")
@click.option("--cache-dir", required=True, type=click.Path(path_type=Path, file_okay=False))
@store_option
@_allow_env_option
@_env_file_option
@json_option
def env_command(ref: str, cache_dir: Path, store_url: str | None, allow_env: tuple[str, ...], env_file: Path | None, as_json: bool) -> None:
    """Print the environment a serving process needs for REF's cache (shell `export` lines)."""
    from neffbuild.pull import serving_env
    from neffbuild.store import open_store, resolve_store_url

    store = open_store(resolve_store_url(store_url, os.environ), env=os.environ)
    Console(as_json).exports(serving_env(store, ref, cache_dir, allow_env=allow_env, env_file=env_file))


@cli.command()
@click.option("--cache-dir", type=click.Path(path_type=Path), help="Cache dir the server will use [default: the backend's variable, else the compiler's default].")
@click.option("--backend", type=click.Choice(["neuron", "inductor"]), help="Backend to check for [default: the release's, else neuron where torch_neuronx is installed, else inductor].")
@click.option("--release", "release_ref", metavar="FILE|TAG", help="Compare with a release: its JSON file, or a tag or release id in --store.")
@store_option
@json_option
def doctor(cache_dir: Path | None, backend: str | None, release_ref: str | None, store_url: str | None, as_json: bool) -> int:
    """Check this host before it serves: backend, devices, versions, cache dir; exit 11 if any check fails."""
    from neffbuild.doctor import load_release, run_doctor
    from neffbuild.store import resolve_store_url

    release = load_release(release_ref, resolve_store_url(store_url, os.environ), os.environ) if release_ref else None
    report = run_doctor(env=os.environ, cache_dir=cache_dir, backend=backend, release=release)
    Console(as_json).doctor(report)
    return report.exit_code


@cli.command()
@click.argument("ref", metavar="TAG_OR_RELEASE")
@click.option("--from", "from_url", required=True, metavar="URL", help="Store to copy from (directory or s3://).")
@click.option("--to", "to_url", required=True, metavar="URL", help="Store to copy to; created if absent.")
@_endpoint_flag
@jobs_option
@json_option
@_with_endpoint
def push(ref: str, from_url: str, to_url: str, jobs: int | None, as_json: bool) -> None:
    """Copy a release and its tag to another store, uploading only what that store lacks."""
    from neffbuild.names import check_ref
    from neffbuild.store import open_store
    from neffbuild.transfer import push as run_push

    check_ref(ref)  # before --to is created
    src = open_store(from_url, env=os.environ)
    result = run_push(ref, src, open_store(to_url, create=True, env=os.environ), jobs=jobs or 16)
    Console(as_json).push(result)


@cli.command()
@click.argument("name")
@click.argument("release_id", metavar="RELEASE")
@store_option
@json_option
def tag(name: str, release_id: str, store_url: str | None, as_json: bool) -> None:
    """Point tag NAME at RELEASE (a release id, e.g. from the tag's history): rollback."""
    from neffbuild.publish import move_tag
    from neffbuild.store import open_store, resolve_store_url

    store = open_store(resolve_store_url(store_url, os.environ), env=os.environ)
    Console(as_json).tag(move_tag(store, name, release_id))


@cli.command()
def schema() -> None:
    """Print the manifest's JSON schema."""
    from neffbuild.manifest import manifest_json_schema

    click.echo(json.dumps(manifest_json_schema(), indent=2))


# ---- gc and verify --store (issue 11) ------------------------------------------------------


def _verify_store(store_url: str | None, deep: bool, as_json: bool) -> None:
    from neffbuild.output import print_store_check
    from neffbuild.store import open_store, resolve_store_url
    from neffbuild.storecheck import check_store, store_error

    result = check_store(open_store(resolve_store_url(store_url, os.environ), env=os.environ), deep=deep)
    print_store_check(Console(as_json), result)
    if error := store_error(result):
        raise error


@cli.command("gc")
@store_option
@click.option("--keep", type=click.IntRange(0, 10**6), default=3, show_default=True, help="Releases of each tag's history kept besides its current one.")
@click.option("--grace", default="24h", show_default=True, metavar="DURATION", help="Objects younger than this are kept (a publish may be in flight): 24h, 30m, 90s, 0.")
@click.option("--cache-dir", type=click.Path(path_type=Path, file_okay=False), help="Prune this host cache dir to its installed release instead of a store.")
@click.option("--dry-run", is_flag=True, help="Print what would be deleted; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Delete without asking (required without a terminal).")
@jobs_option
@json_option
def gc_command(
    store_url: str | None, keep: int, grace: str, cache_dir: Path | None, dry_run: bool, yes: bool, jobs: int | None, as_json: bool
) -> None:
    """Delete what no tag reaches (mark and sweep), or prune a host's --cache-dir."""
    from neffbuild.output import print_cache_prune, print_gc_plan, print_gc_result
    from neffbuild.store import open_store, resolve_store_url

    console = Console(as_json)
    if cache_dir is not None:
        from neffbuild.prune import prune_cache_dir

        store = open_store(resolve_store_url(store_url, os.environ), env=os.environ) if store_url else None
        planned = prune_cache_dir(cache_dir, store=store, dry_run=True)
        if not dry_run and planned.remove and _confirmed(yes, f"delete {len(planned.remove)} files from {planned.cache_dir}?"):
            planned = prune_cache_dir(cache_dir, store=store)
        print_cache_prune(console, planned)
        return
    from neffbuild.gc import Policy, parse_duration, plan_gc, sweep

    policy = Policy(keep=keep, grace_s=parse_duration(grace))
    store = open_store(resolve_store_url(store_url, os.environ), env=os.environ)
    plan = plan_gc(store, policy, jobs=jobs or 32)
    if dry_run or not plan.delete:
        print_gc_plan(console, plan)
        return
    if not as_json:
        print_gc_plan(console, plan)
    if _confirmed(yes, f"delete {plan.delete_objects} objects from {plan.store}?"):
        print_gc_result(console, sweep(store, plan, policy, jobs=jobs or 32))


def _confirmed(yes: bool, question: str) -> bool:
    """--yes, or a yes typed at a terminal; without a terminal and without --yes: bad input (2)."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise InputError("refusing to delete without confirmation: no terminal to ask on", hint="pass --yes, or --dry-run to see the plan")
    return click.confirm(question, default=False, err=True)


def main(argv: list[str] | None = None) -> None:
    """The one exit point: typed errors become one line plus a hint and their exit code."""
    # What start-up imported lives as long as the process: keep it out of every later garbage
    # collection (those run often while thousands of small files land, and scanned it all).
    gc.freeze()
    code = _run(lambda: cli.main(args=argv, prog_name="neffbuild", standalone_mode=False))
    sys.exit(code)


def _run(invoke: Callable[[], Any]) -> int:
    try:
        result = invoke()
        return result if isinstance(result, int) else 0
    except NeffbuildError as exc:
        _print_error(exc.message, exc.hint, exc.details, exc.debug_detail)
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
        _print_error(f"internal error: {type(exc).__name__}: {exc}", "rerun with --debug for a traceback, and report it")
        return 1


def _print_error(message: str, hint: str | None, details: tuple[str, ...] = (), debug_detail: str | None = None) -> None:
    if _DEBUG["on"]:
        traceback.print_exc()
        if debug_detail:
            click.echo(f"the worker's traceback:\n{debug_detail.rstrip()}", err=True)
    click.secho(f"error: {message}", fg="red", err=True)
    for line in details:
        click.echo(line, err=True)
    if hint:
        click.echo(f"hint: {hint}", err=True)
