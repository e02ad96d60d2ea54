"""Archive storage on a real LMDB index and real blob files in tmp_path: round trips, opening, locking, records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvblend.archive.codec import LOSSLESS_CODECS

from archive_helpers import DIM, HEADS, N_LAYERS, TOKENS, ar, layers, put, same  # noqa: F401 (ar: fixture)
from kvblend.archive import Archive, DocumentRecord, SegmentRecord, resolve_location, segment_key
from kvblend.archive import blobs as blobs_mod
from kvblend.errors import ArchiveBusyError, ArchiveError, UsageError
from support import REPO, run_in_threads

# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec", LOSSLESS_CODECS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_trip_every_layer_bit_identical(tmp_path, codec, dtype):
    with Archive.open(tmp_path / "ar") as ar, ar.writer():
        stored = {}
        for i in range(3):
            kv = layers(i, dtype)
            ar.put_segment(SegmentRecord(key=f"seg{i}", token_ids=list(range(TOKENS)), base_position=5), kv,
                           codec=codec)
            stored[f"seg{i}"] = kv
    with Archive.open(tmp_path / "ar", create=False, readonly=True) as ar:
        for key, kv in stored.items():
            rec = ar.get_segment(key)
            assert (rec.codec, rec.n_layers, rec.kv_heads, rec.n_tokens, rec.head_dim, rec.base_position) == \
                (codec, N_LAYERS, HEADS, TOKENS, DIM, 5)
            assert rec.dtype == {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
            for i, (k, v) in enumerate(kv):
                k2, v2 = ar.read_layer(key, i)
                assert same(k2, k) and same(v2, v)
            raw = ar.read_layer_raw(rec, 1)
            k2, _ = ar.decode(rec, 1, raw)
            assert same(k2, kv[1][0])
        assert ar.verify(deep=True).ok


def test_layers_are_contiguous_ranges_of_one_blob(ar):
    rec = put(ar, "aa01")
    assert rec.blob == "blobs/aa/aa01.kvb"
    offset = 0
    for entry in rec.layers:
        assert entry.offset == offset and entry.length > 0 and len(entry.checksum) == 8
        offset += entry.length
    assert (ar.path / rec.blob).stat().st_size == offset


def test_record_json_round_trip_ignores_unknown_fields():
    rec = SegmentRecord(key="k1", n_tokens=2, token_ids=[1, 2], extra={"sink": "prefix"})
    d = json.loads(rec.to_json())
    d["field_from_the_future"] = 1
    assert SegmentRecord.from_json(json.dumps(d)) == rec
    doc = DocumentRecord(path="/x", segment_keys=["a", "b"], incomplete=True)
    assert DocumentRecord.from_json(doc.to_json()) == doc
    # Older kvblends wrote an always-zero `mtime`; such records still load.
    legacy = DocumentRecord.from_json(json.dumps({**doc.to_dict(), "mtime": 0.0}))
    assert legacy == doc and "mtime" not in doc.to_dict()


def test_put_segments_batch_and_replace(ar):
    with ar.writer():
        recs = ar.put_segments([(SegmentRecord(key=f"bb{i}"), layers(i)) for i in range(3)])
    assert [r.key for r in recs] == ["bb0", "bb1", "bb2"]
    ar.touch(["bb1"])
    new = ar.put_segment(SegmentRecord(key="bb1"), layers(9), codec="zstd")
    assert new.blob != recs[1].blob and not (ar.path / recs[1].blob).exists()
    assert ar.get_segment("bb1").hits == 1  # popularity survives a replace
    assert same(ar.read_layer("bb1", 2)[0], layers(9)[2][0])
    assert ar.gc().orphan_blobs == []


def test_rejects_inconsistent_input(ar):
    with pytest.raises(ValueError):
        ar.put_segment(SegmentRecord(key="cc", token_ids=[1, 2]), layers(0))
    with pytest.raises(ArchiveError, match="invalid segment key"):
        ar.put_segment(SegmentRecord(key="../evil"), layers(0))
    with pytest.raises(IndexError):
        put(ar, "cc1")
        ar.read_layer("cc1", N_LAYERS)


def test_concurrent_reader_threads(ar):
    for i in range(3):
        put(ar, f"dd{i}", seed=i)

    def read_all():
        for _ in range(3):
            for i in range(3):
                for layer in range(N_LAYERS):
                    assert same(ar.read_layer(f"dd{i}", layer)[1], layers(i)[layer][1])

    assert not run_in_threads(read_all)


def test_disk_full_leaves_index_unchanged(ar, monkeypatch):
    put(ar, "jj0")

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blobs_mod, "_write_all", full)
    with pytest.raises(ArchiveError, match="disk full"):
        put(ar, "jj1")
    monkeypatch.undo()
    assert not ar.has_segment("jj1") and ar.count_segments() == 1
    assert [rel for rel, _, _ in blobs_mod.scan_blob_dir(ar.path)] == ["blobs/jj/jj0.kvb"]


def test_segment_key_depends_on_model_tokens_and_settings():
    base = segment_key("fp", [1, 2, 3], {"dtype": "float16"})
    assert base == segment_key("fp", (1, 2, 3), {"dtype": "float16"}) and len(base) == 40
    assert len({base, segment_key("fp2", [1, 2, 3], {"dtype": "float16"}),
                segment_key("fp", [1, 2, 4], {"dtype": "float16"}),
                segment_key("fp", [1, 2, 3], {"dtype": "bfloat16"})}) == 4


def test_import_and_listing_do_not_load_torch(tmp_path, ar):
    put(ar, "tt1")
    code = ("import sys, kvblend.archive as a\n"
            f"with a.Archive.open({str(ar.path)!r}, create=False, readonly=True) as ar:\n"
            "    assert [r.key for r in ar.iter_segments()] == ['tt1'] and ar.verify().ok\n"
            "    ar.stats(); ar.size_bytes()\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- opening


def test_open_errors(tmp_path):
    with pytest.raises(ArchiveError, match="no archive"):
        Archive.open(tmp_path / "missing", create=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArchiveError, match="not a directory"):
        Archive.open(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArchiveError, match="not a kvblend archive"):
        Archive.open(tmp_path / "empty", create=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ArchiveError):
            Archive.open(ro / "ar")
    finally:
        ro.chmod(0o700)


def test_readonly_open(tmp_path, ar):
    put(ar, "ee1")
    with Archive.open(ar.path, readonly=True) as ro:
        assert ro.has_segment("ee1") and ro.touch(["ee1"]) == 0
        with pytest.raises(ArchiveError, match="read-only"):
            with ro.writer():
                pass
        with pytest.raises(ArchiveError, match="read-only"):
            ro.put_profile("disk", {})


def test_resolve_location(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBLEND_ARCHIVE", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_location("~/x").path == Path.home() / "x"
    assert resolve_location(None).path == tmp_path / "env"
    monkeypatch.delenv("KVBLEND_ARCHIVE")
    assert resolve_location(None).path == tmp_path / "xdg" / "kvblend"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert resolve_location(None).path == Path.home() / ".cache" / "kvblend"
    with pytest.raises(UsageError, match="--archive is empty"):  # `--archive "$UNSET"`: not the default archive
        resolve_location("")


# ---------------------------------------------------------------- locking and growth


def test_writer_lock_busy(tmp_path, ar):
    with Archive.open(ar.path) as other:
        with ar.writer() as held:
            assert held is ar and ar.holds_writer and not other.holds_writer
            with pytest.raises(ArchiveBusyError, match=f"pid {os.getpid()}"):
                with other.writer():
                    pass
            t0 = time.monotonic()
            with pytest.raises(ArchiveBusyError):
                with other.writer(wait=0.2):
                    pass
            assert time.monotonic() - t0 >= 0.2
            with pytest.raises(ArchiveBusyError):
                other.put_segment(SegmentRecord(key="ff1"), layers(0))
            with pytest.raises(ArchiveBusyError):
                other.gc()
            assert other.touch(["anything"]) == 0  # index-only writes are not blocked
            other.put_profile("disk", {"read_GBps": 1.0})
            with ar.writer():  # re-entrant for the holder
                put(ar, "ff2")
        assert not ar.holds_writer
        with other.writer():
            put(other, "ff3")
        assert ar.has_segment("ff3") and other.get_profile("disk") == {"read_GBps": 1.0}


def test_map_full_grows_and_retries(tmp_path):
    with Archive.open(tmp_path / "ar", initial_map_size=64 * 1024) as ar:
        start = ar.store.index.map_size  # a local store's LMDB map
        with ar.writer():
            for i in range(12):
                ar.put_segment(SegmentRecord(key=f"gg{i:02d}", text="x" * 20_000), layers(i))
        assert ar.store.index.map_size > start
        assert all(ar.get_segment(f"gg{i:02d}").text == "x" * 20_000 for i in range(12))
        assert ar.verify().ok


# ---------------------------------------------------------------- documents and side stores


def test_documents_embeddings_profiles_tuned_meta_stats(ar, tmp_path):
    put(ar, "nn1")
    put(ar, "nn2", seed=2)
    long_path = "/" + "d" * 300 + "/" + "f" * 300 + ".txt"  # beyond LMDB's key limit
    for p in ("rel/doc.txt", long_path):
        ar.put_document(DocumentRecord(path=p, content_hash="h", segment_keys=["nn1"], n_tokens=TOKENS, size=10))
    assert ar.get_document(long_path).path == long_path
    assert ar.get_document("rel/doc.txt").path == os.path.abspath("rel/doc.txt")
    assert sorted(d.path for d in ar.iter_documents()) == sorted([long_path, os.path.abspath("rel/doc.txt")])
    assert ar.count_documents() == 2

    ar.put_embeddings([("nn1", np.arange(3, dtype=np.float64))])
    ar.put_embeddings([("nn2", np.ones(3))])
    keys, mat = ar.get_embeddings()
    assert keys == ["nn1", "nn2"] and mat.dtype == np.float32 and mat.shape == (2, 3)
    ar.put_embeddings(["nn1", "nn2"], np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32))
    assert ar.get_embeddings()[1].tolist() == [[1, 2, 3], [4, 5, 6]]
    keys, mat = ar.get_embeddings(["nn2", "missing"])
    assert keys == ["nn2"] and mat.tolist() == [[4.0, 5.0, 6.0]]
    assert ar.has_embedding("nn2") and not ar.has_embedding("missing")

    ar.put_profile("nvme", {"read_GBps": 3.2})
    ar.put_tuned("tiny/cpu/nvme", {"ratio": 0.15})
    assert list(ar.iter_profiles()) == [("nvme", {"read_GBps": 3.2})]
    assert ar.get_tuned("tiny/cpu/nvme") == {"ratio": 0.15} and ar.get_tuned("x") is None
    ar.set_meta("note", {"a": 1})
    assert ar.get_meta("note") == {"a": 1} and ar.get_meta("format_version") == 1
    assert ar.get_meta("absent", "dflt") == "dflt"
    with pytest.raises(ArchiveError):
        ar.set_meta("format_version", 9)

    ar.touch(["nn1", "nn1", "nn2"])
    s = ar.stats().to_dict()
    assert (s["segments"], s["documents"], s["tokens"], s["hits"]) == (2, 2, 2 * TOKENS, 2)
    assert s["raw_bytes"] == 2 * 2 * N_LAYERS * HEADS * DIM * 2 * TOKENS
    assert s["bytes_per_token_raw"] == s["raw_bytes"] / s["tokens"]
    assert s["compression_ratio"] == pytest.approx(s["raw_bytes"] / s["stored_bytes"])
    assert ar.size_bytes() > ar.size_bytes(include_index=False) >= s["stored_bytes"]


def _blob_descriptors(archive: Archive) -> list[str]:
    """What this process holds open under the archive's blobs/ (Linux /proc), deleted files marked so."""
    under, found = str(archive.path / "blobs"), []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(under):
            found.append(target)
    return found


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_reads_leak_no_descriptors_and_hold_no_evicted_blob_open(ar):
    """Every query streams on a thread of its own: its descriptors close with it (a server gained ~6 a
    request), and a long-lived reader lets go of blobs that gc deleted, whose disk space it would hold."""
    import threading

    recs = [put(ar, f"fd{i:02d}", seed=i) for i in range(6)]

    def query() -> None:
        for layer in range(N_LAYERS):
            assert all(isinstance(r, bytes) for r in ar.read_layers_raw(recs, layer))

    for _ in range(10):
        thread = threading.Thread(target=query)
        thread.start()
        thread.join()
    assert _blob_descriptors(ar) == []
    query()  # this thread lives on, like a server's
    assert len(_blob_descriptors(ar)) == len(recs)
    assert len(ar.gc(max_size_bytes=0).evicted) == len(recs)
    fresh = put(ar, "fd99", seed=99)
    assert isinstance(ar.read_layers_raw([fresh], 0)[0], bytes)
    assert _blob_descriptors(ar) == [str(ar.path / fresh.blob)]


def test_new_directories_are_synced_into_their_parents(tmp_path, monkeypatch):
    """A blob in a new shard directory, and a manifest: the parent of every directory made, and the manifest's
    directory, are fsynced, or a power loss could drop the entry a committed record points through."""
    synced: list[Path] = []
    real = blobs_mod.fsync_dir
    monkeypatch.setattr(blobs_mod, "fsync_dir", lambda d: (synced.append(Path(d)), real(d)))
    with Archive.open(tmp_path / "ar") as ar, ar.writer():
        assert {tmp_path, tmp_path / "ar"} <= set(synced)  # the archive, its index/ and blobs/ entries
        synced.clear()
        ar.put_segment(SegmentRecord(key="zz01", token_ids=list(range(TOKENS))), layers(1))
        assert {tmp_path / "ar" / "blobs", tmp_path / "ar" / "blobs" / "zz"} <= set(synced)
        synced.clear()
        ar.replace_document(DocumentRecord(path="/a.txt", segment_keys=["zz01"]))
        assert tmp_path / "ar" / "documents" in synced and tmp_path / "ar" in synced  # documents/ was new


# ---------------------------------------------------------------- provenance in document records

SOURCES = [{"pages": [1, 2], "section": "Intro", "sections": None, "rows": None}, {"pages": [3, 3], "section": None, "sections": None, "rows": None},
           {"pages": None, "section": "B", "sections": ["B", "C"], "rows": [2, 26]}]  # a segment of two sheets: the rows of the first


def test_document_provenance_records_and_old_records_still_read():
    """A document record's provenance round-trips through its JSON; a record written before provenance reads as
    text, 0 pages, sources unknown. (Stored and read back through each store: test_store_contract.py.)"""
    doc = DocumentRecord(path="/docs/manual.pdf", name="manual.pdf", segment_keys=["pv1", "pv2", "pv3"],
                         format="pdf", pages=3, sources=SOURCES)
    assert DocumentRecord.from_json(doc.to_json()) == doc
    assert [doc.source(i) for i in range(3)] == SOURCES

    old = {k: v for k, v in doc.to_dict().items() if k not in ("format", "pages", "sources")}
    legacy = DocumentRecord.from_json(json.dumps(old))
    assert (legacy.format, legacy.pages, legacy.sources) == ("text", 0, [])
    assert legacy.source(0) == {"pages": None, "section": None, "sections": None, "rows": None}
    # sources that are not parallel to the keys (or not sources at all) say nothing rather than the wrong thing
    assert DocumentRecord(path="/x", segment_keys=["a", "b"], sources=SOURCES).source(0)["pages"] is None
    assert DocumentRecord.from_dict({**old, "sources": "junk"}).source(1) == {"pages": None, "section": None, "sections": None, "rows": None}
