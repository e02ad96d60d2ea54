"""Every archive rule, run against each store: a local directory (real LMDB and blob files in tmp_path) and a real
redis-server. The rules live once in kvblend/archive/core.py over the narrow Store interface, so each test here
must pass unchanged on both; what only one store does (the local flock and LMDB map, Redis eviction, claims and
clusters) stays in test_archive_*.py and test_redis_store.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from archive_helpers import N_LAYERS, TOKENS, flip_byte, layers, put, same
from kvblend.archive import Archive, DocumentRecord, SegmentRecord, core
from kvblend.archive.records import describe
from kvblend.archive.redis_store import Keys
from kvblend.errors import (
    ArchiveDamagedError,
    ArchiveError,
    ArchiveModelMismatchError,
    ArchiveVersionError,
    CorruptBlobError,
    NotFoundError,
    UsageError,
)
from support import one_line_error, run_cli


@pytest.fixture(params=["local", "redis"])
def where(request, tmp_path) -> str:
    """Where the archive lives: a directory, or a fresh real redis-server (skipped only if none is installed)."""
    if request.param == "local":
        return str(tmp_path / "ar")
    from redis_support import redis_binary

    try:
        redis_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    return request.getfixturevalue("redis_url")


@pytest.fixture
def ar(where):
    archive = Archive.open(where, model_name="tiny", model_fingerprint="fp-tiny")
    yield archive
    archive.close()


def damage_layer(ar: Archive, key: str, layer: int) -> None:
    """Flip a byte in the middle of one stored layer, wherever the store keeps it."""
    rec = ar.get_segment(key)
    if ar.store.kind == "local":
        flip_byte(ar.path / rec.blob, rec.layers[layer].offset + rec.layers[layer].length // 2)
        return
    name = Keys().layer(key, layer, rec.blob)
    data = bytearray(ar.store.client.get(name))
    data[len(data) // 2] ^= 0xFF
    ar.store.client.set(name, bytes(data))


def set_meta_raw(ar: Archive, name: str, raw: bytes) -> None:
    """Write a meta entry as another (newer, or broken) writer would, through the store itself."""
    ar.store.write(lambda txn: txn.put("meta", name, raw))


# ---------------------------------------------------------------- payloads


@pytest.mark.parametrize("codec", ["zstd-shuffle", "int8"])
def test_payload_round_trip_every_layer(ar, codec):
    for i in range(3):
        ar.put_segment(SegmentRecord(key=f"seg{i}", token_ids=list(range(TOKENS)), base_position=5), layers(i),
                       codec=codec)
    for i in range(3):
        rec = ar.get_segment(f"seg{i}")
        assert (rec.codec, rec.n_layers, rec.n_tokens, rec.base_position) == (codec, N_LAYERS, TOKENS, 5)
        for layer in range(N_LAYERS):
            k, v = ar.read_layer(f"seg{i}", layer)
            if codec == "zstd-shuffle":
                assert same(k, layers(i)[layer][0]) and same(v, layers(i)[layer][1])
            else:
                assert k.shape == layers(i)[layer][0].shape
    got = ar.read_layers_raw([ar.get_segment(f"seg{i}") for i in range(3)], 1)
    assert all(isinstance(x, bytes) for x in got)
    assert ar.verify(deep=True).ok


def test_a_damaged_layer_fails_its_checksum_and_repair_drops_the_segment(ar):
    for i in range(3):
        put(ar, f"seg{i}", seed=i)
    ar.replace_document(DocumentRecord(path="/docs/a.md", segment_keys=["seg0", "seg1"]))
    damage_layer(ar, "seg1", 2)
    with pytest.raises(CorruptBlobError, match="checksum") as e:
        ar.read_layer("seg1", 2)
    assert (e.value.segment_key, e.value.layer) == ("seg1", 2)
    assert same(ar.read_layer("seg1", 1)[0], layers(1)[1][0])  # other layers still fine
    got = ar.read_layers_raw([ar.get_segment("seg0"), ar.get_segment("seg1")], 2)
    assert isinstance(got[0], bytes) and isinstance(got[1], CorruptBlobError)
    report = ar.verify()
    assert not report.ok and [(p.key, p.layer) for p in report.problems] == [("seg1", 2)]
    fixed = ar.verify(repair=True)
    assert fixed.repaired_segments == ["seg1"] and fixed.repaired_documents == ["/docs/a.md"]
    doc = ar.get_document("/docs/a.md")
    assert doc.segment_keys == ["seg0"] and doc.incomplete and not ar.has_segment("seg1")
    assert ar.verify().ok


def test_a_segment_is_visible_only_after_every_layer_and_its_record(ar, monkeypatch):
    """Payloads stored but no record (a writer killed before its commit, or a commit that failed): nothing lists
    the segment, verify finds only leftovers, gc removes them."""
    rec = describe(SegmentRecord(key="half", token_ids=list(range(TOKENS)), text="x"), layers(0), "zstd-shuffle")
    ar.store.put_payloads([(rec, (b"payload %d" % i for i in range(N_LAYERS)))])  # crashed before its record
    assert not ar.has_segment("half") and ar.count_segments() == 0

    def failed_commit(*args, **kwargs):
        raise ArchiveError("the commit failed")

    monkeypatch.setattr(core, "commit_segments", failed_commit)
    with pytest.raises(ArchiveError, match="the commit failed"):
        put(ar, "lost")
    monkeypatch.undo()
    assert not ar.has_segment("lost") and list(ar.iter_segments()) == []
    if ar.store.kind == "redis":  # no writer lock: a write in flight is marked, and gc leaves it until that lapses
        assert ar.gc().orphans == []
        for name in ar.store.client.scan_iter(match="*:W:*"):
            ar.store.client.delete(name)  # the markers' expiry, now
    report = ar.verify()
    assert report.ok and report.orphan_blobs >= 2
    gc = ar.gc()
    assert len(gc.orphan_blobs) == report.orphan_blobs and gc.freed_bytes > 0
    assert ar.verify().orphan_blobs == 0


def test_replacing_a_segment_keeps_its_hits_and_frees_the_old_payload(ar):
    put(ar, "bb1", seed=1)
    assert ar.touch(["bb1", "bb1", "nope"]) == 1
    new = ar.put_segment(SegmentRecord(key="bb1", token_ids=list(range(TOKENS))), layers(9), codec="zstd")
    assert ar.get_segment("bb1").hits == 1 and ar.get_segment("bb1").blob == new.blob
    assert same(ar.read_layer("bb1", 2)[0], layers(9)[2][0])
    assert ar.gc().orphans == [] and ar.verify().ok


def test_put_segments_stores_repeated_keys_once_with_their_embeddings(ar):
    with ar.writer() as held:
        assert held is ar
        recs = ar.put_segments([(SegmentRecord(key=k), layers(i)) for i, k in enumerate(["cc0", "cc1", "cc0"])],
                               embeddings={"cc0": np.ones(3), "cc1": np.zeros(3)})
    assert [r.key for r in recs] == ["cc0", "cc1"] and ar.count_segments() == 2
    keys, matrix = ar.get_embeddings()
    assert keys == ["cc0", "cc1"] and matrix.tolist() == [[1, 1, 1], [0, 0, 0]]


# ---------------------------------------------------------------- documents


def test_remove_documents_keeps_shared_segments(ar):
    for key in ("mm1", "mm2", "mm3"):
        put(ar, key)
    ar.put_embeddings([("mm1", np.ones(4))])
    ar.put_document(DocumentRecord(path="/docs/a.txt", segment_keys=["mm1", "mm2"]))
    ar.put_document(DocumentRecord(path="/docs/b.txt", segment_keys=["mm2", "mm3"]))
    assert ar.remove_documents(["/docs/a.txt", "/docs/nope.txt"]) == ["/docs/a.txt"]
    assert ar.get_document("/docs/a.txt") is None
    assert not ar.has_segment("mm1") and ar.has_segment("mm2") and ar.has_segment("mm3")
    assert ar.get_embeddings()[0] == [] and not ar.has_embedding("mm1")
    assert not ar.get_document("/docs/b.txt").incomplete
    assert ar.verify().ok and ar.gc().orphans == []


def test_replace_document_drops_only_unshared_stale_segments(ar):
    for key in ("rr1", "rr2", "rr3", "rr4", "rr5"):
        put(ar, key)
    ar.put_document(DocumentRecord(path="/a.txt", segment_keys=["rr1", "rr2", "rr3", "rr5"]))
    ar.put_document(DocumentRecord(path="/b.txt", segment_keys=["rr3"]))
    assert ar.replace_document(DocumentRecord(path="/a.txt", segment_keys=["rr2", "rr4"]), keep={"rr5"}) == ["rr1"]
    assert ar.get_document("/a.txt").segment_keys == ["rr2", "rr4"]
    assert [r.key for r in ar.iter_segments()] == ["rr2", "rr3", "rr4", "rr5"]  # rr5: kept for a later document
    assert ar.replace_document(DocumentRecord(path="/new.txt", segment_keys=["rr2"])) == []
    assert ar.verify().ok and ar.gc().orphans == []


SOURCES = [{"pages": [1, 2], "section": "Intro", "sections": None, "rows": None}, {"pages": [3, 3], "section": None, "sections": None, "rows": None},
           {"pages": None, "section": "B", "sections": ["B", "C"], "rows": [2, 26]}]  # a segment of two sheets: the rows of the first


def test_document_provenance_round_trips_and_old_records_still_read(ar):
    for key in ("pv1", "pv2", "pv3"):
        put(ar, key)
    doc = DocumentRecord(path="/docs/manual.pdf", name="manual.pdf", segment_keys=["pv1", "pv2", "pv3"],
                         format="pdf", pages=3, sources=SOURCES)
    ar.replace_document(doc)
    back = ar.get_document("/docs/manual.pdf")
    assert (back.format, back.pages, back.sources) == ("pdf", 3, SOURCES)
    assert [back.source(i) for i in range(3)] == SOURCES
    assert [s.format for s in ar.document_summaries()] == ["pdf"]
    old = {k: v for k, v in doc.to_dict().items() if k not in ("format", "pages", "sources")}
    old["path"] = "/old.md"
    ar.store.write(lambda txn: txn.put("documents", "/old.md", json.dumps(old).encode()))  # an older kvblend's
    legacy = ar.get_document("/old.md")
    assert (legacy.format, legacy.pages, legacy.source(0)) == ("text", 0, {"pages": None, "section": None, "sections": None, "rows": None})


def test_dropping_a_segment_marks_its_documents_and_drops_its_source(ar):
    """A damaged segment dropped by verify --repair, and a key that names no segment, both leave the document
    incomplete with its sources parallel to its keys; fields this kvblend does not know survive the rewrite."""
    for key in ("pw1", "pw3", "pw4"):
        put(ar, key)
    keys = ["pw1", "pw2", "pw3", "pw4"]
    sources = [*SOURCES, {"pages": [4, 4], "section": "D", "sections": None, "rows": None}]
    ar.replace_document(DocumentRecord(path="/docs/m.pdf", segment_keys=keys, format="pdf", pages=4,
                                       sources=sources, extra={"future": 1}))
    damage_layer(ar, "pw3", 0)
    with ar.writer():
        fixed = ar.verify(repair=True)
    assert fixed.repaired_segments == ["pw3"] and fixed.repaired_documents == ["/docs/m.pdf"]
    doc = ar.get_document("/docs/m.pdf")
    assert doc.incomplete and doc.segment_keys == ["pw1", "pw4"] and doc.sources == [sources[0], sources[3]]
    assert doc.extra == {"future": 1} and ar.verify().ok


# ---------------------------------------------------------------- what an archive is: version and model


def test_a_newer_format_is_refused_in_one_line(ar, where):
    put(ar, "seg0")
    set_meta_raw(ar, "format_version", b"2")
    with pytest.raises(ArchiveVersionError, match=r"archive format v2 is newer than this kvblend supports \(v1\)"):
        Archive.open(where)
    line = one_line_error(run_cli("ls", "--archive", where))
    assert "v2 is newer" in line and "upgrade kvblend" in line


@pytest.mark.parametrize("raw", [b"1.5", b'"1"', b"garbage"])
def test_a_malformed_format_version_is_damage(ar, where, raw):
    set_meta_raw(ar, "format_version", raw)
    with pytest.raises(ArchiveDamagedError, match="format version .* is not a positive integer") as e:
        Archive.open(where)
    assert str(e.value).startswith(f"archive at {ar.store.location} is damaged: its format version")


def test_another_model_is_refused_with_the_same_message(where):
    Archive.open(where, model_name="SmolLM2-135M", model_fingerprint="aaa").close()
    with pytest.raises(ArchiveModelMismatchError) as e:
        Archive.open(where, model_name="Qwen3-0.6B", model_fingerprint="bbb")
    with Archive.open(where) as ar:  # no model asked: fine, and reports the recorded one
        assert (ar.model_name, ar.model_fingerprint) == ("SmolLM2-135M", "aaa")
        location = ar.store.location
    assert str(e.value) == (f"archive at {location} was built with model SmolLM2-135M; you asked for model "
                            "Qwen3-0.6B (pass the --model path it was built with (named SmolLM2-135M) or use "
                            "another --archive)")  # `--model SmolLM2-135M` is no path: "no model at SmolLM2-135M"
    with pytest.raises(ArchiveModelMismatchError) as e:  # same name, other weights
        Archive.open(where, model_name="SmolLM2-135M", model_fingerprint="ccc")
    assert "SmolLM2-135M (fingerprint aaa); you asked for model SmolLM2-135M (fingerprint ccc)" in str(e.value)
    with Archive.open(where, model_name="SmolLM2-135M", model_fingerprint="aaa"):
        pass


def test_the_model_is_recorded_by_the_first_open_that_names_one(where):
    with Archive.open(where, model_name="named-only") as ar:
        assert (ar.model_name, ar.model_fingerprint) == ("named-only", None)
    with Archive.open(where, model_name="real", model_fingerprint="fff") as ar:  # a fingerprint brings its name
        assert (ar.model_name, ar.model_fingerprint) == ("real", "fff")
    with Archive.open(where, model_name="other") as ar:  # no fingerprint asked: nothing to check or record
        assert (ar.model_name, ar.model_fingerprint) == ("real", "fff")
        assert ar.get_meta("format_version") == 1 and ar.format_version == 1


def test_deferred_binding_records_the_model_only_with_the_first_segment(where):
    with Archive.open(where, model_name="garbage", model_fingerprint="fp-garbage", defer_binding=True):
        pass  # e.g. the model failed to load here
    with Archive.open(where, readonly=True) as ar:
        assert (ar.model_name, ar.model_fingerprint) == (None, None)
    with Archive.open(where, model_name="real", model_fingerprint="fp-real", defer_binding=True) as ar:
        assert ar.model_fingerprint is None
        put(ar, "bb1")
        assert (ar.model_name, ar.model_fingerprint) == ("real", "fp-real")
    with pytest.raises(ArchiveModelMismatchError, match="built with model real"):
        Archive.open(where, model_name="garbage", model_fingerprint="fp-garbage", defer_binding=True)


def test_deferred_binding_is_rechecked_in_the_commit(where):
    """Two writers naming different models on a fresh archive: the second commit is refused."""
    Archive.open(where).close()
    first = Archive.open(where, model_name="a", model_fingerprint="fp-a", defer_binding=True)
    second = Archive.open(where, model_name="b", model_fingerprint="fp-b", defer_binding=True)
    try:
        first.put_segment(SegmentRecord(key="aa1"), layers(1))
        with pytest.raises(ArchiveModelMismatchError):
            second.put_segment(SegmentRecord(key="bb1"), layers(2))
        assert not first.has_segment("bb1")
    finally:
        first.close()
        second.close()


# ---------------------------------------------------------------- lookups and scans


def test_lookups_by_prefix_name_and_suffix(ar):
    for key in ("abcdef01", "abcdef02", "fedcba01"):
        put(ar, key)
    ar.replace_document(DocumentRecord(path="/docs/x/a.md", name="x/a.md", segment_keys=["abcdef01", "gone0"]))
    ar.replace_document(DocumentRecord(path="/docs/y/a.md", name="y/a.md", segment_keys=["fedcba01"]))
    assert ar.find_segment("fedcba").key == "fedcba01" and ar.find_segment("abcdef02").key == "abcdef02"
    with pytest.raises(UsageError, match="ambiguous"):
        ar.find_segment("abcdef")
    with pytest.raises(NotFoundError, match="a prefix needs 6"):
        ar.find_segment("fed")
    assert ar.find_document("x/a.md").path == "/docs/x/a.md" and ar.find_document("/docs/y/a.md").name == "y/a.md"
    with pytest.raises(UsageError, match="ambiguous"):
        ar.find_document("a.md")
    with pytest.raises(NotFoundError, match="no such document"):
        ar.find_document("b.md")
    summary = {s.name: s for s in ar.document_summaries()}
    assert (summary["x/a.md"].segments, summary["x/a.md"].missing_segments) == (2, 1)
    assert summary["y/a.md"].bytes == ar.get_segment("fedcba01").stored_bytes


def test_scans_counts_side_tables_and_embeddings(ar):
    for i in (2, 0, 1):
        put(ar, f"seg{i}", seed=i)
    for p in ("/d/b.md", "/d/a.md"):
        ar.put_document(DocumentRecord(path=p, segment_keys=["seg0"]))
    assert [r.key for r in ar.iter_segments()] == ["seg0", "seg1", "seg2"] and ar.count_segments() == 3
    assert [d.path for d in ar.iter_documents()] == ["/d/a.md", "/d/b.md"] and ar.count_documents() == 2
    ar.put_embeddings([("seg0", [1.0, 2.0]), ("seg1", [3.0, 4.0])])
    ar.put_embeddings(["seg2"], np.array([[5, 6]], dtype=np.float32))
    keys, matrix = ar.get_embeddings()
    assert keys == ["seg0", "seg1", "seg2"] and matrix.dtype == np.float32 and matrix.shape == (3, 2)
    keys, matrix = ar.get_embeddings(["seg1", "missing"])
    assert keys == ["seg1"] and matrix.tolist() == [[3.0, 4.0]]
    assert ar.has_embedding("seg2") and not ar.has_embedding("missing")
    ar.put_profile("p", {"read": 1})
    ar.put_tuned("t", {"ratio": 0.2})
    ar.set_meta("note", [1])
    assert list(ar.iter_profiles()) == [("p", {"read": 1})] and ar.get_tuned("t") == {"ratio": 0.2}
    assert ar.get_tuned("x") is None and ar.get_meta("note") == [1] and ar.get_meta("absent", "d") == "d"
    with pytest.raises(ArchiveError, match="managed by the archive"):
        ar.set_meta("format_version", 9)
    ar.touch(["seg0", "seg0", "seg1"])
    s = ar.stats()
    assert (s.segments, s.documents, s.tokens, s.hits) == (3, 2, 3 * TOKENS, 2)
    assert ar.size_bytes() >= ar.size_bytes(include_index=False) >= s.stored_bytes > 0


def test_gc_max_size_evicts_least_recently_used_first(ar):
    for i in range(5):
        put(ar, f"ll{i}", seed=i, created=1000.0 + i, last_access=1000.0 + i)
    ar.put_document(DocumentRecord(path="/d.txt", segment_keys=["ll0", "ll3", "ll4"]))
    ar.touch(["ll0", "ll1"])  # the two oldest become the most recently used
    sizes = {f"ll{i}": ar.store.segment_bytes(ar.get_segment(f"ll{i}")) for i in range(5)}
    budget = sizes["ll0"] + sizes["ll1"] + sizes["ll4"]

    dry = ar.gc(max_size_bytes=budget, dry_run=True)
    assert dry.evicted == ["ll2", "ll3"] and dry.incomplete_documents == ["/d.txt"]  # the dry run said none
    assert ar.count_segments() == 5 and not ar.get_document("/d.txt").incomplete
    report = ar.gc(max_size_bytes=budget)
    assert report.evicted == ["ll2", "ll3"] and report.blob_bytes_after <= budget
    assert report.freed_bytes == sizes["ll2"] + sizes["ll3"]
    assert sorted(r.key for r in ar.iter_segments()) == ["ll0", "ll1", "ll4"]
    doc = ar.get_document("/d.txt")
    assert doc.segment_keys == ["ll0", "ll4"] and doc.incomplete
    assert report.incomplete_documents == ["/d.txt"]
    summary = next(s for s in ar.document_summaries() if s.path == "/d.txt")  # `ls` says so (it showed nothing)
    assert summary.incomplete and summary.to_dict()["incomplete"] is True
    assert ar.size_bytes(include_index=False) <= budget
    with pytest.raises(ArchiveError, match=">= 0"):
        ar.gc(max_size_bytes=-1)


# ---------------------------------------------------------------- locking and read-only


def test_the_writer_is_reentrant_and_a_read_only_open_writes_nothing(ar, where):
    with ar.writer(), ar.writer():  # re-entrant for the holder
        put(ar, "ee1")
    with Archive.open(where, readonly=True) as ro:
        assert ro.has_segment("ee1") and ro.touch(["ee1"]) == 0 and ro.readonly
        for write in (lambda: ro.writer().__enter__(), lambda: ro.put_profile("disk", {}), lambda: put(ro, "ee2"),
                      lambda: ro.put_document(DocumentRecord(path="/x")), lambda: ro.remove_documents(["/x"])):
            with pytest.raises(ArchiveError, match="read-only"):
                write()
    assert ar.get_segment("ee1").hits == 0 and not ar.has_segment("ee2")


def test_the_storage_probe_asks_the_store_itself(ar):
    """`kvblend profile` measures reads through a store no disk probe can measure (Redis: pipelined fetches, one
    per layer), leaving nothing behind; a local store is a directory, which the disk probe measures."""
    from kvblend.tuning.probes import measure_store_read

    segments = [[bytes([i]) * 4096 for _ in range(N_LAYERS)] for i in range(3)]
    got = measure_store_read(ar.store, segments, runs=2)
    if ar.store.kind == "local":
        assert got is None
        return
    assert len(got.warm_runs_MBps) == 2 and all(rate > 0 for rate in got.warm_runs_MBps)
    assert got.scratch_bytes == 3 * N_LAYERS * 4096
    assert ar.store.client.dbsize() == 1  # only the meta hash: the scratch keys are gone


def test_a_bundled_models_name_is_the_model_to_pass():
    from kvblend.archive.core import Model, mismatch_message
    from kvblend.defaults import DEFAULT_MODEL_NAME

    told = mismatch_message("here", Model(DEFAULT_MODEL_NAME, "aaa"), Model("mine", "bbb"))
    assert f"(pass --model {DEFAULT_MODEL_NAME} or use another --archive)" in told


def test_a_container_or_folder_names_every_document_read_out_of_it(ar):
    """`rm facts.jsonl` (or the folder ingested) found nothing: its records are facts.jsonl#L1, #L2, ..., and the
    user had to remove each line's document by hand."""
    for i in range(3):
        put(ar, f"cc{i}", seed=i)
    for path, key in (("/docs/facts.jsonl#L1", "cc0"), ("/docs/facts.jsonl#L2", "cc1"), ("/docs/sub/a.md", "cc2")):
        ar.replace_document(DocumentRecord(path=path, name=path.removeprefix("/docs/"), segment_keys=[key]))
    assert [d.path for d in ar.find_documents("/docs/facts.jsonl")] == ["/docs/facts.jsonl#L1", "/docs/facts.jsonl#L2"]
    assert [d.name for d in ar.find_documents("facts.jsonl")] == ["facts.jsonl#L1", "facts.jsonl#L2"]
    assert [d.path for d in ar.find_documents("/docs/sub")] == ["/docs/sub/a.md"]
    assert [d.path for d in ar.find_documents("a.md")] == ["/docs/sub/a.md"]  # one document: as find_document
    with pytest.raises(NotFoundError):
        ar.find_documents("/docs/facts")  # a prefix of a name is no container
    put(ar, "cc3", seed=3)  # another ingest's folder of the same name: a name alone must not take both
    ar.replace_document(DocumentRecord(path="/other/sub/b.md", name="sub/b.md", segment_keys=["cc3"]))
    with pytest.raises(UsageError, match="sub is ambiguous .2 ingested folders or files: /docs/sub, /other/sub"):
        ar.find_documents("sub")
    assert [d.path for d in ar.find_documents("/other/sub")] == ["/other/sub/b.md"]  # its path is not
    ar.replace_document(DocumentRecord(path="/docs/2023/README.md", name="2023/README.md", segment_keys=["cc0"]))
    ar.replace_document(DocumentRecord(path="/docs/2023/a.md", name="a.md", segment_keys=["cc1"]))  # not renamed
    assert [d.path for d in ar.find_documents("2023")] == ["/docs/2023/README.md", "/docs/2023/a.md"]  # the folder
