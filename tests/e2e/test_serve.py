"""`kvblend serve` as a user runs it: the installed script in a subprocess on a free loopback
port, the real default model, and the official `openai` client. (What the HTTP edge decides before the model,
such as validation and a full queue's 429, is tested over a stub engine in tests/unit/test_serve_app.py.)

Kept small for a CPU: short passages and questions, max_tokens of a few tokens.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import openai
import pytest

from serve_support import PASSAGES, TOKENS, Server, ask, get, report
from support import run_cli


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    srv = Server(root / "archive", root / "server.log", 4, "--max-batch", "4")
    yield srv
    srv.stop()


def test_health_and_models(server):
    status, body = get(server.url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


def test_client_chunks_hit_on_the_second_request(server):
    client = server.client()
    tag = uuid.uuid4().hex[:8]  # passages this archive has never seen
    passages = [f"{p} Batch {tag}." for p in PASSAGES]
    ask(client, [f"Warm-up {tag}."], "Hi?", max_tokens=1)  # archives the instruction prefix: both requests reuse it
    first = ask(client, passages, "Where is the Skua-7 assembled?", max_tokens=6)
    second = ask(client, passages, "Where is the Skua-7 assembled?", max_tokens=6)
    assert [s["source"] for s in report(first)["segments"]] == ["computed", "computed"]
    assert [s["source"] for s in report(second)["segments"]] == ["hit", "hit"]
    assert report(second)["recompute_share"] < report(first)["recompute_share"]
    assert second.choices[0].message.content == first.choices[0].message.content  # temperature 0
    assert first.choices[0].message.content
    assert {"ttft_s", "load_wait_s"} <= set(report(second)) and report(second)["ttft_s"] > 0
    assert second.usage.completion_tokens <= 6 and second.usage.prompt_tokens > 0


def test_store_false_computes_without_storing(server):
    client = server.client()
    passages = [f"Unstored note {uuid.uuid4().hex[:8]}: the buoy is yellow."]
    for _ in range(2):
        r = ask(client, passages, "What colour is the buoy?", extra_body={"kvblend": {"store": False}})
        assert [s["source"] for s in report(r)["segments"]] == ["computed"]


def test_streaming_matches_the_non_streamed_answer(server):
    client = server.client()
    plain = ask(client, PASSAGES, "Who sells the Skua-7?")
    stream = ask(client, PASSAGES, "Who sells the Skua-7?", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert text.strip() == plain.choices[0].message.content
    assert len(finals) == 1 and finals[0].model_extra["kvblend"]["segments"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_a_document_ingested_meanwhile_is_visible_without_restart(server, tmp_path):
    doc = tmp_path / "harbour.md"
    doc.write_text("Harbour notes. The pilot boat Tern is moored at berth nine in Lerwick.\n")
    client = server.client()
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="kvblend", messages=[{"role": "user", "content": "Where is Tern?"}],
                                       max_tokens=TOKENS, extra_body={"kvblend": {"docs": [str(doc)]}})
    assert info.value.body["code"] == "not_found"
    run_cli("ingest", doc, "--archive", server.archive, "--compute", "cpu", check=True)
    pinned = client.chat.completions.create(model="kvblend", messages=[{"role": "user", "content": "Where is Tern?"}],
                                            max_tokens=TOKENS, extra_body={"kvblend": {"docs": [str(doc)]}})
    assert [s["document"] for s in report(pinned)["segments"]] == ["harbour.md"]  # the name as ingested: no server path reaches a client
    assert report(pinned)["segments"][0]["source"] == "hit"
    retrieved = client.chat.completions.create(model="kvblend", max_tokens=TOKENS, extra_body={"kvblend": {"top_k": 1}},
                                               messages=[{"role": "user", "content": "Which berth is the pilot boat at?"}])
    assert report(retrieved)["segments"][0]["document"] == "harbour.md"


def test_errors_are_openai_shaped_with_the_right_status(server):
    """The refusals that need the model's context and the archive (validation's: tests/unit/test_serve_app.py)."""
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, ["word " * 9000], "Q?")
    assert info.value.status_code == 400 and info.value.body["code"] == "context_length_exceeded"
    assert set(info.value.body) >= {"message", "type", "code"}
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, PASSAGES, "Q?", max_tokens=100_000, stream=True)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        ask(client, [], "Q?", extra_body={"kvblend": {"docs": ["no/such/doc.md"]}})
    metrics = get(server.url + "/metrics")[1]
    assert 'kvblend_requests_total{status="400"}' in metrics and 'kvblend_requests_total{status="404"}' in metrics


def run_clients(server: Server, clients: int, per_client: int) -> list:
    """`clients` threads, each asking `per_client` questions in turn; every outcome is kept."""
    outcomes: list = []
    lock = threading.Lock()

    def one(i: int) -> None:
        client = server.client()
        for j in range(per_client):
            try:
                got = ask(client, PASSAGES[:1], f"Client {i} question {j}: where is the drone built?", max_tokens=2)
            except openai.APIStatusError as exc:
                got = exc
            with lock:
                outcomes.append(got)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def test_eight_concurrent_clients_are_all_answered(server):
    outcomes = run_clients(server, clients=8, per_client=4)
    assert len(outcomes) == 32
    errors = [o for o in outcomes if isinstance(o, Exception)]
    assert not errors, errors[:3]
    assert len({o.id for o in outcomes}) == 32
    computed = [o for o in outcomes if report(o)["segments"][0]["source"] == "computed"]
    assert len(computed) <= 1  # the passage is stored by whichever request saw it first


def test_a_client_that_disconnects_cancels_its_generation(server):
    client = server.client()
    stream = ask(client, PASSAGES, "Tell me a very long story about the drone.", max_tokens=400, stream=True)
    for n, _ in enumerate(stream):
        if n == 2:
            break
    stream.close()
    started = time.perf_counter()
    after = ask(client, PASSAGES, "Who sells the Skua-7?")
    # 400 tokens would take minutes on a CPU; the cancelled stream stopped at its next token.
    assert report(after)["queue_wait_s"] < 30 and time.perf_counter() - started < 60
