"""A host's cache dir, opened once per command: its path, its directory, its state, its lock.

The path is resolved once (where a symlink at the root points is the operator's choice); below
it nothing follows a link (fs/confined.py). The directory is opened, not made: a pull makes it
only once every check has passed, so a refused pull leaves no trace. Its state file is read
through host/statefile.py and host/state.py (strictly: a corrupt state is StateCorrupt for
commands that only read), and its lock is pull's flock under `.neffbuild/`, which saves
duplicate work when two pulls race (correctness comes from unique temp files and rename, never
from the lock). find_target says which release a command means for the dir: the installed
one, from its state, else REF's.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from neffbuild.errors import InputError, NotFoundError
from neffbuild.fs.beneath import Beneath
from neffbuild.fs.confined import disk_error
from neffbuild.fs.locks import acquire
from neffbuild.host.bundleunits import release_units
from neffbuild.host.state import CacheState
from neffbuild.host.statefile import open_existing, open_state_dir, read_state, read_state_data, state_path
from neffbuild.names import STATE_DIR

if TYPE_CHECKING:
    from neffbuild.host.held import Held
    from neffbuild.host.target import Target
    from neffbuild.store.base import Store

LOCK_FILE = "pull.lock"
LOCK_HINT = "another pull into this cache dir is still running; wait for it or raise --lock-timeout"


def has_state_file(path: Path) -> bool:
    """Whether a state file lies in the cache dir at path: a plain look, for a quick answer only
    (a cache dir without one was never pulled into; anything odd is the full pull's to judge)."""
    return state_path(path).is_file()


class CacheDir:
    """One cache dir for the life of a command; `with CacheDir.opened(path) as cache:`."""

    def __init__(self, path: Path) -> None:
        self.path = path.expanduser().resolve()
        self.fd: int | None = open_existing(self.path)  # None: it does not exist (yet)

    @classmethod
    @contextmanager
    def opened(cls, path: Path) -> Iterator[CacheDir]:
        cache = cls(path)
        try:
            yield cache
        finally:
            cache.close()

    @classmethod
    def held(cls, cache_dir: Path | CacheDir) -> AbstractContextManager[CacheDir]:
        """For a block: the caller's own CacheDir (left open: the caller closes it), or the path opened."""
        return nullcontext(cache_dir) if isinstance(cache_dir, CacheDir) else cls.opened(cache_dir)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @property
    def exists(self) -> bool:
        return self.fd is not None

    @property
    def state_path(self) -> Path:
        return state_path(self.path)

    @property
    def lock_path(self) -> Path:
        return self.path / STATE_DIR / LOCK_FILE

    def make(self) -> int:
        """The dir's descriptor, the dir made first if it is missing."""
        if self.fd is None:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                raise disk_error(exc, self.path) from None
        return self.fd

    def read_state(self) -> tuple[bytes | None, CacheState]:
        """(the state file's bytes, what it says), corrupt or not; makes nothing."""
        return (None, CacheState()) if self.fd is None else read_state(self.fd, self.path)

    def read_state_data(self) -> bytes | CacheState:
        """The state file's bytes, unparsed (else what it reads as: nothing known, or corrupt)."""
        return CacheState() if self.fd is None else read_state_data(self.fd, self.path)

    def state(self) -> CacheState:
        """What the state says, for a command that only reads: StateCorrupt if it is corrupt."""
        return self.read_state()[1].trusted(self.state_path)

    def state_dir(self, *, create: bool) -> int | None:
        """`.neffbuild/` open (made with the dir if create), else None when missing."""
        if self.fd is None and not create:
            return None
        return open_state_dir(self.make(), self.path, create=create)

    def has_state_dir(self) -> bool:
        """Whether a pull ever recorded anything here (`.neffbuild/` exists; a link there is refused)."""
        state_dir = self.state_dir(create=False)
        if state_dir is None:
            return False
        os.close(state_dir)
        return True

    def beneath(self) -> Beneath:
        """The confined view of what lies below the dir (which must exist)."""
        return Beneath(self.make(), self.path)

    @contextmanager
    def locked(self, timeout: float | None = None) -> Iterator[Held]:
        """Hold pull's lock while the block runs (ConflictError after timeout seconds); yields
        the state as the holder reads and writes it. The kernel drops the lock if this process dies."""
        from neffbuild.host.held import Held  # a no-op pull writes nothing, and takes no lock

        state_dir = self.state_dir(create=True)
        assert state_dir is not None
        try:
            with lock_in(state_dir, self.lock_path, timeout):
                yield Held(state_dir, self.state_path)
        finally:
            os.close(state_dir)

    def wait_for_other_pull(self, timeout: float | None) -> bool:
        """Whether another pull held the lock (then it has finished: waited for up to timeout
        seconds, else ConflictError); opens only what exists, takes the lock only to wait."""
        state_dir = self.state_dir(create=False)
        if state_dir is None:
            return False
        try:
            fd = os.open(LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=state_dir)
        except OSError:
            return False  # no lock file: no pull at work (a link there is refused when one takes it)
        finally:
            os.close(state_dir)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False
            except BlockingIOError:
                acquire(fd, self.lock_path, timeout, "pull lock", LOCK_HINT)
                return True
        finally:
            os.close(fd)

    def writable_dirs(self, allowed: Collection[str]) -> list[Path]:
        """Dirs this process could write, outside allowed (read-only detection)."""
        from neffbuild.fs.readonly import writable_dirs  # tempfile and shutil: not on a pull's path

        return writable_dirs(self.path, allowed)

    def require_read_only(self, backend: str, writable: Collection[str]) -> None:
        """Refuse a dir this process could write outside `writable` (InputError), or one whose
        `writable` dirs it cannot write (HostNotReady): what `verify --replay --in-place` needs."""
        from neffbuild.fs.readonly import require_read_only

        require_read_only(self.path, backend, writable)


@contextmanager
def lock_in(state_dir: int, shown: Path, timeout: float | None = None) -> Iterator[None]:
    """An advisory lock (flock) on state_dir's lock file, held while the block runs."""
    try:
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=state_dir)
    except OSError as exc:
        raise disk_error(exc, shown) from None
    try:
        acquire(fd, shown, timeout, "pull lock", LOCK_HINT)
        yield
    finally:
        os.close(fd)


def find_target(
    state: CacheState,
    cache_dir: Path,
    ref: str | None,
    open_store: Callable[[], Store] | None,
    *,
    store_named: bool = False,
    with_units: bool = True,
) -> Target:
    """REF's release (and its units' key parts): from the cache dir's state when it is the
    installed one (a tag only while no store is named: it may have moved), else from the store."""
    from neffbuild.host.target import Target  # `env` and `status` ask; a pull names its release itself

    installed = state.installed
    if installed is not None and ref in (None, installed.release_id, *(() if store_named else (installed.tag,))):
        return Target(
            installed.release_id, installed.release, installed.tag or None, installed.units, str(state_path(cache_dir))
        )
    if ref is None:
        raise NotFoundError(
            f"{cache_dir}: no installed release recorded (never pulled, or pulled by an older neffbuild)",
            hint="pull it (a complete cache fetches nothing and records it), or name the release and its store: TAG --store S",
        )
    if open_store is None:
        raise InputError(
            f"{ref}: not the release installed in {cache_dir}", hint="pass --store to read it from the store"
        )
    from neffbuild.documents.refs import resolve

    store = open_store()
    resolved = resolve(store, ref)
    if installed is not None and installed.release_id == resolved.release_id:
        return Target(
            installed.release_id, installed.release, resolved.tag, installed.units, str(state_path(cache_dir))
        )
    units = release_units(store, resolved, 16) if with_units else ()
    return Target(resolved.release_id, resolved.release, resolved.tag, units, store.url)
