"""The archive on a real redis-server (single node and a three-master cluster): the same archive API as a
local directory, one key per segment layer, records written last, claims, eviction as a miss, faults as one line."""

from __future__ import annotations

import json
import threading

import pytest
import redis

from archive_helpers import N_LAYERS, TOKENS, layers, put, same
from kvblend.archive import Archive, DocumentRecord, SegmentRecord
from kvblend.archive.redis_store import Keys
from kvblend.errors import (
    ArchiveModelMismatchError,
    ArchiveVersionError,
    CorruptBlobError,
)
from redis_support import free_port, redis_server
from support import one_line_error, run_cli


def open_redis(url: str, **kw) -> Archive:
    return Archive.open(url, model_name="tiny", model_fingerprint="fp-tiny", **kw)


@pytest.mark.parametrize("codec", ["lossless", "int8", "int4"])
def test_round_trip_and_bytes_per_token_match_the_local_archive(redis_url, tmp_path, codec):
    """The same payloads, byte for byte, so bytes per token on Redis equal the local archive's for every codec."""
    with open_redis(redis_url) as remote, Archive.open(tmp_path / "local", model_name="tiny",
                                                       model_fingerprint="fp-tiny") as local:
        for ar in (remote, local):
            for i in range(3):
                ar.put_segment(SegmentRecord(key=f"seg{i}", token_ids=list(range(TOKENS)), text=f"text {i}"),
                               layers(i), codec=codec)
        for i in range(3):
            for layer in range(N_LAYERS):
                k, v = remote.read_layer(f"seg{i}", layer)
                lk, lv = local.read_layer(f"seg{i}", layer)
                assert same(k, lk) and same(v, lv)
        r, s = remote.stats(), local.stats()
        assert r.store == "redis" and s.store == "local"
        # the same payloads (layer 0 also describes its segment: a timestamp may differ by a digit)
        assert r.bytes_per_token_stored == pytest.approx(s.bytes_per_token_stored, rel=0.01)
        assert r.segments == 3 and r.tokens == 3 * TOKENS and r.usage["redis_used_memory_bytes"] > 0


def test_documents_embeddings_side_tables_and_usage(redis_url):
    with open_redis(redis_url) as ar:
        for i in range(3):
            put(ar, f"seg{i}", seed=i)
        ar.replace_document(DocumentRecord(path="/docs/a.md", name="a.md", segment_keys=["seg0", "seg1"]))
        ar.replace_document(DocumentRecord(path="/docs/b.md", name="b.md", segment_keys=["seg1", "seg2"]))
        assert [d.name for d in ar.document_summaries()] == ["a.md", "b.md"]
        assert ar.find_document("a.md").path == "/docs/a.md" and ar.find_segment("seg1").key == "seg1"
        ar.put_embeddings([("seg0", [1.0, 2.0]), ("seg1", [3.0, 4.0])])
        keys, matrix = ar.get_embeddings()
        assert keys == ["seg0", "seg1"] and matrix.tolist() == [[1.0, 2.0], [3.0, 4.0]]
        ar.put_profile("p", {"read": 1}), ar.put_tuned("t", {"ratio": 0.2}), ar.set_meta("note", [1])
        assert ar.get_profile("p") == {"read": 1} and ar.get_tuned("t") == {"ratio": 0.2}
        assert ar.get_meta("note") == [1] and ar.get_meta("format_version") == 1
        assert ar.touch(["seg0", "seg0", "nope"]) == 1 and ar.get_segment("seg0") is not None
        assert {r.key: r.hits for r in ar.iter_segments()}["seg0"] == 1
        assert ar.remove_documents(["/docs/a.md"]) == ["/docs/a.md"]
        assert not ar.has_segment("seg0") and ar.has_segment("seg1")  # seg1 is b.md's too
        assert ar.get_embeddings(["seg0"])[0] == []


def test_a_segment_is_invisible_until_every_layer_and_then_its_record_are_stored(redis_url):
    """A writer killed between layers and record leaves no half segment: nothing lists it, gc removes its layers."""
    with open_redis(redis_url) as ar:
        store = ar.store
        rec = SegmentRecord(key="half", token_ids=list(range(TOKENS)), text="x", n_tokens=TOKENS)
        from kvblend.archive.records import describe

        rec = describe(rec, layers(0), "zstd-shuffle")
        rec.blob = "deadbeef"
        store._write_layers(rec, (b"payload %d" % i for i in range(N_LAYERS)))  # crashed before its record
        assert not ar.has_segment("half") and ar.count_segments() == 0
        report = ar.verify()
        assert report.ok and report.orphan_blobs == N_LAYERS
        gc = ar.gc()
        assert len(gc.orphan_blobs) == N_LAYERS and gc.freed_bytes > 0
        assert ar.verify().orphan_blobs == 0


def test_two_writers_of_one_segment_never_mix_their_layers(redis_url):
    """Two nodes storing the same key at once: one record wins, its layers are the ones read, the other's are
    garbage for gc; and claims let only one of them prefill."""
    with open_redis(redis_url) as a, open_redis(redis_url) as b:
        assert a.claim(["k1", "k2"]) == ["k1", "k2"] and b.claim(["k1", "k2", "k3"]) == ["k3"]
        errors = []

        def write(ar, seed):
            try:
                ar.put_segment(SegmentRecord(key="same", token_ids=list(range(TOKENS)), text="t"), layers(seed))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=write, args=(ar, seed)) for ar, seed in ((a, 1), (b, 2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        rec = a.get_segment("same")
        expected = layers(1) if same(a.read_layer(rec, 0)[0], layers(1)[0][0]) else layers(2)
        for layer in range(N_LAYERS):
            assert same(b.read_layer("same", layer)[1], expected[layer][1])
        assert a.verify().ok
        a.gc()
        assert a.verify().orphan_blobs == 0 and b.read_layer("same", 0) is not None


def test_an_evicted_layer_or_record_is_a_miss_that_verify_names_and_repair_drops(redis_url):
    with open_redis(redis_url) as ar:
        for i in range(3):
            put(ar, f"seg{i}", seed=i)
        ar.replace_document(DocumentRecord(path="/d.md", segment_keys=["seg0", "seg1", "seg2"]))
        keys, client = Keys(), ar.store.client
        client.delete(keys.layer("seg0", 2, ar.get_segment("seg0").blob))  # what allkeys-lru may do
        client.delete(keys.rec("seg1"))
        with pytest.raises(CorruptBlobError, match="missing from Redis"):
            ar.read_layer("seg0", 2)
        report = ar.verify()
        assert {p.key for p in report.problems} == {"seg0", "seg1"} and not report.ok
        fixed = ar.verify(repair=True)
        assert sorted(fixed.repaired_segments) == ["seg0", "seg1"] and fixed.repaired_documents == ["/d.md"]
        assert ar.verify().ok
        doc = ar.get_document("/d.md")
        assert doc.incomplete and doc.segment_keys == ["seg2"]


def test_gc_max_size_evicts_least_recently_used_first(redis_url):
    with open_redis(redis_url) as ar:
        for i in range(4):
            put(ar, f"seg{i}", seed=i)
        ar.touch(["seg0"])  # used last: kept
        one = ar.get_segment("seg0").stored_bytes
        report = ar.gc(max_size_bytes=2 * one)
        assert len(report.evicted) == 2 and "seg0" not in report.evicted
        assert ar.count_segments() == 2 and ar.has_segment("seg0")


def test_another_model_or_a_newer_format_is_refused_in_one_line(redis_url):
    with open_redis(redis_url) as ar:
        put(ar, "seg0")
    with pytest.raises(ArchiveModelMismatchError, match="built with model tiny"):
        Archive.open(redis_url, model_name="other", model_fingerprint="fp-other")
    client = redis.Redis.from_url(redis_url)
    client.hset(Keys().meta, "format_version", "99")
    with pytest.raises(ArchiveVersionError, match="v99 is newer"):
        Archive.open(redis_url)
    line = one_line_error(run_cli("ls", "--archive", redis_url))
    assert "v99 is newer" in line


def test_a_missing_archive_is_not_created_by_reading_commands(redis_url):
    line = one_line_error(run_cli("ls", "--archive", redis_url))
    assert "no archive at" in line and "kvblend ingest" in line
    assert redis.Redis.from_url(redis_url).dbsize() == 0


def test_faults_are_one_line_and_never_show_the_password(tmp_path):
    """Redis not running, a wrong password, a malformed URL: one line each, no traceback, no password."""
    port = free_port()
    down = run_cli("ls", "--archive", f"redis://127.0.0.1:{port}/0")
    assert "cannot reach Redis at redis://127.0.0.1:" in one_line_error(down) and down.returncode == 1
    with redis_server("--requirepass", "s3cret-pw") as server:
        url = f"redis://:wrong-pw@127.0.0.1:{server.port}/0"
        line = one_line_error(run_cli("stats", "--archive", url))
        assert "refused the credentials" in line and "wrong-pw" not in line
        good = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
        with Archive.open(good, model_name="tiny", model_fingerprint="fp-tiny") as ar:
            put(ar, "seg0")
        for argv in (["path", "--json"], ["stats", "--json"], ["ls", "--json"], ["verify", "--json"], ["stats"]):
            proc = run_cli(*argv, "--archive", good)
            assert proc.returncode == 0, proc.stderr
            assert "s3cret-pw" not in proc.stdout + proc.stderr, argv
        assert json.loads(run_cli("path", "--json", "--archive", good).stdout)["path"] == \
            f"redis://:***@127.0.0.1:{server.port}/0"
    for bad in ("redis://", "redis://host:notaport", "redis://h:1/x", "redis://:pw@h:99999/0"):
        proc = run_cli("ls", "--archive", bad)
        line = one_line_error(proc)
        assert proc.returncode == 2 and "Redis URL" in line or "database" in line or "port" in line, line
        assert "pw" not in line


def test_the_cluster_spreads_segments_over_its_masters(redis_cluster_nodes):
    url = redis_cluster_nodes[0].url
    import redis as redis_py

    redis_py.RedisCluster.from_url(url).flushall()
    with Archive.open(url, model_name="tiny", model_fingerprint="fp-tiny") as ar:
        assert ar.store.cluster
        for i in range(12):
            put(ar, f"seg{i:02d}", seed=i)
        ar.replace_document(DocumentRecord(path="/d.md", segment_keys=[f"seg{i:02d}" for i in range(12)]))
        for i in range(12):
            k, v = ar.read_layer(f"seg{i:02d}", N_LAYERS - 1)
            assert same(v, layers(i)[-1][1])
        got = ar.read_layers_raw([ar.get_segment(f"seg{i:02d}") for i in range(12)], 1)
        assert all(isinstance(x, bytes) for x in got)
        assert ar.verify().ok and ar.stats().usage["redis_nodes"] == 3
    per_node = [int(n.cli("dbsize").strip()) for n in redis_cluster_nodes]
    assert all(n > 0 for n in per_node), per_node  # KV spread over every master


def test_document_provenance_round_trips_and_follows_dropped_segments(redis_url):
    """format, pages and per-segment sources round-trip through Redis; a segment Redis lost takes its source
    with it when verify --repair drops it, and a record without them (an older kvblend's) still reads."""
    sources = [{"pages": [1, 1], "section": "Intro"}, {"pages": [2, 3], "section": "Specs"}, {"pages": [3, 3],
                                                                                            "section": None}]
    with open_redis(redis_url) as ar:
        for i in range(3):
            put(ar, f"seg{i}", seed=i)
        ar.replace_document(DocumentRecord(path="/d.pdf", name="d.pdf", segment_keys=["seg0", "seg1", "seg2"],
                                           format="pdf", pages=3, sources=sources))
        doc = ar.get_document("/d.pdf")
        assert (doc.format, doc.pages, doc.sources) == ("pdf", 3, sources)
        assert [s.format for s in ar.document_summaries()] == ["pdf"]
        ar.store.client.delete(Keys().rec("seg1"))  # what allkeys-lru may do
        ar.verify(repair=True)
        doc = ar.get_document("/d.pdf")
        assert doc.segment_keys == ["seg0", "seg2"] and doc.sources == [sources[0], sources[2]]
        old = {k: v for k, v in doc.to_dict().items() if k not in ("format", "pages", "sources")}
        ar.store.client.hset(Keys().docs, "/old.md", json.dumps(old))
        legacy = ar.get_document("/old.md")
        assert (legacy.format, legacy.pages, legacy.source(0)) == ("text", 0, {"pages": None, "section": None})
