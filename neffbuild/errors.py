"""One error hierarchy; each kind has its own exit code, caught once in the CLI."""

from __future__ import annotations

import signal
from collections.abc import Sequence


class NeffbuildError(Exception):
    """Base of every error neffbuild reports to a user: a one-line message and a hint.

    `details` are lines shown under the message (e.g. the end of a worker's log); `debug_detail`
    is shown only with --debug (e.g. the worker process's own traceback).
    """

    exit_code = 1

    def __init__(
        self, message: str, hint: str | None = None, *, details: Sequence[str] = (), debug_detail: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = tuple(details)
        self.debug_detail = debug_detail

    def __str__(self) -> str:
        return self.message


class InputError(NeffbuildError):
    """A manifest, flag, path or document given to us is invalid."""

    exit_code = 2


class ManifestError(InputError):
    """The manifest is invalid; the message names file, entry and key (several problems: a count
    in the message, each on a detail line)."""

    def __str__(self) -> str:
        return "\n".join((self.message, *self.details))  # every problem, for a caller of the API


class PipelineMismatch(InputError):
    """A loaded pipeline is not what the manifest entry built (class, dtype, components)."""


class StoreError(NeffbuildError):
    """The store could not be read or written (missing, unreachable, denied)."""

    exit_code = 3


class DeadlineExceeded(StoreError):
    """An operation on the store (a pull's --timeout) ran past its deadline: a slow or stalled store."""


class Abandoned(StoreError):
    """A request given up because another request of the same operation failed for good: the
    operation reports that first failure, never this one (store/dataplane.py's run_all)."""


class IntegrityError(NeffbuildError):
    """Bytes or a document do not match their recorded digest or schema."""

    exit_code = 4


class BuildError(NeffbuildError):
    """A warmup compile failed or produced something we cannot bundle."""

    exit_code = 5


class PartlyCompiledError(BuildError):
    """A unit's warmup compiled some components but not every listed one: its row says how many."""

    def __init__(self, message: str, hint: str | None = None, *, compiles: int = 0) -> None:
        super().__init__(message, hint)
        self.compiles = compiles


class ReplayMissError(NeffbuildError):
    """A replay compiled something: the cache did not cover the manifest."""

    exit_code = 6


class WarmupMiss(ReplayMissError):
    """`neffbuild.serve.warmup`: a shape the manifest lists compiled in the serving process."""


class EnvironmentMismatch(NeffbuildError):
    """This host's environment fingerprint differs from the one a bundle was built for."""

    exit_code = 7


class NotFoundError(NeffbuildError):
    """A tag, release or bundle is not in the store."""

    exit_code = 8


class ConflictError(NeffbuildError):
    """Two writers or two bundles disagree (tag race lost too often, path clash)."""

    exit_code = 9


class DiskError(NeffbuildError):
    """The local filesystem refused a write (full disk, permissions)."""

    exit_code = 10


class HostNotReady(NeffbuildError):
    """`doctor` found a check that fails: this host should not serve yet."""

    exit_code = 11


class StatusMiss(NeffbuildError):
    """`status` predicts a unit would not hit: missing, stale, mismatched or absent."""

    exit_code = 12


class StateCorrupt(NeffbuildError):
    """A cache dir's own state file (.neffbuild/state.json) is malformed or was edited. pull
    repairs it (every file re-verified, the state rewritten); commands that only read stop."""

    exit_code = 13


class IncompleteRelease(NeffbuildError):
    """`release`: a unit of the manifest has no bundle in the store yet; nothing was released."""

    exit_code = 14


class WorkerKilled(BuildError):
    """A build worker was killed by a signal or the OOM killer, not failed by its compile: a
    retry (of the unit, or of the shard) may pass, so fleets retry this code and not exit 5."""

    exit_code = 15
    how = "killed"  # "killed by SIGKILL", "killed by the OOM killer (...)"


class TrustError(NeffbuildError):
    """With trusted keys: a signature or signed statement is missing, malformed, expired, rolled
    back, by an untrusted key, or does not match what the store holds. Nothing was written."""

    exit_code = 16


class UnlistedShape(NeffbuildError):
    """A serving guard in mode "fail" refused a compile: a call at a shape the manifest does not
    list (or that the pulled cache does not hold) would have compiled on a live request."""

    exit_code = 17


class Interrupted(NeffbuildError):
    """SIGINT or SIGTERM stopped a build or replay; its exit code is the shell's 128 + signal."""

    def __init__(self, signum: int, message: str | None = None, hint: str | None = None) -> None:
        name = signal.Signals(signum).name
        super().__init__(message or f"interrupted by {name}", hint)
        self.signum = signum
        self.exit_code = 128 + signum
