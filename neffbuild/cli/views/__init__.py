"""What commands print (being split by command group; everything still lives in `store`)."""

from neffbuild.cli.views.store import (
    Console,
    differences,
    fit_table,
    host_differences,
    listing,
    print_cache_prune,
    print_fleet_plan,
    print_gc_plan,
    print_gc_result,
    print_status,
    print_store_check,
    printed_document,
    shown_ref,
    tag_history,
    usage,
)

__all__ = [
    "Console",
    "differences",
    "fit_table",
    "host_differences",
    "listing",
    "print_cache_prune",
    "print_fleet_plan",
    "print_gc_plan",
    "print_gc_result",
    "print_status",
    "print_store_check",
    "printed_document",
    "shown_ref",
    "tag_history",
    "usage",
]
