"""The local archive: a directory with an LMDB index and blob files, one writer at a time.

Opening checks, in order, before anything is read, created or written: the
directory, the index file (missing, empty, truncated: index.py), the LMDB
environment, the format version, the tables, a blank index beside blobs, and
the model. A read-only open writes nothing at all; a writable open of a
directory this user cannot write falls back to read-only, so reading commands
still work there and only an actual write is refused, naming the reason.

What an archive *is* lives in the ``meta`` table: its format version (checked
before anything else, so a newer archive is refused untouched) and the model it
was built with (recorded by the first writer, refused for any other model,
because KV from one model is garbage to another). A writer may defer recording
the model to its first committed segment, so a run that fails before storing
anything leaves the archive bound to nothing.

Index edits (segments, embeddings and documents kept consistent) run inside one
LMDB write transaction and return the blobs they unreferenced; the caller
unlinks those only after the commit, so a crash leaves orphans for ``gc``,
never a record without its blob. The single writer is an ``flock`` across
processes (the kernel drops it when a writer dies, even by SIGKILL) and a
re-entrant mutex within one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import numpy as np

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
    unlink_blob,
    write_manifest,
    write_segment_blobs,
)
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
from kvblend.archive.records import (
    DocumentRecord,
    Model,
    SegmentRecord,
    document_db_key,
    drop_listed,
    load_record,
    name_db_key,
)
from kvblend.archive.store import (
    Leftover,
    Store,
    dump_json,
    embedding_bytes,
    embedding_matrix,
    load_json,
)
from kvblend.errors import (
    ArchiveBusyError,
    ArchiveError,
    ArchiveModelMismatchError,
    ArchiveVersionError,
    BlobUnreadableError,
    CorruptBlobError,
)
from kvblend.types import LayerKV

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


FORMAT_VERSION = 1


def check_version(raw: bytes | memoryview | None, root: Path) -> int | None:
    """The stored ``format_version`` (None when absent); refuse a newer or a malformed one.

    Only positive integers are versions: 1.5, 0, -1 or "1" were never written
    by kvblend, so the index is damaged rather than of some other format.
    """
    if raw is None:
        return None
    try:
        version: Any = json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError):
        version = raw[:20]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise damaged(root, f"its format version {version!r} is not a positive integer")
    if version > FORMAT_VERSION:
        raise ArchiveVersionError(
            f"archive format v{version} is newer than this kvblend supports (v{FORMAT_VERSION}); upgrade kvblend"
        )
    return version


def recorded(txn: lmdb.Transaction, meta: Any, root: Path, asked: Model) -> Model:
    """The model the archive records (checked against ``asked``); refuses a mismatch."""
    if meta is None:  # a read-only open of an index without tables: nothing recorded
        return Model()
    check_version(txn.get(b"format_version", db=meta), root)
    have = Model(load_json(txn.get(b"model_name", db=meta)), load_json(txn.get(b"model_fingerprint", db=meta)))
    if asked.fingerprint and have.fingerprint and asked.fingerprint != have.fingerprint:
        raise ArchiveModelMismatchError(_mismatch_message(root, have, asked))
    return have


def stamp(
    txn: lmdb.Transaction, meta: Any, root: Path, asked: Model, *, version: bool = True, model: bool = True
) -> Model:
    """Check, then record what is missing: the format version (with ``created``) and/or the model.

    A fingerprint is recorded when none is; a name when it comes with a new
    fingerprint or when nothing identifies the model yet. Returns the model
    now recorded. Runs inside the caller's write transaction.
    """
    have = recorded(txn, meta, root, asked)
    if version and txn.get(b"format_version", db=meta) is None:
        txn.put(b"format_version", dump_json(FORMAT_VERSION), db=meta)
        txn.put(b"created", dump_json(time.time()), db=meta)
    if not model:
        return have
    name, fp = have.name, have.fingerprint
    new_fp = bool(asked.fingerprint and not fp)
    if new_fp:
        fp = asked.fingerprint
        txn.put(b"model_fingerprint", dump_json(fp), db=meta)
    if asked.name and (new_fp or not (name or fp)):  # a new fingerprint brings its name
        name = asked.name
        txn.put(b"model_name", dump_json(name), db=meta)
    return Model(name, fp)


def needs_stamp(
    txn: lmdb.Transaction, meta: Any, root: Path, asked: Model, *, version: bool = True, model: bool = True
) -> bool:
    """Whether :func:`stamp` would write anything (so opening an up-to-date archive needs no write)."""
    have = recorded(txn, meta, root, asked)
    if version and txn.get(b"format_version", db=meta) is None:
        return True
    return model and (
        bool(asked.fingerprint and not have.fingerprint) or bool(asked.name and not (have.name or have.fingerprint))
    )


def _mismatch_message(root: Path, have: Model, asked: Model) -> str:
    old_fp, new_fp = have.fingerprint or "", asked.fingerprint or ""
    a = have.name or f"fingerprint {old_fp[:12]}"
    b = asked.name or f"fingerprint {new_fp[:12]}"
    if a == b:  # same name, other weights (e.g. a re-quantized checkpoint)
        a, b = f"{a} (fingerprint {old_fp[:12]})", f"{b} (fingerprint {new_fp[:12]})"
    hint = f"pass --model {have.name} or use another --archive" if have.name else "use another --archive"
    return f"archive at {root} was built with model {a}; you asked for model {b} ({hint})"


class _Flock:
    """Exclusive ``flock`` on the archive's ``lock`` file, holding the owner's pid for error messages.

    flock (not fcntl record locks) because it belongs to the open file, so the
    kernel drops it when a writer dies, even by SIGKILL.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self, wait: bool | float) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
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


Dbs = dict[str, Any]  # the index's named sub-databases


def commit_segments(
    txn: lmdb.Transaction, dbs: Dbs, records: list[SegmentRecord], embedding_rows: Sequence[tuple[bytes, bytes]] = ()
) -> tuple[list[SegmentRecord], list[str]]:
    """Write segment records (and their embeddings); returns (the records, blobs of replaced records)."""
    put_embedding_rows(txn, dbs, embedding_rows)
    db = dbs["segments"]
    old_blobs = []
    for rec in records:
        kb = rec.key.encode()
        old = txn.get(kb, db=db)
        if old is not None:
            old_rec = load_record(old)
            rec.hits = int(old_rec.get("hits", 0))  # a replaced segment keeps its popularity
            if old_rec.get("blob") and old_rec["blob"] != rec.blob:
                old_blobs.append(old_rec["blob"])
        txn.put(kb, rec.to_json().encode(), db=db)
    return records, old_blobs


def bump_usage(txn: lmdb.Transaction, dbs: Dbs, keys: Sequence[str], now: float) -> int:
    """last_access = now, hits += 1 for each key present; returns how many were."""
    db = dbs["segments"]
    n = 0
    for key in keys:
        kb = key.encode()
        raw = txn.get(kb, db=db)
        if raw is None:
            continue
        d = load_record(raw)
        d["last_access"] = now
        d["hits"] = int(d.get("hits", 0)) + 1
        txn.put(kb, dump_json(d), db=db)
        n += 1
    return n


def drop_segments(
    txn: lmdb.Transaction, dbs: Dbs, keys: Iterable[str], mark_documents: bool = True
) -> tuple[list[str], list[str]]:
    """Delete segment records and their embeddings; returns (document paths marked, blobs to unlink).

    With ``mark_documents``, documents listing a dropped key lose it and get
    ``incomplete: true`` so `ingest` knows to redo them.
    """
    drop = set(keys)
    blobs = []
    for key in sorted(drop):
        kb = key.encode()
        raw = txn.get(kb, db=dbs["segments"])
        if raw is not None:
            blob = load_record(raw).get("blob")
            if blob:
                blobs.append(blob)
            txn.delete(kb, db=dbs["segments"])
        txn.delete(kb, db=dbs["embeddings"])
    marked: list[str] = []
    if mark_documents and drop:
        updates: list[tuple[bytes, dict[str, Any]]] = []
        for doc_key, value in txn.cursor(db=dbs["documents"]):
            d = load_record(value)
            if drop.intersection(d.get("segment_keys", [])):
                updates.append((bytes(doc_key), d))
        for kb, d in updates:
            marked.append(_mark_incomplete(txn, dbs, kb, d, drop))
    return marked, blobs


def strip_dangling(txn: lmdb.Transaction, dbs: Dbs, dangling: dict[str, list[str]]) -> list[str]:
    """Remove keys that name no segment from their documents, marking them incomplete; returns paths."""
    marked = []
    for path, missing in dangling.items():
        kb = document_db_key(path)
        raw = txn.get(kb, db=dbs["documents"])
        if raw is not None:
            _mark_incomplete(txn, dbs, kb, load_record(raw), set(missing))
            marked.append(path)
    return marked


def _mark_incomplete(txn: lmdb.Transaction, dbs: Dbs, kb: bytes, d: dict[str, Any], gone: set[str]) -> str:
    drop_listed(d, gone)  # their sources go with them
    d["incomplete"] = True
    txn.put(kb, dump_json(d), db=dbs["documents"])
    return d.get("path", kb.decode("utf-8", "replace"))


def _unused(txn: lmdb.Transaction, dbs: Dbs, candidates: set[str]) -> set[str]:
    """The candidate segment keys no document (in this transaction's view) lists."""
    for _, raw in txn.cursor(db=dbs["documents"]):
        candidates.difference_update(load_record(raw).get("segment_keys", []))
    return candidates


def replace_document(
    txn: lmdb.Transaction, dbs: Dbs, doc: DocumentRecord, keep: Collection[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """Store ``doc``; drop segments only its previous version used, none in ``keep``. Returns (dropped keys,
    blobs)."""
    key = document_db_key(doc.path)
    old = txn.get(key, db=dbs["documents"])
    txn.put(key, doc.to_json().encode(), db=dbs["documents"])
    stale = set(load_record(old).get("segment_keys", [])) if old is not None else set()
    stale.difference_update(doc.segment_keys)
    stale.difference_update(keep)
    if stale:
        stale = _unused(txn, dbs, stale)
    _, blobs = drop_segments(txn, dbs, stale, mark_documents=False)
    return sorted(stale), blobs


def remove_documents(txn: lmdb.Transaction, dbs: Dbs, paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """Forget documents and drop the segments no remaining document uses. Returns (removed paths, blobs)."""
    removed: list[str] = []
    candidates: set[str] = set()
    for p in dict.fromkeys(paths):
        kb = document_db_key(p)
        raw = txn.get(kb, db=dbs["documents"])
        if raw is None:
            continue
        d = load_record(raw)
        removed.append(d.get("path", p))
        candidates.update(d.get("segment_keys", []))
        txn.delete(kb, db=dbs["documents"])
    _, blobs = drop_segments(txn, dbs, _unused(txn, dbs, candidates), mark_documents=False)
    return removed, blobs


@dataclass
class Opened:
    """What :func:`open_parts` found: the index and how the archive may be used."""

    root: Path
    index: Index
    readonly: bool
    denied: str | None  # why a writable open fell back to read-only, if it did
    model: Model  # the model the archive records


def open_parts(
    path: str | os.PathLike[str], *, create: bool, readonly: bool, asked: Model, defer_binding: bool, map_size: int
) -> Opened:
    """Check and open the archive at ``path``; raises a one-line ArchiveError for every refusal."""
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
        check_version(index.peek_meta("format_version"), root)
        _refuse_blank(index, root)
        index.open_dbs()
        model = _bind(index, root, asked, version=create and not readonly, model=not (readonly or defer_binding))
    except BaseException:
        index.close()
        raise
    return Opened(root, index, readonly, denied, model)


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


def _bind(index: Index, root: Path, asked: Model, *, version: bool, model: bool) -> Model:
    """Check the asked model against the recorded one; record the format version and/or the model now.

    Only a creating writer stamps the version at open (so a fresh archive is
    never blank while its first blobs are written); others leave a missing
    one to the first segment commit. The model waits for that commit too
    when binding is deferred.
    """
    meta = index.dbs["meta"]
    if (version or model) and index.read(lambda txn: needs_stamp(txn, meta, root, asked, version=version, model=model)):
        return index.write(lambda txn: stamp(txn, meta, root, asked, version=version, model=model))
    return index.read(lambda txn: recorded(txn, meta, root, asked))


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
        self.model = opened.model
        self._denied = opened.denied
        self._lock = WriterLock(opened.root / LOCK_FILE)
        self._closed = False
        self._index_file = self._index_identity()

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        create: bool,
        readonly: bool,
        asked: Model,
        defer_binding: bool,
        map_size: int = DEFAULT_MAP_SIZE,
    ) -> LocalStore:
        return cls(
            open_parts(
                path, create=create, readonly=readonly, asked=asked, defer_binding=defer_binding, map_size=map_size
            )
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lock.close()
        self.blobs.close()
        self.index.close()

    # ── writing ──
    @contextmanager
    def writer(self, wait: bool | float = False) -> Iterator[LocalStore]:
        """Hold the archive's exclusive writer lock for the block (re-entrant). ``wait``: False fails at once
        if another process writes (ArchiveBusyError naming its pid), True blocks, a number waits that long."""
        self.check_writable()
        with self._lock.hold(wait):
            if self._lock.depth == 1:
                ensure_reserve(self.root)  # room for gc/rm on a disk this writer may fill
            yield self

    @property
    def holds_writer(self) -> bool:
        return self._lock.held

    def check_writable(self) -> None:
        if self.readonly and self._denied:
            raise ArchiveError(f"{self._denied}; this command needs to write to it (use another --archive)")
        super().check_writable()

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """One index write transaction, into the index the archive has now (see :meth:`_index_identity`)."""
        self.check_writable()
        if self._index_identity() != self._index_file:
            raise ArchiveError(
                f"the index of {self.root} was replaced since this command opened it (`verify --rebuild-index` "
                "in another process); run the command again"
            )
        return self.index.write(fn)

    def _index_identity(self) -> tuple[int, int] | None:
        """(device, inode) of ``index/data.mdb``. A rebuild in another process renames the index directory away
        and puts a new one in its place; this store's LMDB environment still writes to the old one, where a
        commit would be lost (and its new blobs then deleted by gc as orphans)."""
        try:
            st = os.stat(self.root / INDEX_DIR / DATA_FILE)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _commit(self, edit: Callable[[lmdb.Transaction], tuple[T, list[str]]], frees: bool = False) -> T:
        """Run an index edit returning (result, blobs it unreferenced); unlink those blobs after the commit.

        If the commit fails the blobs stay as orphans for gc: deleting them could race a commit that did
        land. ``frees``: the edit frees space (gc, rm, repair), so it may spend the disk reserve.
        """
        with spending_reserve(self.root) if frees else nullcontext():
            result, blobs = self._write(edit)
            for rel in blobs:
                self.blobs.invalidate(rel)
                unlink_blob(self.root, rel)
        return result

    # ── segments ──
    def get_segment(self, key: str) -> SegmentRecord | None:
        raw = self.index.get("segments", name_db_key(key, "segment"))
        return None if raw is None else SegmentRecord.from_json(raw)

    def has_segment(self, key: str) -> bool:
        return self.index.get("segments", name_db_key(key, "segment")) is not None

    def iter_segments(self) -> Iterator[SegmentRecord]:
        for _, raw in self.index.items("segments"):
            yield SegmentRecord.from_json(raw)

    def count_segments(self) -> int:
        return self.index.count("segments")

    def put_segments(
        self,
        items: Sequence[tuple[SegmentRecord, Sequence[LayerKV]]],
        codec: str,
        level: int,
        embeddings: dict[str, Any] | None,
        asked: Model,
    ) -> list[SegmentRecord]:
        """Write and fsync every blob, then commit ONE index transaction (two LMDB fsyncs for the batch)."""
        with self.ensure_writer():
            model = Model(self.model.name or asked.name, self.model.fingerprint or asked.fingerprint)
            records = write_segment_blobs(self.root, items, codec, level, self.get_segment, model, embeddings)
            rows = embedding_rows((embeddings or {}).items())

            def edit(txn: lmdb.Transaction) -> tuple[tuple[list[SegmentRecord], Model], list[str]]:
                bound = stamp(txn, self.index.dbs["meta"], self.root, asked)  # re-checked in the commit
                stored, replaced = commit_segments(txn, self.index.dbs, records, rows)
                return (stored, bound), replaced

            stored, self.model = self._commit(edit)
            return stored

    def read_layer_raw(self, rec: SegmentRecord, layer: int) -> bytes:
        data, reason, unreadable = self.blobs.read_checked(rec.blob, rec.layers[layer])
        if data is None:
            error = BlobUnreadableError if unreadable else CorruptBlobError
            raise error(f"segment {rec.key} layer {layer}: {reason} ({rec.blob})", rec.key, layer, reason)
        return data

    def payload_intact(self, rec: SegmentRecord) -> bool:
        """A stat, no read: the blob exists and is long enough for every layer (bit flips are caught by the
        per-layer checksums while streaming)."""
        try:
            size = (self.root / rec.blob).stat().st_size
        except OSError:
            return False
        return all(layer.offset + layer.length <= size for layer in rec.layers)

    def touch(self, keys: Sequence[str]) -> int:
        if self.readonly or not keys:
            return 0
        now = time.time()
        try:
            return self._write(lambda txn: bump_usage(txn, self.index.dbs, keys, now))
        except (lmdb.Error, ArchiveError):
            return 0

    def drop_segments(self, keys: Iterable[str]) -> list[str]:
        drop = list(keys)
        with self.ensure_writer():
            return self._commit(lambda txn: drop_segments(txn, self.index.dbs, drop), frees=True)

    # ── documents ──
    def get_document(self, path: str) -> DocumentRecord | None:
        raw = self.index.get("documents", document_db_key(path))
        return None if raw is None else DocumentRecord.from_json(raw)

    def iter_documents(self) -> Iterator[DocumentRecord]:
        for _, raw in self.index.items("documents"):
            yield DocumentRecord.from_json(raw)

    def count_documents(self) -> int:
        return self.index.count("documents")

    def put_document(self, doc: DocumentRecord) -> None:
        """Under the writer lock, because its manifest (blobs.py) is a file that ``gc`` may collect."""
        key = document_db_key(doc.path)
        with self.ensure_writer():
            write_manifest(self.root, doc)
            self._write(lambda txn: txn.put(key, doc.to_json().encode(), db=self.index.dbs["documents"]))

    def replace_document(self, doc: DocumentRecord, keep: Collection[str] = frozenset()) -> list[str]:
        with self.ensure_writer():
            write_manifest(self.root, doc)
            return self._commit(lambda txn: replace_document(txn, self.index.dbs, doc, keep))

    def remove_documents(self, paths: Sequence[str]) -> list[str]:
        """Index first, blobs after: a crash in between leaves orphans, never a record without its blob."""
        with self.ensure_writer():
            removed = self._commit(lambda txn: remove_documents(txn, self.index.dbs, paths), frees=True)
            for path in removed:
                remove_manifest(self.root, path)
            return removed

    def strip_dangling(self, dangling: dict[str, list[str]]) -> list[str]:
        with self.ensure_writer():
            return self._commit(lambda txn: (strip_dangling(txn, self.index.dbs, dangling), []), frees=True)

    # ── side tables ──
    def get_json(self, table: str, name: str) -> Any:
        return load_json(self.index.get(table, name_db_key(name, table)))

    def put_json(self, table: str, name: str, value: Any) -> None:
        kb, data = name_db_key(name, table), dump_json(value)
        self._write(lambda txn: txn.put(kb, data, db=self.index.dbs[table]))

    def json_items(self, table: str) -> Iterator[tuple[str, Any]]:
        for k, raw in self.index.items(table):
            yield k.decode(), load_json(raw)

    def put_embeddings(self, pairs: Sequence[tuple[str, Any]]) -> None:
        rows = embedding_rows(pairs)
        self._write(lambda txn: put_embedding_rows(txn, self.index.dbs, rows))

    def has_embedding(self, key: str) -> bool:
        return self.index.get("embeddings", name_db_key(key, "embedding")) is not None

    def get_embeddings(self, keys: Iterable[str] | None = None) -> tuple[list[str], np.ndarray]:
        if keys is None:
            return embedding_matrix([(k.decode(), v) for k, v in self.index.items("embeddings")])
        wanted = [name_db_key(k, "embedding") for k in keys]
        db = self.index.dbs["embeddings"]
        got = [] if db is None else self.index.read(lambda txn: [(kb.decode(), txn.get(kb, db=db)) for kb in wanted])
        return embedding_matrix([(k, bytes(v)) for k, v in got if v is not None])

    # ── upkeep ──
    def leftovers(self) -> list[Leftover]:
        """Temp files and blobs no record names. Under the writer lock a temp file is never a live writer's."""
        referenced = {rec.blob for rec in self.iter_segments()}
        return [
            Leftover(rel, size, is_temp)
            for rel, size, is_temp in scan_blob_dir(self.root)
            if is_temp or (rel.endswith(BLOB_SUFFIX) and rel not in referenced)
        ]

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
        live = {manifest_relpath(doc.path) for doc in self.iter_documents()}
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
