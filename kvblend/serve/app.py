"""The HTTP routes: OpenAI's chat completions and models, plus /health and /metrics.

A request is parsed, queued for the model worker, and its events (tokens, then
the result or an error) become a JSON response or server-sent events. The
status is decided by the first event, before any byte is sent: a streamed
request that fails (unknown document, prompt too long) still gets its 404 or
400, not a 200 with an error inside. While a request waits or decodes, a
client that disconnects cancels it (kvblend.serve.worker).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvblend.errors import ArchiveBusyError, ArchiveUnavailableError, KvblendError, NotFoundError, UsageError
from kvblend.pipeline.query import ContextLengthError
from kvblend.pipeline.results import QueryResult
from kvblend.serve.chunks import segment_source
from kvblend.serve.metrics import Metrics
from kvblend.serve.responses import (
    chunk_body,
    completion_body,
    completion_id,
    finish_reason,
    kvblend_report,
    models_body,
    request_share,
    usage,
)
from kvblend.serve.schema import ApiError, ChatRequest, parse_body, parse_chat_request
from kvblend.serve.worker import Job, ModelWorker

log = logging.getLogger("kvblend.serve")
DISCONNECT_POLL_S = 0.2
CLIENT_CLOSED = 499  # nginx's "client closed request": counted, never sent


def error_for(exc: BaseException) -> ApiError:
    """The HTTP answer to a failure: the user's mistakes are 4xx, only our own faults are 5xx."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, NotFoundError):
        return ApiError(404, str(exc), "not_found")
    if isinstance(exc, ContextLengthError):
        return ApiError(400, str(exc), "context_length_exceeded")
    if isinstance(exc, UsageError):
        return ApiError(400, str(exc), "invalid_value")
    if isinstance(exc, ArchiveBusyError):
        return ApiError(503, str(exc), "archive_busy", type="server_error")
    if isinstance(exc, ArchiveUnavailableError):
        return ApiError(503, str(exc), "archive_unavailable", type="server_error")
    if isinstance(exc, KvblendError):
        return ApiError(500, str(exc), "archive_error", type="server_error")
    log.error("request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", "internal_error", type="server_error")


def create_app(worker: ModelWorker, metrics: Metrics, model: str, archive: Path) -> FastAPI:
    """The ASGI app around a started engine; the worker runs for the app's lifespan."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await worker.stop()

    app = FastAPI(title="kvblend", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    def closed() -> Response:
        metrics.request(CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)

    def refuse(exc: ApiError) -> JSONResponse:
        metrics.request(exc.status)
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "http_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), code).body(), status_code=exc.status_code)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        try:
            req = parse_chat_request(parse_body(await request.body()))
            job = worker.submit(req)
        except ApiError as exc:
            return refuse(exc)
        first = await next_event(request, job)
        if first[0] == "error":
            return refuse(error_for(first[1]))
        if first[0] == "cancelled":
            return closed()
        cid = completion_id()
        if req.stream:
            metrics.request(200)
            return StreamingResponse(sse(job, req, cid, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        kind, value = first
        while kind == "token":
            kind, value = await next_event(request, job)
        if kind != "done":
            return refuse(error_for(value)) if kind == "error" else closed()
        metrics.request(200)
        observe(value, job)
        return JSONResponse(completion_body(cid, model, value, req.max_tokens, job.queue_wait_s))

    async def sse(job: Job, req: ChatRequest, cid: str, first: tuple[str, Any]) -> AsyncIterator[str]:
        """The OpenAI stream: a role chunk, content deltas, a final chunk (finish_reason + kvblend), [DONE].

        Leaving early (the client went away: the response task is cancelled) cancels the job."""
        try:
            yield event(chunk_body(cid, model, {"role": "assistant", "content": ""}))
            kind, value = first
            started = False
            while kind == "token":
                text = value if started else value.lstrip()  # as the non-streamed answer, which is stripped
                started = started or bool(text)
                if text:
                    yield event(chunk_body(cid, model, {"content": text}))
                kind, value = await job.events.get()
            if kind == "done":
                observe(value, job)
                yield event(chunk_body(cid, model, {}, finish_reason(value, req.max_tokens),
                                       kvblend=kvblend_report(value, job.queue_wait_s)))
                if req.include_usage:
                    yield event({**chunk_body(cid, model, {}), "choices": [], "usage": usage(value)})
            elif kind == "error":
                yield event(error_for(value).body())
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # a no-op once done

    def observe(result: QueryResult, job: Job) -> None:
        sources = [segment_source(s) for s in result.segments]
        metrics.answered(result.ttft_s, request_share(result), sources)
        log.info("answered: %d prompt tokens, ttft %.3fs, recompute share %.3f, %d hit / %d computed, "
                 "queue wait %.3fs", result.prompt_tokens, result.ttft_s, request_share(result),
                 sources.count("hit"), sources.count("computed"), job.queue_wait_s)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(models_body(model, created))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "model": model, "archive": str(archive),
                             "queue_depth": worker.depth, "busy": worker.busy})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(worker.depth, worker.busy),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def next_event(request: Request, job: Job) -> tuple[str, Any]:
    """The job's next event; ('cancelled', None) as soon as the client disconnects (the job is cancelled)."""
    getter = asyncio.ensure_future(job.events.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
            if done:
                return getter.result()
            if await request.is_disconnected():
                job.cancel()
                return "cancelled", None
    finally:
        getter.cancel()


def event(payload: dict) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
