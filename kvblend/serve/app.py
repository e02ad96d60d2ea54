"""The HTTP routes: OpenAI's chat completions, legacy completions and models, plus /health and /metrics.

A request is parsed, queued for the scheduler, and its events (tokens, then
the result or an error) become a JSON response or server-sent events. The
status is decided by the first event, before any byte is sent: a streamed
request that fails (unknown document, prompt too long) still gets its 404 or
400, not a 200 with an error inside. While a request waits or decodes, a
client that disconnects cancels it (kvblend.serve.async_bridge). With an API key
every route but /health needs it as a Bearer token, as vLLM's --api-key does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvblend.errors import (
    ArchiveBusyError,
    ArchiveUnavailableError,
    KvblendError,
    NonFiniteLogitsError,
    NotFoundError,
    UsageError,
)
from kvblend.pipeline.query import ContextLengthError
from kvblend.serve.async_bridge import Completed, Job, TokenEvent
from kvblend.serve.chunks import segment_source
from kvblend.serve.engine_core import EngineCore
from kvblend.serve.metrics import CONTENT_TYPE, Metrics
from kvblend.serve.responses import (
    chunk_body,
    completion_body,
    completion_id,
    kvblend_report,
    models_body,
    request_share,
    usage_chunk,
)
from kvblend.serve.schema import ApiError, ChatRequest, parse_body, parse_chat_request, parse_completion_request

log = logging.getLogger("kvblend.serve")
DISCONNECT_POLL_S = 0.2
CLIENT_CLOSED = 499  # nginx's "client closed request": counted, never sent
OPEN_PATHS = {"/health"}  # answered without the API key (load balancers' health checks)
MAX_BODY_BYTES = 1 << 20  # ~25 times the text of the default model's 8k-token context; tokenizing it takes ~2 s
BODY_BYTES_PER_CONTEXT_TOKEN = 64  # a long-context model's limit: its context in tokens, times this


def error_for(exc: BaseException, hidden: Sequence[str] = (), legacy: bool = False) -> ApiError:
    """The HTTP answer to a failure: the user's mistakes are 4xx, only our own faults are 5xx.

    `hidden`: the server's own paths (the archive directory and its real path), replaced in every message by
    "<archive>": an error names what went wrong, never where the server keeps its files. `legacy`: the request
    came to /v1/completions, whose prompt is `prompt`, not `messages`."""
    answer = _classify(exc, "prompt" if legacy else "messages")
    for path in sorted((p for p in hidden if p), key=len, reverse=True):
        answer.message = answer.message.replace(path, "<archive>")
    return answer


def _classify(exc: BaseException, prompt_param: str) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, NotFoundError):
        return ApiError(404, str(exc), "not_found")
    if isinstance(exc, ContextLengthError):  # a client asks for fewer segments with kvblend.top_k, not --top-k
        tokens = "max_tokens" if prompt_param == "prompt" else "max_completion_tokens (max_tokens)"
        return ApiError(
            400, exc.explain("kvblend.top_k, or fewer passages", tokens), "context_length_exceeded", param=prompt_param
        )
    if isinstance(exc, UsageError):
        return ApiError(400, str(exc), "invalid_value")
    if isinstance(exc, ArchiveBusyError):
        return ApiError(503, str(exc), "archive_busy", type="server_error")
    if isinstance(exc, ArchiveUnavailableError):
        return ApiError(503, str(exc), "archive_unavailable", type="server_error")
    if isinstance(exc, NonFiniteLogitsError):  # the server's --dtype, not the request
        return ApiError(500, str(exc), "model_error", type="server_error")
    if isinstance(exc, KvblendError):
        return ApiError(500, str(exc), "archive_error", type="server_error")
    log.error("request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", "internal_error", type="server_error")


def create_app(
    scheduler: EngineCore,
    metrics: Metrics,
    model: str,
    store: str,
    api_key: str | None = None,
    hidden_paths: Sequence[str] = (),
) -> FastAPI:
    """The ASGI app around a started engine; the scheduler runs for the app's lifespan."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        await scheduler.stop()

    app = FastAPI(title="kvblend", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    # A body is tokenized on the model thread, so one far over any context would freeze every stream for seconds.
    body_limit = max(MAX_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * (scheduler.engine.runner.max_positions or 0))

    def closed() -> Response:
        metrics.request(CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)

    def refuse(exc: ApiError) -> JSONResponse:
        metrics.request(exc.status)
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        if exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def unauthorized(scope: dict) -> Response | None:
        """The 401 for a request without the key (None: let it through)."""
        if not api_key or scope["path"] in OPEN_PATHS:
            return None
        given = Headers(scope=scope).get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), api_key.encode()):
            return None
        return refuse(
            ApiError(
                401,
                "Incorrect API key provided: pass it as a Bearer token (the key given to `kvblend serve --api-key`)",
                "invalid_api_key",
            )
        )

    # A plain ASGI middleware, not @app.middleware("http"): Starlette's BaseHTTPMiddleware hides the client's
    # disconnect from the route, so an abandoned non-streaming request ran to its end, holding a batch place.
    app.add_middleware(ApiKeyGuard, unauthorized=unauthorized)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "http_error"
        return JSONResponse(  # with Starlette's headers: a 405 must say what is Allow-ed
            ApiError(exc.status_code, str(exc.detail), code).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def complete(request: Request, parse: Callable[[dict], ChatRequest]) -> Response:
        try:
            req = parse(parse_body(await read_body(request, body_limit)))
            job = scheduler.submit(req)
        except ApiError as exc:
            return refuse(exc)
        except ClientDisconnect:
            return closed()
        first = await next_event(request, job)
        if first[0] == "error":
            return refuse(error_for(first[1], hidden_paths, req.legacy))
        if first[0] == "cancelled":
            return closed()
        cid, stamp = completion_id(req.legacy), int(job.created)
        if req.stream:
            metrics.request(200)
            return StreamingResponse(
                sse(job, req, cid, stamp, first),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        kind, value = first
        while kind == "token":
            kind, value = await next_event(request, job)
        if kind != "done":
            return refuse(error_for(value, hidden_paths, req.legacy)) if kind == "error" else closed()
        metrics.request(200)
        observe(value, job)
        return JSONResponse(completion_body(cid, model, value, job.queue_wait_s, req.legacy, stamp))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, parse_chat_request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, parse_completion_request)

    async def sse(job: Job, req: ChatRequest, cid: str, stamp: int, first: tuple[str, Any]) -> AsyncIterator[str]:
        """The OpenAI stream: per choice a role chunk (chat), text deltas, a final chunk (finish_reason; the
        first choice's also carries `kvblend`), then a usage chunk if asked, then [DONE].

        Leaving early (the client went away: the response task is cancelled) cancels the job."""
        try:
            if not req.legacy:
                for i in range(req.n):
                    yield event(chunk_body(cid, model, i, False, role=True, created=stamp))
            kind, value = first
            started = [req.legacy] * req.n  # a chat answer loses its leading whitespace, as unstreamed
            offsets = [0] * req.n  # legacy logprobs' text_offset counts from the answer's start
            while kind == "token":
                token: TokenEvent = value
                text = token.text if started[token.choice] else token.text.lstrip()
                started[token.choice] = started[token.choice] or bool(text)
                if text or token.logprobs:
                    body = chunk_body(
                        cid,
                        model,
                        token.choice,
                        req.legacy,
                        text,
                        logprobs=token.logprobs,
                        text_offset=offsets[token.choice],
                        created=stamp,
                    )
                    offsets[token.choice] += sum(len(e["token"]) for e in token.logprobs)
                    yield event(body)
                kind, value = await job.events.get()
            if kind == "done":
                observe(value, job)
                for choice in value.choices:
                    report = kvblend_report(value.result, job.queue_wait_s) if choice.index == 0 else None
                    yield event(
                        chunk_body(
                            cid,
                            model,
                            choice.index,
                            req.legacy,
                            finish=choice.finish_reason,
                            kvblend=report,
                            created=stamp,
                        )
                    )
                if req.include_usage:
                    yield event(usage_chunk(cid, model, req.legacy, value, stamp))
            elif kind == "error":
                yield event(error_for(value, hidden_paths, req.legacy).body())
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # a no-op once done

    def observe(done: Completed, job: Job) -> None:
        result = done.result
        sources = [segment_source(s) for s in result.segments]
        metrics.answered(result.ttft_s, request_share(result), sources)
        log.info(
            "answered: %d prompt tokens, %d choice(s), ttft %.3fs, recompute share %.3f, %d hit / %d computed, "
            "queue wait %.3fs",
            result.prompt_tokens,
            len(done.choices),
            result.ttft_s,
            request_share(result),
            sources.count("hit"),
            sources.count("computed"),
            job.queue_wait_s,
        )

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(models_body(model, created))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            {
                "status": "failed" if scheduler.failed else "ok",
                "model": model,
                "store": store,
                "queue_depth": scheduler.depth,
                "running": scheduler.running,
                "max_batch": scheduler.max_batch,
                "busy": scheduler.busy,
            },
            status_code=503 if scheduler.failed else 200,  # a load balancer takes a dead server out
        )

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(
            metrics.render(scheduler.depth, scheduler.busy, scheduler.running, scheduler.outcomes()),
            media_type=CONTENT_TYPE,
        )

    return app


async def next_event(request: Request, job: Job) -> tuple[str, Any]:
    """The job's next event; ('cancelled', None) as soon as the client disconnects (the job is cancelled).

    Asked every DISCONNECT_POLL_S whether events flow or not: a non-streamed answer's tokens come every few
    tens of ms, so a check made only when none came never ran once decoding began, and a client gone (or an
    openai client's timed-out try, retried twice) decoded on to max_tokens."""
    now = time.monotonic()
    if now - job.checked_at >= DISCONNECT_POLL_S:
        job.checked_at = now
        if await request.is_disconnected():
            job.cancel()
            return "cancelled", None
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


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 past `limit` bytes (a prompt that large is far over the model's context, and
    tokenizing it would hold the model thread for seconds); ClientDisconnect if the client leaves while
    sending it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit / (1 << 20):g} MiB", "request_too_large")


class ApiKeyGuard:
    """Answers 401 before the app when `unauthorized(scope)` says so (kvblend.serve.app.build_app)."""

    def __init__(self, app: Any, unauthorized: Callable[[dict], Response | None]):
        self.app, self.unauthorized = app, unauthorized

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        refusal = self.unauthorized(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await refusal(scope, receive, send)


def event(payload: dict) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
