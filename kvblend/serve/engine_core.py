"""The engine core: one model thread that loops schedule → execute → update, and the face the routes see.

The routes submit requests and read gauges here; the model thread runs
kvblend.serve.scheduler's decision through kvblend.serve.executor and hands the
outcome back to the scheduler (vLLM v1's EngineCore.step). Which thread owns
what is written in kvblend.serve.scheduler's module doc.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvblend.defaults import DEFAULT_MAX_BATCH
from kvblend.serve.async_bridge import Job
from kvblend.serve.executor import ROWS_PER_STEP, Executor, release
from kvblend.serve.scheduler import Scheduler
from kvblend.serve.schema import ChatRequest
from kvblend.types import Steps

if TYPE_CHECKING:
    from kvblend.pipeline.engine import Engine
    from kvblend.pipeline.query import Prepared

log = logging.getLogger("kvblend.serve")


class EngineCore:
    """The bounded queue in front of the one model thread, which batches every running request."""

    def __init__(
        self,
        engine: Engine,
        max_queue: int,
        max_batch: int = DEFAULT_MAX_BATCH,
        rows_per_step: int = ROWS_PER_STEP,
        after_request: Callable[[Prepared], Steps[None]] | None = None,
        max_stored_tokens: int | None = None,
    ):
        self.engine = engine
        self.scheduler = Scheduler(max_queue, max_batch, engine.writes)
        self.executor = Executor(engine, rows_per_step, after_request, max_stored_tokens)
        self._thread = threading.Thread(target=self._run, name="kvblend-model", daemon=True)
        self._finished = threading.Event()

    # ── the event loop's side (gauges read under the scheduler's lock) ──
    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    @property
    def depth(self) -> int:
        """Requests waiting for admission (not counting the running ones)."""
        return self.scheduler.depth

    @property
    def running(self) -> int:
        """Sequences admitted: prefilling or decoding."""
        return self.scheduler.running

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def failed(self) -> bool:
        return self.scheduler.failed

    def outcomes(self) -> dict[str, int]:
        """Requests submitted, and finished by status: for /metrics."""
        return self.scheduler.outcomes()

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: ChatRequest) -> Job:
        """Queue a request (from the event loop), or refuse it with a 429 / 503 ApiError."""
        return self.scheduler.submit(request, asyncio.get_running_loop())

    def begin_shutdown(self, grace_s: float) -> None:
        """SIGTERM / Ctrl-C: refuse what waits now; running requests get `grace_s` to finish."""
        self.scheduler.begin_shutdown()
        timer = threading.Timer(grace_s, self.scheduler.cut)
        timer.daemon = True
        timer.start()

    async def stop(self) -> None:
        """After shutdown: wait for the model thread to finish its step, so no archive write is cut short."""
        self.scheduler.begin_shutdown()
        self.scheduler.cut()
        await asyncio.get_running_loop().run_in_executor(None, self._finished.wait)

    # ── the model thread ──
    def _run(self) -> None:
        try:
            while self.scheduler.wait_for_work():
                decision = self.scheduler.schedule()
                outcome = self.executor.execute(decision)
                self.scheduler.update(outcome)
        except BaseException:  # a bug in the loop itself: fail every request rather than hang them
            log.exception("the model thread failed")
            for req in self.scheduler.fail_everything(RuntimeError("the model thread failed")):
                with contextlib.suppress(Exception):  # already failing: free what can be freed
                    release(req)
        finally:
            self._finished.set()
