"""The write-behind queue: every archive write a query causes runs after its answer, through one queue.

Answering is read-only: query.py reads the archive and enqueues what it would write (archive a freshly
computed instruction prefix, touch the segments used for gc, store again the segments whose KV could not be
read) as jobs here; the owner drains them once the answer is out. The engine (resources.py) owns the one
queue: the CLI drains it after each query (so the next query of a bench or a tune finds the prefix archived,
as before) and again on close, so nothing is lost; the server's scheduler holds the same queue as its
background work and runs it only when no request can use the time, `rows_per_step` tokens at a time.

A job is a Steps[None] generator (it may yield WAITING while another writer holds a passage, and yields every
few rows so a server can interleave it) or a plain closure. A job that fails is a warning line: the answer
it follows was already given and stands.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from kvblend.archive import SegmentRecord
from kvblend.types import LayerKV, Steps, drain

log = logging.getLogger(__name__)

Write = Steps[None]
StagedSegment = tuple[SegmentRecord, list[LayerKV]]  # a segment's record and KV, computed, not yet written


def closure_job(fn: Callable[[], None]) -> Write:
    """A closure as a job: it runs in one step when the job is first advanced."""
    fn()
    return
    yield  # a generator: nothing runs before the queue advances it


class WriteBehind:
    """A FIFO of write jobs, safe to share between the thread that enqueues and the one that drains."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: deque[Write] = deque()
        self._staged: dict[str, StagedSegment] = {}  # segments queued to be written, readable meanwhile

    def stage(self, rec: SegmentRecord, kv: list[LayerKV], write: Callable[[], None]) -> None:
        """Queue the write of a segment computed for an answer (a stored miss), and let later queries read its
        KV from here until it is written (a client's second request hits, as when it was written at once)."""
        with self._lock:
            self._staged[rec.key] = (rec, kv)

        def write_then_unstage() -> None:
            try:
                write()
            finally:
                with self._lock:
                    self._staged.pop(rec.key, None)

        self.put_call(write_then_unstage)

    def staged(self, key: str) -> StagedSegment | None:
        """A segment queued to be written, with its KV, if any."""
        with self._lock:
            return self._staged.get(key)

    def put(self, job: Write) -> None:
        """Queue a job (a Steps[None]); it runs after everything queued before it."""
        with self._lock:
            self._jobs.append(job)

    def put_call(self, fn: Callable[[], None]) -> None:
        """Queue a closure."""
        self.put(closure_job(fn))

    def pending(self) -> list[Write]:
        """The jobs not finished yet, oldest first (a snapshot: a server runs them in its idle time)."""
        with self._lock:
            return list(self._jobs)

    def remove(self, job: Write) -> None:
        """A job another runner (the server's executor) finished."""
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)

    def clear(self) -> None:
        with self._lock:
            self._jobs.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def __bool__(self) -> bool:
        return len(self) > 0

    def drain(self, warn: Callable[[str], None] | None = None) -> int:
        """Run every queued job to its end, oldest first (jobs queued meanwhile too); returns how many ran.
        A job that fails is reported through `warn` (default: the log) and the next one runs."""
        ran = 0
        while True:
            with self._lock:
                if not self._jobs:
                    return ran
                job = self._jobs.popleft()
            try:
                drain(job)  # sleeps while it says WAITING
            except Exception as exc:  # a write behind an answer never takes the answer with it
                (warn or log.warning)(f"could not write after the answer: {exc}")
            ran += 1
