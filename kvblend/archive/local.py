"""The local store: a directory with an LMDB index and blob files, one writer at a time.

Opening checks, in order, before anything is read, created or written: the
directory, the index file (missing, empty, truncated: index.py), the LMDB
environment, the format version (core.py's rule, checked here first so a newer
archive is refused untouched), the tables, and a blank index beside blobs; the
model is then the core's to check. A read-only open writes nothing at all; a
writable open of a directory this user cannot write falls back to read-only, so
reading commands still work there and only an actual write is refused, naming
the reason.

Records are the index's tables, one LMDB write transaction per edit (so a
core rule commits whole or not at all); payloads are one blob file per
segment (blobs.py), written and fsynced before the record that names them
commits. Usage (``touch``) lives in the segment record. The single writer is
an ``flock`` across processes (the kernel drops it when a writer dies, even
by SIGKILL) and a re-entrant mutex within one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from kvblend.archive.blobs import (
    BLOB_DIR,
    BLOB_SUFFIX,
    BlobReader,
    ensure_reserve,
    iter_manifest_files,
    make_dirs_durably,
    manifest_relpath,
    remove_manifest,
    scan_blob_dir,
    spending_reserve,
    stale_profile_scratch,
    unlink_blob,
    write_blob,
    write_segment_blobs,
)
from kvblend.archive.core import check_version
from kvblend.archive.index import (
    DATA_FILE,
    DEFAULT_MAP_SIZE,
    INDEX_DIR,
    Index,
    check_index_file,
    damaged,
    has_blobs,
    open_index,
)
from kvblend.archive.records import SegmentRecord, document_db_key, load_record, name_db_key
from kvblend.archive.store import Leftover, Store, Txn, dump_json, embedding_bytes
from kvblend.errors import ArchiveBusyError, ArchiveError, BlobUnreadableError, CorruptBlobError

T = TypeVar("T")

LOCK_FILE = "lock"  # the writer's flock (see lock.py)
INDEX_FILES = ("data.mdb", "lock.mdb")


def archive_exists(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds an archive (its index directory), without opening or creating it."""
    return (Path(path) / INDEX_DIR).is_dir()


def writable(root: Path) -> bool:
    """Whether this process may create and delete files in the archive directory and its index."""
    dirs = [root] + [root / d for d in (INDEX_DIR, BLOB_DIR) if (root / d).is_dir()]
    return all(os.access(d, os.W_OK | os.X_OK) for d in dirs)


def check_creatable(root: Path) -> None:
    """Refuse, as :func:`prepare_dir` would when creating, a place no archive can be made: a file, or under a
    directory this process may not write (an ingest's dry run creates nothing, but must not promise what the
    ingest then refuses)."""
    if root.exists() and not root.is_dir():
        raise ArchiveError(f"archive path {root} is a file, not a directory")
    existing = root
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise ArchiveError(f"cannot create archive directory {root}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ArchiveError(f"cannot create archive directory {root}: permission denied")


def prepare_dir(root: Path, *, create: bool, readonly: bool) -> None:
    """Check (and, when creating, make) the archive directory and its ``index/`` and ``blobs/``."""
    if root.exists() and not root.is_dir():
        raise ArchiveError(f"archive path {root} is a file, not a directory")
    if not root.exists():
        if not create:
            raise ArchiveError(f"no archive at {root} (ingest documents first, or check --archive)")
        try:
            make_dirs_durably(root)
        except OSError as e:
            raise ArchiveError(f"cannot create archive directory {root}: {e.strerror or e}") from None
    if not archive_exists(root):
        if has_blobs(root):  # the index directory itself was lost: never start a fresh one over the blobs
            raise damaged(root, f"its {INDEX_DIR}/ directory is missing but segment blobs remain")
        if not create:
            raise ArchiveError(f"{root} is not a kvblend archive (it has no {INDEX_DIR}/ directory)")
    if readonly:
        return
    if not writable(root):
        raise ArchiveError(f"archive directory {root} is not writable; use another --archive")
    try:
        make_dirs_durably(root / INDEX_DIR)
        make_dirs_durably(root / BLOB_DIR)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ArchiveError(f"disk full while creating archive {root}") from None
        raise ArchiveError(f"cannot create archive directory {root}: {e.strerror or e}") from None


def index_bytes(root: Path) -> int:
    """Bytes of the LMDB files (the map is sparse, so this is what the index really takes)."""
    total = 0
    for name in INDEX_FILES:
        with suppress(FileNotFoundError):
            total += (root / INDEX_DIR / name).stat().st_size
    return total


class _Flock:
    """Exclusive ``flock`` on the archive's ``lock`` file, holding the owner's pid for error messages.

    flock (not fcntl record locks) because it belongs to the open file, so the
    kernel drops it when a writer dies, even by SIGKILL.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self, wait: bool | float) -> None:
        fd = self._open()
        try:
            if wait is True:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                self._poll(fd, deadline=time.monotonic() + (0.0 if wait is False else float(wait)))
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _note_pid(fd)

    def _open(self) -> int:
        """The lock file, for writing where we may (the pid note), else for reading: flock needs no write
        access, and in an archive a group shares, the member who made the file owns it. Created as the umask
        allows (0666 minus it), so a shared umask shares it."""
        cloexec = getattr(os, "O_CLOEXEC", 0)
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | cloexec, 0o666)
        except PermissionError:
            try:
                return os.open(self.path, os.O_RDONLY | cloexec)
            except OSError as e:
                raise ArchiveError(f"cannot take the archive's writer lock {self.path}: {e.strerror}") from None
        except OSError as e:
            raise ArchiveError(f"cannot take the archive's writer lock {self.path}: {e.strerror}") from None

    def _poll(self, fd: int, deadline: float) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ArchiveBusyError(
                        f"another kvblend process is writing to this archive (pid {_holder(fd)}); "
                        "retry when it is done, or pass --wait to wait for it"
                    ) from None
                time.sleep(0.05)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the last descriptor releases the flock


def _note_pid(fd: int) -> None:
    """Write our pid for the busy message of other writers; best effort.

    Only a courtesy for error messages: on a full disk (ENOSPC) the write
    fails, and the lock must still be usable, since `gc` and `rm`, which
    free space, need it most then.
    """
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass


def _holder(fd: int) -> str:
    """The pid the current holder wrote into the lock file, or "unknown"."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"


class WriterLock:
    """Re-entrant exclusive writer: a thread mutex in this process, the flock across processes.

    The flock is taken by the outermost :meth:`hold` and released with it, so
    nested writes (a batch inside ``with archive.writer()``) reuse it.
    """

    def __init__(self, path: Path):
        self._flock = _Flock(path)
        self._mutex = threading.RLock()
        self._depth = 0

    @property
    def held(self) -> bool:
        return self._depth > 0

    @property
    def depth(self) -> int:
        """Nesting of :meth:`hold` in this process (1 inside the outermost)."""
        return self._depth

    @contextmanager
    def hold(self, wait: bool | float = False) -> Iterator[None]:
        """Hold the lock for the block. ``wait``: False fails at once, True blocks, a number waits seconds."""
        if wait is True:
            got = self._mutex.acquire()
        elif wait is False or float(wait) <= 0:
            got = self._mutex.acquire(blocking=False)
        else:
            got = self._mutex.acquire(timeout=float(wait))
        if not got:
            raise ArchiveBusyError("another thread of this process is writing to this archive; retry when it is done")
        try:
            if self._depth == 0:
                self._flock.acquire(wait)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._flock.release()
        finally:
            self._mutex.release()

    def close(self) -> None:
        """Drop the flock whatever the nesting (the archive is closing)."""
        self._flock.release()
        self._depth = 0


def embedding_rows(pairs: Iterable[tuple[str, Any]]) -> list[tuple[bytes, bytes]]:
    """(db key, float32 little-endian bytes) per (segment key, vector)."""
    return [(name_db_key(k, "embedding"), embedding_bytes(v)) for k, v in pairs]


def put_embedding_rows(txn: lmdb.Transaction, dbs: dict[str, Any], rows: Sequence[tuple[bytes, bytes]]) -> None:
    """Write encoded rows inside a caller's transaction (a segment batch commits its embeddings with it)."""
    for kb, data in rows:
        txn.put(kb, data, db=dbs["embeddings"])


@dataclass
class Opened:
    """What :func:`open_parts` found: the index and how the archive may be used."""

    root: Path
    index: Index
    readonly: bool
    denied: str | None  # why a writable open fell back to read-only, if it did


def open_parts(path: str | os.PathLike[str], *, create: bool, readonly: bool, map_size: int) -> Opened:
    """Check and open the archive at ``path``; raises a one-line ArchiveError for every refusal.

    The format version is checked here, before the tables are opened (or created), so a newer archive is
    refused untouched; the model is the core's to check and bind (core.bind), once the store is open."""
    root = Path(path).expanduser().absolute()
    denied = None
    if not readonly and not create and root.is_dir() and not writable(root):
        readonly, denied = True, f"archive directory {root} is not writable"
    prepare_dir(root, create=create and not readonly, readonly=readonly)
    check_index_file(root, fresh_ok=create and not readonly)
    index = open_index(
        root / INDEX_DIR, readonly=readonly, map_size=map_size, lock=not readonly or _reader_table_usable(root)
    )
    try:
        index.refuse_unclean()  # before LMDB reads a page: a damaged one could kill the process
        check_version(index.peek_meta("format_version"), partial(damaged, root))
        _refuse_blank(index, root)
        index.open_dbs()
    except BaseException:
        index.close()
        raise
    return Opened(root, index, readonly, denied)


def _reader_table_usable(root: Path) -> bool:
    """Whether a read-only open may use LMDB's ``lock.mdb`` (it exists and this user can write it).

    LMDB registers every reader there; a read-only open must neither create
    that file nor fail because it cannot write it (see ``Index``).
    """
    lock = root / INDEX_DIR / "lock.mdb"
    return lock.is_file() and os.access(lock, os.R_OK | os.W_OK)


def _refuse_blank(index: Index, root: Path) -> None:
    """An index with no format version and no segments, beside blobs, is a lost index LMDB re-created."""
    if index.peek_meta("format_version") is None and index.peek_count("segments") == 0 and has_blobs(root):
        raise damaged(root, "its index is blank (no format version, no segments) but segment blobs remain")


def _table_key(table: str, name: str) -> bytes:
    """The LMDB key of a record: a document's path (hashed when too long for LMDB), else the name itself."""
    if table == "documents":
        return document_db_key(name)
    return name_db_key(name, {"segments": "segment", "embeddings": "embedding"}.get(table, table))


def _table_name(table: str, key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape") if table == "documents" else key.decode()


class _LmdbTxn(Txn):
    """A Txn over one LMDB write transaction. A document put also writes its manifest (blobs.py), a rebuild's
    copy of it, first, except in an edit that frees space (it only marks documents incomplete, which a rebuild
    finds again from the blobs, and a manifest write could fail on the full disk it is freeing); a document's
    manifest is removed after the commit that deletes it."""

    def __init__(self, store: LocalStore, txn: lmdb.Transaction):
        self._store = store
        self._txn = txn
        self._dbs = store.index.dbs
        self.removed_documents: list[str] = []

    def get(self, table: str, name: str) -> bytes | None:
        value = self._txn.get(_table_key(table, name), db=self._dbs[table])
        return None if value is None else bytes(value)

    def put(self, table: str, name: str, value: bytes) -> None:
        if table == "documents" and not self._store.freeing_now:
            write_blob(self._store.root, manifest_relpath(str(load_record(value).get("path", name))), [value])
        self._txn.put(_table_key(table, name), value, db=self._dbs[table])

    def put_new(self, table: str, name: str, value: bytes) -> bool:
        return bool(self._txn.put(_table_key(table, name), value, db=self._dbs[table], overwrite=False))

    def delete(self, table: str, name: str) -> None:
        if self._txn.delete(_table_key(table, name), db=self._dbs[table]) and table == "documents":
            self.removed_documents.append(name)

    def scan(self, table: str) -> Iterator[tuple[str, bytes]]:
        rows = [(_table_name(table, bytes(k)), bytes(v)) for k, v in self._txn.cursor(db=self._dbs[table])]
        return iter(rows)  # read whole first: the caller may write to the table while it goes through them


class LocalStore(Store):
    """An archive directory: the LMDB index under ``index/`` and one blob file per segment under ``blobs/``.

    Any number of readers, in any number of processes, read without locks (LMDB
    snapshots; blobs are immutable once renamed into place). One writer at a time
    (:class:`WriterLock`) creates or deletes files: blobs and document manifests.
    Index-only updates (``touch``, side tables) take no lock, because LMDB
    serializes them and a query must not fail because an ingest is running.
    """

    def __init__(self, opened: Opened):
        self.root = opened.root
        self.location = str(opened.root)
        self.readonly = opened.readonly
        self.index: Index = opened.index
        self.blobs = BlobReader(opened.root)
        self._denied = opened.denied
        self._lock = WriterLock(opened.root / LOCK_FILE)
        self._closed = False
        self._freeing = 0
        self._index_file = self._index_identity()

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, create: bool, readonly: bool, map_size: int = DEFAULT_MAP_SIZE
    ) -> LocalStore:
        return cls(open_parts(path, create=create, readonly=readonly, map_size=map_size))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lock.close()
        self.blobs.close()
        self.index.close()

    def damaged(self, what: str) -> ArchiveError:
        return damaged(self.root, what)

    # ── records ──
    def get_many(self, table: str, names: Sequence[str]) -> list[bytes | None]:
        keys = [_table_key(table, name) for name in names]
        db = self.index.dbs[table]
        if db is None:  # a read-only open of an index without this table
            return [None] * len(keys)
        got = self.index.read(lambda txn: [txn.get(k, db=db) for k in keys])
        return [None if v is None else bytes(v) for v in got]

    def scan(self, table: str) -> Iterator[tuple[str, bytes]]:
        for key, value in self.index.items(table):
            yield _table_name(table, key), value

    def count(self, table: str) -> int:
        return self.index.count(table)

    def write(self, edit: Callable[[Txn], T]) -> T:
        """One index write transaction, into the index the archive has now (see :meth:`_index_identity`);
        manifests of documents it deleted are removed after the commit."""
        self.check_writable()
        self._check_index_current()
        last: list[_LmdbTxn] = []

        def run(txn: lmdb.Transaction) -> T:
            last[:] = [_LmdbTxn(self, txn)]  # a rerun (the map grew) starts afresh
            return edit(last[0])

        result = self.index.write(run)
        for path in last[0].removed_documents if last else []:
            remove_manifest(self.root, path)
        return result

    def _check_index_current(self) -> None:
        if self._index_identity() != self._index_file:
            raise ArchiveError(
                f"the index of {self.root} was replaced since this command opened it (`verify --rebuild-index` "
                "in another process); run the command again"
            )

    def _index_identity(self) -> tuple[int, int] | None:
        """(device, inode) of ``index/data.mdb``. A rebuild in another process renames the index directory away
        and puts a new one in its place; this store's LMDB environment still writes to the old one, where a
        commit would be lost (and its new blobs then deleted by gc as orphans)."""
        try:
            st = os.stat(self.root / INDEX_DIR / DATA_FILE)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def touch(self, keys: Sequence[str]) -> int:
        """Usage lives in the segment record: last_access = now, hits += 1, in one index write."""
        if self.readonly or not keys:
            return 0
        now = time.time()

        def bump(txn: Txn) -> int:
            n = 0
            for key in keys:
                raw = txn.get("segments", key)
                if raw is None:
                    continue
                d = load_record(raw)
                d["last_access"] = now
                d["hits"] = int(d.get("hits", 0)) + 1
                txn.put("segments", key, dump_json(d))
                n += 1
            return n

        try:
            return self.write(bump)
        except (lmdb.Error, ArchiveError):
            return 0

    # ── payloads ──
    def put_payloads(self, staged: Sequence[tuple[SegmentRecord, Iterable[bytes]]]) -> None:
        """One blob file per segment, each written and fsynced (then their directories) before this returns:
        the batch's index commit then costs two LMDB fsyncs in all."""
        with self.ensure_writer():
            write_segment_blobs(self.root, staged, self._committed)

    def _committed(self, key: str) -> SegmentRecord | None:
        raw = self.get("segments", key)
        return None if raw is None else SegmentRecord.from_json(raw)

    def read_payloads(self, recs: Sequence[SegmentRecord], layer: int) -> list[bytes | CorruptBlobError]:
        out: list[bytes | CorruptBlobError] = []
        for rec in recs:
            data, reason, unreadable = self.blobs.read_checked(rec.blob, rec.layers[layer])
            if data is None:
                error = BlobUnreadableError if unreadable else CorruptBlobError
                out.append(error(f"segment {rec.key} layer {layer}: {reason} ({rec.blob})", rec.key, layer, reason))
            else:
                out.append(data)
        return out

    def delete_payloads(self, recs: Sequence[SegmentRecord]) -> None:
        for rec in recs:
            if rec.blob:
                self.blobs.invalidate(rec.blob)
                with suppress(OSError, ArchiveError):  # what stays is a leftover that gc names
                    unlink_blob(self.root, rec.blob)

    def payload_intact(self, rec: SegmentRecord) -> bool:
        """A stat, no read: the blob exists and is long enough for every layer (bit flips are caught by the
        per-layer checksums while streaming)."""
        try:
            size = (self.root / rec.blob).stat().st_size
        except OSError:
            return False
        return all(layer.offset + layer.length <= size for layer in rec.layers)

    # ── the writer lock ──
    @contextmanager
    def writer(self, wait: bool | float = False) -> Iterator[LocalStore]:
        """Hold the archive's exclusive writer lock for the block (re-entrant). ``wait``: False fails at once
        if another process writes (ArchiveBusyError naming its pid), True blocks, a number waits that long."""
        self.check_writable()
        with self._lock.hold(wait):
            if self._lock.depth == 1:
                # a rebuild that ran while this one waited for the lock left this store reading the old index:
                # gc would take the blobs the new index restored for orphans
                self._check_index_current()
                ensure_reserve(self.root)  # room for gc/rm on a disk this writer may fill
            yield self

    @property
    def holds_writer(self) -> bool:
        return self._lock.held

    def check_writable(self) -> None:
        if self.readonly and self._denied:
            raise ArchiveError(f"{self._denied}; this command needs to write to it (use another --archive)")
        super().check_writable()

    @contextmanager
    def freeing(self) -> Iterator[None]:
        """Spend the disk reserve: an LMDB commit writes new pages before it frees any (blobs.py)."""
        self._freeing += 1
        try:
            with spending_reserve(self.root):
                yield
        finally:
            self._freeing -= 1

    @property
    def freeing_now(self) -> bool:
        return self._freeing > 0

    # ── upkeep ──
    def leftovers(self) -> list[Leftover]:
        """Temp files and blobs no record names. Under the writer lock a temp file is never a live writer's."""
        referenced = {SegmentRecord.from_json(raw).blob for _, raw in self.scan("segments")}
        found = [
            Leftover(rel, size, is_temp)
            for rel, size, is_temp in scan_blob_dir(self.root)
            if is_temp or (rel.endswith(BLOB_SUFFIX) and rel not in referenced)
        ]
        return found + [Leftover(name, size, True) for name, size in stale_profile_scratch(self.root)]

    def delete_leftovers(self, leftovers: Sequence[Leftover]) -> int:
        with self.ensure_writer():
            return sum(unlink_blob(self.root, item.name) for item in leftovers)

    def segment_bytes(self, rec: SegmentRecord) -> int:
        try:
            return (self.root / rec.blob).stat().st_size
        except OSError:
            return 0

    def structure_problems(self) -> list[str]:
        return self.index.problems()

    def after_gc(self, dry_run: bool = False) -> list[str]:
        """Temp manifests and manifests of documents the index no longer holds."""
        live = {manifest_relpath(str(load_record(raw).get("path", name))) for name, raw in self.scan("documents")}
        stale = [rel for rel, is_temp in iter_manifest_files(self.root) if is_temp or rel not in live]
        if not dry_run:
            for rel in stale:
                unlink_blob(self.root, rel)
        return stale

    def usage(self) -> dict[str, Any]:
        return {"index_bytes": index_bytes(self.root)}

    def size_bytes(self, include_index: bool = True) -> int:
        blobs = sum(size for _, size, _ in scan_blob_dir(self.root))
        return blobs + (index_bytes(self.root) if include_index else 0)
