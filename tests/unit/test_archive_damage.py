"""A lost, emptied, blank, truncated or corrupted index: one line naming the repair, never a traceback,
a signal, or an "empty archive" that gc would then wipe; `verify --rebuild-index` restores it from the blobs."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import lmdb
import pytest

from archive_helpers import TOKENS, flip_byte, layers, same
from hardening_helpers import DOCS, N_SEGMENTS, build_archive, embedding, index_pages, snapshot
from kvblend.archive import Archive, encode_layer, rebuild_index
from kvblend.archive.blobs import write_blob
from kvblend.errors import ArchiveDamagedError, ArchiveVersionError
from support import one_line_error, run_cli

#: LMDB's page layout (lmdb.h's MDB_page), written out here rather than taken from the code under test
PAGE = 4096
LMDB_PAGE_HEADER = struct.Struct("=QHHHH")  # pgno, pad, flags, lower, upper
P_LEAF = 0x02

# Every command, as far as it gets without a model: each must stop at the damaged index.
COMMANDS = [["ls"], ["stats"], ["show", "seg00"], ["verify"], ["verify", "--repair"], ["gc", "--dry-run"],
            ["gc"], ["gc", "--max-size", "1KB"], ["rm", "/docs/a.md"], ["query", "q?"]]


def _damage(arc, how: str) -> None:
    data = arc / "index" / "data.mdb"
    if how == "missing":
        data.unlink()
    elif how == "empty":
        os.truncate(data, 0)
    elif how == "truncated":  # LMDB would map it and die of SIGBUS on the first read past the end
        os.truncate(data, 16384)
    elif how == "no-index-dir":
        shutil.rmtree(arc / "index")
    elif how == "blank":  # LMDB re-created from nothing: no format version, no segments
        shutil.rmtree(arc / "index")
        env = lmdb.open(str(arc / "index"), max_dbs=8)
        with env.begin(write=True) as txn:
            env.open_db(b"segments", txn=txn)
        env.close()


@pytest.mark.parametrize("how", ["missing", "empty", "truncated", "no-index-dir", "blank"])
def test_damaged_index_is_refused_by_every_command_and_nothing_is_deleted(tmp_path, how):
    arc = build_archive(tmp_path / "arc")
    _damage(arc, how)
    before = snapshot(arc)
    for command in COMMANDS:
        proc = run_cli(*command, "--archive", arc, timeout=300)
        line = one_line_error(proc)
        assert proc.returncode > 0, (command, proc.returncode)  # an exit code, not a signal (SIGBUS was 135/-7)
        assert "damaged" in line and f"kvblend verify --rebuild-index --archive {arc}" in line, (command, line)
    assert snapshot(arc) == before  # nothing created (no fresh data.mdb, no blobs/), nothing deleted
    assert sorted(p.name for p in (arc / "blobs" / "se").iterdir()) == [f"seg{i:02d}.kvb" for i in range(N_SEGMENTS)]


@pytest.mark.parametrize("field", [b'"checksum"', b'"offset"'])
def test_a_record_that_lost_a_field_is_damage_not_a_traceback(tmp_path, field):
    """A flipped bit can leave a record valid JSON without one of its fields; every command that reads it said
    TypeError with a traceback."""
    arc = build_archive(tmp_path / "arc")
    env = lmdb.open(str(arc / "index"), max_dbs=8)
    with env.begin(write=True) as txn:  # the live record, as a bit flip in its page would leave it
        segments = env.open_db(b"segments", txn=txn)
        key, value = next(iter(txn.cursor(db=segments)))
        at = value.index(field)
        txn.put(key, value[:at + 1] + b"X" + value[at + 2:], db=segments)  # '"checksum"' -> '"Xhecksum"'
    env.close()
    before = snapshot(arc)
    for command in (["ls", "--json"], ["stats"], ["verify"], ["verify", "--repair"], ["gc", "--dry-run"]):
        proc = run_cli(*command, "--archive", arc, timeout=300)
        line = one_line_error(proc)
        assert proc.returncode > 0 and "damaged" in line and "--rebuild-index" in line, (command, line)
    assert snapshot(arc) == before


def test_rebuild_restores_segments_documents_embeddings_and_model(tmp_path):
    arc = build_archive(tmp_path / "arc")
    with Archive.open(arc, readonly=True) as ar:
        before = {r.key: r for r in ar.iter_segments()}
        docs_before = {d.path: d for d in ar.iter_documents()}
    (arc / "index" / "data.mdb").unlink()

    proc = run_cli("verify", "--rebuild-index", "--archive", arc, "--json", check=True)
    report = json.loads(proc.stdout)
    assert report["segments_restored"] == N_SEGMENTS and report["documents_restored"] == 2
    assert report["incomplete_documents"] == [] and report["lost_blobs"] == []
    assert report["unlinked_segments"] == 1  # seg05 belongs to no document
    assert run_cli("verify", "--archive", arc, check=True).stdout.startswith(f"ok: {N_SEGMENTS} segments")
    assert {d["path"] for d in json.loads(run_cli("ls", "--archive", arc, "--json", check=True).stdout)} == set(DOCS)

    with Archive.open(arc, readonly=True) as ar:
        assert (ar.model_name, ar.model_fingerprint) == ("tiny", "fp-tiny")
        for key, old in before.items():
            new = ar.get_segment(key)
            for field in ("token_ids", "text", "n_tokens", "dtype", "codec", "n_layers", "kv_heads", "head_dim",
                          "base_position", "layers", "blob", "extra"):
                assert getattr(new, field) == getattr(old, field), (key, field)
            k, v = ar.read_layer(key, 3)
            assert same(k, layers(int(key[3:]))[3][0]) and same(v, layers(int(key[3:]))[3][1])
        keys, matrix = ar.get_embeddings()
        assert keys == sorted(before) and all((matrix[i] == embedding(i)).all() for i in range(N_SEGMENTS))
        for path, doc in docs_before.items():
            new_doc = ar.get_document(path)
            assert (new_doc.segment_keys, new_doc.content_hash, new_doc.n_tokens, new_doc.incomplete) == \
                (doc.segment_keys, doc.content_hash, doc.n_tokens, False)
    assert any(p.name.startswith("index.damaged-") for p in arc.iterdir())  # the old index is kept


def test_a_rebuild_killed_between_its_renames_is_finished_by_the_next(tmp_path, monkeypatch):
    """Killed after moving the old index aside but before putting the new one in place: the next rebuild puts
    the finished new index in place (tuned settings, profiles and hit counts with it) instead of deleting it and
    rebuilding from the blobs alone."""
    from kvblend.archive import repair

    arc = build_archive(tmp_path / "arc")
    with Archive.open(arc) as ar, ar.writer():
        ar.put_tuned("tiny", {"ratio": 0.2})
        ar.put_profile("nvme", {"read_gbps": 1.5})
        ar.touch(["seg01", "seg01", "seg02"])
        hits = {r.key: r for r in ar.iter_segments()}
    real_rename = os.rename

    def killed_after_first(src, dst):
        real_rename(src, dst)
        if Path(dst).name.startswith("index.damaged-"):
            raise KeyboardInterrupt  # the process dies here (nothing after this line runs)

    monkeypatch.setattr(repair.os, "rename", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        rebuild_index(arc)
    monkeypatch.setattr(repair.os, "rename", real_rename)
    assert not (arc / "index").exists()
    assert "damaged" in one_line_error(run_cli("ls", "--archive", arc))
    run_cli("verify", "--rebuild-index", "--archive", arc, check=True)
    with Archive.open(arc, readonly=True) as ar:
        assert ar.get_tuned("tiny") == {"ratio": 0.2} and ar.get_profile("nvme") == {"read_gbps": 1.5}
        for key, rec in hits.items():
            assert ar.get_segment(key).to_dict() == rec.to_dict()  # hit counts and last access included
    assert not (arc / "index.rebuild").exists() and not (arc / "index" / repair.BUILT_MARK).exists()


def test_rebuild_reports_what_it_cannot_restore(tmp_path):
    """A blob written before blobs described themselves, and a damaged blob, go to lost+found; the
    documents that used them are restored incomplete and named."""
    arc = build_archive(tmp_path / "arc")
    (arc / "index" / "data.mdb").unlink()
    old_style = "blobs/ol/old1.kvb"
    write_blob(arc, old_style, [encode_layer(k, v, "zstd-shuffle") for k, v in layers(9)])  # no segment metadata
    flip_byte(arc / "blobs/se/seg01.kvb", 200)  # inside layer 0: its zstd frame checksum fails

    proc = run_cli("verify", "--rebuild-index", "--archive", arc)
    assert proc.returncode == 0, proc.stderr
    assert "/docs/a.md lost segments" in proc.stderr and "/docs/b.md" not in proc.stderr
    assert "old1.kvb" in proc.stderr and "seg01.kvb" in proc.stderr and "lost+found" in proc.stderr
    assert (arc / "lost+found/ol/old1.kvb").is_file() and (arc / "lost+found/se/seg01.kvb").is_file()
    with Archive.open(arc, readonly=True) as ar:
        doc = ar.get_document("/docs/a.md")
        assert doc.segment_keys == ["seg00", "seg02"] and doc.incomplete
        assert ar.count_segments() == N_SEGMENTS - 1 and ar.verify().ok
    gc = json.loads(run_cli("gc", "--archive", arc, "--json", check=True).stdout)
    assert gc["orphans"] == [] and (arc / "lost+found/ol/old1.kvb").is_file()  # gc never reaches them


def test_truncated_index_rebuilt_from_blobs(tmp_path):
    arc = build_archive(tmp_path / "arc", n=40)  # enough records that the index spans many pages
    os.truncate(arc / "index" / "data.mdb", 16384)
    line = one_line_error(run_cli("ls", "--archive", arc))
    assert "truncated" in line and "--rebuild-index" in line
    report = rebuild_index(arc)
    assert report.segments_restored == 40 and report.documents_restored == 2 and not report.incomplete_documents
    assert any("truncated" in p for p in report.problems)
    assert run_cli("verify", "--archive", arc).returncode == 0


def _corrupt_first_segment_page(arc) -> None:
    """Overwrite the header of every leaf page whose node area holds seg01's record (LMDB then says
    MDB_CORRUPTED).

    Every such copy, because LMDB's copy-on-write leaves stale copies of a record in pages it no longer
    reads: corrupting only the first copy found made the test pass or fail with the page layout. Only
    leaf pages, and only where the record lies in the used node area (at or after mp_upper): a reused
    page keeps stale bytes in its free gap, and when that page had become the segments table's branch
    root, corrupting it lost every segment record at once (a rare flake of the rebuild test below).
    """
    path = arc / "index" / "data.mdb"
    data = path.read_bytes()
    pages = set()
    for at in range(len(data)):
        if data.startswith(b'"key":"seg01"', at):
            page = at // PAGE
            _, _, flags, _, upper = LMDB_PAGE_HEADER.unpack_from(data, page * PAGE)
            if flags & P_LEAF and at - page * PAGE >= upper:
                pages.add(page)
    assert pages
    with open(path, "r+b") as f:
        for page in pages:
            f.seek(page * PAGE)
            f.write(b"\xff" * 16)


def test_corrupted_index_page_is_one_line_and_named_by_verify(tmp_path):
    arc = build_archive(tmp_path / "arc", n=40)
    _corrupt_first_segment_page(arc)
    for command in (["verify"], ["stats"], ["gc", "--dry-run"], ["rm", "/docs/a.md"]):
        line = one_line_error(run_cli(*command, "--archive", arc, timeout=300))
        assert "corrupted" in line and "--rebuild-index" in line, (command, line)
    # LMDB names the first failure MDB_CORRUPTED, and a read in the same transaction after it
    # MDB_BAD_TXN: which one surfaces depends on the page order
    with pytest.raises(ArchiveDamagedError, match="index is corrupted"):
        with Archive.open(arc, readonly=True) as ar:
            ar.verify()


def test_rebuild_keeps_what_a_corrupted_index_still_holds(tmp_path):
    """Records the damaged index still yields (usage counts, profiles) survive the rebuild."""
    arc = build_archive(tmp_path / "arc", n=40)
    with Archive.open(arc) as ar:
        ar.touch(["seg30"])
        ar.touch(["seg30"])
        ar.put_profile("nvme", {"read_GBps": 3.0})
    _corrupt_first_segment_page(arc)
    report = rebuild_index(arc)
    assert report.segments_restored == 40 and 0 < report.segments_from_old_index < 40
    with Archive.open(arc, readonly=True) as ar:
        assert ar.get_segment("seg30").hits == 2 and ar.get_profile("nvme") == {"read_GBps": 3.0}
        assert ar.verify().ok


def test_bad_json_record_is_one_line(tmp_path):
    """LMDB keeps no checksums: a flipped byte inside a record's JSON is found only when parsed."""
    arc = build_archive(tmp_path / "arc")
    path = arc / "index" / "data.mdb"
    data = bytearray(path.read_bytes())
    for at in range(len(data)):  # every copy: LMDB's copy-on-write may leave older ones behind
        if data[at:at + 13] == b'"key":"seg03"':
            data[at] = ord("{")
    path.write_bytes(bytes(data))
    line = one_line_error(run_cli("verify", "--archive", arc))
    assert "not valid JSON" in line and "--rebuild-index" in line
    assert rebuild_index(arc).segments_restored == N_SEGMENTS
    assert run_cli("verify", "--archive", arc).returncode == 0


def test_read_commands_create_nothing_beside_a_bare_index_dir(tmp_path):
    """A folder with an empty `index/` is not an archive: reading it must not make it one."""
    bare = tmp_path / "bare"
    (bare / "index").mkdir(parents=True)
    for command in (["ls"], ["stats"], ["verify"], ["gc", "--dry-run"], ["show", "x1"]):
        line = one_line_error(run_cli(*command, "--archive", bare))
        assert "no archive index" in line, (command, line)
    assert sorted(p.name for p in bare.rglob("*")) == ["index"]


def test_rebuild_is_idempotent_and_keeps_tokens_for_keys(tmp_path):
    arc = build_archive(tmp_path / "arc")
    first = rebuild_index(arc)  # of a healthy archive: everything comes from the old index
    assert first.segments_from_old_index == N_SEGMENTS
    again = rebuild_index(arc)
    assert again.segments_restored == N_SEGMENTS
    with Archive.open(arc, readonly=True) as ar:
        assert ar.get_segment("seg04").token_ids == list(range(4, 4 + TOKENS))


def _put_meta(arc, key: bytes, raw: bytes) -> None:
    env = lmdb.open(str(arc / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(key, raw, db=env.open_db(b"meta", txn=txn))
    env.close()


def test_rebuild_refuses_a_newer_archive_and_repairs_a_malformed_version(tmp_path):
    arc = build_archive(tmp_path / "arc")
    _put_meta(arc, b"format_version", b"7")
    with pytest.raises(ArchiveVersionError, match="v7 is newer"):
        rebuild_index(arc)
    assert not any(p.name.startswith("index.damaged-") for p in arc.iterdir())  # refused untouched
    _put_meta(arc, b"format_version", b"1.5")
    assert "not a positive integer" in one_line_error(run_cli("ls", "--archive", arc))
    assert rebuild_index(arc).segments_from_old_index == N_SEGMENTS
    assert run_cli("ls", "--archive", arc).returncode == 0


def _live_pages(arc) -> list[int]:
    """Every branch and leaf page the current snapshot reads (not stale copies LMDB left behind)."""
    return index_pages(arc / "index" / "data.mdb")[0]


def _garble_page(arc, page: int) -> None:
    """What users hit: bytes 16..4095 of a page overwritten (its header intact, its node pointers garbage)."""
    with open(arc / "index" / "data.mdb", "r+b") as f:
        f.seek(page * 4096 + 16)
        f.write(b"\xff" * (4096 - 16))


def test_no_garbled_index_page_ends_in_a_signal(tmp_path):
    """Every page the index reads, garbled in turn: each command is one line and an exit code (never SIGBUS,
    which LMDB died of when a node pointer led outside the file), and the rebuild restores the archive.

    `verify` (which reads every page) meets every garbled page; a reader (`stats`) and a writer (`rm`) take
    turns over them (13 pages: 26 fresh interpreters, not 39, on a suite where each costs ~0.7 s)."""
    built = build_archive(tmp_path / "built", n=40)
    pages = _live_pages(built)
    assert len(pages) > 3
    for i, page in enumerate(pages):
        arc = tmp_path / f"p{page}"
        shutil.copytree(built, arc)
        _garble_page(arc, page)
        for command in (["verify"], ["stats"] if i % 2 else ["rm", "/docs/a.md"]):
            proc = run_cli(*command, "--archive", arc, timeout=300)
            line = one_line_error(proc)
            assert proc.returncode > 0, (page, command, proc.returncode)  # SIGBUS was -7 (135 from a shell)
            assert "damaged" in line and "--rebuild-index" in line, (page, command, line)
        report = rebuild_index(arc)
        assert report.segments_restored == 40, (page, report.problems)
        run_cli("verify", "--archive", arc, check=True)  # must pass: a forked child of the test's CLI host


def test_a_write_over_a_page_damaged_since_open_fails_and_changes_nothing(tmp_path):
    """The archive opened clean; a page it would write through is damaged since: the write is refused in one
    line before LMDB follows the garbage, and the file is as it was."""
    arc = build_archive(tmp_path / "arc", n=40)
    with Archive.open(arc) as ar:
        for page in _live_pages(arc):
            _garble_page(arc, page)
        before = (arc / "index" / "data.mdb").read_bytes()
        with pytest.raises(ArchiveDamagedError, match="index is corrupted.*--rebuild-index"):
            ar.put_profile("nvme", {"read_GBps": 3.0})
        assert ar.touch(["seg01"]) == 0  # usage counts never fail a query, and write nothing either
    assert (arc / "index" / "data.mdb").read_bytes() == before


def test_a_writer_does_not_commit_into_an_index_another_process_rebuilt(tmp_path):
    """A process that opened the archive before another ran `verify --rebuild-index` still holds the old index
    (now index.damaged-*): its commits there were reported stored and lost. It is told to run again instead."""
    from kvblend.archive import SegmentRecord
    from kvblend.errors import ArchiveError

    arc = build_archive(tmp_path / "arc")
    with Archive.open(arc) as ar:
        run_cli("verify", "--rebuild-index", "--archive", arc, check=True)
        with pytest.raises(ArchiveError, match="rebuild-index"), ar.writer():
            ar.put_segment(SegmentRecord(key="after", token_ids=list(range(TOKENS)), text="t"), layers(7))
    with Archive.open(arc) as ar, ar.writer():  # opened after the rebuild: it writes where everyone reads
        ar.put_segment(SegmentRecord(key="after", token_ids=list(range(TOKENS)), text="t"), layers(7))
    assert "after" in run_cli("show", "after", "--archive", arc, check=True).stdout


def test_a_gc_opened_before_a_rebuild_deletes_nothing_the_new_index_uses(tmp_path):
    """gc deleted leftovers before its first write, through the index it opened: a rebuild in between (a
    `gc --wait` queued behind `verify --rebuild-index`) restored a segment from its blob, and that gc took the
    blob for an orphan of the old index."""
    from kvblend.errors import ArchiveError

    arc = build_archive(tmp_path / "arc")
    with Archive.open(arc) as ar:
        key = next(iter(ar.iter_segments())).key
        blob = arc / ar.get_segment(key).blob
        ar.store.write(lambda txn: txn.delete("segments", key))  # its record lost, its blob kept
        assert rebuild_index(arc).segments_restored == N_SEGMENTS  # another process, meanwhile
        with pytest.raises(ArchiveError, match="was replaced since this command opened it"):
            ar.gc()
        assert blob.exists()
    with Archive.open(arc) as again:
        assert again.has_segment(key) and again.gc().orphans == [] and again.verify().ok
