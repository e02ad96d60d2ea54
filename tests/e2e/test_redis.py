"""The archive on a real redis-server with the real default model: the installed `kvblend` and `kvblend serve`
against Redis as users run them, two serving nodes sharing one archive, evicted embeddings. (The server killed
mid-ingest and the LRU cache are in test_redis_faults.py: a module of their own, so xdist's loadscope runs
them beside these.)"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from redis_support import redis_server
from serve_support import Server, ask, report
from support import DOCS, one_line_error, run_cli

QUESTION = "Who manages the plant where the Tern-4 sonar is built?"
NAMES = ("plants.md", "sonar-products.md", "customers.md")


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """Three bundled documents: a small corpus to ingest quickly."""
    root = tmp_path_factory.mktemp("redis-docs") / "docs"
    root.mkdir()
    for name in NAMES:
        shutil.copy(DOCS / name, root / name)
    return root


@pytest.fixture(scope="module")
def ingested(docs, tmp_path_factory):
    """`kvblend ingest` of the three documents into Redis, done once: (the server's RDB snapshot, the ingest's
    JSON report). Tests that need the documents archived start their own server from a copy of the snapshot."""
    with redis_server() as server:
        report = json.loads(run_cli("ingest", docs, "--archive", server.url, "--compute", "cpu", "--json",
                                    check=True).stdout)
        server.cli("save")
        snapshot = tmp_path_factory.mktemp("redis-ingested") / "dump.rdb"
        shutil.copy(server.directory / "dump.rdb", snapshot)
    return snapshot, report


def query(archive: str, *args: str, timeout: float = 600, check: bool = False):
    return run_cli("query", QUESTION, "--archive", archive, "--compute", "cpu", "--max-tokens", "8", "--json",
                   *args, timeout=timeout, check=check)


def test_query_from_redis_answers_exactly_as_from_a_local_archive(ingested, docs, tmp_path):
    """Same ingest, same query: the KV read from Redis is the local archive's, so the answer is the same."""
    local = tmp_path / "local"
    run_cli("ingest", docs, "--archive", local, "--compute", "cpu", check=True)
    with redis_server(preload=ingested[0]) as server:
        _same_answer_from_redis_and_disk(server.url, local)


def _same_answer_from_redis_and_disk(redis_url: str, local) -> None:
    from_redis = json.loads(query(redis_url, "--no-prefix-cache", check=True).stdout)
    from_disk = json.loads(query(str(local), "--no-prefix-cache", check=True).stdout)
    assert from_redis["answer"] == from_disk["answer"] and from_redis["answer"]
    assert [s["key"] for s in from_redis["segments"]] == [s["key"] for s in from_disk["segments"]]
    assert all(s["cached"] for s in from_redis["segments"]) and not from_redis["warnings"]
    assert from_redis["recompute_share"] == from_disk["recompute_share"]
    ls = json.loads(run_cli("ls", "--archive", redis_url, "--json", check=True).stdout)
    assert sorted(d["name"] for d in ls) == sorted(NAMES) and all(d["missing_segments"] == 0 for d in ls)
    assert run_cli("verify", "--archive", redis_url).returncode == 0


def test_two_serving_nodes_share_one_archive(ingested, tmp_path):
    """Passages a client sends to node A are hits on node B, documents ingested with the CLI are retrieved by
    both, and when Redis dies a served request still answers by recomputing (retrieval alone is a 503)."""
    with redis_server(preload=ingested[0]) as server:
        _two_nodes(server.url, tmp_path)


def _two_nodes(redis_url: str, tmp_path) -> None:
    a = Server(redis_url, tmp_path / "a.log")
    try:
        b = Server(redis_url, tmp_path / "b.log")
        try:
            _shared_between(a, b, redis_url)
        finally:
            b.stop()
        _redis_goes_away(a, redis_url)
    finally:
        a.stop()
    assert "Traceback" not in (tmp_path / "a.log").read_text()


def _shared_between(a: Server, b: Server, redis_url: str) -> None:
    passages = [f"Passage {i}: the Tern-{i} sonar is tested in Bergen on pier {i}." for i in range(3)]
    first = ask(a.client(), passages, "Where is the Tern-1 tested?", max_tokens=4)
    second = ask(b.client(), passages, "Where is the Tern-1 tested?", max_tokens=4)
    assert [s["source"] for s in report(first)["segments"]] == ["computed"] * 3
    assert [s["source"] for s in report(second)["segments"]] == ["hit"] * 3
    assert report(second)["recompute_share"] < report(first)["recompute_share"]
    for node in (a, b):
        retrieved = node.client().chat.completions.create(
            model="kvblend", messages=[{"role": "user", "content": QUESTION}], max_tokens=2,
            extra_body={"kvblend": {"top_k": 2}})
        assert {s["document"] for s in report(retrieved)["segments"]} & set(NAMES)  # (client passages too)
        assert all(s["source"] == "hit" for s in report(retrieved)["segments"])
    stores = json.loads(run_cli("stats", "--archive", redis_url, "--json", check=True).stdout)
    assert stores["segments_stored_total"] == len(NAMES) + 3 + 1  # documents, passages, instruction prefix


def _redis_goes_away(a: Server, redis_url: str) -> None:
    """Redis dies under a running node: a request with its own passages still answers, by computing them in the
    prompt; a question that needs retrieval is a 503 naming Redis."""
    import openai
    import redis

    try:
        redis.Redis.from_url(redis_url).shutdown(nosave=True)
    except redis.exceptions.RedisError:  # the connection drops as the server exits
        pass
    alive = ask(a.client(), [f"Fresh passage {time.time()}: Kestrel labs are in Tromsø."],
                "Where are the Kestrel labs?", max_tokens=3)
    assert alive.choices[0].message.content is not None
    assert report(alive)["segments"][0]["source"] == "computed"
    with pytest.raises(openai.APIStatusError) as info:
        a.client().chat.completions.create(model="kvblend", messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=2)
    assert info.value.status_code == 503 and "cannot reach Redis" in str(info.value)


def test_evicted_retrieval_embeddings_come_back_with_the_next_ingest(ingested, docs):
    """Redis may evict any key, the shared embeddings hash too: retrieval then finds nothing, and re-running
    the same ingest embeds the stored segments again (no prefill) so questions are answered from them again."""
    import redis

    snapshot, first = ingested
    with redis_server(preload=snapshot) as server:
        client = redis.Redis.from_url(server.url)
        emb = [k for k in client.scan_iter(match="*:emb") if k.endswith(b":emb")]
        assert len(emb) == 1 and client.delete(*emb) == 1  # what an LRU eviction of that one key does
        assert "empty" in one_line_error(query(server.url))
        again = json.loads(run_cli("ingest", docs, "--archive", server.url, "--compute", "cpu", "--json",
                                   check=True).stdout)
        assert again["documents_unchanged"] == len(NAMES) and again["segments_new"] == 0
        assert again["embeddings_restored"] == first["segments_new"]
        answered = json.loads(query(server.url, check=True).stdout)
        assert answered["answer"] and {s["document"] for s in answered["segments"]} <= set(NAMES)
