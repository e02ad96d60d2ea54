"""The scheduler: every request's state, and the decision of what the model thread does next.

vLLM v1's shape, for a CPU and one small model. Each iteration of the model
thread (kvblend.serve.engine_core) is

    decision = scheduler.schedule()      which requests start, which prefill (in what order, for how long),
                                         which decode, which are dropped
    outcome  = executor.execute(decision)    the model work (kvblend.serve.executor)
    scheduler.update(outcome)            state transitions, and each request's events to its client

A request's state is its RequestStatus:

    WAITING ──admit──▶ PREFILLING ──first tokens──▶ DECODING ──every choice ends──▶ FINISHED_STOPPED / _LENGTH
       │                   │                           │
       └── client left, or the server cuts it (shutdown) ──▶ FINISHED_ABORTED;  a failure ──▶ FINISHED_ERROR

PREFILLING is everything before the first token: retrieval, prefilling the
passages the archive misses, streaming the cached KV and fusing. It runs in
slices (fuse_steps with row chunks, vLLM's chunked prefill) between decode
steps, under a time budget tied to the decode step's own duration, so a long
prompt arriving does not freeze the streams that are running; a request that
can only wait for another writer gives its turn to the next. DECODING
sequences all advance in one batched forward pass per step (on a CPU decoding
is bound by reading the weights), and sequences join and leave at any step.

Requests wait in a bounded queue (`max_queue`; one more is a 429). A client
that goes away cancels its request at the next schedule. Shutdown refuses what
waits (503) and gives running requests a grace period, after which their
clients get an error event, not a torn stream.

Threads and what they may touch. Three threads meet here: the event loop
(submit, shutdown, the /health and /metrics gauges), a timer (the end of the
shutdown grace period) and the model thread (schedule, update, and the
executor between them). Everything this class holds (the queue, the running
list, every Request's status and live-sequence count, the chores (the engine's write-behind queue), the
counters and flags) is guarded by its one lock, `_lock`; no method reads or
writes it outside the lock. A Request's working parts (its steps, its
Prepared, its Sequences and their KV) are the model thread's alone: the
executor uses them without the lock, and no other thread reads them. A Job's
`cancelled` is a threading.Event, set from the event loop and read here.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvblend.defaults import DEFAULT_MAX_BATCH
from kvblend.pipeline.writebehind import WriteBehind
from kvblend.serve.async_bridge import Completed, Job, TokenEvent, shutting_down
from kvblend.serve.schema import ApiError, ChatRequest
from kvblend.types import Steps

if TYPE_CHECKING:
    import asyncio

    from kvblend.generation import Delta, Sequence
    from kvblend.pipeline.query import Prepared

# Prefill time per iteration: what keeps the running streams' inter-token latency near ITL_FACTOR times a lone
# stream's, or MIN_ITL_S where that is longer (the decode step of the whole batch, plus this), and at least
# MIN_PREFILL_S so new requests progress. The floor: with kvblend's C decode step a lone step is ~12 ms, and
# 2.5x that left 15 ms prefill slices between decode steps of a few sequences each, so a prefill took ~60
# iterations and the batch rarely filled (8 clients streamed 1.06x one client's tokens, BENCHMARKS.md); a
# stream at 10 tokens a second while another request prefills still outpaces its reader.
ITL_FACTOR = 2.5
MIN_ITL_S = 0.1
MIN_PREFILL_S = 0.015
IDLE_PREFILL_S = 0.25  # nothing decoding: prefill in slices this long, so new arrivals are admitted between


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for a place in the batch
    PREFILLING = "prefilling"  # admitted: retrieval, stored misses, KV streaming and fusion, in slices
    DECODING = "decoding"  # first tokens out: in every batched decode step until each choice ends
    FINISHED_STOPPED = "stop"  # every choice ended on a stop token or stop string
    FINISHED_LENGTH = "length"  # a choice reached max_tokens
    FINISHED_ABORTED = "abort"  # its client went away, or the server cut it (shutdown)
    FINISHED_ERROR = "error"  # it failed; its client got the error

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


_ids = itertools.count(1)


class Request:
    """The scheduler's record of one request. `status` and `live` are the scheduler's (under its lock); `steps`,
    `prepared` and `sequences` are the model thread's working parts (see the module doc)."""

    def __init__(self, job: Job):
        self.id = next(_ids)
        self.job = job
        self.status = RequestStatus.WAITING
        self.admitted = 0.0
        self.live = job.request.n  # sequences not finished: places it holds in the batch
        self.steps: Steps[Prepared] | None = None  # from admission to the fused prompt
        self.prepared: Prepared | None = None
        self.sequences: list[Sequence] = []

    @property
    def chat(self) -> ChatRequest:
        return self.job.request


@dataclass
class SchedulerOutput:
    """One iteration's decision, for the executor."""

    dropped: list[Request] = field(default_factory=list)  # aborted: close their steps, free their KV
    start: list[Request] = field(default_factory=list)  # admitted now: build their steps
    prefill: list[Request] = field(default_factory=list)  # oldest first: the first that is not waiting runs
    background: list[Steps[None]] = field(default_factory=list)  # chores, when no request can use the time
    prefill_budget_s: float = 0.0  # prefill and chores stop at this much time
    decode: list[Request] = field(default_factory=list)  # one batched step for each unfinished sequence

    @property
    def empty(self) -> bool:
        return not (self.dropped or self.start or self.prefill or self.background or self.decode)


@dataclass
class ExecutorOutput:
    """What the model work did, for `update`."""

    failed: list[tuple[Request, BaseException]] = field(default_factory=list)
    first_tokens: list[tuple[Request, list[Delta]]] = field(default_factory=list)  # fused: one delta per choice
    decoded: list[tuple[Request, int, Delta]] = field(default_factory=list)  # (request, choice, what it added)
    completed: list[tuple[Request, Completed, Steps[None]]] = field(default_factory=list)  # and its bookkeeping
    chores_done: list[Steps[None]] = field(default_factory=list)
    decode_s: float = 0.0  # the batched decode step's duration (0: none ran)
    decode_batch: int = 0  # sequences in it


class Scheduler:
    """The bounded queue, the batch, every request's state, and what to run next."""

    def __init__(self, max_queue: int, max_batch: int = DEFAULT_MAX_BATCH, writes: WriteBehind | None = None):
        self.max_queue, self.max_batch = max_queue, max_batch
        self._lock = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # PREFILLING and DECODING, in admission order
        # the engine's write-behind queue: the writes after answers, run when no request can use the time
        self._background = writes if writes is not None else WriteBehind()
        self._stopping = False
        self._cut: ApiError | None = None  # the shutdown grace is over: every running request ends with this
        self._failed = False  # the model thread died (a bug): nothing will be answered any more
        self._counts: Counter[str] = Counter()  # submitted, and finished by status
        self._last_decode_s = 0.0
        self._lone_decode_s = 0.0  # a decode step of one sequence (running mean): the ITL streams are held to

    # ── the event loop's side ──
    @property
    def depth(self) -> int:
        """Requests waiting for admission (not counting the running ones)."""
        with self._lock:
            return len(self._waiting)

    @property
    def running(self) -> int:
        """Sequences admitted: prefilling or decoding."""
        with self._lock:
            return self._live()

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._running)

    @property
    def failed(self) -> bool:
        with self._lock:
            return self._failed

    def outcomes(self) -> dict[str, int]:
        """Requests submitted, and finished by status (stop, length, abort, error): for /metrics."""
        with self._lock:
            counts = {"submitted": self._counts["submitted"]}
            for status in RequestStatus:
                if status.finished:
                    counts[status.value] = self._counts[status.value]
            return counts

    def submit(self, chat: ChatRequest, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a request, or refuse it with a 429 when `max_queue` requests already wait (and with a 400 when
        its `n` choices alone exceed `max_batch`: they would all decode in one batch past the bound)."""
        if chat.n > self.max_batch:
            raise ApiError(
                400, f"n ({chat.n}) exceeds the server's --max-batch ({self.max_batch})", "invalid_value", param="n"
            )
        with self._lock:
            if self._stopping:
                raise shutting_down()
            if self._failed:
                raise ApiError(
                    503,
                    "the server's model thread failed; restart it (see its log)",
                    "model_failed",
                    type="server_error",
                )
            room = max(0, self.max_batch - self._live())  # places in the batch the model thread is about to fill
            if len(self._waiting) >= self.max_queue + room:
                raise ApiError(
                    429,
                    f"the server is busy: {self.max_queue} requests already wait for the model; retry shortly",
                    "rate_limit_exceeded",
                    type="requests",
                )
            job = Job(chat, loop)
            self._waiting.append(Request(job))
            self._counts["submitted"] += 1
            self._lock.notify()
        return job

    def begin_shutdown(self) -> None:
        """SIGTERM / Ctrl-C: refuse what waits now (503); running requests go on until `cut`."""
        with self._lock:
            self._stopping = True
            while self._waiting:
                self._finish(self._waiting.popleft(), RequestStatus.FINISHED_ABORTED, shutting_down())
            self._lock.notify()

    def cut(self) -> None:
        """The grace period is over (a timer's thread): every running request ends at the next schedule."""
        with self._lock:
            self._cut = shutting_down()
            self._lock.notify()

    # ── the model thread's side ──
    def wait_for_work(self) -> bool:
        """Block until there is something to do; False once stopping with nothing left to finish."""
        with self._lock:
            while not (self._waiting or self._running or self._background or self._stopping):
                self._lock.wait()
            return not (self._stopping and not self._running and not self._background)

    def schedule(self) -> SchedulerOutput:
        """Drop what was cancelled, admit what fits, and decide this iteration's prefill and decode work."""
        with self._lock:
            out = SchedulerOutput()
            for req in list(self._running):
                if req.job.cancelled.is_set() or self._cut is not None:
                    self._finish(req, RequestStatus.FINISHED_ABORTED, self._cut)
                    out.dropped.append(req)
            out.start = self._admit()
            out.prefill = [r for r in self._running if r.status is RequestStatus.PREFILLING]
            out.decode = [r for r in self._running if r.status is RequestStatus.DECODING]
            out.background = self._background.pending()
            if out.decode:
                lone = self._lone_decode_s or self._last_decode_s
                itl = max(ITL_FACTOR * lone, MIN_ITL_S)
                out.prefill_budget_s = max(MIN_PREFILL_S, itl - self._last_decode_s)
            else:
                out.prefill_budget_s = IDLE_PREFILL_S
            return out

    def _admit(self) -> list[Request]:
        """Waiting requests the batch has room for, oldest first (under the lock)."""
        admitted = []
        while self._waiting and not self._stopping:
            req = self._waiting[0]
            live = self._live()
            if live and live + req.chat.n > self.max_batch:
                break
            self._waiting.popleft()
            if req.job.cancelled.is_set():
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                continue
            req.admitted = time.perf_counter()
            req.job.queue_wait_s = req.admitted - req.job.enqueued
            req.status = RequestStatus.PREFILLING
            self._running.append(req)
            admitted.append(req)
        return admitted

    def update(self, out: ExecutorOutput) -> None:
        """Apply what the executor did: state transitions, each client's events, the next chores."""
        with self._lock:
            for req, exc in out.failed:
                if not req.status.finished:
                    self._finish(req, RequestStatus.FINISHED_ERROR, exc)
            for req, deltas in out.first_tokens:
                if req.status is RequestStatus.PREFILLING:
                    req.status = RequestStatus.DECODING
                    for choice, delta in enumerate(deltas):
                        _send(req, choice, delta)
            for req, choice, delta in out.decoded:
                if req.status is RequestStatus.DECODING:
                    _send(req, choice, delta)
            for req in self._running:
                req.live = sum(not s.finished for s in req.sequences) if req.sequences else req.chat.n
            for req, done, chore in out.completed:
                if req.status is RequestStatus.DECODING:
                    length = any(c.finish_reason == "length" for c in done.choices)
                    self._finish(req, RequestStatus.FINISHED_LENGTH if length else RequestStatus.FINISHED_STOPPED)
                    req.job.emit("done", done)
                    self._background.put(chore)
            for chore in out.chores_done:
                self._background.remove(chore)
            if out.decode_batch:
                self._last_decode_s = out.decode_s
                if out.decode_batch == 1:
                    lone = self._lone_decode_s
                    self._lone_decode_s = out.decode_s if not lone else 0.8 * lone + 0.2 * out.decode_s

    def fail_everything(self, exc: BaseException) -> list[Request]:
        """The model thread itself failed (a bug): every request ends with an error rather than hanging, and new
        ones get a 503 (/health says so). Returns the requests that were running, for their resources."""
        with self._lock:
            self._failed = True
            running = list(self._running)
            for req in [*running, *self._waiting]:
                self._finish(req, RequestStatus.FINISHED_ERROR, exc)
            self._waiting.clear()
            self._background.clear()
            return running

    def _finish(self, req: Request, status: RequestStatus, error: BaseException | None = None) -> None:
        """End a request (under the lock): out of the batch, counted, and its client told unless it finished
        well (then `update` sends the answer)."""
        req.status = status
        req.live = 0
        if req in self._running:
            self._running.remove(req)
        self._counts[status.value] += 1
        if status is RequestStatus.FINISHED_ERROR:
            req.job.emit("error", error)
        elif status is RequestStatus.FINISHED_ABORTED:
            req.job.emit("error", error) if error is not None else req.job.emit("cancelled")

    def _live(self) -> int:
        return sum(r.live for r in self._running)


def _send(req: Request, choice: int, delta: Delta) -> None:
    if delta.text or delta.logprobs:
        req.job.emit("token", TokenEvent(choice, delta.text, delta.logprobs))
