"""The store's commands: ls, show, diff, du, gc (and `gc --cache-dir`, a host's prune)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from neffbuild.cli.options import (
    grace_option,
    jobs_option,
    json_option,
    keep_option,
    store_option,
)
from neffbuild.cli.terminal import confirmed, report_after_change
from neffbuild.cli.views import Console
from neffbuild.cli.views import store as views
from neffbuild.errors import InputError

if TYPE_CHECKING:
    from neffbuild.store import StoreChoice


@click.command("ls")
@click.option("--tag", "tag_name", metavar="NAME", help="Show this tag's history (NAME@N names each release) instead.")
@store_option
@json_option
def ls_command(tag_name: str | None, store: StoreChoice, as_json: bool) -> None:
    """List the store's tags and releases, newest first."""
    from neffbuild.inspect.ls import list_store, tag_history

    opened = store.open(os.environ)
    if tag_name is not None:
        views.tag_history(Console(as_json), tag_history(opened, tag_name))
    else:
        views.listing(Console(as_json), list_store(opened))


@click.command("show")
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

    if trace is not None:
        from neffbuild.inspect.unused import unused

        views.unused_files(Console(as_json), unused(store.open(os.environ), ref, trace))
        return
    from neffbuild.inspect.show import show

    views.shown_ref(Console(as_json), show(store.open(os.environ), ref))


@click.command("diff")
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
    from neffbuild.inspect.diff import diff, diff_host

    if host_ref is not None:
        if old_ref is not None:
            raise InputError(
                f"diff --host {host_ref} takes no A or B (got {old_ref!r})",
                hint="neffbuild diff --host REF, or neffbuild diff A B",
            )
        views.host_differences(Console(as_json), diff_host(store.open(os.environ), host_ref, os.environ))
        return
    if old_ref is None or new_ref is None:
        raise InputError(
            "diff needs two references A and B, or --host REF",
            hint="e.g. neffbuild diff klein@1 klein, or neffbuild diff --host klein",
        )
    views.differences(Console(as_json), diff(store.open(os.environ), old_ref, new_ref))


@click.command("du")
@store_option
@keep_option
@grace_option
@json_option
def du_command(store: StoreChoice, keep: int, grace: str, as_json: bool) -> None:
    """Bytes the store holds by tag, release, model entry and toolchain, what dedup saves, and
    what `gc` would free under --keep and --grace."""
    from neffbuild.inspect.du import disk_usage
    from neffbuild.maint.gc import Policy, parse_duration, reclaimable

    policy = Policy(keep=keep, grace_s=parse_duration(grace))
    views.usage(Console(as_json), disk_usage(store.open(os.environ), reclaim=reclaimable(policy)))


@click.command("gc")
@store_option
@keep_option
@grace_option
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

    console = Console(as_json)
    if cache_dir is not None:
        from neffbuild.host.prune import prune_cache_dir

        opened = store.open(os.environ) if store.url else None
        planned = prune_cache_dir(cache_dir, store=opened, dry_run=True)
        if (
            not dry_run
            and planned.remove
            and confirmed(yes, f"delete {len(planned.remove)} files from {planned.cache_dir}?")
        ):
            planned = prune_cache_dir(cache_dir, store=opened)
        report_after_change(lambda: views.cache_prune(console, planned), f"pruned {planned.cache_dir}")
        return
    from neffbuild.maint.gc import Policy, parse_duration, plan_gc, sweep

    policy = Policy(keep=keep, grace_s=parse_duration(grace))
    opened = store.open(os.environ)
    plan = plan_gc(opened, policy, jobs=jobs or 32)
    if dry_run or not plan.delete:
        report_after_change(lambda: views.gc_plan(console, plan), f"planned gc of {plan.store}")
        return
    if not as_json:  # what it is about to delete: not printable (stdout closed) is no reason to stop
        report_after_change(lambda: views.gc_plan(console, plan), f"planned deleting {plan.delete_objects} objects")
    if confirmed(yes, f"delete {plan.delete_objects} objects from {plan.store}?"):
        result = sweep(opened, plan, policy, jobs=jobs or 32)
        report_after_change(
            lambda: views.gc_result(console, result), f"deleted {len(result.deleted)} objects from {plan.store}"
        )


COMMANDS: tuple[click.Command, ...] = (ls_command, show_command, diff_command, du_command, gc_command)
