"""The archive index: small JSON records (records.py) in an LMDB environment.

The index holds only metadata (a few KB per segment); KV payloads live in
blob files (see :mod:`kvblend.archive.blobs`). Keeping LMDB small keeps
its copy-on-write B-tree cheap to commit and its map easy to grow.

Every LMDB error that means the file is damaged (a bad page, a broken
B-tree) becomes one :class:`ArchiveDamagedError` line naming the repair
command, wherever it surfaces: at open, mid-iteration, or in a commit.

LMDB trusts its file, and a bad file can kill the process instead of raising:
a ``data.mdb`` shorter than its own header says is mapped anyway, and the first
read past the end is SIGBUS (no exception, no message). So before LMDB maps it,
the two meta pages are read with plain file I/O and the file size compared with
the last page they claim (:func:`index_problem`); damage *inside* the file is
found by walking it (indexcheck.py) at open and before a write whenever the file
is not in a state a kvblend writer stamped, and in ``verify``. A missing or
empty index next to blob files is a *damaged* archive, not an empty one:
opening it as empty would let ``gc`` delete every blob as an orphan.

The LMDB engine is chosen here, never by py-lmdb's defaults (which follow
``LMDB_DEFAULT_LIB_VERSION``): an existing ``data.mdb`` opens with the engine
whose data version it holds, a new one is written by LMDB 0.9 (:data:`NEW_LIB_VERSION`).
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from kvblend.archive.blobs import BLOB_DIR, BLOB_SUFFIX, is_temp_name
from kvblend.archive.indexcheck import SnapshotGone, file_problems, identity, read_stamp, write_stamp
from kvblend.errors import ArchiveDamagedError, ArchiveError

T = TypeVar("T")

#: Named sub-databases of the LMDB environment under ``index/``.
DB_NAMES: tuple[str, ...] = ("meta", "segments", "documents", "embeddings", "profiles", "tuned")

DEFAULT_MAP_SIZE = 1 << 30  # 1 GiB; sparse on Linux, grown by doubling on MapFullError
PINNED_WALK_ATTEMPTS = 20  # a walk loses its snapshot only to two commits inside a millisecond window

#: LMDB errors that mean the index file itself is damaged (not a full disk or a permission problem).
DAMAGE_ERRORS: tuple[type[lmdb.Error], ...] = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.PanicError,
    lmdb.IncompatibleError,
    lmdb.ProblemError,
    lmdb.VersionMismatchError,
    lmdb.BadTxnError,  # a transaction LMDB flagged after it met a damaged page
)


class _SharedExclusiveLock:
    """Many holders in shared mode, or one in exclusive mode.

    LMDB's ``set_mapsize`` must run while this process has no transaction
    open, so every transaction holds the lock shared and a map resize takes it
    exclusive. Transactions are short and never nest, so this cannot deadlock.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._shared:
                self._cond.wait()
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class Index:
    """The LMDB environment under ``index/`` and its named sub-databases.

    All access goes through :meth:`read` and :meth:`write`, which handle map
    growth: ``MapFullError`` doubles the map and reruns the write function;
    ``MapResizedError`` (another process grew it) adopts the new size.
    Transactions never nest: iterate with :meth:`items`, which reads in
    batches and releases the transaction between them.

    ``lock=False`` (read-only opens of a directory this user cannot write)
    skips LMDB's reader table in ``lock.mdb``: LMDB would otherwise have to
    create or write that file, which is impossible there, and refusing to
    list a read-only archive helps no one. The cost: a writer in another
    process does not see this reader, so a concurrent commit may recycle
    pages under it; an archive its reader cannot write is rarely being
    written, and a torn read then surfaces as a damaged-index error.
    """

    def __init__(self, path: Path, *, readonly: bool = False, map_size: int = DEFAULT_MAP_SIZE, lock: bool = True):
        self.path = path
        self.root = path.parent
        self.readonly = readonly
        self.data = path / DATA_FILE
        self._rw = _SharedExclusiveLock()
        self._known: dict[str, Any] | None = None  # the data file's identity when this process last knew it sound
        self._stamped: dict[str, Any] | None = None  # the identity this process last wrote to the stamp
        try:
            self.env = lmdb.open(
                str(path),
                map_size=map_size,
                subdir=True,
                readonly=readonly,
                create=not readonly,
                max_dbs=len(DB_NAMES) + 2,
                readahead=False,
                meminit=False,
                lock=lock,
                lib_version=lib_version_for(self.data),
            )
        except DAMAGE_ERRORS as e:
            raise damaged(self.root, f"its index cannot be opened ({lmdb_reason(e)})") from None
        except lmdb.Error as e:
            raise ArchiveError(f"cannot open archive index {path}: {lmdb_reason(e)}") from None
        self.dbs: dict[str, Any] = {}
        self._refs = 1
        self._registry_key = ""

    def peek_meta(self, key: str) -> bytes | None:
        """Read a ``meta`` entry before the other tables are opened (or created).

        Opening checks the format version with this first, so a newer archive
        is refused before this process creates or touches anything in it.
        """
        db = self._open_existing(b"meta")
        value = None if db is None else self.read(lambda txn: txn.get(key.encode(), db=db))
        return None if value is None else bytes(value)

    def peek_count(self, table: str) -> int:
        """Entries of a table before the tables are opened (or created); 0 when it does not exist."""
        db = self._open_existing(table.encode())
        return 0 if db is None else int(self.read(lambda txn: txn.stat(db)["entries"]))

    def _open_existing(self, name: bytes) -> Any:
        """The handle of an existing table, or None when the index has no such table."""
        # No txn argument: py-lmdb then commits its own short transaction, which keeps the
        # handle valid (a handle opened inside a `with env.begin()` read block is not).
        while True:
            try:
                with self._rw.shared():
                    return self.env.open_db(name, create=False)
            except lmdb.NotFoundError:
                return None
            except lmdb.MapResizedError:
                self._adopt_resize()
            except DAMAGE_ERRORS as e:
                raise self._damaged(e) from None

    def open_dbs(self) -> None:
        """Open every named table, creating missing ones unless read-only.

        Read-only, a missing table (an archive written before it existed) is
        None and reads as empty: listing an old archive must not need a write.
        """
        if self.readonly:
            for name in DB_NAMES:
                self.dbs[name] = self._open_existing(name.encode())
        else:

            def create(txn: lmdb.Transaction) -> None:
                for name in DB_NAMES:
                    self.dbs[name] = self.env.open_db(name.encode(), txn=txn, create=True)

            self.write(create)

    def close(self) -> None:
        """Drop one reference (see :func:`open_index`); the environment closes with the last."""
        with _OPEN_LOCK:
            self._refs -= 1
            if self._refs > 0:
                return
            if _OPEN.get(self._registry_key) is self:
                del _OPEN[self._registry_key]
        self.env.close()

    @property
    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    def _grow(self, factor: int = 2) -> None:
        with self._rw.exclusive():
            self.env.set_mapsize(self.map_size * factor)

    def _adopt_resize(self) -> None:
        with self._rw.exclusive():
            self.env.set_mapsize(0)  # 0: take the size another process set

    def _damaged(self, e: lmdb.Error) -> ArchiveError:
        return damaged(self.root, f"its index is corrupted ({lmdb_reason(e)})")

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in one write transaction and commit; rerun it after growing a full map.

        ``fn`` must be repeatable: on ``MapFullError`` the transaction is
        aborted and ``fn`` runs again from scratch in a new one.
        """
        if self.readonly:
            raise ArchiveError("archive was opened read-only")
        while True:
            try:
                with self._rw.shared():
                    with self.env.begin(write=True) as txn:
                        before = self._refuse_unchecked_changes()
                        result = fn(txn)
                    self._stamp(before)
                    return result
            except lmdb.MapFullError:
                self._grow()
            except lmdb.MapResizedError:
                self._adopt_resize()
            except DAMAGE_ERRORS as e:
                raise self._damaged(e) from None
            except lmdb.Error as e:  # e.g. ENOSPC while data.mdb grows: the transaction was aborted
                raise ArchiveError(
                    f"index write failed, nothing was committed ({lmdb_reason(e)}); free space or check {self.path}"
                ) from None

    def refuse_unclean(self) -> None:
        """At open, before LMDB reads a page: walk the file (ArchiveDamagedError naming the first problem) unless
        it is in a state a kvblend writer stamped after its commit, or this process already checked."""
        self._walk_unless_known(self.problems)

    def _refuse_unchecked_changes(self) -> dict[str, Any] | None:
        """Inside a write transaction, before ``fn`` touches a page: a file changed since this process last knew
        it sound, and not by a stamped kvblend commit, is walked first (LMDB would follow a garbage pointer and
        kill the process mid-commit). The transaction is held, so no writer moves the snapshot meanwhile; a
        damaged page aborts it and nothing is written."""
        return self._walk_unless_known(lambda: file_problems(self.data))

    def _walk_unless_known(self, walk: Callable[[], list[str]]) -> dict[str, Any] | None:
        """The file's identity now, after walking it (ArchiveDamagedError naming the first problem) unless this
        process already knew this state sound or a kvblend writer stamped it after its commit. The usual case
        costs one stat."""
        now = identity(self.data)
        if now is not None and now != self._known and now != read_stamp(self.path):
            problems = walk()
            if problems:
                raise damaged(self.root, f"its index is corrupted ({problems[0]})")
        self._known = now
        return now

    def _stamp(self, before: dict[str, Any] | None) -> None:
        """After a commit that changed the file: this state was reached from a checked one, so record it for
        other processes (best effort: a stamp that could not be written only costs the next opener a walk). A
        commit that changed nothing writes nothing, so a command that fails leaves the archive as it was."""
        now = identity(self.data)
        self._known = now
        if now is not None and now != before and now != self._stamped and write_stamp(self.path, now):
            self._stamped = now

    def problems(self) -> list[str]:
        """Every structural problem of the newest snapshot (lmdb.verify), one line each.

        A read transaction holds the snapshot so a writer in another process
        cannot recycle its pages mid-walk, and the walk is pinned to that
        snapshot's meta page, so commits landing meanwhile never read as
        damage. Only when two commits land between the transaction's start and
        the walk's first read is the snapshot's root lost (SnapshotGone): then
        a new transaction, and the walk again. The walk uses plain reads and
        can never crash, whatever it finds.
        """
        for _ in range(PINNED_WALK_ATTEMPTS):
            with self._rw.shared(), self.env.begin(write=False) as txn:
                try:
                    return file_problems(self.data, txnid=txn.id())
                except SnapshotGone:
                    continue
        raise ArchiveError(
            f"the index of {self.root} changed faster than it could be checked ({PINNED_WALK_ATTEMPTS} tries); "
            "run the command again when fewer writers commit"
        )

    def read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in a read transaction (a consistent snapshot); results must be copied out."""
        while True:
            try:
                with self._rw.shared():
                    with self.env.begin(write=False, buffers=False) as txn:
                        return fn(txn)
            except lmdb.MapResizedError:
                self._adopt_resize()
            except DAMAGE_ERRORS as e:
                raise self._damaged(e) from None

    def get(self, db: str, key: bytes) -> bytes | None:
        handle = self.dbs[db]
        value = None if handle is None else self.read(lambda txn: txn.get(key, db=handle))
        return None if value is None else bytes(value)

    def count(self, db: str) -> int:
        handle = self.dbs[db]
        return 0 if handle is None else int(self.read(lambda txn: txn.stat(handle)["entries"]))

    def items(self, db: str, batch: int = 256) -> Iterator[tuple[bytes, bytes]]:
        """All (key, value) pairs of a sub-db in key order, read ``batch`` at a time.

        Not one snapshot: records written meanwhile may or may not appear. That
        is what listing commands want, and it never holds a transaction open
        while the caller works (which would block map growth).
        """
        handle = self.dbs[db]
        if handle is None:
            return
        after: bytes | None = None
        while True:

            def chunk(txn: lmdb.Transaction, after: bytes | None = after) -> list[tuple[bytes, bytes]]:
                cur = txn.cursor(db=handle)
                out: list[tuple[bytes, bytes]] = []
                if after is None:
                    ok = cur.first()
                else:
                    ok = cur.set_range(after)
                    if ok and cur.key() == after:
                        ok = cur.next()
                while ok and len(out) < batch:
                    out.append((bytes(cur.key()), bytes(cur.value())))
                    ok = cur.next()
                return out

            rows = self.read(chunk)
            yield from rows
            if len(rows) < batch:
                return
            after = rows[-1][0]


_OPEN: dict[str, Index] = {}
_OPEN_LOCK = threading.Lock()


def open_index(path: Path, *, readonly: bool = False, map_size: int = DEFAULT_MAP_SIZE, lock: bool = True) -> Index:
    """Open the index at ``path``, sharing one environment per process.

    LMDB forbids opening one environment twice in a process (closing either
    copy would drop the other's locks), but a process may well hold two
    :class:`Archive` objects on one directory, e.g. a reader and a writer.
    They share the environment, reference-counted; each keeps its own
    writer flock, so they still exclude each other as writers.
    """
    key = os.path.realpath(path)
    with _OPEN_LOCK:
        index = _OPEN.get(key)
        if index is not None:
            if index.readonly and not readonly:
                raise ArchiveError(
                    f"archive index {path} is already open read-only in this process; "
                    "close it before opening it for writing"
                )
            index._refs += 1
            return index
        index = Index(path, readonly=readonly, map_size=map_size, lock=lock)
        index._registry_key = key
        _OPEN[key] = index
        return index


def lmdb_reason(e: lmdb.Error) -> str:
    """One line for an LMDB error (its text may end with the raw errno description)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


INDEX_DIR = "index"  # the LMDB environment
DATA_FILE = "data.mdb"

# An LMDB meta page on a 64-bit build (mdb.c: the MDB_page header, then MDB_meta): the header is 16 bytes in
# LMDB 0.9 (data version 1) and 24 in 1.0 (data version 3); MDB_meta's fields sit at the same offsets after it.
_MAGIC = 0xBEEFC0DE
_HEADER_SIZES = (16, 24)
_PSIZE_AT = 24  # after the header: mm_dbs[FREE_DBI].md_pad holds the page size
_LAST_PG_AT = 120  # after the header: mm_last_pg, then mm_txnid, two uint64
_META_BYTES = max(_HEADER_SIZES) + _LAST_PG_AT + 16
_MIN_PAGE = 512

#: LMDB data version -> the engine that reads and writes it (py-lmdb's ``lib_version``: LMDB's major version).
ENGINES = {1: 0, 3: 1}
#: The engine a new index is written with: LMDB 0.9 (data version 1), which every py-lmdb release and the
#: usual ``mdb_*`` tools read, so an archive stays readable by older kvblend and by those tools.
NEW_LIB_VERSION = 0


@dataclass(frozen=True)
class _Meta:
    version: int  # LMDB's data version
    psize: int
    last_pg: int
    txnid: int


def _read_meta(fd: int, at: int) -> _Meta | str:
    """The meta page at byte ``at``, or why it cannot be read ("is too short ...", "is not an LMDB file")."""
    raw = os.pread(fd, _META_BYTES, at)
    hdr = next((h for h in _HEADER_SIZES if len(raw) >= h + 4 and struct.unpack_from("=I", raw, h)[0] == _MAGIC), None)
    if hdr is None:
        return "is too short to be an LMDB file" if len(raw) < max(_HEADER_SIZES) + 4 else "is not an LMDB file"
    if len(raw) < hdr + _LAST_PG_AT + 16:
        return "is too short to be an LMDB file"
    version = struct.unpack_from("=I", raw, hdr + 4)[0]
    psize = struct.unpack_from("=I", raw, hdr + _PSIZE_AT)[0]
    last_pg, txnid = struct.unpack_from("=QQ", raw, hdr + _LAST_PG_AT)
    return _Meta(version, psize, last_pg, txnid)


def _newest_meta(fd: int) -> _Meta | str | None:
    """The meta page LMDB would use (the newer one), a reason if it cannot; None on a 32-bit build (there
    LMDB's own checks stand alone)."""
    if sys.maxsize <= 2**32:
        return None
    first = _read_meta(fd, 0)
    if isinstance(first, str):
        return first
    if first.version not in ENGINES:
        return f"holds LMDB data version {first.version}, which this kvblend cannot read"
    if first.psize < _MIN_PAGE or first.psize & (first.psize - 1):
        return "has a damaged header (bad page size)"
    second = _read_meta(fd, first.psize)
    if second == "is too short to be an LMDB file":
        return "is truncated (its second meta page is missing)"
    return second if isinstance(second, _Meta) and second.txnid > first.txnid else first


def lib_version_for(data: Path) -> int:
    """The LMDB engine for ``data``: the one whose data version an existing file holds, else the one new
    indexes use. Passed at every open, so py-lmdb's default (``LMDB_DEFAULT_LIB_VERSION``) never decides."""
    try:
        with open(data, "rb") as f:
            meta = _read_meta(f.fileno(), 0)
    except OSError:
        return NEW_LIB_VERSION
    return ENGINES.get(meta.version, NEW_LIB_VERSION) if isinstance(meta, _Meta) else NEW_LIB_VERSION


def repair_hint(root: Path) -> str:
    """The command that repairs a damaged index, for every message that reports one."""
    return f"run `kvblend verify --rebuild-index --archive {root}` to restore it from the blobs"


def data_file(root: Path) -> Path:
    return root / INDEX_DIR / DATA_FILE


def has_blobs(root: Path) -> bool:
    """Whether any finished segment blob exists (stops at the first one found)."""
    base = root / BLOB_DIR
    try:
        subdirs = [e for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return False
    for sub in subdirs:
        with os.scandir(sub.path) as entries:
            if any(e.name.endswith(BLOB_SUFFIX) and not is_temp_name(e.name) for e in entries):
                return True
    return False


def index_problem(root: Path) -> str | None:
    """Why ``index/data.mdb`` cannot be mapped safely, or None when it can (or LMDB itself will say).

    Only damage that would crash the process or hide data is reported here:
    a missing or empty file, a file too short for its meta pages, a file that
    is not LMDB, and a file shorter than its last used page.
    """
    path = data_file(root)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                return "is empty"
            meta = _newest_meta(f.fileno())
            size = max(size, os.fstat(f.fileno()).st_size)  # a writer may have grown it meanwhile
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if isinstance(meta, str):
        return meta
    if meta is not None and size < (meta.last_pg + 1) * meta.psize:
        return f"is truncated ({size} bytes; its header needs {(meta.last_pg + 1) * meta.psize})"
    return None


def check_index_file(root: Path, *, fresh_ok: bool) -> bool:
    """Refuse (ArchiveDamagedError) an index that is damaged; True if ``data.mdb`` exists and looks whole.

    ``fresh_ok``: a missing or empty index with no blobs beside it is a
    new archive (LMDB creates the file); False is returned and the caller
    decides. With blobs beside it, it is always damage.
    """
    problem = index_problem(root)
    if problem is None:
        return True
    if problem in ("is missing", "is empty"):
        if has_blobs(root):
            raise damaged(root, f"its index {INDEX_DIR}/{DATA_FILE} {problem} but segment blobs remain")
        if fresh_ok:
            return False
        raise ArchiveDamagedError(
            f"{root} holds no archive index yet ({INDEX_DIR}/{DATA_FILE} {problem[3:]}); "
            "run `kvblend ingest PATH` to create one"
        )
    raise damaged(root, f"its index {INDEX_DIR}/{DATA_FILE} {problem}")


def damaged(root: Path, what: str) -> ArchiveDamagedError:
    """The one-line error for a damaged archive: what is wrong and the command that repairs it."""
    return ArchiveDamagedError(f"archive at {root} is damaged: {what}; {repair_hint(root)}")
