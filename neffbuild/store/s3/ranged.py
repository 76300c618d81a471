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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from neffbuild import retry
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
