"""What real clients send to `kvblend serve`, through the official `openai` client (raw HTTP only for what a client
library would refuse to send): multi-turn chats, stop, logprobs, n, ignore_eos / min_tokens, legacy completions,
continuous batching that changes no answer, an API key from the environment, and a bounded archive.

What the HTTP edge refuses before the model (400, 401, 413, 429) is tested over a stub engine in
tests/unit/test_serve_app.py."""

from __future__ import annotations

import json
import math
import threading
import uuid

import openai
import pytest

from serve_support import PASSAGES, Server, ask, get, report

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


def test_the_archive_stays_under_its_bound_while_serving(tmp_path):
    """--max-archive-size evicts least-recently-used segments while serving; --max-stored-tokens caps what one
    request may store; every request is answered. The server takes its API key from $KVBLEND_API_KEY (what the
    key guards is tests/unit/test_serve_app.py's)."""
    from kvblend.archive import Archive

    srv = Server(tmp_path / "archive", tmp_path / "server.log", 4, "--max-archive-size", "12MB",
                 "--max-stored-tokens", "300", env={"KVBLEND_API_KEY": "k-123"})
    keys = []
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.client().models.list()
        client = srv.client(api_key="k-123")
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
