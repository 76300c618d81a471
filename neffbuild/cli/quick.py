"""The no-op pull's entry: `neffbuild pull REF [--store URL] --cache-dir DIR [--no-host-check]
[--env-file PATH] [--allow-stale]`, the boot of a host whose cache dir survived a reboot, parsed
without click and answered by host/noop.py's `noop_pull` with nothing imported that the full
command needs only for other work. It prints what the full command prints for a no-op, the same
way; any other command line, any environment it does not read (trusted keys, a retry scale) and
any pull that is not a clean no-op is the full command's (`quick_pull` answers None: nothing was
printed, nothing written that a no-op does not write too)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from neffbuild.cli.lines import pull_summary

_VALUED = ("--store", "--cache-dir", "--env-file")
_FLAGS = ("--no-host-check", "--allow-stale")  # --allow-stale acts on a store error only, which is not a no-op
_FULL_ONLY_ENV = ("NEFFBUILD_TRUSTED_KEYS", "NEFFBUILD_RETRY_SCALE")
# The attempt never waits: one try per request, a short deadline, no waiting for another pull's
# lock. What it cannot answer at once is the full command's, which retries and waits as it always
# did: a store that is down at boot costs one failed request more, not a second round of retries.
_ATTEMPT_S = 5.0


def quick_pull(args: Sequence[str], env: Mapping[str, str]) -> int | None:
    """The exit code of a no-op pull it printed; None: the full command's to run."""
    parsed = parse(args)
    if parsed is None or "--cache-dir" not in parsed or any(name in env for name in _FULL_ONLY_ENV):
        return None
    from neffbuild import retry
    from neffbuild.host.exports import host_allow, shell_lines
    from neffbuild.host.noop import noop_pull
    from neffbuild.host.pull import PullOptions
    from neffbuild.store import StoreChoice

    gc.freeze()  # as cli/main.py's main: what start-up imported stays out of every later collection
    env_file = parsed.get("--env-file")
    try:
        options = PullOptions(  # as `pull`'s click command fills it, but for waiting (above)
            allow_env=host_allow((), env), env_file=None if env_file is None else Path(env_file),
            host_env=None if "--no-host-check" in parsed else env, lock_timeout=0.0, timeout=_ATTEMPT_S,
            policy=replace(retry.DEFAULT, attempts=1, throttled_attempts=1),
        )  # fmt: skip  # arguments packed by meaning, not one a line
    except Exception:  # noqa: BLE001 - an unusable NEFFBUILD_ALLOW_ENV: the full command says so
        return None
    store = StoreChoice(parsed.get("--store"))
    report = noop_pull(lambda: store.open(env), parsed["ref"], Path(parsed["--cache-dir"]), options)
    if report is None:
        return None
    _show(pull_summary(report), shell_lines(report.exports), f"pulled {report.release_id} into {report.cache_dir}")
    return 0


def parse(args: Sequence[str]) -> dict[str, str] | None:
    """{"ref": REF, option: value or ""} for `pull` with only the options this entry knows, each
    once, values neither empty nor option-like; None for anything else."""
    if not args or args[0] != "pull":
        return None
    parsed: dict[str, str] = {}
    rest = iter(args[1:])
    for arg in rest:
        name, eq, value = arg.partition("=")
        if name in _VALUED:
            value = value if eq else next(rest, "")
        elif arg in _FLAGS:
            value = ""
        elif arg.startswith("-") or "ref" in parsed:
            return None
        else:
            name, value = "ref", arg
        if name in parsed or ((name != arg or name in _VALUED) and (not value or value.startswith("-"))):
            return None
        parsed[name] = value
    return parsed if "ref" in parsed else None


def _show(summary: str, exports: str, done: str) -> None:
    """The summary on stderr, the exports on stdout, as the full command's view writes them; a
    failure to print is said as the full command says it (cli/terminal.py)."""
    from neffbuild.printable import printable

    def show() -> None:
        sys.stderr.write(printable(summary) + "\n")
        sys.stderr.flush()
        sys.stdout.write(exports)

    failure: BaseException | None = None
    if sys.stdout is not None:
        try:
            show()
            sys.stdout.flush()
            return
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - said below, as the full command says it
            failure = exc
    from neffbuild.cli.terminal import report_after_change

    def again() -> None:
        if failure is not None:
            raise failure
        show()

    report_after_change(again, done)
