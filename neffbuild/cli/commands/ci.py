"""CI's commands: plan, build, release, push, tag, keygen, schema, recipe, suggest."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from neffbuild.cli.options import (
    endpoint_option,
    jobs_option,
    json_option,
    plan_file_option,
    signing_options,
    store_option,
)
from neffbuild.cli.terminal import report_after_change, say
from neffbuild.cli.views import Console, loop
from neffbuild.cli.views import ci as views
from neffbuild.errors import InputError

if TYPE_CHECKING:
    from neffbuild.build.compile import BuildOptions
    from neffbuild.documents.signing import Signing
    from neffbuild.store import StoreChoice


@click.command()
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


@click.command()
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

        views.plan(Console(as_json), make_plan(load_manifest(manifest), os.environ, cache=cache_dir(os.environ)))
        return
    from neffbuild.build.fleet import plan_fleet

    views.fleet_plan(Console(as_json), plan_fleet(manifest, store, env=os.environ, shards=shards, out=out, tag=tag))


@click.command()
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
)  # fmt: skip  # an option's names, type and help kept together
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
)  # fmt: skip  # an option's names, type and help kept together
@click.option(
    "--memory-budget", metavar="SIZE",
    help="Memory the units may share, with --unit-memory [default: what is available when the build starts, within the cgroup's limit].",
)  # fmt: skip  # an option's names, type and help kept together
@click.option(
    "--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
    help="Build each unit as a task on a Ray cluster (ADDRESS, e.g. auto or ray://head:10001; alone: a local Ray instance), then release [needs neffbuild[ray]].",
)  # fmt: skip  # an option's names, type and help kept together
@signing_options
@json_option
def build(
    manifest: Path, store: StoreChoice, tag: str | None, jobs: int | None, work_dir: Path | None, keep_work: bool,
    shard_text: str | None, shard_count: int | None, plan_file: Path | None, retries: int, report_file: Path | None,
    unit_memory: str | None, memory_budget: str | None, ray_address: str | None, signing: Signing | None,
    as_json: bool,
) -> None:  # fmt: skip  # parameters packed by meaning, not one a line
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
    )  # fmt: skip  # arguments packed by meaning, not one a line
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
    views.build(console, report)
    if report.failed:
        raise failure(report)


def _build_on_ray(
    manifest: Path, store: StoreChoice, options: BuildOptions, address: str, report_file: Path | None, console: Console
) -> None:
    from neffbuild.build.fanin import incomplete
    from neffbuild.build.rayfleet import build_on_ray

    result = build_on_ray(manifest, store, env=os.environ, options=options, address=address, report_file=report_file)
    if result.release.missing:
        views.release(console, result.release)
        raise incomplete(result.release)
    report_after_change(lambda: views.release(console, result.release), f"released {result.release.release_id}")


@click.command("release")
@click.argument("manifest", type=click.Path(path_type=Path))
@store_option
@click.option("--tag", help="Tag to move [default: the manifest's name].")
@plan_file_option
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
        views.release(Console(as_json), result)
        raise incomplete(result)
    report_after_change(lambda: views.release(Console(as_json), result), f"released {result.release_id}")


@click.command()
@click.argument("ref", metavar="TAG_OR_RELEASE")
@click.option("--from", "from_url", required=True, metavar="URL", help="Store to copy from (directory or s3://).")
@click.option("--to", "to_url", required=True, metavar="URL", help="Store to copy to; created if absent.")
@endpoint_option
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
    )  # fmt: skip  # arguments packed by meaning, not one a line
    report_after_change(lambda: views.push(Console(as_json), result), f"pushed release {result.release_id}")


@click.command()
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
    report_after_change(lambda: views.tag(Console(as_json), record), f"tag {record.name} -> {record.release}")


@click.command()
@click.argument("name")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
def keygen(name: str, path: Path) -> None:
    """Write a new Ed25519 signing key NAME (e.g. ci.example-1; bump the suffix on rotation) to
    PATH (mode 0600) and its public key to PATH.pub, both one line NAME:base64."""
    from neffbuild.documents.signing import generate_key, write_key_pair

    public = write_key_pair(generate_key(name), path)
    say(f"wrote {path} (private: give it to CI's --sign-key) and {public} (to hosts' --trusted-key)")


@click.command()
def schema() -> None:
    """Print the manifest's JSON schema."""
    from neffbuild.documents.manifest import manifest_json_schema

    click.echo(json.dumps(manifest_json_schema(), indent=2))


@click.command()
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
        report_after_change(lambda: loop.suggestion(Console(as_json), result), f"wrote {manifest}")
    else:
        loop.suggestion(Console(as_json), result)


COMMANDS: tuple[click.Command, ...] = (recipe, plan, build, release_command, push, tag, keygen, schema, suggest)
