"""Archive upkeep on real files: verify finds (and repairs) corruption, gc collects leftovers and evicts LRU."""

from __future__ import annotations

import json
import os

import pytest

from archive_helpers import N_LAYERS, TOKENS, ar, flip_byte, layers, put, same  # noqa: F401 (ar: fixture)
from kvblend.archive import DocumentRecord
from kvblend.errors import CorruptBlobError

# ---------------------------------------------------------------- verify and repair


def test_flipped_byte_detected_and_repaired(ar):
    for i in range(3):
        put(ar, f"hh{i}", seed=i)
    ar.put_document(DocumentRecord(path="/docs/a.txt", segment_keys=["hh0", "hh1"], n_tokens=2 * TOKENS))
    rec = ar.get_segment("hh1")
    flip_byte(ar.path / rec.blob, rec.layers[2].offset + rec.layers[2].length // 2)

    report = ar.verify()
    assert not report.ok and report.bad_segments == ["hh1"]
    assert [(p.key, p.layer) for p in report.problems] == [("hh1", 2)]
    assert "checksum" in report.problems[0].reason
    with pytest.raises(CorruptBlobError) as e:
        ar.read_layer("hh1", 2)
    assert (e.value.segment_key, e.value.layer) == ("hh1", 2)
    assert same(ar.read_layer("hh1", 1)[0], layers(1)[1][0])  # other layers still fine

    fixed = ar.verify(repair=True)
    assert fixed.repaired_segments == ["hh1"] and fixed.repaired_documents == ["/docs/a.txt"]
    assert not ar.has_segment("hh1")
    doc = ar.get_document("/docs/a.txt")
    assert doc.segment_keys == ["hh0"] and doc.incomplete
    assert ar.verify().ok
    with pytest.raises(CorruptBlobError):  # gone from the index: callers recompute
        ar.read_layer("hh1", 0)


def test_truncated_and_missing_blobs(ar):
    a, b = put(ar, "ii1", seed=1), put(ar, "ii2", seed=2)
    os.truncate(ar.path / a.blob, a.layers[1].offset + 3)
    (ar.path / b.blob).unlink()
    report = ar.verify()
    assert {(p.key, p.layer) for p in report.problems} == \
        {("ii1", i) for i in range(1, N_LAYERS)} | {("ii2", None)}
    assert all("truncated" in p.reason for p in report.problems if p.key == "ii1")
    assert same(ar.read_layer("ii1", 0)[0], layers(1)[0][0])
    with pytest.raises(CorruptBlobError, match="truncated"):
        ar.read_layer("ii1", 3)
    with pytest.raises(CorruptBlobError, match="missing") as e:
        ar.read_layer("ii2", 0)
    assert e.value.segment_key == "ii2"
    ar.verify(repair=True)
    assert ar.verify().ok and ar.count_segments() == 0


def test_dangling_document_reference_reported_and_stripped(ar):
    put(ar, "uu1")
    ar.put_document(DocumentRecord(path="/u.txt", segment_keys=["uu1", "uu-gone"]))
    report = ar.verify()
    assert [(p.key, p.layer) for p in report.problems] == [("uu-gone", None)]
    assert "/u.txt" in report.problems[0].reason and report.documents_checked == 1
    fixed = ar.verify(repair=True)
    assert fixed.repaired_segments == [] and fixed.repaired_documents == ["/u.txt"]
    doc = ar.get_document("/u.txt")
    assert doc.segment_keys == ["uu1"] and doc.incomplete and ar.has_segment("uu1")
    assert ar.verify().ok


def test_deep_verify_decodes(ar):
    rec = put(ar, "vv1")
    report = ar.verify(deep=True)
    assert report.ok and report.layers_checked == N_LAYERS and report.bytes_checked == rec.stored_bytes


def test_reports_serialize(ar):
    rec = put(ar, "ss1")
    flip_byte(ar.path / rec.blob, 0)
    d = ar.verify().to_dict()
    assert d["ok"] is False and d["problems"][0] == {"key": "ss1", "layer": 0, "reason": "checksum mismatch",
                                                             "damaged": True}
    assert json.dumps(ar.gc(dry_run=True).to_dict())


# ---------------------------------------------------------------- gc


def test_gc_removes_orphans_and_temp_files(ar):
    rec = put(ar, "kk0")
    orphan = ar.path / "blobs/zz/zz9.kvb"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"x" * 100)
    temp = ar.path / "blobs/kk/.kk1.kvb.tmp-123-abcd"
    temp.write_bytes(b"y" * 50)
    foreign = ar.path / "blobs/kk/README"
    foreign.write_text("not ours")

    found = ar.verify()
    assert found.ok and (found.orphan_blobs, found.temp_files) == (1, 1)
    dry = ar.gc(dry_run=True)
    assert dry.orphan_blobs == ["blobs/zz/zz9.kvb"] and dry.temp_files == ["blobs/kk/.kk1.kvb.tmp-123-abcd"]
    assert orphan.exists() and temp.exists()
    report = ar.gc()
    assert report.freed_bytes == 150 and not orphan.exists() and not temp.exists()
    assert foreign.exists() and (ar.path / rec.blob).exists() and ar.verify().ok


def test_gc_removes_what_a_killed_profile_left_in_the_archive(ar):
    """`profile` measures the archive's folder through a scratch file; one killed outright left it for good."""
    import os

    dead = ar.path / ".kvblend-profile-99999999-0bad.scratch"  # above any pid_max: its process is gone
    running = ar.path / f".kvblend-profile-{os.getpid()}-0ace.scratch"
    dead.write_bytes(b"x" * 100)
    running.write_bytes(b"y" * 10)
    assert ar.gc(dry_run=True).temp_files == [dead.name] and dead.exists()
    assert ar.gc().freed_bytes == 100 and not dead.exists() and running.exists()
