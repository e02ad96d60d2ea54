"""What real clients send to `kvblend serve`, through the official `openai` client (raw HTTP only for what a client
library would refuse to send): multi-turn chats, stop, logprobs, n, ignore_eos / min_tokens, legacy completions,
continuous batching that changes no answer, an API key, and a bounded archive."""

from __future__ import annotations

import json
import math
import threading
import uuid

import openai
import pytest

from serve_support import PASSAGES, Server, ask, get, post_raw, report

QUESTION = "Where is the Skua-7 assembled?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-api")
    srv = Server(root / "archive", root / "server.log", 8, "--max-batch", "8")
    yield srv
    srv.stop()
    assert "Traceback" not in (root / "server.log").read_text()


def test_the_openai_client_gets_multi_turn_stop_logprobs_n_ignore_eos_and_legacy_completions(server):
    client = server.client()
    parts = [{"type": "text", "text": t} for t in [*PASSAGES, QUESTION]]
    chat = client.chat.completions.create(model="kvblend", max_tokens=6, messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Which company builds survey drones?"},
        {"role": "assistant", "content": "Norrow Marine builds them."},
        {"role": "user", "content": parts}])
    assert chat.choices[0].message.content and [s["source"] for s in report(chat)["segments"]] == ["computed"] * 2

    plain = client.chat.completions.create(model="kvblend", max_tokens=8, messages=[{"role": "user", "content": parts}])
    text = plain.choices[0].message.content
    words = text.split()
    assert len(words) >= 3
    cut = client.chat.completions.create(model="kvblend", max_tokens=8, stop=[words[2], "\n\n"],
                                         messages=[{"role": "user", "content": parts}])
    assert cut.choices[0].finish_reason == "stop" and words[2] not in cut.choices[0].message.content
    assert text.startswith(cut.choices[0].message.content.strip())

    lp = client.chat.completions.create(model="kvblend", max_tokens=4, logprobs=True, top_logprobs=3,
                                        messages=[{"role": "user", "content": parts}])
    entries = lp.choices[0].logprobs.content
    assert len(entries) == lp.usage.completion_tokens > 0  # one entry per token
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the chosen token is the top one
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-5)

    two = client.chat.completions.create(model="kvblend", max_tokens=6, n=2, temperature=0.8, seed=7,
                                         messages=[{"role": "user", "content": parts}])
    assert [c.index for c in two.choices] == [0, 1] and all(c.message.content for c in two.choices)
    again = client.chat.completions.create(model="kvblend", max_tokens=6, n=2, temperature=0.8, seed=7,
                                           messages=[{"role": "user", "content": parts}])
    assert [c.message.content for c in again.choices] == [c.message.content for c in two.choices]  # seeded

    forced = client.chat.completions.create(model="kvblend", max_tokens=12, messages=[{"role": "user", "content": parts}],
                                            extra_body={"ignore_eos": True, "min_tokens": 12})
    assert forced.usage.completion_tokens == 12 and forced.choices[0].finish_reason == "length"

    legacy = client.completions.create(model="kvblend", max_tokens=5, logprobs=2,
                                       prompt="\n<<<chunk>>>\n".join([*PASSAGES, QUESTION]))
    assert legacy.object == "text_completion" and legacy.choices[0].text
    assert len(legacy.choices[0].logprobs.tokens) == len(legacy.choices[0].logprobs.token_logprobs) > 0
    assert [s["source"] for s in legacy.model_extra["kvblend"]["segments"]] == ["hit", "hit"]

    stream = client.chat.completions.create(model="kvblend", max_tokens=6, n=2, stream=True,
                                            messages=[{"role": "user", "content": parts}])
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts[0] == texts[1] and texts[0] and set(finishes) == {0, 1}  # greedy: two identical samples


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
def test_malformed_new_parameters_are_400_in_openai_shape(server, body):
    payload = {"model": "kvblend", "messages": [{"role": "user", "content": "Where?"}], **body}
    status, reply = post_raw(server.url + "/v1/chat/completions", json.dumps(payload).encode())
    assert status == 400, (body, reply)
    assert set(reply["error"]) >= {"message", "type", "code"}


@pytest.mark.parametrize("body", [{}, {"prompt": 5}, {"prompt": ""}, {"prompt": "x", "logprobs": 9},
                                  {"prompt": "x", "suffix": "y"}, {"prompt": "x", "logprobs": 1, "top_logprobs": 2}])
def test_malformed_legacy_completions_are_400(server, body):
    status, reply = post_raw(server.url + "/v1/completions", json.dumps({"model": "kvblend", **body}).encode())
    assert status == 400 and reply["error"]["code"], (body, reply)


def test_json_nested_a_hundred_thousand_deep_is_a_400_not_a_500(server):
    status, reply = post_raw(server.url + "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and reply["error"]["code"] == "invalid_json"
    assert get(server.url + "/health")[0] == 200


def test_batching_changes_no_answer(server):
    """The same greedy answers, token for token (and log-probabilities within 1e-4), whether each request ran
    alone or all of them ran together in one batch."""
    client = server.client()
    tag = uuid.uuid4().hex[:6]
    requests = [([f"{p} ({tag}-{i})" for p in PASSAGES], f"{q} ({i})")
                for i, q in enumerate(["Where is the Skua-7 assembled?", "Who sells the drones?",
                                       "Which office sells Norrow drones?", "What does Norrow Marine build?"])]

    def one(passages, question):
        r = ask(client, passages, question, max_tokens=10, logprobs=True, extra_body={"ignore_eos": True})
        return r.choices[0].message.content, [e.logprob for e in r.choices[0].logprobs.content]

    alone = [one(*r) for r in requests]  # also stores the passages: the batched run hits, as the alone run did not
    alone = [one(*r) for r in requests]
    together: list = [None] * len(requests)

    def run(i):
        together[i] = one(*requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (text_alone, lp_alone), (text_batched, lp_batched) in zip(alone, together):
        assert text_batched == text_alone
        assert all(abs(a - b) < 1e-4 for a, b in zip(lp_alone, lp_batched))


def test_health_shows_no_paths_and_documents_are_named_as_ingested(server):
    health = json.loads(get(server.url + "/health")[1])
    assert set(health) >= {"status", "model", "store", "queue_depth", "running", "max_batch"}
    assert "/" not in json.dumps(health).replace("127.0.0.1", "")  # no filesystem path of the server's


def test_an_api_key_guards_every_route_but_health(tmp_path):
    srv = Server(tmp_path / "archive", tmp_path / "server.log", 4, env={"KVBLEND_API_KEY": "k-123"})
    try:
        assert get(srv.url + "/health")[0] == 200
        with pytest.raises(openai.AuthenticationError) as info:
            ask(srv.client(), PASSAGES[:1], QUESTION, max_tokens=2)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        assert ask(srv.client(api_key="k-123"), PASSAGES[:1], QUESTION, max_tokens=2).choices[0].message.content
    finally:
        srv.stop()


def test_the_archive_stays_under_its_bound_while_serving(tmp_path):
    """--max-archive-size evicts least-recently-used segments while serving; --max-stored-tokens caps what one
    request may store; every request is answered."""
    from kvblend.archive import Archive

    srv = Server(tmp_path / "archive", tmp_path / "server.log", 4, "--max-archive-size", "12MB",
                 "--max-stored-tokens", "300")
    keys = []
    try:
        client = srv.client()
        for i in range(4):  # ~220 tokens each, stored: ~4-5 MB of KV apiece, so four pass the 12 MB bound
            passage = f"Record {i}: " + " ".join(f"the harbour logbook entry {i}.{j} names vessel {j}." for j in range(18))
            r = ask(client, [passage], "Which vessel is named first?", max_tokens=2)
            assert r.choices[0].message.content is not None
            (segment,) = report(r)["segments"]
            assert segment["source"] == "computed" and segment["tokens"] <= 300
            keys.append(segment["key"])
        big = " ".join(f"filler sentence number {j} about nothing." for j in range(80))  # > 300 tokens
        r = ask(client, [big], "What is this?", max_tokens=2)
        assert r.choices[0].message.content is not None
    finally:
        srv.stop()
    with Archive.open(tmp_path / "archive", readonly=True) as ar:
        assert ar.size_bytes(include_index=False) <= 12_000_000
        kept = [key for key in keys if ar.has_segment(key)]
        assert keys[-1] in kept and len(kept) < len(keys), kept  # stored, then the least recently used evicted
        assert not any(rec.n_tokens > 300 for rec in ar.iter_segments() if rec.extra.get("role") != "prefix")


@pytest.mark.parametrize("raw", [
    b'{"model": "kvblend", "messages": [{"role": "user", "content": "Where?"}], "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"model": "kvblend", "messages": [{"role": "user", "content": "Say \\ud800 please"}]}',
    b'{"model": "kvblend", "messages": [{"role": "system", "content": "\\ud83d"}, {"role": "user", "content": "q"}]}',
], ids=["5000-digit integer", "lone surrogate", "lone surrogate in system"])
def test_what_json_allows_but_no_request_means_is_a_400(server, raw):
    status, reply = post_raw(server.url + "/v1/chat/completions", raw)
    assert status == 400 and reply["error"]["code"] == "invalid_json", reply


def test_a_body_over_the_limit_is_a_413_and_the_server_goes_on(server):
    """Refused on its Content-Length, before the server reads (or tokenizes, on the model thread) 6 MB."""
    import http.client

    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(6 << 20))
    conn.endheaders(b'{"prompt": "hello')  # the rest never comes: the answer must not wait for it
    reply = conn.getresponse()
    assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "request_too_large"
    conn.close()
    assert get(server.url + "/health")[0] == 200


def test_a_tiny_temperature_is_greedy_and_the_server_goes_on(server):
    """temperature 1e-39 overflowed the logits to inf and killed the model thread: every later request hung."""
    client = server.client()
    greedy = ask(client, PASSAGES, QUESTION, max_tokens=6)
    tiny = ask(client, PASSAGES, QUESTION, max_tokens=6, temperature=1e-39)
    assert tiny.choices[0].message.content == greedy.choices[0].message.content
    assert json.loads(get(server.url + "/health")[1])["status"] == "ok"


def test_streaming_sends_whole_characters_and_logprob_bytes_rebuild_them(server):
    """A character spanning tokens decodes to U+FFFD until its last byte: the stream holds it back (it used to
    send the U+FFFD), and each token's logprob bytes are its own bytes, which join to the answer."""
    client = server.client()
    parts = ["In Japanese, thank you is written ありがとう.", "Write the Japanese word for thank you, in Japanese script."]
    messages = [{"role": "user", "content": [{"type": "text", "text": t} for t in parts]}]
    kw = {"model": "kvblend", "messages": messages, "max_tokens": 16, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(logprobs=True, **kw)
    text = whole.choices[0].message.content
    assert any(ord(ch) > 0x3000 for ch in text), text  # the test needs a multi-byte answer
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text
    joined = b"".join(bytes(e.bytes) for e in whole.choices[0].logprobs.content)
    assert joined.decode("utf-8", "replace").lstrip() == text


def test_min_tokens_holds_stop_strings_too(server):
    """vLLM checks no stop string before min_tokens, not only no end-of-sequence."""
    client = server.client()
    plain = ask(client, PASSAGES, QUESTION, max_tokens=10, extra_body={"ignore_eos": True})
    first_word = plain.choices[0].message.content.split()[0]
    held = ask(client, PASSAGES, QUESTION, max_tokens=10, stop=[first_word], extra_body={"min_tokens": 8})
    assert held.usage.completion_tokens >= 8 and held.choices[0].message.content.startswith(first_word)


def test_legacy_logprobs_zero_and_streamed_text_offsets(server):
    client = server.client()
    prompt = "\n<<<chunk>>>\n".join([*PASSAGES, QUESTION])
    zero = client.completions.create(model="kvblend", max_tokens=5, logprobs=0, prompt=prompt)
    assert zero.choices[0].logprobs is not None and len(zero.choices[0].logprobs.token_logprobs) == 5
    offsets = []
    for chunk in client.completions.create(model="kvblend", max_tokens=5, logprobs=0, prompt=prompt, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            offsets += chunk.choices[0].logprobs.text_offset
    assert offsets == zero.choices[0].logprobs.text_offset and offsets[-1] > 0


def test_a_client_that_leaves_before_its_answer_frees_its_place(server):
    """A non-streaming request whose client closed the connection is cancelled (it ran to its end, holding its
    place in the batch, while other clients got 429s)."""
    import socket
    import time

    body = json.dumps({"model": "kvblend", "max_tokens": 2000, "ignore_eos": True,
                       "messages": [{"role": "user", "content": f"{PASSAGES[0]}\n<<<chunk>>>\nTell me a story."}]}
                      ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 60
        while json.loads(get(server.url + "/health")[1])["running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    left = time.monotonic()
    while json.loads(get(server.url + "/health")[1])["running"]:
        assert time.monotonic() - left < 15, "the abandoned request still runs"  # 2000 tokens: minutes
        time.sleep(0.2)
