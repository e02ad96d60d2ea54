"""What only the Redis store does, on a real redis-server (single node and a three-master cluster): payloads byte
for byte those of a local archive, one key per segment layer, two writers of one segment, claims, eviction as a
miss, faults as one line. The rules every store obeys run against Redis in test_store_contract.py."""

from __future__ import annotations

import json
import threading

import pytest
import redis

from archive_helpers import N_LAYERS, TOKENS, layers, put, same
from kvblend.archive import Archive, DocumentRecord, SegmentRecord
from kvblend.archive.redis_store import Keys
from kvblend.errors import (
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


def test_gc_leaves_a_write_in_flight_and_the_segments_whose_listing_was_evicted(redis_url):
    """Redis has no writer lock: a gc between a stored miss's layers and its record took the layers for garbage
    (the segment then committed with no KV); and with the set listing the segments evicted, gc took every live
    segment's layers (their records were still there)."""
    from kvblend.archive.records import describe

    with open_redis(redis_url) as ar, open_redis(redis_url) as other:
        put(ar, "live", seed=1)
        rec = describe(SegmentRecord(key="fresh", token_ids=list(range(TOKENS)), text="x"), layers(2), "zstd-shuffle")
        ar.store.put_payloads([(rec, (b"payload %d" % i for i in range(N_LAYERS)))])  # its record comes next
        assert other.gc().orphans == []  # another node's gc, now
        ar.store.write(lambda txn: txn.put("segments", "fresh", json.dumps(rec.to_dict()).encode()))
        assert ar.read_layers_raw([ar.get_segment("fresh")], 0)[0] == b"payload 0"
        assert not list(ar.store.client.scan_iter(match="*:W:*"))  # the record ended the write
        ar.store.client.delete(Keys().segs)  # evicted under allkeys-lru
        assert other.gc().orphans == []
        assert same(ar.read_layer("live", 0)[0], layers(1)[0][0])


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


def test_a_record_no_kvblend_wrote_is_lost_for_verify_and_dropped_by_repair(redis_url):
    """A segment record that is not a kvblend record (another client wrote the key) made every command say the
    index is damaged and name --rebuild-index, which refuses a Redis archive: the user had no way out."""
    with open_redis(redis_url) as ar:
        put(ar, "seg0")
        put(ar, "seg1", seed=1)
        ar.replace_document(DocumentRecord(path="/d.md", segment_keys=["seg0", "seg1"]))
        ar.store.client.set(Keys().rec("seg1"), b"not json")
    proc = run_cli("verify", "--archive", redis_url)
    assert proc.returncode == 1 and "seg1" in proc.stdout + proc.stderr and "rebuild-index" not in proc.stderr
    assert run_cli("stats", "--archive", redis_url).returncode == 0
    run_cli("verify", "--repair", "--archive", redis_url, check=True)
    with open_redis(redis_url) as ar:
        assert ar.verify().ok and ar.get_document("/d.md").segment_keys == ["seg0"]


def test_a_writer_releases_its_claims_and_only_its_own(redis_url):
    """Claims held to their 120 s expiry made the next ingest of those segments (a document removed and added
    again) wait 60 s for a writer that had finished; releasing leaves another process's claim alone."""
    with open_redis(redis_url) as a, open_redis(redis_url) as b:
        assert a.claim(["k1", "k2"]) == ["k1", "k2"]
        b.release(["k1"])  # not b's: still a's
        assert b.claim(["k1", "k2"]) == []
        a.release(["k1", "k2"])
        assert b.claim(["k1", "k2"]) == ["k1", "k2"]


def test_a_redis_out_of_memory_is_the_documented_line_without_the_payload(tmp_path):
    """redis-py strips 'OOM' into its exception class and names a pipeline's command with every argument: the
    line showed raw KV bytes instead of what to do."""
    with redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        with pytest.raises(Exception) as caught, open_redis(url) as ar:
            for i in range(200):
                put(ar, f"seg{i}", seed=i)
        line = str(caught.value)
        assert "out of memory and evicts nothing" in line and "allkeys-lru" in line, line
        assert "pipeline" not in line and len(line) < 300


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
    for bad in ("redis://", "redis://host:notaport", "redis://h:1/x", "redis://:pw@h:99999/0", "redis://h:0/0",
                "redis://h:1/\u00b2", "redis://admin:12/pwTopSecret@h:1/0", "redis://admin:/pwTopSecret@h:1/0"):
        proc = run_cli("ls", "--archive", bad)
        line = one_line_error(proc)
        assert proc.returncode == 2 and "Redis URL" in line or "database" in line or "port" in line, line
        assert "pw" not in line, line  # a '/' in the password split the URL: its rest was shown as the database
    assert json.loads(run_cli("path", "--json", "--archive", "redis://h:1/0", check=True).stdout)["exists"] is None
    for scheme in ("reddis", "unix", "http"):  # read as a folder named after the URL, made by ingest
        line = one_line_error(proc := run_cli("ls", "--archive", f"{scheme}://127.0.0.1:{port}/0"))
        assert proc.returncode == 2 and f"unsupported scheme '{scheme}'" in line, line


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


def test_repair_keeps_a_segment_another_node_stored_again_while_it_read(redis_url):
    """verify --repair skipped its "replaced meanwhile" check, assuming the writer lock kept writers out; Redis
    has none: the old generation's layers vanished mid-read and the freshly stored segment was dropped."""
    with open_redis(redis_url) as ar, open_redis(redis_url) as other:
        put(ar, "hot", seed=1)
        read = ar.read_layer_raw

        def racing(rec, layer):
            if rec.key == "hot" and layer == 1 and not racing.done:
                racing.done = True
                put(other, "hot", seed=2)  # stored again: the generation being read is gone
            return read(rec, layer)

        racing.done = False
        ar.read_layer_raw = racing
        report = ar.verify(repair=True)
        assert racing.done and report.repaired_segments == [] and report.ok
        assert ar.has_segment("hot") and same(ar.read_layer("hot", 1)[0], layers(2)[1][0])
