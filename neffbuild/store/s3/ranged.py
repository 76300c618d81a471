"""Large blobs as concurrent ranged GETs, each part written in place at its offset.

One GET per large blob leaves connections idle when a pull has only a few large blobs,
and on a busy host the server then gets less done per second (s5cmd and the AWS CLI fetch parts
concurrently for the same reason; bench/RESULTS.md). Each part is received into a reused buffer
and written at its offset (pwrite) by the thread that fetched it, so parts land in any order; the
blob's writer hashes them in order (XXH3 and BLAKE3: confined.write_placed checks both before the
file is linked into place) and gives each buffer back. A part that fails is retried alone, from the
bytes it had received (DataPlane.get). The parts of one blob must come from one version of its
object (responses.Version: If-Match on the first part's ETag): if it is replaced mid-way, the
blob starts again from its first byte, at most CHANGED_TRIES times in all.

Where the file lives in memory (tmpfs: no O_DIRECT, see host/landing.py) the parts need not wait
in buffers to be hashed in order (read_back): each streams through a small buffer into the file,
and the blob's writer hashes the file's own pages, mapped, in order as they are written. So
every large blob goes as ranges there, a few large ones each, all in flight: the many
connections that keep a busy server sending (bench/RESULTS.md, issue 40).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from neffbuild import retry
from neffbuild.errors import StoreError
from neffbuild.fs.confined import BlobTarget, write_at
from neffbuild.store.s3.dataplane import Buffers, DataPlane
from neffbuild.store.s3.responses import Buffer, Version

# Measured best on 8 x 128 MiB (bench/RESULTS.md): smaller parts cost requests, larger ones
# stall the in-order hashing and fault in more fresh buffer memory.
PART_MIN = 4 << 20
PART_MAX = 64 << 20
# Smaller large blobs stream as one GET each: three parts of a 9 MiB file gain little and would
# triple its requests (a fleet's boots are counted in requests: docs/hosts.md).
RANGED_MIN = 4 * PART_MIN
PARTS_PER_JOB = 16  # parts per connection over the whole download, so all stay busy to the end
MEMORY = 256 << 20  # receive buffers held at once, all large blobs together
# read_back: parts per connection, and their least size (S3 requests are counted per boot:
# docs/hosts.md); measured on 8 x 128 MiB into tmpfs (bench/RESULTS.md).
BACK_PARTS_PER_JOB = 2
BACK_PART_MIN = 16 << 20
BACK_BUFFER = 1 << 20  # a part's receive buffer: fresh memory per connection costs page faults
BACK_HASHED = 4 << 20  # bytes of a part mapped and hashed at once (page-aligned: parts are whole MiB)
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
CHANGED_TRIES = 3  # a blob whose object keeps changing under us fails after this many starts


@dataclass(frozen=True, slots=True)
class Plan:
    """How the large blobs of one download are split: part size, parts of one blob in flight or
    waiting to be hashed, and blobs being written at once."""

    part: int
    window: int
    writers: int

    def requests(self, sizes: Sequence[int]) -> int:
        return sum(-(-size // self.part) for size in sizes)


def plan(sizes: Sequence[int], jobs: int) -> Plan:
    """Parts of a multiple of PART_MIN (aligned for O_DIRECT), about PARTS_PER_JOB per connection;
    each blob keeps twice its share of the connections in flight (a part waiting to be hashed
    holds no connection), buffers within MEMORY."""
    jobs = max(1, jobs)
    writers = max(1, min(len(sizes), jobs))
    window = 2 * -(-jobs // writers) + 2
    part = max(PART_MIN, min(PART_MAX, sum(sizes) // (jobs * PARTS_PER_JOB)) // PART_MIN * PART_MIN)
    while part > PART_MIN and writers * window * part > MEMORY:
        part -= PART_MIN
    return Plan(part, window, writers)


def placed(
    data: DataPlane, key: str, target: BlobTarget, plan: Plan, fetchers: ThreadPoolExecutor, buffers: Buffers
) -> Callable[[int, bool], Generator[memoryview, None, None]]:
    """confined.write_placed's `place` for one blob: its parts fetched by `fetchers` and written
    at their offsets, yielded in order (buffers of plan.part bytes)."""

    def place(fd: int, direct: bool) -> Generator[memoryview, None, None]:
        version = Version(data.where(key))
        # The last part, seldom block-aligned, is written once all others are: O_DIRECT turned
        # off for it (confined.write_at) must not send the other parts through the page cache.
        last = (target.size - 1) // plan.part * plan.part

        def fetch(start: int) -> tuple[Buffer, memoryview]:
            buf = buffers.take()
            try:
                end = min(start + plan.part, target.size)
                view = data.get(key, start, end, into=buf, needed=str(target.dest), version=version)
                if start != last:
                    write_at(fd, view, start, direct)
                return buf, view
            except BaseException:
                buffers.give(buf)
                raise

        at = 0
        for view in _in_order(fetch, range(0, target.size, plan.part), plan.window, fetchers, buffers):
            if at == last:
                write_at(fd, view, at, direct)
            at += len(view)
            yield view

    return place


def _in_order(
    fetch: Callable[[int], tuple[Buffer, memoryview]],
    starts: range,
    window: int,
    fetchers: ThreadPoolExecutor,
    buffers: Buffers,
) -> Iterator[memoryview]:
    """The fetched parts in order, `window` of them submitted ahead. On the way out (done,
    failed or closed) no fetch is left running: they write into a file about to be closed."""
    ahead = iter(starts)
    pending = deque(fetchers.submit(retry.carried(partial(fetch, s))) for s in _take(ahead, window))
    try:
        while pending:
            buf, view = pending.popleft().result()
            yield view
            buffers.give(buf)
            for start in _take(ahead, 1):
                pending.append(fetchers.submit(retry.carried(partial(fetch, start))))
    finally:
        for f in pending:  # cancel what has not started, wait for what has, keep its buffer
            if not f.cancel() and f.exception() is None:
                buffers.give(f.result()[0])


def _take(starts: Iterator[int], count: int) -> list[int]:
    return [s for _, s in zip(range(count), starts, strict=False)]


def back_plan(sizes: Sequence[int], jobs: int) -> Plan:
    """Parts for read_back: about BACK_PARTS_PER_JOB per connection, of BACK_PART_MIN or more;
    every part of a blob in flight at once (they hold no buffer while they wait)."""
    jobs = max(1, jobs)
    part = max(BACK_PART_MIN, min(PART_MAX, sum(sizes) // (jobs * BACK_PARTS_PER_JOB)) // PART_MIN * PART_MIN)
    return Plan(part, max(-(-size // part) for size in sizes), max(1, min(len(sizes), jobs)))


def read_back(
    data: DataPlane, key: str, target: BlobTarget, plan: Plan, fetchers: ThreadPoolExecutor, buffers: Buffers
) -> Callable[[int, bool], Generator[memoryview, None, None]]:
    """confined.write_placed's `place` for one blob whose file lives in memory (the page cache,
    tmpfs): every part streamed at once by `fetchers`, each through a small reused buffer and
    written at its offset, and the bytes read back from the file in order to be hashed. No
    part is held in memory waiting for the ones before it, so parts can be large (few requests)
    and all in flight (many connections)."""

    def place(fd: int, direct: bool) -> Generator[memoryview, None, None]:
        version = Version(data.where(key))
        starts = range(0, target.size, plan.part)
        progress = _Progress(len(starts))

        def fetch(index: int, start: int) -> None:
            size = min(plan.part, target.size - start)
            at = start
            try:
                with buffers.lend() as buf:
                    for view in data.resumed(key, size, buf, needed=str(target.dest), part=(start, version)):
                        write_at(fd, view, at, direct)
                        at += len(view)
                        if not progress.advance(index, at - start):
                            return  # the blob failed elsewhere: its file is being discarded
            finally:
                progress.ended(index)

        futures = [fetchers.submit(retry.carried(partial(fetch, i, s))) for i, s in enumerate(starts)]
        reader = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            for index, start in enumerate(starts):
                size = min(plan.part, target.size - start)
                for at in range(0, size, BACK_HASHED):  # hashed as it lands, not once the part is whole
                    end = min(at + BACK_HASHED, size)
                    if progress.wait(index, end) < end:
                        futures[index].result()  # its failure
                        raise StoreError(f"{data.where(key)}: a part of {size} bytes ended at {at}")
                    # The written pages, mapped (no copy) and faulted in at once.
                    flags = mmap.MAP_SHARED | MAP_POPULATE
                    with mmap.mmap(reader, end - at, flags, mmap.PROT_READ, offset=start + at) as pages:
                        view = memoryview(pages)
                        yield view
                        view.release()
        finally:
            os.close(reader)
            progress.stop()
            for f in futures:  # none may still write into a file about to be closed
                if not f.cancel():
                    f.exception()

    return place


class _Progress:
    """The bytes written so far of each part of one blob, from its start (thread-safe)."""

    def __init__(self, parts: int) -> None:
        self._written = [0] * parts
        self._ended = [False] * parts
        self._stopped = False
        self._changed = threading.Condition()

    def advance(self, index: int, written: int) -> bool:
        """Record a part's progress; False once the blob is given up (the part should stop)."""
        with self._changed:
            self._written[index] = written
            self._changed.notify_all()
            return not self._stopped

    def ended(self, index: int) -> None:
        with self._changed:
            self._ended[index] = True
            self._changed.notify_all()

    def wait(self, index: int, size: int) -> int:
        """A part's bytes written, once size of them are, or it ended."""
        with self._changed:
            while self._written[index] < size and not self._ended[index]:
                self._changed.wait()
            return self._written[index]

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
