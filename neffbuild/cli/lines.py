"""Lines the views print that the no-op pull's entry (cli/quick.py) prints too: kept free of
click and rich, which that entry never imports."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neffbuild.host.pull import PullReport


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def pull_summary(report: PullReport) -> str:
    """`pulled TAG: F of N files fetched (B of T) in S s`, and what a full verify found."""
    return (
        f"{'kept (stale)' if report.stale else 'pulled'} {report.tag or report.release_id}: {report.files_fetched} of {report.files_total} files fetched "
        f"({human_size(report.bytes_fetched)} of {human_size(report.bytes_total)}) in {report.seconds:.2f} s"
        + (
            f"; {report.files_rehashed} rehashed, {report.files_repaired} repaired"
            if report.files_rehashed or report.files_repaired
            else ""
        )
    )
