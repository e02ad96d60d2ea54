"""The model worker: one thread answers every request, in arrival order, from a bounded queue.

Fusion and decoding run one request at a time: on CPU two requests would only
share the same cores, and one thread owning the model (and every archive
write) keeps torch and LMDB free of cross-request races. Requests wait in an
asyncio queue; when `max_queue` already wait, a new one is refused at once
(429) rather than left to time out. A request's progress (tokens, then the
result or an error) comes back as events on its own asyncio queue. A client
that goes away sets its job's `cancelled` flag: a job still queued is skipped,
a running one stops at its next token (the token callback raises). Shutdown
refuses what waits (503) and gives the running request a grace period, after
which it is cut the same way and its client gets an error event, not a torn stream.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvblend.defaults import DEFAULT_MODE, DEFAULT_TOP_K
from kvblend.generation import SamplingConfig
from kvblend.pipeline.results import QueryOptions, QueryResult
from kvblend.prompt import PromptTemplate
from kvblend.serve.schema import ApiError, ChatRequest

if TYPE_CHECKING:
    from kvblend.pipeline.engine import Engine

log = logging.getLogger("kvblend.serve")


class Cancelled(Exception):
    """Raised from the token callback once the job's client has gone: it ends the decode loop."""


class Job:
    """One request on its way through the queue and the model thread."""

    def __init__(self, request: ChatRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.enqueued = time.perf_counter()
        self.queue_wait_s = 0.0
        self.abort: ApiError | None = None  # why the server cut it (None: its client left)

    def emit(self, kind: str, value: Any = None) -> None:
        """Hand an event to the request's handler (thread-safe): token, done, error or cancelled."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self, abort: ApiError | None = None) -> None:
        """Stop at the next token; `abort` is the error its client gets, if still listening."""
        self.abort = self.abort or abort
        self.cancelled.set()


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", "shutting_down", type="server_error")


def query_options(req: ChatRequest) -> QueryOptions:
    """The pipeline options for a request: client chunks replace retrieval unless top_k asks for both."""
    top_k = req.top_k if req.top_k is not None else (0 if req.chunks else DEFAULT_TOP_K)
    return QueryOptions(
        mode=req.mode or DEFAULT_MODE,
        ratio=req.ratio,
        top_k=top_k,
        docs=list(req.docs),
        context_texts=list(req.chunks),
        store_context=req.store,
        restore_missing=req.store,
        template=PromptTemplate(system=req.system) if req.system else PromptTemplate(),
        sampling=SamplingConfig(req.max_tokens, req.temperature, req.top_p, req.seed),
    )


def answer(engine: Engine, job: Job) -> QueryResult:
    """Run one request on the model thread, streaming tokens as events until cancelled."""

    def on_token(text: str) -> None:
        if job.cancelled.is_set():
            raise Cancelled()
        if text:
            job.emit("token", text)

    engine.refresh()  # documents another process ingested since the last request
    return engine.query(job.request.question, query_options(job.request), on_token=on_token,
                        on_warning=lambda msg: log.warning("%s", msg))


class ModelWorker:
    """The bounded queue in front of the one model thread."""

    def __init__(self, engine: Engine, max_queue: int):
        self.engine = engine
        self.max_queue = max_queue
        self.busy = False
        self.stopping = False
        self.current: Job | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvblend-model")
        self._queue: asyncio.Queue[Job] | None = None
        self._task: asyncio.Task | None = None

    @property
    def depth(self) -> int:
        """Requests waiting (not counting the one running)."""
        return self._queue.qsize() if self._queue is not None else 0

    def start(self) -> None:
        """Begin taking jobs (call inside the server's event loop)."""
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvblend-worker")

    def submit(self, request: ChatRequest) -> Job:
        """Queue a request, or refuse it with a 429 when `max_queue` requests already wait."""
        if self._queue is None or self.stopping:
            raise shutting_down()
        if self._queue.qsize() >= self.max_queue:
            raise ApiError(429, f"the server is busy: {self.max_queue} requests already wait for the model; "
                                "retry shortly", "rate_limit_exceeded", type="requests")
        job = Job(request, asyncio.get_running_loop())
        self._queue.put_nowait(job)
        return job

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            job = await self._queue.get()
            if job.cancelled.is_set():
                job.emit("cancelled")
                continue
            job.queue_wait_s = time.perf_counter() - job.enqueued
            self.busy, self.current = True, job
            try:
                await loop.run_in_executor(self._executor, self._execute, job)
            finally:
                self.busy, self.current = False, None

    def _execute(self, job: Job) -> None:
        """On the model thread: every outcome becomes exactly one final event."""
        try:
            result = answer(self.engine, job)
        except Cancelled:
            if job.abort is not None:
                job.emit("error", job.abort)
            else:
                job.emit("cancelled")
        except Exception as exc:  # reported to the client by app.error_for; a bug is logged there
            job.emit("error", exc)
        else:
            job.emit("done", result)

    def begin_shutdown(self, grace_s: float) -> None:
        """SIGTERM / Ctrl-C: refuse what waits now; the running request gets `grace_s` to finish."""
        self.stopping = True
        if self._queue is not None:
            while not self._queue.empty():
                self._queue.get_nowait().emit("error", shutting_down())
        asyncio.get_running_loop().call_later(grace_s, self._cut_current)

    def _cut_current(self) -> None:
        if self.current is not None:
            self.current.cancel(shutting_down())

    async def stop(self) -> None:
        """After shutdown: wait for the model thread to finish its step, so no archive write is
        cut short (each is a transaction that completes or never was)."""
        if not self.stopping:
            self.begin_shutdown(0)
        self._cut_current()
        if self._task is not None:
            self._task.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
