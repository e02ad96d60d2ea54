"""A full disk: writes fail in one line leaving the index unchanged, and the commands that free space
(`gc`, `rm`, `verify --repair`) still run, on a real tmpfs filled to 100%."""

from __future__ import annotations

import errno
import json
import os

import lmdb
import pytest

from archive_helpers import ar, flip_byte, layers, put  # noqa: F401 (ar: fixture)
from hardening_helpers import build_archive, fill_disk, small_tmpfs
from kvblend.archive import Archive, SegmentRecord, core, local
from kvblend.archive.blobs import RESERVE_BYTES, RESERVE_FILE
from kvblend.errors import ArchiveError
from support import one_line_error, run_cli


def test_space_freeing_commands_run_on_a_full_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk") as disk:
        arc = build_archive(disk / "arc", n=40)
        assert (arc / RESERVE_FILE).stat().st_size == RESERVE_BYTES  # the writer kept its reserve
        filler = fill_disk(disk)

        # Writing now fails cleanly (disk full during a blob write), and leaves the index as it was.
        with Archive.open(arc) as ar:
            with pytest.raises(ArchiveError, match="disk full"):
                ar.put_segment(SegmentRecord(key="full1"), layers(1))
            assert ar.count_segments() == 40 and not ar.has_segment("full1")

        fill_disk(disk, "filler2")
        gc = run_cli("gc", "--max-size", "60KB", "--archive", arc, "--json")
        assert gc.returncode == 0, gc.stderr  # was: OSError ENOSPC writing the pid into the lock file
        assert json.loads(gc.stdout)["evicted"]

        fill_disk(disk, "filler3")
        assert run_cli("rm", "/docs/b.md", "--archive", arc).returncode == 0

        fill_disk(disk, "filler4")
        with Archive.open(arc, readonly=True) as ar:
            rec = next(iter(ar.iter_segments()))
        flip_byte(arc / rec.blob, 10)  # in place: needs no new blocks
        assert run_cli("verify", "--repair", "--archive", arc).returncode == 0

        verify = run_cli("verify", "--archive", arc)
        assert verify.returncode == 0, verify.stderr
        for name in ("filler", "filler2", "filler3", "filler4"):
            (filler.parent / name).unlink(missing_ok=True)


def test_ingest_on_a_full_disk_is_one_line(tmp_path):
    """`ingest` fails before the model loads or after, but always in one line and never half-commits."""
    with small_tmpfs(tmp_path / "disk") as disk:
        arc = build_archive(disk / "arc")
        doc = tmp_path / "a.md"
        doc.write_text("Some words.\n")
        fill_disk(disk)
        (arc / RESERVE_FILE).unlink()  # not even the reserve is left
        fill_disk(disk, "filler2")
        proc = run_cli("gc", "--archive", arc)
        assert proc.returncode == 0, proc.stderr  # locks, commits nothing, deletes nothing
        with Archive.open(arc, readonly=True) as ar:
            assert ar.count_segments() == 6 and ar.verify().ok


def test_pid_note_in_lock_file_does_not_fail_on_enospc(ar, monkeypatch):
    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local.os, "pwrite", no_space)
    with ar.writer():
        put(ar, "pp1")
    assert ar.has_segment("pp1")


def test_index_commit_failure_leaves_index_unchanged_and_orphans_for_gc(ar, monkeypatch):
    """Disk full during the index commit: nothing committed, the written blob is an orphan gc deletes."""
    put(ar, "cc0")

    def full(*args, **kwargs):
        raise lmdb.DiskError("mdb_txn_commit: No space left on device")

    monkeypatch.setattr(core, "commit_segments", full)
    with pytest.raises(ArchiveError, match="nothing was committed"):
        put(ar, "cc1")
    monkeypatch.undo()
    assert not ar.has_segment("cc1") and ar.count_segments() == 1
    assert ar.gc().orphan_blobs == ["blobs/cc/cc1.kvb"]
    assert ar.verify().ok


def test_reserve_is_spent_by_gc_and_taken_back(ar, tmp_path):
    put(ar, "rr1")
    reserve = ar.path / RESERVE_FILE
    assert reserve.stat().st_size == RESERVE_BYTES
    reserve.unlink()
    ar.gc(max_size_bytes=0)
    assert reserve.stat().st_size == RESERVE_BYTES and ar.count_segments() == 0
    assert ar.size_bytes(include_index=False) == 0  # the reserve is not archive data
    assert not [p for p in os.listdir(ar.path) if p.startswith(".reserve")]


def test_lock_file_busy_message_mentions_wait(tmp_path):
    arc = build_archive(tmp_path / "arc")
    with Archive.open(arc) as holder, holder.writer():
        line = one_line_error(run_cli("gc", "--archive", arc))
        assert f"pid {os.getpid()}" in line and "--wait" in line
