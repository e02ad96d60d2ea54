"""The archive: an LMDB index plus one blob file per segment (see FORMAT.md).

Concurrency model:

* Any number of readers, in any number of processes, without locks: LMDB
  gives each read a consistent snapshot, and blobs are immutable once
  renamed into place.
* One *writer* at a time across processes, by ``flock`` on ``lock``. Every
  operation that creates or deletes blob files (put, remove, repair, gc)
  runs under it, so ``gc`` can tell a crashed writer's leftovers from a live
  writer's work in progress.
* Small index-only updates (``touch``, documents, embeddings, profiles,
  tuned settings, meta) need no flock: LMDB serializes write transactions
  itself, and a query must not fail because an ingest is running.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import lmdb
import numpy as np
import torch

from kvblend.archive_format.blobs import (
    BLOB_DIR,
    BLOB_SUFFIX,
    BlobReader,
    blob_relpath,
    check_key,
    fsync_dir,
    scan_blob_dir,
    unlink_blob,
    write_blob,
)
from kvblend.archive_format.codec import (
    CODECS,
    DEFAULT_CODEC,
    DEFAULT_LEVEL,
    check_codec,
    decode_layer,
    dtype_name,
    encode_layer,
)
from kvblend.archive_format.index import (
    DEFAULT_MAP_SIZE,
    DocumentRecord,
    Index,
    SegmentRecord,
    checksum,
    document_db_key,
    name_db_key,
    open_index,
)
from kvblend.errors import (
    ArchiveBusyError,
    ArchiveError,
    ArchiveModelMismatchError,
    ArchiveVersionError,
    CorruptBlobError,
)

FORMAT_VERSION = 1
T = TypeVar("T")
INDEX_DIR = "index"
LOCK_FILE = "lock"
_RESERVED_META = {"format_version"}


def resolve_archive_path(cli_value: str | os.PathLike[str] | None) -> Path:
    """Where the archive lives: ``--archive``, else ``$KVBLEND_ARCHIVE``, else the XDG cache dir."""
    if cli_value:
        return Path(cli_value).expanduser()
    env = os.environ.get("KVBLEND_ARCHIVE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvblend"


def _embedding_rows(pairs: Iterable[tuple[str, np.ndarray]]) -> list[tuple[bytes, bytes]]:
    """(db key, float32 little-endian bytes) per (segment key, vector)."""
    return [(name_db_key(k, "embedding"), np.ascontiguousarray(np.asarray(v, dtype="<f4").reshape(-1)).tobytes())
            for k, v in pairs]


# ---------------------------------------------------------------- reports


class VerifyProblem(NamedTuple):
    """One finding of :meth:`Archive.verify`; ``layer`` is None when the whole segment is affected."""

    key: str
    layer: int | None
    reason: str


@dataclass
class VerifyReport:
    segments_checked: int = 0
    layers_checked: int = 0
    bytes_checked: int = 0
    documents_checked: int = 0
    problems: list[VerifyProblem] = field(default_factory=list)
    orphan_blobs: int = 0  # unreferenced blob files (harmless; `gc` deletes them)
    temp_files: int = 0  # leftovers of interrupted writes (harmless; `gc` deletes them)
    repaired_segments: list[str] = field(default_factory=list)  # dropped from the index
    repaired_documents: list[str] = field(default_factory=list)  # now marked incomplete

    @property
    def ok(self) -> bool:
        """True when every layer of every segment read back intact and every document's segments exist."""
        return not self.problems

    @property
    def bad_segments(self) -> list[str]:
        return sorted({p.key for p in self.problems})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["problems"] = [p._asdict() for p in self.problems]
        d["ok"] = self.ok
        return d


@dataclass
class GcReport:
    dry_run: bool = False
    orphan_blobs: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)  # segment keys, least recently used first
    freed_bytes: int = 0
    blob_bytes_before: int = 0
    blob_bytes_after: int = 0
    incomplete_documents: list[str] = field(default_factory=list)

    @property
    def orphans(self) -> list[str]:
        """Every leftover file deleted (or, dry run, to delete): orphan blobs and temp files."""
        return self.orphan_blobs + self.temp_files

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "orphans": self.orphans}


# ---------------------------------------------------------------- writer lock


class _WriterLock:
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
                deadline = time.monotonic() + (0.0 if wait is False else float(wait))
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise ArchiveBusyError(
                                f"another kvblend process is writing to this archive (pid {self._holder(fd)}); "
                                "wait for it or retry") from None
                        time.sleep(0.05)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            text = ""
        return text if text.isdigit() else "unknown"

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)  # closing the last descriptor releases the flock


# ---------------------------------------------------------------- archive


def _now() -> float:
    return time.time()


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


class Archive:
    """A KV archive directory. Open with :meth:`Archive.open`; close (or use ``with``) when done."""

    def __init__(self, path: Path, index: Index, *, readonly: bool):
        """Internal: use :meth:`open`."""
        self.path = path
        self.readonly = readonly
        self._index = index
        self._reader = BlobReader(path)
        self._lock = _WriterLock(path / LOCK_FILE)
        self._writer_mutex = threading.RLock()
        self._writer_depth = 0
        self._closed = False
        self.model_name: str | None = None
        self.model_fingerprint: str | None = None

    # ------------------------------------------------------------ open / close

    @staticmethod
    def exists(path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` holds an archive (its index directory), without opening or creating it."""
        return (Path(path) / INDEX_DIR).is_dir()

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        model_name: str | None = None,
        model_fingerprint: str | None = None,
        readonly: bool = False,
        initial_map_size: int = DEFAULT_MAP_SIZE,
    ) -> Archive:
        """Open (or create) the archive at ``path``.

        Refuses, with one actionable line, an archive written by a newer
        format (ArchiveVersionError), one built with another model
        (ArchiveModelMismatchError, when ``model_fingerprint`` is given), a
        missing archive when ``create`` is False, and an unwritable directory.
        The first open with a model records it, so later opens can check it.
        """
        root = Path(path).expanduser().absolute()
        _prepare_dir(root, create=create and not readonly, readonly=readonly)
        index = open_index(root / INDEX_DIR, readonly=readonly, map_size=initial_map_size)
        try:
            _check_version(index.peek_meta("format_version"), root)
            index.open_dbs()
            archive = cls(root, index, readonly=readonly)
            archive._init_meta(model_name, model_fingerprint)
        except BaseException:
            index.close()
            raise
        return archive

    def _init_meta(self, model_name: str | None, model_fingerprint: str | None) -> None:
        """Stamp a new archive with the format version; record or check the model."""

        def check(txn: lmdb.Transaction, write: bool) -> tuple[str | None, str | None, bool]:
            meta = self._index.dbs["meta"]
            raw_version = txn.get(b"format_version", db=meta)
            _check_version(raw_version, self.path)
            old_name = _load(txn.get(b"model_name", db=meta))
            old_fp = _load(txn.get(b"model_fingerprint", db=meta))
            if model_fingerprint and old_fp and model_fingerprint != old_fp:
                raise ArchiveModelMismatchError(_mismatch_message(self.path, old_name, old_fp,
                                                                  model_name, model_fingerprint))
            needs_write = raw_version is None or bool(model_fingerprint and not old_fp) or \
                bool(model_name and not old_name and not old_fp)
            if write:
                if raw_version is None:
                    txn.put(b"format_version", _json(FORMAT_VERSION), db=meta)
                    txn.put(b"created", _json(_now()), db=meta)
                if model_fingerprint and not old_fp:
                    txn.put(b"model_fingerprint", _json(model_fingerprint), db=meta)
                    old_fp = model_fingerprint
                    if model_name:
                        txn.put(b"model_name", _json(model_name), db=meta)
                        old_name = model_name
                elif model_name and not old_name and not old_fp:
                    txn.put(b"model_name", _json(model_name), db=meta)
                    old_name = model_name
            return old_name, old_fp, needs_write

        # Read first: opening an existing archive should not need a write transaction.
        name, fp, needs_write = self._index.read(lambda txn: check(txn, False))
        if needs_write and not self.readonly:
            name, fp, _ = self._write(lambda txn: check(txn, True))
        self.model_name, self.model_fingerprint = name, fp

    def close(self) -> None:
        """Release the writer lock if held, close blob descriptors and the index. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._lock.release()
        self._writer_depth = 0
        self._reader.close()
        self._index.close()

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Archive({str(self.path)!r}, model={self.model_name!r})"

    @property
    def format_version(self) -> int:
        return FORMAT_VERSION

    @property
    def map_size(self) -> int:
        """Current LMDB map size (grows by doubling when full)."""
        return self._index.map_size

    # ------------------------------------------------------------ writer lock

    @contextmanager
    def writer(self, wait: bool | float = False) -> Iterator[Archive]:
        """Hold the archive's exclusive writer lock for the block (re-entrant).

        ``wait``: False fails at once if another process writes
        (ArchiveBusyError naming its pid), True blocks, a number waits that
        many seconds. Blob-writing methods called outside this take the lock
        themselves for the call, without waiting.
        """
        if self.readonly:
            raise ArchiveError("archive was opened read-only; cannot write to it")
        if wait is True:
            got = self._writer_mutex.acquire()
        elif wait is False or float(wait) <= 0:
            got = self._writer_mutex.acquire(blocking=False)
        else:
            got = self._writer_mutex.acquire(timeout=float(wait))
        if not got:
            raise ArchiveBusyError("another thread of this process is writing to this archive; wait for it or retry")
        try:
            if self._writer_depth == 0:
                self._lock.acquire(wait)
            self._writer_depth += 1
            try:
                yield self
            finally:
                self._writer_depth -= 1
                if self._writer_depth == 0:
                    self._lock.release()
        finally:
            self._writer_mutex.release()

    @property
    def holds_writer(self) -> bool:
        return self._writer_depth > 0

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """One index write transaction; refused on a read-only archive (the env may be shared)."""
        if self.readonly:
            raise ArchiveError("archive was opened read-only; cannot write to it")
        return self._index.write(fn)

    # ------------------------------------------------------------ meta

    def get_meta(self, name: str, default: Any = None) -> Any:
        raw = self._index.get("meta", name_db_key(name, "meta"))
        return default if raw is None else json.loads(raw)

    def set_meta(self, name: str, value: Any) -> None:
        """Store a JSON value under ``name`` (``format_version`` is reserved)."""
        if name in _RESERVED_META:
            raise ArchiveError(f"meta entry {name!r} is managed by the archive")
        key = name_db_key(name, "meta")
        self._write(lambda txn: txn.put(key, _json(value), db=self._index.dbs["meta"]))

    # ------------------------------------------------------------ segments

    def has_segment(self, key: str) -> bool:
        kb = name_db_key(key, "segment")
        return bool(self._index.read(lambda txn: txn.get(kb, db=self._index.dbs["segments"]) is not None))

    def get_segment(self, key: str) -> SegmentRecord | None:
        raw = self._index.get("segments", name_db_key(key, "segment"))
        return None if raw is None else SegmentRecord.from_json(raw)

    def iter_segments(self) -> Iterator[SegmentRecord]:
        """Every segment record, in key order (read in batches; see :meth:`Index.items`)."""
        for _, raw in self._index.items("segments"):
            yield SegmentRecord.from_json(raw)

    def count_segments(self) -> int:
        return self._index.count("segments")

    def put_segment(
        self,
        record: SegmentRecord,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        codec: str = DEFAULT_CODEC,
        level: int = DEFAULT_LEVEL,
    ) -> SegmentRecord:
        """Encode and store one segment's KV (every layer) and commit its index record.

        ``record`` carries key, token_ids, text, base_position, extra; shape,
        dtype, codec and layer entries are filled in here. The blob is durable
        on disk before the index commits (see FORMAT.md). Replacing an
        existing key is atomic too: the old blob is deleted only after the new
        record commits. Takes the writer lock for the call unless held.
        """
        return self.put_segments([(record, layers)], codec=codec, level=level)[0]

    def put_segments(
        self,
        items: Iterable[tuple[SegmentRecord, Sequence[tuple[torch.Tensor, torch.Tensor]]]],
        codec: str = DEFAULT_CODEC,
        level: int = DEFAULT_LEVEL,
        embeddings: dict[str, np.ndarray] | None = None,
    ) -> list[SegmentRecord]:
        """Batch :meth:`put_segment`: write and fsync every blob, then commit ONE index transaction.

        One commit (two LMDB fsyncs) for the batch instead of per segment is
        what makes ingesting many small chunks fast. Repeated keys in a batch
        are stored once (first wins). ``embeddings`` (key -> vector) commit in
        the same transaction, so no crash can leave a segment that retrieval
        cannot see.
        """
        check_codec(codec)
        with self._ensure_writer():
            records: list[SegmentRecord] = []
            seen: set[str] = set()
            written: list[str] = []
            dirs: set[Path] = set()
            try:
                for record, layers in items:
                    if record.key in seen:
                        continue
                    seen.add(record.key)
                    rec = self._describe(record, layers, codec)
                    rec.blob = self._new_blob_path(rec.key)
                    rec.layers = write_blob(self.path, rec.blob,
                                            (encode_layer(k, v, codec, level) for k, v in layers), sync_dir=False)
                    written.append(rec.blob)
                    dirs.add((self.path / rec.blob).parent)
                    records.append(rec)
                for d in sorted(dirs):
                    fsync_dir(d)
            except BaseException:
                for rel in written:  # not referenced by any committed record yet
                    unlink_blob(self.path, rel)
                raise
            # If the commit fails the blobs are orphans for gc; deleting them here could
            # race a commit that did land (e.g. interrupted after LMDB returned).
            rows = _embedding_rows((embeddings or {}).items())
            old_blobs = self._write(lambda txn: self._commit_segments(txn, records, rows))
            self._delete_blobs(old_blobs)
            return records

    def _describe(self, record: SegmentRecord, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  codec: str) -> SegmentRecord:
        """Validate the tensors against the record and fill in shape, dtype, codec, times."""
        check_key(record.key)
        if not layers:
            raise ValueError(f"segment {record.key}: no layers to store")
        k0 = layers[0][0]
        if k0.dim() != 3:
            raise ValueError(f"segment {record.key}: K must be [kv_heads, n_tokens, head_dim], got {tuple(k0.shape)}")
        for i, (k, v) in enumerate(layers):
            if k.shape != k0.shape or v.shape != k0.shape or k.dtype != k0.dtype or v.dtype != k0.dtype:
                raise ValueError(f"segment {record.key} layer {i}: K/V shape or dtype differs from layer 0")
        kv_heads, n_tokens, head_dim = (int(s) for s in k0.shape)
        if record.n_tokens and record.n_tokens != n_tokens:
            raise ValueError(f"segment {record.key}: record says {record.n_tokens} tokens, KV has {n_tokens}")
        if record.token_ids and len(record.token_ids) != n_tokens:
            raise ValueError(f"segment {record.key}: {len(record.token_ids)} token ids for {n_tokens} KV tokens")
        now = _now()
        return dataclasses.replace(
            record, n_tokens=n_tokens, token_ids=[int(t) for t in record.token_ids], dtype=dtype_name(k0.dtype),
            codec=codec, n_layers=len(layers), kv_heads=kv_heads, head_dim=head_dim, layers=[],
            created=record.created or now, last_access=record.last_access or now, extra=dict(record.extra))

    def _new_blob_path(self, key: str) -> str:
        """The plain blob name, unless the committed record uses it (then a fresh generation name)."""
        plain = blob_relpath(key)
        current = self.get_segment(key)
        if current is not None and current.blob == plain:
            return blob_relpath(key, secrets.token_hex(4))
        return plain

    def _commit_segments(self, txn: lmdb.Transaction, records: list[SegmentRecord],
                         embedding_rows: Sequence[tuple[bytes, bytes]] = ()) -> list[str]:
        """Index half of a put: write the records (and their embeddings); return blobs of
        replaced records to delete after commit."""
        self._put_embedding_rows(txn, embedding_rows)
        db = self._index.dbs["segments"]
        old_blobs = []
        for rec in records:
            kb = rec.key.encode()
            old = txn.get(kb, db=db)
            if old is not None:
                old_rec = json.loads(old)
                rec.hits = int(old_rec.get("hits", 0))  # a replaced segment keeps its popularity
                if old_rec.get("blob") and old_rec["blob"] != rec.blob:
                    old_blobs.append(old_rec["blob"])
            txn.put(kb, rec.to_json().encode(), db=db)
        return old_blobs

    def _delete_blobs(self, relpaths: Iterable[str]) -> int:
        freed = 0
        for rel in relpaths:
            self._reader.invalidate(rel)
            freed += unlink_blob(self.path, rel)
        return freed

    @contextmanager
    def _ensure_writer(self) -> Iterator[None]:
        """Run under the writer lock: reuse ours if held, else take it (no waiting) for the call."""
        with self.writer(wait=False) if not self.holds_writer else nullcontext():
            yield

    # ------------------------------------------------------------ reading KV

    def _record(self, key_or_record: str | SegmentRecord, layer: int) -> SegmentRecord:
        if isinstance(key_or_record, SegmentRecord):
            rec = key_or_record
        else:
            rec = self.get_segment(key_or_record)
            if rec is None:
                raise CorruptBlobError(f"segment {key_or_record} is not in the archive (evicted or removed)",
                                       key_or_record, layer)
        if not 0 <= layer < len(rec.layers):
            raise IndexError(f"segment {rec.key} has {len(rec.layers)} layers; layer {layer} requested")
        return rec

    def _try_read(self, rec: SegmentRecord, layer: int) -> tuple[bytes | None, str]:
        """Read and checksum one layer; (data, "") or (None, reason). Retries once with a fresh descriptor."""
        entry = rec.layers[layer]
        reason = ""
        for _ in range(2):
            try:
                data = self._reader.pread(rec.blob, entry.offset, entry.length)
            except FileNotFoundError:
                reason = "blob file is missing"
            except OSError as e:
                reason = f"cannot read blob ({e.strerror or e})"
            else:
                if len(data) < entry.length:
                    reason = f"blob is truncated (layer needs bytes {entry.offset}..{entry.offset + entry.length})"
                elif checksum(data) != entry.checksum:
                    reason = "checksum mismatch"
                else:
                    return data, ""
            self._reader.invalidate(rec.blob)
        return None, reason

    def read_layer_raw(self, key_or_record: str | SegmentRecord, layer: int) -> bytes:
        """Layer ``layer``'s payload, checksum-verified but still compressed: one ``pread``.

        Split from :meth:`read_layer` so a loader can time (or thread) I/O and
        decompression separately. Raises CorruptBlobError(key, layer).
        """
        rec = self._record(key_or_record, layer)
        data, reason = self._try_read(rec, layer)
        if data is None:
            raise CorruptBlobError(f"segment {rec.key} layer {layer}: {reason} ({self.path / rec.blob})",
                                   rec.key, layer)
        return data

    def decode(self, record: SegmentRecord, layer: int, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a payload from :meth:`read_layer_raw` and check it matches the record's shape and dtype."""
        if record.codec not in CODECS:  # written by a newer kvblend: unreadable here, so recompute
            raise CorruptBlobError(f"segment {record.key} uses codec {record.codec!r}, unknown to this kvblend",
                                   record.key, layer)
        try:
            k, v = decode_layer(data, record.codec)
        except CorruptBlobError as e:
            raise CorruptBlobError(f"segment {record.key} layer {layer}: {e}", record.key, layer) from None
        want = (record.kv_heads, record.n_tokens, record.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want or dtype_name(k.dtype) != record.dtype:
            raise CorruptBlobError(f"segment {record.key} layer {layer}: payload is {tuple(k.shape)} {k.dtype}, "
                                   f"record says {want} {record.dtype}", record.key, layer)
        return k, v

    def read_layer(self, key_or_record: str | SegmentRecord, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer`` of a segment as CPU ``(k, v)`` ``[kv_heads, n_tokens, head_dim]``.

        Raises CorruptBlobError (with ``segment_key`` and ``layer``) when the
        blob is missing, truncated or fails its checksum: the caller should
        recompute that segment rather than trust it.
        """
        rec = self._record(key_or_record, layer)
        return self.decode(rec, layer, self.read_layer_raw(rec, layer))

    def touch(self, keys: Iterable[str]) -> int:
        """Record a use of these segments (last_access = now, hits += 1); returns how many were found.

        Takes no writer lock (LMDB serializes this small transaction), and
        never fails the caller: a read-only archive or an index error is
        reported as 0 touched, because usage statistics must not break a query.
        """
        unique = list(dict.fromkeys(keys))
        if self.readonly or not unique:
            return 0
        now = _now()

        def bump(txn: lmdb.Transaction) -> int:
            db = self._index.dbs["segments"]
            n = 0
            for key in unique:
                kb = key.encode()
                raw = txn.get(kb, db=db)
                if raw is None:
                    continue
                d = json.loads(raw)  # update the dict, so fields newer kvblends added survive
                d["last_access"] = now
                d["hits"] = int(d.get("hits", 0)) + 1
                txn.put(kb, _json(d), db=db)
                n += 1
            return n

        try:
            return self._write(bump)
        except (lmdb.Error, ArchiveError):
            return 0

    # ------------------------------------------------------------ documents

    def put_document(self, doc: DocumentRecord) -> DocumentRecord:
        """Store (or replace) a document record; its path is made absolute."""
        doc = dataclasses.replace(doc, path=os.path.abspath(doc.path), ingested=doc.ingested or _now())
        key = document_db_key(doc.path)
        self._write(lambda txn: txn.put(key, doc.to_json().encode(), db=self._index.dbs["documents"]))
        return doc

    def replace_document(self, doc: DocumentRecord) -> list[str]:
        """Store ``doc`` and delete segments only its previous version used; returns their keys.

        For re-ingesting a changed file: chunks that changed get new keys, and
        the old ones would otherwise stay in the archive unreferenced. One
        index transaction (blobs unlinked after it); takes the writer lock for
        the call unless held.
        """
        doc = dataclasses.replace(doc, path=os.path.abspath(doc.path), ingested=doc.ingested or _now())
        key = document_db_key(doc.path)
        with self._ensure_writer():
            def replace(txn: lmdb.Transaction) -> tuple[list[str], list[str]]:
                docs = self._index.dbs["documents"]
                old = txn.get(key, db=docs)
                txn.put(key, doc.to_json().encode(), db=docs)
                stale = set(json.loads(old).get("segment_keys", [])) if old is not None else set()
                stale.difference_update(doc.segment_keys)
                if stale:
                    for _, raw in txn.cursor(db=docs):
                        stale.difference_update(json.loads(raw).get("segment_keys", []))
                blobs, _ = self._drop_segments_txn(txn, stale, mark_documents=False)
                return sorted(stale), blobs

            dropped, blobs = self._write(replace)
            self._delete_blobs(blobs)
            return dropped

    def get_document(self, path: str | os.PathLike[str]) -> DocumentRecord | None:
        raw = self._index.get("documents", document_db_key(os.path.abspath(path)))
        return None if raw is None else DocumentRecord.from_json(raw)

    def iter_documents(self) -> Iterator[DocumentRecord]:
        for _, raw in self._index.items("documents"):
            yield DocumentRecord.from_json(raw)

    def count_documents(self) -> int:
        return self._index.count("documents")

    def remove_documents(self, paths: Iterable[str | os.PathLike[str]]) -> list[str]:
        """Forget documents and delete the segments no remaining document uses; returns removed paths.

        Index first, blobs after: a crash in between leaves orphans, never a
        record without its blob. Segments shared with a kept document stay.
        """
        wanted = [os.path.abspath(p) for p in paths]
        with self._ensure_writer():
            def remove(txn: lmdb.Transaction) -> tuple[list[str], list[str]]:
                docs = self._index.dbs["documents"]
                removed: list[str] = []
                candidates: set[str] = set()
                for p in dict.fromkeys(wanted):
                    kb = document_db_key(p)
                    raw = txn.get(kb, db=docs)
                    if raw is None:
                        continue
                    d = json.loads(raw)
                    removed.append(d.get("path", p))
                    candidates.update(d.get("segment_keys", []))
                    txn.delete(kb, db=docs)
                for _, raw in txn.cursor(db=docs):
                    candidates.difference_update(json.loads(raw).get("segment_keys", []))
                blobs, _ = self._drop_segments_txn(txn, candidates, mark_documents=False)
                return removed, blobs

            removed, blobs = self._write(remove)
            self._delete_blobs(blobs)
            return removed

    def _drop_segments_txn(self, txn: lmdb.Transaction, keys: Iterable[str],
                           mark_documents: bool = True) -> tuple[list[str], list[str]]:
        """Delete segment records (and their embeddings) in ``txn``; returns (blobs to unlink, docs marked).

        With ``mark_documents``, documents listing a dropped key lose it and
        get ``incomplete: true`` so `ingest` knows to redo them.
        """
        segs, embs, docs = (self._index.dbs[n] for n in ("segments", "embeddings", "documents"))
        drop = set(keys)
        blobs = []
        for key in sorted(drop):
            kb = key.encode()
            raw = txn.get(kb, db=segs)
            if raw is not None:
                blob = json.loads(raw).get("blob")
                if blob:
                    blobs.append(blob)
                txn.delete(kb, db=segs)
            txn.delete(kb, db=embs)
        marked = []
        if mark_documents and drop:
            updates = []
            for kb, raw in txn.cursor(db=docs):
                d = json.loads(raw)
                keys_before = d.get("segment_keys", [])
                if drop.intersection(keys_before):
                    d["segment_keys"] = [k for k in keys_before if k not in drop]
                    d["incomplete"] = True
                    updates.append((bytes(kb), d))
            for kb, d in updates:
                txn.put(kb, _json(d), db=docs)
                marked.append(d.get("path", kb.decode("utf-8", "replace")))
        return blobs, marked

    # ------------------------------------------------------------ embeddings, profiles, tuned

    def put_embedding(self, key: str, vector: np.ndarray) -> None:
        """Store a retrieval embedding (float32, little-endian raw bytes) under a segment key.

        It is deleted with the segment of the same key.
        """
        self.put_embeddings([(key, vector)])

    def put_embeddings(self, keys: Iterable[str] | Iterable[tuple[str, np.ndarray]],
                       vectors: np.ndarray | Sequence[np.ndarray] | None = None) -> None:
        """Batch :meth:`put_embedding` in one transaction.

        Either ``put_embeddings(keys, matrix)`` (row i belongs to keys[i]) or
        ``put_embeddings([(key, vector), ...])``.
        """
        pairs = list(keys) if vectors is None else list(zip(list(keys), vectors, strict=True))
        rows = _embedding_rows(pairs)
        self._write(lambda txn: self._put_embedding_rows(txn, rows))

    def _put_embedding_rows(self, txn: lmdb.Transaction, rows: Sequence[tuple[bytes, bytes]]) -> None:
        db = self._index.dbs["embeddings"]
        for kb, data in rows:
            txn.put(kb, data, db=db)

    def has_embedding(self, key: str) -> bool:
        kb = name_db_key(key, "embedding")
        db = self._index.dbs["embeddings"]
        return self._index.read(lambda txn: txn.get(kb, db=db) is not None)

    def get_embeddings(self, keys: Iterable[str] | None = None) -> tuple[list[str], np.ndarray]:
        """(keys, matrix [n, dim] float32) for the given keys that have one, or for all when None."""
        if keys is None:
            rows = [(k.decode(), v) for k, v in self._index.items("embeddings")]
        else:
            wanted = [name_db_key(k, "embedding") for k in keys]
            db = self._index.dbs["embeddings"]
            got = self._index.read(lambda txn: [(kb.decode(), txn.get(kb, db=db)) for kb in wanted])
            rows = [(k, v) for k, v in got if v is not None]
        if not rows:
            return [], np.zeros((0, 0), dtype=np.float32)
        dims = {len(v) for _, v in rows}
        if len(dims) != 1:
            raise ArchiveError("archive holds embeddings of different sizes; re-ingest with one embedder")
        matrix = np.frombuffer(b"".join(v for _, v in rows), dtype="<f4").reshape(len(rows), -1)
        return [k for k, _ in rows], matrix.astype(np.float32, copy=True)

    def put_profile(self, name: str, profile: dict[str, Any]) -> None:
        """Store a measured device/storage profile (see `kvblend profile`)."""
        self._put_json("profiles", name, profile)

    def get_profile(self, name: str) -> dict[str, Any] | None:
        return self._get_json("profiles", name)

    def iter_profiles(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for k, raw in self._index.items("profiles"):
            yield k.decode(), json.loads(raw)

    def put_tuned(self, name: str, settings: dict[str, Any]) -> None:
        """Store tuned settings (ratio etc.) for a model/device/storage combination."""
        self._put_json("tuned", name, settings)

    def get_tuned(self, name: str) -> dict[str, Any] | None:
        return self._get_json("tuned", name)

    def iter_tuned(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for k, raw in self._index.items("tuned"):
            yield k.decode(), json.loads(raw)

    def _put_json(self, db: str, name: str, value: Any) -> None:
        kb = name_db_key(name, db)
        data = _json(value)
        self._write(lambda txn: txn.put(kb, data, db=self._index.dbs[db]))

    def _get_json(self, db: str, name: str) -> Any:
        raw = self._index.get(db, name_db_key(name, db))
        return None if raw is None else json.loads(raw)

    # ------------------------------------------------------------ maintenance

    def verify(self, repair: bool = False, deep: bool = False) -> VerifyReport:
        """Re-read every layer of every segment and check its checksum (``deep``: also decode it).

        Also checks that each document's segments exist. With ``repair``, bad
        segments are dropped from the index (their documents lose them and are
        marked incomplete) so queries recompute instead of failing; orphaned
        blobs are left for ``gc``.
        """
        report = VerifyReport()
        bad: set[str] = set()
        with self._ensure_writer() if repair else nullcontext():
            present: set[str] = set()
            referenced: set[str] = set()
            for rec in self.iter_segments():
                report.segments_checked += 1
                present.add(rec.key)
                referenced.add(rec.blob)
                problems = self._verify_segment(rec, report, deep)
                if problems and not repair and self._replaced_meanwhile(rec):
                    continue  # a concurrent writer replaced or removed it: not corruption
                report.problems.extend(problems)
                bad.update(p.key for p in problems)
            dangling: dict[str, list[str]] = {}
            for doc in self.iter_documents():
                report.documents_checked += 1
                missing = [k for k in doc.segment_keys if k not in present]
                if missing and not repair:
                    missing = [k for k in missing if not self.has_segment(k)]
                for k in missing:
                    report.problems.append(VerifyProblem(k, None, f"document {doc.path} lists a segment "
                                                                  "that is not in the archive"))
                if missing:
                    dangling[doc.path] = missing
            for rel, _, is_temp in scan_blob_dir(self.path):
                if is_temp:
                    report.temp_files += 1
                elif rel.endswith(BLOB_SUFFIX) and rel not in referenced:
                    report.orphan_blobs += 1
            if repair and (bad or dangling):
                self._repair(bad, dangling, report)
        return report

    def _verify_segment(self, rec: SegmentRecord, report: VerifyReport, deep: bool) -> list[VerifyProblem]:
        if len(rec.layers) != rec.n_layers:
            reason = f"record lists {len(rec.layers)} layers but says n_layers={rec.n_layers}"
            return [VerifyProblem(rec.key, None, reason)]
        if not (self.path / rec.blob).is_file():
            return [VerifyProblem(rec.key, None, f"blob file is missing ({rec.blob})")]
        problems = []
        for i in range(len(rec.layers)):
            report.layers_checked += 1
            data, reason = self._try_read(rec, i)
            if data is None:
                problems.append(VerifyProblem(rec.key, i, reason))
                continue
            report.bytes_checked += len(data)
            if deep:
                try:
                    self.decode(rec, i, data)
                except CorruptBlobError as e:
                    problems.append(VerifyProblem(rec.key, i, str(e)))
        return problems

    def _replaced_meanwhile(self, rec: SegmentRecord) -> bool:
        now = self.get_segment(rec.key)
        return now is None or now.blob != rec.blob or now.layers != rec.layers

    def _repair(self, bad: set[str], dangling: dict[str, list[str]], report: VerifyReport) -> None:
        def fix(txn: lmdb.Transaction) -> tuple[list[str], list[str]]:
            blobs, marked = self._drop_segments_txn(txn, bad)
            docs = self._index.dbs["documents"]
            for path, missing in dangling.items():
                kb = document_db_key(path)
                raw = txn.get(kb, db=docs)
                if raw is None:
                    continue
                d = json.loads(raw)
                d["segment_keys"] = [k for k in d.get("segment_keys", []) if k not in set(missing)]
                d["incomplete"] = True
                txn.put(kb, _json(d), db=docs)
                marked.append(path)
            return blobs, marked

        blobs, marked = self._write(fix)
        self._delete_blobs(blobs)
        report.repaired_segments = sorted(bad)
        report.repaired_documents = sorted(set(marked))

    def gc(self, max_size_bytes: int | None = None, dry_run: bool = False) -> GcReport:
        """Delete orphan blobs and temp files; with ``max_size_bytes``, evict least recently used segments.

        Eviction order is by ``last_access`` (then ``created``), oldest first,
        until the referenced blobs total at most ``max_size_bytes``. Evicted
        segments leave their documents marked incomplete. Runs under the
        writer lock, so a temp file is never a live writer's.
        """
        if max_size_bytes is not None and max_size_bytes < 0:
            raise ArchiveError("gc budget must be >= 0 bytes")
        report = GcReport(dry_run=dry_run)
        with self._ensure_writer():
            live: dict[str, tuple[float, float, str]] = {}  # blob -> (last_access, created, key)
            for rec in self.iter_segments():
                live[rec.blob] = (rec.last_access or rec.created, rec.created, rec.key)
            sizes: dict[str, int] = {}
            for rel, size, is_temp in scan_blob_dir(self.path):
                if is_temp:
                    report.temp_files.append(rel)
                elif rel in live:
                    sizes[rel] = size
                    continue
                elif rel.endswith(BLOB_SUFFIX):
                    report.orphan_blobs.append(rel)
                else:
                    continue  # not ours: leave it
                report.blob_bytes_before += size
                report.freed_bytes += size
                if not dry_run:
                    unlink_blob(self.path, rel)
            total = sum(sizes.values())
            report.blob_bytes_before += total
            if max_size_bytes is not None and total > max_size_bytes:
                for blob, (_, _, key) in sorted(live.items(), key=lambda item: item[1]):
                    if total <= max_size_bytes:
                        break
                    report.evicted.append(key)
                    total -= sizes.get(blob, 0)
                    report.freed_bytes += sizes.get(blob, 0)
                if report.evicted and not dry_run:
                    blobs, marked = self._write(lambda txn: self._drop_segments_txn(txn, report.evicted))
                    self._delete_blobs(blobs)
                    report.incomplete_documents = sorted(set(marked))
            report.blob_bytes_after = total
        return report

    def stats(self) -> dict[str, Any]:
        """Totals for `kvblend stats`: counts, tokens, bytes stored vs raw fp16, compression, hits."""
        n = tokens = stored = raw = hits = 0
        codecs: dict[str, int] = {}
        for rec in self.iter_segments():
            n += 1
            tokens += rec.n_tokens
            stored += rec.stored_bytes
            raw += rec.raw_bytes
            hits += rec.hits
            codecs[rec.codec] = codecs.get(rec.codec, 0) + 1
        return {
            "path": str(self.path),
            "format_version": FORMAT_VERSION,
            "model_name": self.model_name,
            "model_fingerprint": self.model_fingerprint,
            "segments": n,
            "documents": self.count_documents(),
            "tokens": tokens,
            "stored_bytes": stored,
            "raw_bytes": raw,
            "bytes_per_token_raw": raw / tokens if tokens else 0.0,
            "bytes_per_token_stored": stored / tokens if tokens else 0.0,
            "compression_ratio": raw / stored if stored else 0.0,
            "hits": hits,
            "codecs": codecs,
            "index_bytes": self._index_bytes(),
        }

    def _index_bytes(self) -> int:
        total = 0
        for name in ("data.mdb", "lock.mdb"):
            try:
                total += (self.path / INDEX_DIR / name).stat().st_size
            except FileNotFoundError:
                pass
        return total

    def size_bytes(self, include_index: bool = True) -> int:
        """Bytes on disk: every file under ``blobs/`` (orphans included) plus, by default, the index."""
        blobs = sum(size for _, size, _ in scan_blob_dir(self.path))
        return blobs + (self._index_bytes() if include_index else 0)


# ---------------------------------------------------------------- helpers


def _load(raw: bytes | None) -> Any:
    return None if raw is None else json.loads(raw)


def _prepare_dir(root: Path, *, create: bool, readonly: bool) -> None:
    """Check (and create) the archive directory, turning OS errors into one-line ArchiveErrors."""
    if root.exists() and not root.is_dir():
        raise ArchiveError(f"archive path {root} is a file, not a directory")
    if not root.exists():
        if not create:
            raise ArchiveError(f"no archive at {root} (ingest documents first, or check --archive)")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArchiveError(f"cannot create archive directory {root}: {e.strerror or e}") from None
    if not Archive.exists(root) and not create:
        raise ArchiveError(f"{root} is not a kvblend archive (it has no {INDEX_DIR}/ directory)")
    if readonly:
        return
    if not os.access(root, os.W_OK | os.X_OK):
        raise ArchiveError(f"archive directory {root} is not writable; use another --archive")
    try:
        (root / INDEX_DIR).mkdir(exist_ok=True)
        (root / BLOB_DIR).mkdir(exist_ok=True)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ArchiveError(f"disk full while creating archive {root}") from None
        raise ArchiveError(f"cannot create archive directory {root}: {e.strerror or e}") from None


def _check_version(raw: bytes | None, root: Path) -> None:
    if raw is None:
        return
    try:
        version = int(json.loads(raw))
    except (ValueError, TypeError):
        raise ArchiveError(f"archive at {root} has an unreadable format version {raw[:20]!r}") from None
    if version > FORMAT_VERSION:
        raise ArchiveVersionError(f"archive format v{version} is newer than this kvblend supports "
                                  f"(v{FORMAT_VERSION}); upgrade kvblend")


def _mismatch_message(root: Path, old_name: str | None, old_fp: str,
                      new_name: str | None, new_fp: str) -> str:
    a = old_name or f"fingerprint {old_fp[:12]}"
    b = new_name or f"fingerprint {new_fp[:12]}"
    if a == b:  # same name, other weights (e.g. a re-quantized checkpoint)
        a, b = f"{a} (fingerprint {old_fp[:12]})", f"{b} (fingerprint {new_fp[:12]})"
    hint = f"pass --model {old_name} or use another --archive" if old_name else "use another --archive"
    return f"archive at {root} was built with model {a}; you asked for model {b} ({hint})"
