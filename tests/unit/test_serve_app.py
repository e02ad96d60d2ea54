"""`kvblend serve`'s HTTP edge over a stub engine (serve_stub.py): validation (400), the API key (401), the body
limit (413), a full queue (429), the OpenAI error and response shapes, and /metrics. No model: FastAPI's
TestClient (an httpx client, so the official `openai` client runs over it too), or an in-process uvicorn where
a real socket matters. What needs the real model stays in tests/e2e/test_serve*.py."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from contextlib import contextmanager

import openai
import pytest
import uvicorn
from serve_stub import ANSWER, StubEngine, openai_client
from starlette.testclient import TestClient

from kvblend.pipeline.writebehind import WriteBehind
from kvblend.serve.app import create_app
from kvblend.serve.metrics import Metrics
from kvblend.serve.engine_core import EngineCore
from kvblend.serve.schema import ApiError, ChatRequest
from serve_support import PASSAGES, ask, free_port

QUESTION = "Where is the Skua-7 assembled?"
CHAT, LEGACY = "/v1/chat/completions", "/v1/completions"


@contextmanager
def serving(api_key: str | None = None, **stub_args) -> Iterator[tuple[TestClient, StubEngine]]:
    """The app around a stub engine, its lifespan running (the engine started, then stopped)."""
    engine = StubEngine(**stub_args)
    app = create_app(engine, Metrics(), "stub-model", "local", api_key)  # type: ignore[arg-type]  # a stub
    with TestClient(app) as http:
        yield http, engine
    assert engine.started and engine.stopped


@pytest.fixture(scope="module")
def app_client():
    with serving() as both:
        yield both


def post(http: TestClient, path: str, payload: dict | bytes) -> tuple[int, dict]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    reply = http.post(path, content=data, headers={"Content-Type": "application/json"})
    return reply.status_code, reply.json()


# moved from tests/e2e/test_serve_api.py (each started a real-model server to be refused before the model)
@pytest.mark.parametrize("body", [
    {"stop": ["a", "b", "c", "d", "e"]}, {"stop": 7}, {"stop": [""]}, {"n": 0}, {"n": 9}, {"n": "2"},
    {"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": "yes"},
    {"max_tokens": 4, "min_tokens": 9}, {"min_tokens": -1}, {"ignore_eos": "yes"}, {"max_completion_tokens": 0},
    {"messages": [{"role": "assistant", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"id": "x"}]},
                  {"role": "user", "content": "q2"}]},
    {"messages": [{"role": "tool", "content": "x"}, {"role": "user", "content": "q"}]},
    {"stream_options": {"include_usage": True}}, {"stream": True, "stream_options": {"include_usage": "no"}},
])
def test_malformed_new_parameters_are_400_in_openai_shape(app_client, body):
    http, engine = app_client
    asked = len(engine.requests)
    payload = {"model": "kvblend", "messages": [{"role": "user", "content": "Where?"}], **body}
    status, reply = post(http, CHAT, payload)
    assert status == 400, (body, reply)
    assert set(reply["error"]) == {"message", "type", "code", "param"}
    assert reply["error"]["param"].split(".")[0] in {*body, "messages"}, reply  # every 400 names the parameter
    assert len(engine.requests) == asked  # refused before the engine


@pytest.mark.parametrize("body", [{}, {"prompt": 5}, {"prompt": ""}, {"prompt": "x", "logprobs": 9},
                                  {"prompt": "x", "suffix": "y"}, {"prompt": "x", "logprobs": 1, "top_logprobs": 2}])
def test_malformed_legacy_completions_are_400(app_client, body):
    http, _ = app_client
    status, reply = post(http, LEGACY, {"model": "kvblend", **body})
    assert status == 400 and reply["error"]["code"] and reply["error"]["param"], (body, reply)


def test_json_nested_a_hundred_thousand_deep_is_a_400_not_a_500(app_client):
    http, _ = app_client
    status, reply = post(http, CHAT, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and reply["error"]["code"] == "invalid_json"
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("raw", [
    b'{"model": "kvblend", "messages": [{"role": "user", "content": "Where?"}], "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"model": "kvblend", "messages": [{"role": "user", "content": "Say \\ud800 please"}]}',
    b'{"model": "kvblend", "messages": [{"role": "system", "content": "\\ud83d"}, {"role": "user", "content": "q"}]}',
], ids=["5000-digit integer", "lone surrogate", "lone surrogate in system"])
def test_what_json_allows_but_no_request_means_is_a_400(app_client, raw):
    http, _ = app_client
    status, reply = post(http, CHAT, raw)
    assert status == 400 and reply["error"]["code"] == "invalid_json", reply


def test_errors_are_openai_shaped_with_the_right_status():
    """(The context-length and unknown-document cases need the model and an archive: tests/e2e/test_serve.py.)"""
    with serving() as (http, engine):
        status, body = post(http, CHAT, b'{"messages": [')
        assert status == 400 and body["error"]["code"] == "invalid_json"
        assert set(body["error"]) >= {"message", "type", "code"}
        client = openai_client(http)
        for extra in ({"tools": [{"type": "function", "function": {"name": "f"}}]}, {"frequency_penalty": 0.5}):
            with pytest.raises(openai.BadRequestError) as info:
                ask(client, [], "Q?", **extra)
            assert info.value.status_code == 400 and info.value.body["code"] == "unsupported_parameter"
            assert info.value.body["param"] == next(iter(extra))
        assert not engine.requests
        assert 'kvblend_requests_total{status="400"} 3.0' in http.get("/metrics").text


def test_an_api_key_guards_every_route_but_health():
    """(That `kvblend serve` takes the key from $KVBLEND_API_KEY is checked on a real server in
    tests/e2e/test_serve_api.py.)"""
    with serving(api_key="k-123") as (http, _):
        assert http.get("/health").status_code == 200
        with pytest.raises(openai.AuthenticationError) as info:
            ask(openai_client(http), PASSAGES[:1], QUESTION, max_tokens=2)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        assert info.value.response.headers["WWW-Authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError):
            openai_client(http, api_key="wrong").models.list()
        assert http.get("/metrics").status_code == 401
        ok = ask(openai_client(http, api_key="k-123"), PASSAGES[:1], QUESTION, max_tokens=2)
        assert ok.choices[0].message.content == "".join(ANSWER)


def test_a_full_queue_answers_429():
    with serving(max_queue=2) as (http, engine):
        client = openai_client(http)
        assert ask(client, PASSAGES[:1], QUESTION).choices[0].message.content  # room: answered
        engine.waiting += [ChatRequest(question="q")] * 2  # two wait for the model: the queue is full
        for _ in range(3):
            with pytest.raises(openai.RateLimitError) as info:
                ask(client, PASSAGES[:1], QUESTION)
            assert info.value.status_code == 429 and info.value.body["code"] == "rate_limit_exceeded"
            assert info.value.response.headers["Retry-After"] == "1"
        metrics = http.get("/metrics").text
        assert "kvblend_queue_depth 2.0" in metrics and 'kvblend_requests_total{status="429"} 3.0' in metrics
        assert 'kvblend_requests_total{status="200"} 1.0' in metrics


def test_the_scheduler_refuses_past_its_queue_and_batch_room_with_a_429():
    """The bound the stub stands in for: `max_queue` waiting requests, plus the places the batch is about to
    fill; one more is a 429 (no model thread runs: nothing is admitted)."""

    async def fill() -> ApiError:
        engine = SimpleNamespace(writes=WriteBehind())  # no model: nothing is admitted, so nothing runs
        scheduler = EngineCore(engine=engine, max_queue=2, max_batch=1)  # type: ignore[arg-type]
        for _ in range(3):
            scheduler.submit(ChatRequest(question="q"))
        assert scheduler.depth == 3
        with pytest.raises(ApiError) as info:
            scheduler.submit(ChatRequest(question="q"))
        return info.value

    refused = asyncio.run(fill())
    assert (refused.status, refused.code, refused.type) == (429, "rate_limit_exceeded", "requests")


def test_a_body_over_the_limit_is_a_413_and_the_server_goes_on():
    """Refused on its Content-Length, before the server reads (or tokenizes, on the model thread) 6 MB: over a
    real socket, the answer comes while the body never does."""
    with live_server() as (host, port):
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.putrequest("POST", LEGACY)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(6 << 20))
        conn.endheaders(b'{"prompt": "hello')  # the rest never comes: the answer must not wait for it
        reply = conn.getresponse()
        assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "request_too_large"
        conn.close()
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200


def test_a_body_over_the_limit_without_a_length_is_a_413_too(app_client):
    """A chunked body declares no length: it is counted as it arrives."""
    http, _ = app_client

    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(3):
            yield b"x" * (1 << 20)

    reply = http.post(LEGACY, content=body(), headers={"Content-Type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"


def test_answers_and_streams_parse_as_the_openai_types_with_the_kvblend_report(app_client):
    """Bodies built from the `openai` package's types: the client parses them, and `kvblend` rides along."""
    http, _ = app_client
    client = openai_client(http)
    chat = ask(client, PASSAGES, QUESTION, logprobs=True, top_logprobs=1)
    assert chat.object == "chat.completion" and chat.choices[0].message.content == "".join(ANSWER)
    assert [e.token for e in chat.choices[0].logprobs.content] == list(ANSWER)
    assert chat.usage.completion_tokens == len(ANSWER)
    assert {"ttft_s", "recompute_share", "segments", "queue_wait_s"} <= set(chat.model_extra["kvblend"])
    again = ask(client, PASSAGES, QUESTION)
    assert [s["source"] for s in again.model_extra["kvblend"]["segments"]] == ["hit", "hit"]

    chunks = list(ask(client, PASSAGES, QUESTION, n=2, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.created for c in chunks}) == 1  # stamped once per request, as OpenAI and vLLM do
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    for i in range(2):
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i) \
            == "".join(ANSWER)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["stop", "stop"]
    assert finals[0].model_extra["kvblend"]["segments"] and "kvblend" not in finals[1].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(ANSWER)

    legacy = client.completions.create(model="kvblend", prompt="P.\n<<<chunk>>>\nQ?", logprobs=0, max_tokens=4)
    assert legacy.object == "text_completion" and legacy.choices[0].text == "".join(ANSWER)
    assert legacy.choices[0].logprobs.text_offset == [0, len(ANSWER[0])]
    streamed = list(client.completions.create(model="kvblend", prompt="Q?", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "".join(ANSWER)
    assert [c.choices[0].finish_reason for c in streamed][-1] == "stop"
    assert [m.id for m in client.models.list().data] == ["stub-model"]


def test_metrics_are_prometheus_text_and_each_app_counts_its_own():
    """A registry per app: two apps in one process neither collide nor share counts."""
    with serving() as (first, _), serving() as (second, _):
        ask(openai_client(first), PASSAGES[:1], QUESTION)
        reply = first.get("/metrics")
        assert reply.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert 'kvblend_requests_total{status="200"} 1.0' in reply.text
        assert 'kvblend_segments_total{source="computed"} 1.0' in reply.text
        assert "kvblend_ttft_seconds_count 1.0" in reply.text and "_created" not in reply.text
        assert "kvblend_scheduler_submitted_total 1.0" in reply.text  # the scheduler's counts, sampled
        assert 'kvblend_scheduler_finished_total{status="stop"} 1.0' in reply.text
        assert "kvblend_requests_total{" not in second.get("/metrics").text


@contextmanager
def live_server() -> Iterator[tuple[str, int]]:
    """The app over a stub engine under a real uvicorn on a loopback port, in this process."""
    app = create_app(StubEngine(), Metrics(), "stub-model", "local")  # type: ignore[arg-type]  # a stub
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_the_model_loads_on_a_thread_that_ends_with_the_load_and_its_failure_reaches_the_caller():
    """serve loads its model off the main thread (kvblend.serve.server.in_a_thread_of_its_own), so that the
    model thread is the process's one OpenMP pool: the work runs elsewhere, the thread is gone afterwards,
    and an error (a bad --model) is raised in the caller, where the CLI turns it into one line."""
    from kvblend.errors import ModelNotFoundError
    from kvblend.serve.server import in_a_thread_of_its_own

    ran_on: list[threading.Thread] = []
    in_a_thread_of_its_own(lambda: ran_on.append(threading.current_thread()))
    assert ran_on and ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()

    def bad_model() -> None:
        raise ModelNotFoundError("no model at /nowhere")

    with pytest.raises(ModelNotFoundError, match="no model at /nowhere"):
        in_a_thread_of_its_own(bad_model)


def test_a_405_says_what_is_allowed(app_client):
    """The error handler rebuilt Starlette's 405 without its Allow header, which HTTP requires."""
    http, _ = app_client
    reply = http.get("/v1/chat/completions")
    assert reply.status_code == 405 and reply.headers["allow"] == "POST"


def test_a_client_gone_while_tokens_flow_is_noticed_not_decoded_to_max_tokens():
    """The disconnect check ran only when no event came for DISCONNECT_POLL_S: a non-streamed answer's tokens
    come every few tens of ms, so a client gone mid-answer (or an openai client's timed-out try, retried twice)
    decoded on to max_tokens."""
    from kvblend.serve.app import DISCONNECT_POLL_S, next_event
    from kvblend.serve.async_bridge import Job

    class Gone:
        async def is_disconnected(self) -> bool:
            return True

    loop = asyncio.new_event_loop()
    try:
        job = Job(ChatRequest(question="Q?"), loop)
        for _ in range(3):
            job.events.put_nowait(("token", None))
        assert loop.run_until_complete(next_event(Gone(), job)) == ("token", None)  # just asked: not again yet
        job.checked_at -= DISCONNECT_POLL_S
        assert loop.run_until_complete(next_event(Gone(), job)) == ("cancelled", None) and job.cancelled.is_set()
    finally:
        loop.close()
