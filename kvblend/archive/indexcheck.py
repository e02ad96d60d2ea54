"""Is ``index/data.mdb`` sound, when must that be checked, and what records does a damaged one still hold?

LMDB keeps no checksums and trusts its file: a node offset, key size or child
page number overwritten with garbage is followed as is, and the process dies of
SIGBUS or SIGSEGV with no exception to catch. py-lmdb ships an offline verifier
(``lmdb.verify``) that walks every page of the newest snapshot with plain file
reads (never mmap), for both LMDB 0.9 (data version 1) and 1.0 (data version 3)
files, so the walk itself cannot crash. :func:`file_problems` runs it.

A walk of the whole file costs time in proportion to the index, so it is not
run before every commit. It runs in ``kvblend verify``, and whenever the file
is not in a state a kvblend writer left it in (:func:`identity`, the stamp):

* after each commit a writer records the data file's identity (device, inode,
  size, mtime, ctime and this boot's id) in ``index/verified``;
* an open, and a write transaction, compare the file with that stamp (and with
  what this process last saw): a match means only kvblend commits, each of
  which started from a checked state, touched the file since it was checked;
* anything else is an *unclean* state and the file is walked first: a writer
  killed between its commit and its stamp, a reboot since the stamp (a power
  loss may tear pages; the boot id tells a reboot apart), a file another
  program wrote or a user copied or restored, an archive older than the stamp.

A stamp is a hint, never trusted over a walk: writing it is best effort (a
full disk leaves it stale, which only costs a walk), and it holds no data.

:func:`read_records` reads what a damaged file still holds, for
``verify --rebuild-index``: the same walk, keeping each record of a named
table whose page and node passed every check. It extends ``lmdb.verify``'s
walker (``_Verifier``, not a public API; py-lmdb is pinned in
constraints.txt and tests/unit/test_indexcheck.py would fail first on a change)
by one method, because the verifier reports problems but not records, and a
second hand-written page parser to get them is what this module replaced.
"""

from __future__ import annotations

import json
import os
import struct
from functools import cache
from pathlib import Path
from typing import Any

from lmdb import verify as lmdb_verify

STAMP_FILE = "verified"  # in the index directory, beside data.mdb
MAX_REPORTED = 20  # problems kept from one walk: enough to judge a file

_U64 = struct.Struct("=Q")
_NODE_HEADER = 8


@cache
def _boot_id() -> str:
    """This boot's id (Linux), so a stamp written before a reboot never vouches for the file after it."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def identity(data: Path) -> dict[str, Any] | None:
    """What the stamp records of ``data``: any write to the file changes its ctime, any copy its inode."""
    try:
        st = os.stat(data)
    except OSError:
        return None
    return {
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "boot": _boot_id(),
    }


def read_stamp(index_dir: Path) -> dict[str, Any] | None:
    try:
        value = json.loads((index_dir / STAMP_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_stamp(index_dir: Path, ident: dict[str, Any]) -> bool:
    """Record ``ident`` as a state a kvblend writer left (temp file + rename); False if it could not be written."""
    tmp = index_dir / f".{STAMP_FILE}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(ident, sort_keys=True))
        os.replace(tmp, index_dir / STAMP_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


class SnapshotGone(Exception):
    """The snapshot a walk was pinned to is no longer named by a meta page: two commits landed since the caller's
    read transaction began. Its pages are intact (the transaction holds them) but the walk cannot find its root;
    the caller begins a new transaction and walks again."""


def file_problems(data: Path, txnid: int | None = None) -> list[str]:
    """Every structural problem the walk finds in a snapshot of ``data``, one line each (at most
    :data:`MAX_REPORTED`); empty when LMDB can read the file without going astray.

    ``txnid`` pins the walk to that snapshot, which the caller's read transaction must hold: a writer in another
    process may commit meanwhile, and the newest meta page would then name pages the walk's view of the file
    does not reach yet (a false "beyond EOF"). None walks the newest snapshot, for a file no one writes.
    SnapshotGone if the pinned snapshot's meta page was already overwritten."""
    try:
        return read_records(data, collect=False, txnid=txnid)[1]
    except OSError as e:
        return [f"cannot read {data.name} ({e.strerror or e})"]


def read_records(
    data: Path, collect: bool = True, txnid: int | None = None
) -> tuple[dict[str, list[tuple[bytes, bytes]]], list[str]]:
    """Every (key, value) of every named table on sound pages of ``data``'s newest snapshot (or snapshot
    ``txnid``, see :func:`file_problems`), read with plain reads, and the problems found. For rebuilding a
    damaged index: LMDB would follow the damage and could kill the process; this walk skips it, so only the
    records on damaged pages (and below them) are lost. OSError if the file cannot be read at all."""
    with open(data, "rb") as f:
        walker = _Walker(f, os.fstat(f.fileno()).st_size, collect, txnid)
        try:
            problems = walker.verify()
        except lmdb_verify.VerifyError as e:
            return {}, [str(e)]
    return walker.records, [str(p) for p in problems[:MAX_REPORTED]]


class _Walker(lmdb_verify._Verifier):
    """``lmdb.verify``'s walk, with one false alarm of py-lmdb 3.0.0 fixed, optionally keeping records, and
    optionally pinned to one snapshot.

    The false alarm: LMDB (0.9 and 1.0) overwrites a big value in the overflow
    run it already has when that run was written in the same transaction and
    is long enough, and keeps the run's page count ("we don't bother to try
    shrinking", mdb_cursor_put), so a run may be longer than its value needs;
    the verifier calls that damage (and the spare pages a leak). Such a run is
    checked here as the value it can hold, the value itself kept at its size.
    """

    def __init__(self, f: Any, filesize: int, collect: bool, txnid: int | None = None) -> None:
        super().__init__(f, filesize)
        self.collect = collect
        self.pinned = txnid
        self.tables: dict[str, str] = {}  # the walk's name of a named table -> the table's name
        self.records: dict[str, list[tuple[bytes, bytes]]] = {}

    def load_metas(self) -> None:
        """Both meta pages checked as LMDB checks them; then, when pinned, the walk starts from the pinned
        snapshot's meta page (commit N writes slot N % 2, so it is there until commit N + 2 overwrites it)."""
        super().load_metas()
        if self.pinned is None or self.meta.txnid == self.pinned:
            return
        meta = self._read_meta(self.pinned % lmdb_verify.NUM_METAS, self.psize)
        if meta.txnid != self.pinned:
            raise SnapshotGone(self.pinned)
        self.meta = meta
        self.next_pgno = meta.last_pg + 1

    def _bigdata(
        self, ctx: dict[str, Any], pgno: int, i: int, buf: bytes, doff: int, dsize: int, want_bytes: bool
    ) -> Any:
        first = _U64.unpack_from(buf, doff)[0] if doff + 8 <= self.psize else 0
        head = self.read_page(first) if lmdb_verify.NUM_METAS <= first < self.next_pgno else None
        run = self._pg_pages(head, 0) if head is not None else 0
        if self.eng["has_txnid"] and doff + 24 <= self.psize and _U64.unpack_from(buf, doff + 16)[0] != run:
            run = 0  # LMDB 1.0 records the run's length in the node as well: they must agree
        if run * self.psize - self.hdrsz <= dsize:
            return super()._bigdata(ctx, pgno, i, buf, doff, dsize, want_bytes)
        data = super()._bigdata(ctx, pgno, i, buf, doff, run * self.psize - self.hdrsz, want_bytes)
        return None if data is None else data[:dsize]

    def _leaf_value(
        self,
        ctx: dict[str, Any],
        pgno: int,
        i: int,
        buf: bytes,
        o: int,
        nflags: int,
        ksize: int,
        dsize: int,
        key: bytes,
    ) -> None:
        before = len(self.errors)
        super()._leaf_value(ctx, pgno, i, buf, o, nflags, ksize, dsize, key)
        if not self.collect or len(self.errors) != before:
            return
        if ctx["name"] == "main" and nflags & lmdb_verify.F_SUBDATA:  # LMDB 1.0 keeps a name's NUL terminator
            self.tables[f"main/{lmdb_verify._printable(key)}"] = key.rstrip(b"\0").decode("utf-8", "replace")
        table = self.tables.get(ctx["name"])
        if table is None or nflags & ~lmdb_verify.F_BIGDATA:
            return  # the main tree or the free list, or duplicates
        start = o + _NODE_HEADER + (lmdb_verify._even(ksize) if self.eng["has_txnid"] else ksize)
        if nflags & lmdb_verify.F_BIGDATA:  # the overflow run was checked to lie in the file and hold dsize bytes
            value = self._read_at(_U64.unpack_from(buf, start)[0] * self.psize + self.hdrsz, dsize)
        else:
            value = bytes(buf[start : start + dsize])
        self.records.setdefault(table, []).append((bytes(key), value))
