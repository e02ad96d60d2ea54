"""Archive tests on a real LMDB index and real blob files in tmp_path."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from kvblend.archive_format import (
    CODECS,
    Archive,
    DocumentRecord,
    SegmentRecord,
    resolve_archive_path,
)
from kvblend.archive_format import blobs as blobs_mod
from kvblend.errors import (
    ArchiveBusyError,
    ArchiveError,
    ArchiveModelMismatchError,
    ArchiveVersionError,
    CorruptBlobError,
)

REPO = Path(__file__).resolve().parent.parent
N_LAYERS, HEADS, TOKENS, DIM = 4, 2, 8, 16


def _layers(seed: int, dtype=torch.float16, n_layers=N_LAYERS, tokens=TOKENS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(HEADS, tokens, DIM, generator=g).to(dtype),
             torch.randn(HEADS, tokens, DIM, generator=g).to(dtype)) for _ in range(n_layers)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _put(ar: Archive, key: str, seed: int = 0, **kw) -> SegmentRecord:
    rec = SegmentRecord(key=key, token_ids=list(range(TOKENS)), text=f"text of {key}", **kw)
    return ar.put_segment(rec, _layers(seed))


@pytest.fixture
def ar(tmp_path):
    archive = Archive.open(tmp_path / "ar", model_name="tiny", model_fingerprint="fp-tiny")
    yield archive
    archive.close()


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_trip_every_layer_bit_identical(tmp_path, codec, dtype):
    with Archive.open(tmp_path / "ar") as ar, ar.writer():
        stored = {}
        for i in range(3):
            layers = _layers(i, dtype)
            ar.put_segment(SegmentRecord(key=f"seg{i}", token_ids=list(range(TOKENS)), base_position=5), layers,
                           codec=codec)
            stored[f"seg{i}"] = layers
    with Archive.open(tmp_path / "ar", create=False, readonly=True) as ar:
        for key, layers in stored.items():
            rec = ar.get_segment(key)
            assert (rec.codec, rec.n_layers, rec.kv_heads, rec.n_tokens, rec.head_dim, rec.base_position) == \
                (codec, N_LAYERS, HEADS, TOKENS, DIM, 5)
            assert rec.dtype == {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
            for i, (k, v) in enumerate(layers):
                k2, v2 = ar.read_layer(key, i)
                assert _same(k2, k) and _same(v2, v)
            raw = ar.read_layer_raw(rec, 1)
            k2, _ = ar.decode(rec, 1, raw)
            assert _same(k2, layers[1][0])
        assert ar.verify(deep=True).ok


def test_layers_are_contiguous_ranges_of_one_blob(ar):
    rec = _put(ar, "aa01")
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


def test_put_segments_batch_and_replace(ar):
    with ar.writer():
        recs = ar.put_segments([(SegmentRecord(key=f"bb{i}"), _layers(i)) for i in range(3)])
    assert [r.key for r in recs] == ["bb0", "bb1", "bb2"]
    ar.touch(["bb1"])
    new = ar.put_segment(SegmentRecord(key="bb1"), _layers(9), codec="zstd")
    assert new.blob != recs[1].blob and not (ar.path / recs[1].blob).exists()
    assert ar.get_segment("bb1").hits == 1  # popularity survives a replace
    assert _same(ar.read_layer("bb1", 2)[0], _layers(9)[2][0])
    assert ar.gc().orphan_blobs == []


def test_rejects_inconsistent_input(ar):
    with pytest.raises(ValueError):
        ar.put_segment(SegmentRecord(key="cc", token_ids=[1, 2]), _layers(0))
    with pytest.raises(ArchiveError, match="invalid segment key"):
        ar.put_segment(SegmentRecord(key="../evil"), _layers(0))
    with pytest.raises(IndexError):
        _put(ar, "cc1")
        ar.read_layer("cc1", N_LAYERS)


def test_concurrent_reader_threads(ar):
    for i in range(3):
        _put(ar, f"dd{i}", seed=i)
    errors = []

    def read_all():
        try:
            for _ in range(3):
                for i in range(3):
                    for layer in range(N_LAYERS):
                        assert _same(ar.read_layer(f"dd{i}", layer)[1], _layers(i)[layer][1])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=read_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# ---------------------------------------------------------------- opening


def test_version_refusal(tmp_path):
    path = tmp_path / "ar"
    Archive.open(path).close()
    env = lmdb.open(str(path / "index"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"2", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(ArchiveVersionError, match=r"archive format v2 is newer than this kvblend supports \(v1\)"):
        Archive.open(path)


def test_model_mismatch_refusal(tmp_path):
    path = tmp_path / "ar"
    Archive.open(path, model_name="SmolLM2-135M", model_fingerprint="aaa").close()
    with pytest.raises(ArchiveModelMismatchError) as e:
        Archive.open(path, model_name="Qwen3-0.6B", model_fingerprint="bbb")
    msg = str(e.value)
    assert "SmolLM2-135M" in msg and "Qwen3-0.6B" in msg and "--model SmolLM2-135M" in msg
    with Archive.open(path) as ar:  # no model asked: fine, and reports the recorded one
        assert (ar.model_name, ar.model_fingerprint) == ("SmolLM2-135M", "aaa")
    with Archive.open(path, model_name="SmolLM2-135M", model_fingerprint="aaa"):
        pass


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
    _put(ar, "ee1")
    with Archive.open(ar.path, readonly=True) as ro:
        assert ro.has_segment("ee1") and ro.touch(["ee1"]) == 0
        with pytest.raises(ArchiveError, match="read-only"):
            with ro.writer():
                pass


def test_resolve_archive_path(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBLEND_ARCHIVE", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_archive_path("~/x") == Path.home() / "x"
    assert resolve_archive_path(None) == tmp_path / "env"
    monkeypatch.delenv("KVBLEND_ARCHIVE")
    assert resolve_archive_path(None) == tmp_path / "xdg" / "kvblend"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert resolve_archive_path("") == Path.home() / ".cache" / "kvblend"


# ---------------------------------------------------------------- locking and growth


def test_writer_lock_busy(tmp_path, ar):
    with Archive.open(ar.path) as other:
        with ar.writer():
            with pytest.raises(ArchiveBusyError, match=f"pid {os.getpid()}"):
                with other.writer():
                    pass
            t0 = time.monotonic()
            with pytest.raises(ArchiveBusyError):
                with other.writer(wait=0.2):
                    pass
            assert time.monotonic() - t0 >= 0.2
            with pytest.raises(ArchiveBusyError):
                other.put_segment(SegmentRecord(key="ff1"), _layers(0))
            with pytest.raises(ArchiveBusyError):
                other.gc()
            assert other.touch(["anything"]) == 0  # index-only writes are not blocked
            other.put_profile("disk", {"read_GBps": 1.0})
            with ar.writer():  # re-entrant for the holder
                _put(ar, "ff2")
        with other.writer():
            _put(other, "ff3")
        assert ar.has_segment("ff3") and other.get_profile("disk") == {"read_GBps": 1.0}


def test_map_full_grows_and_retries(tmp_path):
    with Archive.open(tmp_path / "ar", initial_map_size=64 * 1024) as ar:
        start = ar.map_size
        with ar.writer():
            for i in range(12):
                ar.put_segment(SegmentRecord(key=f"gg{i:02d}", text="x" * 20_000), _layers(i))
        assert ar.map_size > start
        assert all(ar.get_segment(f"gg{i:02d}").text == "x" * 20_000 for i in range(12))
        assert ar.verify().ok


# ---------------------------------------------------------------- corruption


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_flipped_byte_detected_and_repaired(ar):
    for i in range(3):
        _put(ar, f"hh{i}", seed=i)
    ar.put_document(DocumentRecord(path="/docs/a.txt", segment_keys=["hh0", "hh1"], n_tokens=2 * TOKENS))
    rec = ar.get_segment("hh1")
    _flip_byte(ar.path / rec.blob, rec.layers[2].offset + rec.layers[2].length // 2)

    report = ar.verify()
    assert not report.ok
    assert [(p.key, p.layer) for p in report.problems] == [("hh1", 2)]
    assert "checksum" in report.problems[0].reason
    with pytest.raises(CorruptBlobError) as e:
        ar.read_layer("hh1", 2)
    assert (e.value.segment_key, e.value.layer) == ("hh1", 2)
    assert _same(ar.read_layer("hh1", 1)[0], _layers(1)[1][0])  # other layers still fine

    fixed = ar.verify(repair=True)
    assert fixed.repaired_segments == ["hh1"] and fixed.repaired_documents == ["/docs/a.txt"]
    assert not ar.has_segment("hh1")
    doc = ar.get_document("/docs/a.txt")
    assert doc.segment_keys == ["hh0"] and doc.incomplete
    assert ar.verify().ok
    with pytest.raises(CorruptBlobError):  # gone from the index: callers recompute
        ar.read_layer("hh1", 0)


def test_truncated_and_missing_blobs(ar):
    a, b = _put(ar, "ii1", seed=1), _put(ar, "ii2", seed=2)
    os.truncate(ar.path / a.blob, a.layers[1].offset + 3)
    (ar.path / b.blob).unlink()
    report = ar.verify()
    assert {(p.key, p.layer) for p in report.problems} == \
        {("ii1", i) for i in range(1, N_LAYERS)} | {("ii2", None)}
    assert all("truncated" in p.reason for p in report.problems if p.key == "ii1")
    assert _same(ar.read_layer("ii1", 0)[0], _layers(1)[0][0])
    with pytest.raises(CorruptBlobError, match="truncated"):
        ar.read_layer("ii1", 3)
    with pytest.raises(CorruptBlobError, match="missing") as e:
        ar.read_layer("ii2", 0)
    assert e.value.segment_key == "ii2"
    ar.verify(repair=True)
    assert ar.verify().ok and ar.count_segments() == 0


def test_disk_full_leaves_index_unchanged(ar, monkeypatch):
    _put(ar, "jj0")

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blobs_mod, "_write_all", full)
    with pytest.raises(ArchiveError, match="disk full"):
        _put(ar, "jj1")
    monkeypatch.undo()
    assert not ar.has_segment("jj1") and ar.count_segments() == 1
    assert [rel for rel, _, _ in blobs_mod.scan_blob_dir(ar.path)] == ["blobs/jj/jj0.kvb"]


# ---------------------------------------------------------------- gc and documents


def test_gc_removes_orphans_and_temp_files(ar):
    rec = _put(ar, "kk0")
    orphan = ar.path / "blobs/zz/zz9.kvb"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"x" * 100)
    temp = ar.path / "blobs/kk/.kk1.kvb.tmp-123-abcd"
    temp.write_bytes(b"y" * 50)
    foreign = ar.path / "blobs/kk/README"
    foreign.write_text("not ours")

    dry = ar.gc(dry_run=True)
    assert dry.orphan_blobs == ["blobs/zz/zz9.kvb"] and dry.temp_files == ["blobs/kk/.kk1.kvb.tmp-123-abcd"]
    assert orphan.exists() and temp.exists()
    report = ar.gc()
    assert report.freed_bytes == 150 and not orphan.exists() and not temp.exists()
    assert foreign.exists() and (ar.path / rec.blob).exists() and ar.verify().ok


def test_gc_evicts_least_recently_used_first(ar):
    for i in range(5):
        _put(ar, f"ll{i}", seed=i, created=1000.0 + i, last_access=1000.0 + i)
    ar.put_document(DocumentRecord(path="/d.txt", segment_keys=["ll0", "ll3", "ll4"]))
    ar.touch(["ll0", "ll1"])  # the two oldest become the most recently used
    sizes = {f"ll{i}": (ar.path / ar.get_segment(f"ll{i}").blob).stat().st_size for i in range(5)}
    budget = sizes["ll0"] + sizes["ll1"] + sizes["ll4"]

    assert ar.gc(max_size_bytes=budget, dry_run=True).evicted == ["ll2", "ll3"]
    assert ar.count_segments() == 5
    report = ar.gc(max_size_bytes=budget)
    assert report.evicted == ["ll2", "ll3"] and report.blob_bytes_after <= budget
    assert report.freed_bytes == sizes["ll2"] + sizes["ll3"]
    assert sorted(r.key for r in ar.iter_segments()) == ["ll0", "ll1", "ll4"]
    doc = ar.get_document("/d.txt")
    assert doc.segment_keys == ["ll0", "ll4"] and doc.incomplete
    assert report.incomplete_documents == ["/d.txt"]
    assert ar.size_bytes(include_index=False) <= budget


def test_remove_documents_keeps_shared_segments(ar):
    for key in ("mm1", "mm2", "mm3"):
        _put(ar, key)
    ar.put_embedding("mm1", np.ones(4))
    ar.put_document(DocumentRecord(path="/docs/a.txt", segment_keys=["mm1", "mm2"]))
    ar.put_document(DocumentRecord(path="/docs/b.txt", segment_keys=["mm2", "mm3"]))
    blob1 = ar.path / ar.get_segment("mm1").blob

    assert ar.remove_documents(["/docs/a.txt", "/docs/nope.txt"]) == ["/docs/a.txt"]
    assert ar.get_document("/docs/a.txt") is None
    assert not ar.has_segment("mm1") and not blob1.exists()
    assert ar.has_segment("mm2") and ar.has_segment("mm3")
    assert ar.get_embeddings()[0] == []
    assert not ar.get_document("/docs/b.txt").incomplete
    assert ar.verify().ok


def test_replace_document_drops_only_unshared_stale_segments(ar):
    for key in ("rr1", "rr2", "rr3", "rr4"):
        _put(ar, key)
    ar.put_document(DocumentRecord(path="/a.txt", segment_keys=["rr1", "rr2", "rr3"]))
    ar.put_document(DocumentRecord(path="/b.txt", segment_keys=["rr3"]))
    assert ar.replace_document(DocumentRecord(path="/a.txt", segment_keys=["rr2", "rr4"])) == ["rr1"]
    assert ar.get_document("/a.txt").segment_keys == ["rr2", "rr4"]
    assert [r.key for r in ar.iter_segments()] == ["rr2", "rr3", "rr4"]
    assert ar.replace_document(DocumentRecord(path="/new.txt", segment_keys=["rr2"])) == []
    assert ar.verify().ok and ar.gc().orphans == []


def test_reports_serialize(ar):
    rec = _put(ar, "ss1")
    _flip_byte(ar.path / rec.blob, 0)
    d = ar.verify().to_dict()
    assert d["ok"] is False and d["problems"][0] == {"key": "ss1", "layer": 0, "reason": "checksum mismatch"}
    assert json.dumps(ar.gc(dry_run=True).to_dict())


def test_documents_embeddings_profiles_tuned_meta_stats(ar, tmp_path):
    _put(ar, "nn1")
    _put(ar, "nn2", seed=2)
    long_path = "/" + "d" * 300 + "/" + "f" * 300 + ".txt"  # beyond LMDB's key limit
    for p in ("rel/doc.txt", long_path):
        ar.put_document(DocumentRecord(path=p, content_hash="h", segment_keys=["nn1"], n_tokens=TOKENS, size=10))
    assert ar.get_document(long_path).path == long_path
    assert ar.get_document("rel/doc.txt").path == os.path.abspath("rel/doc.txt")
    assert sorted(d.path for d in ar.iter_documents()) == sorted([long_path, os.path.abspath("rel/doc.txt")])

    ar.put_embedding("nn1", np.arange(3, dtype=np.float64))
    ar.put_embeddings([("nn2", np.ones(3))])
    keys, mat = ar.get_embeddings()
    assert keys == ["nn1", "nn2"] and mat.dtype == np.float32 and mat.shape == (2, 3)
    ar.put_embeddings(["nn1", "nn2"], np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32))
    assert ar.get_embeddings()[1].tolist() == [[1, 2, 3], [4, 5, 6]]
    keys, mat = ar.get_embeddings(["nn2", "missing"])
    assert keys == ["nn2"] and mat.tolist() == [[4.0, 5.0, 6.0]]

    ar.put_profile("nvme", {"read_GBps": 3.2})
    ar.put_tuned("tiny/cpu/nvme", {"ratio": 0.15})
    assert list(ar.iter_profiles()) == [("nvme", {"read_GBps": 3.2})]
    assert ar.get_tuned("tiny/cpu/nvme") == {"ratio": 0.15} and ar.get_tuned("x") is None
    ar.set_meta("note", {"a": 1})
    assert ar.get_meta("note") == {"a": 1} and ar.get_meta("format_version") == 1
    with pytest.raises(ArchiveError):
        ar.set_meta("format_version", 9)

    ar.touch(["nn1", "nn1", "nn2"])
    s = ar.stats()
    assert (s["segments"], s["documents"], s["tokens"], s["hits"]) == (2, 2, 2 * TOKENS, 2)
    assert s["raw_bytes"] == 2 * 2 * N_LAYERS * HEADS * DIM * 2 * TOKENS
    assert s["bytes_per_token_raw"] == s["raw_bytes"] / s["tokens"]
    assert s["compression_ratio"] == pytest.approx(s["raw_bytes"] / s["stored_bytes"])
    assert ar.size_bytes() > ar.size_bytes(include_index=False) >= s["stored_bytes"]


# ---------------------------------------------------------------- crash safety

from archive_crash_writer import N_LAYERS as CRASH_LAYERS  # noqa: E402
from archive_crash_writer import expected_layers, key_for  # noqa: E402


def _run_and_kill(path: Path, start: int, *, after_commits: int, delay: float) -> list[str]:
    """Start the writer, SIGKILL it ``delay`` s after its Nth commit; return every key it reported committed."""
    cmd = [sys.executable, str(REPO / "tests" / "archive_crash_writer.py"), str(path), str(start), "1000", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    watchdog = threading.Timer(60, proc.kill)  # never hang the suite
    watchdog.start()
    keys: list[str] = []
    try:
        while len(keys) < after_commits:
            line = proc.stdout.readline().strip()
            assert line, proc.stderr.read()
            keys.append(line)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        keys += proc.stdout.read().split()  # committed before the kill landed
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return keys


def test_crash_while_writing_never_leaves_partial_segments(tmp_path):
    path = tmp_path / "ar"
    Archive.open(path).close()
    committed: list[str] = []
    start = 0
    rng = random.Random(7)
    # Each blob write takes ~60 ms (2 ms per layer), so the random delays land in
    # tensor generation, mid-blob, between rename and commit, or just after commit.
    for after in (1, 3, 7, 2):
        delay = rng.uniform(0.0, 0.08)
        keys = _run_and_kill(path, start, after_commits=after, delay=delay)
        assert keys == [key_for(s) for s in range(start, start + len(keys))]
        committed += keys
        start += len(keys) + 1  # the interrupted seed may or may not have committed; skip it

        with Archive.open(path) as ar:
            report = ar.verify()
            assert report.ok, report.problems
            for rec in ar.iter_segments():
                assert rec.n_layers == len(rec.layers) == CRASH_LAYERS
                assert (ar.path / rec.blob).stat().st_size == sum(e.length for e in rec.layers)
            for key in committed:
                layers = expected_layers(int(key[len("crash"):], 16))
                for i in (0, CRASH_LAYERS // 2, CRASH_LAYERS - 1):
                    k, v = ar.read_layer(key, i)
                    assert _same(k, layers[i][0]) and _same(v, layers[i][1])
            for rec in ar.iter_segments():  # every layer of every segment reads back intact
                for i in range(rec.n_layers):
                    ar.read_layer_raw(rec, i)

    with Archive.open(path) as ar:
        ar.gc()
        assert ar.verify().ok and ar.verify().temp_files == 0 and ar.verify().orphan_blobs == 0
        assert set(committed) <= {r.key for r in ar.iter_segments()}
