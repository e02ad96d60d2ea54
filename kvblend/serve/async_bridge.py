"""The bridge between the event loop and the model thread: a request's handle and the events it receives.

A route submits a request and gets a Job; the model thread hands the job its
events (token, done, error, cancelled) with `emit`, which is safe from any
thread (the event loop's call_soon_threadsafe puts them on the job's asyncio
queue). A route that sees its client go away calls `cancel`, which only sets
a threading.Event: the model thread reads it at its next schedule and
nothing else of the scheduler's is touched from the event loop's side.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvblend.serve.schema import ApiError, ChatRequest

if TYPE_CHECKING:
    from kvblend.pipeline.results import QueryResult


@dataclass
class TokenEvent:
    """New text of one choice, and the tokens that made it (with log-probabilities when asked)."""

    choice: int
    text: str
    logprobs: list[dict] = field(default_factory=list)


@dataclass
class ChoiceResult:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict] | None


@dataclass
class Completed:
    """What a finished request's handler gets: the query report and every choice."""

    result: QueryResult
    choices: list[ChoiceResult]


class Job:
    """One request as its route sees it: the events the model thread sends it, and its cancel switch."""

    def __init__(self, request: ChatRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.enqueued = time.perf_counter()
        self.created = time.time()  # the reply's `created`, the same in every chunk of a stream
        self.queue_wait_s = 0.0  # set at admission, before any event: read by the route after its first event
        self.checked_at = time.monotonic()  # when the route last asked whether its client is still there

    def emit(self, kind: str, value: Any = None) -> None:
        """Hand an event to the request's handler (thread-safe): token, done, error or cancelled."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self) -> None:
        """The client went away: the model thread drops the request at its next step (a no-op once done)."""
        self.cancelled.set()


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", "shutting_down", type="server_error")
