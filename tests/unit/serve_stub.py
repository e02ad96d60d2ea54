"""A stub engine for `kvblend serve`'s app: what the routes drive (EngineCore's event-loop side: submit,
depth, running, busy, failed, outcomes), answering every request at once with scripted text instead of a model.

Issue 35 asks for it: what the HTTP edge decides (validation, 400/401/413/429, the error shape, the response
and stream shapes, /metrics) needs no model, so its tests run in milliseconds over FastAPI's TestClient (or an
in-process uvicorn where a real socket matters). What needs the model stays in tests/e2e.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import openai
from starlette.testclient import TestClient

from kvblend.pipeline.results import QueryResult, SegmentInfo
from kvblend.serve.async_bridge import ChoiceResult, Completed, Job, TokenEvent
from kvblend.serve.schema import ApiError, ChatRequest

ANSWER = ("Hal", "ifax")  # the tokens every choice streams


class StubEngine:
    """Answers each request at submit time with ANSWER (each passage a hit once it was seen before); refuses
    with the scheduler's 429 while `waiting` holds `max_queue` requests (a test fills it)."""

    def __init__(self, max_queue: int = 4, max_batch: int = 4, max_positions: int = 8192):
        self.engine = SimpleNamespace(runner=SimpleNamespace(max_positions=max_positions))
        self.max_queue, self.max_batch = max_queue, max_batch
        self.failed = False
        self.started = self.stopped = False
        self.waiting: list[ChatRequest] = []  # requests the stub pretends wait for the model
        self.requests: list[ChatRequest] = []  # every request that reached it, validated
        self.seen: set[str] = set()

    @property
    def depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return 0

    @property
    def busy(self) -> bool:
        return False

    def outcomes(self) -> dict[str, int]:
        """What the scheduler counts for /metrics: every request it took finished at once, with "stop"."""
        done = len(self.requests)
        return {"submitted": done, "stop": done, "length": 0, "abort": 0, "error": 0}

    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def submit(self, request: ChatRequest) -> Job:
        if len(self.waiting) >= self.max_queue:
            raise ApiError(429, "the server is busy; retry shortly", "rate_limit_exceeded", type="requests")
        self.requests.append(request)
        job = Job(request, asyncio.get_running_loop())
        choices = []
        for i in range(request.n):
            for piece in ANSWER:
                job.emit("token", TokenEvent(i, piece, [_logprob(piece)] if request.logprobs else []))
            logprobs = [_logprob(p) for p in ANSWER] if request.logprobs else None
            choices.append(ChoiceResult(i, "".join(ANSWER), list(range(len(ANSWER))), "stop", logprobs))
        job.emit("done", Completed(self._result(request), choices))
        return job

    def _result(self, request: ChatRequest) -> QueryResult:
        segments = [SegmentInfo(f"k{i}", None, len(c.split()), c in self.seen) for i, c in enumerate(request.chunks)]
        self.seen.update(request.chunks)
        prompt = 10 + sum(s.tokens for s in segments)
        return QueryResult(
            answer="".join(ANSWER),
            mode=request.mode or "blend",
            ratio=request.ratio,
            ttft_s=0.01,
            load_wait_s=0.0,
            prompt_tokens=prompt,
            recomputed_tokens=1,
            recompute_share=0.1,
            segments=segments,
            tokens_per_s=100.0,
            timings={},
            warnings=[],
        )


def _logprob(piece: str) -> dict:
    entry = {"token": piece, "logprob": -0.5, "bytes": list(piece.encode())}
    return {**entry, "top_logprobs": [entry]}


def openai_client(http: TestClient, api_key: str = "unused") -> openai.OpenAI:
    """The official client, talking to the app in this process (TestClient is an httpx client)."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key, http_client=http, max_retries=0)
