"""The no-op pull of a host's boot, tried before the command line's parser is imported.

A host whose cache dir survived a reboot runs `pull` and fetches nothing; most of that process's
time used to be start-up. `noop_pull` is the same pull (the same code, verdicts and writes) run
with `noop_only`: it stops with nothing written as soon as it finds anything to do, and answers
None there, for any error, for anything it logged or warned, and for any report line beyond the
summary (stale, throttled, host warnings, a signature). The caller then runs the full command,
which does the work or says what is wrong exactly as it always did.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from neffbuild.host.cachedir import has_state_file
from neffbuild.host.fallback import pull_or_stale
from neffbuild.host.pull import PullOptions, PullReport
from neffbuild.store.base import Store


def noop_pull(open_store: Callable[[], Store], ref: str, cache_dir: Path, options: PullOptions) -> PullReport | None:
    """pull_or_stale's report where the pull is a clean no-op (only its summary and exports to
    show); else None, having written nothing but what a no-op writes too (the serving dirs,
    env_file)."""
    if not has_state_file(cache_dir):
        return None  # nothing installed yet (a host's first boot): the store is the full pull's to ask
    with _heard() as heard:
        try:
            report = pull_or_stale(open_store, ref, cache_dir, replace(options, noop_only=True))
        except Exception:  # noqa: BLE001 - not a no-op: the full command reports it
            return None
    plain = not (report.stale or report.host_warnings or report.throttled or report.state_replaced or report.signed_by)
    return report if plain and not heard and report.files_fetched == 0 else None


class _Heard(logging.Handler):
    """Keeps what neffbuild logged at WARNING or above (the full command shows it its own way)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _heard() -> Iterator[list[object]]:
    """What was logged or warned in the block (a list: empty if nothing), shown nowhere."""
    logger = logging.getLogger("neffbuild")
    handler = _Heard()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            heard: list[object] = []
            yield heard
            heard.extend((*handler.records, *caught))
    finally:
        logger.removeHandler(handler)
