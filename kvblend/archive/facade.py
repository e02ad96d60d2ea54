"""The archive facade: an LMDB index plus one blob file per segment (see FORMAT.md).

Any number of readers, in any number of processes, read without locks (LMDB
snapshots; blobs are immutable once renamed into place); a read-only open
(opening.py) creates and writes nothing. One writer at a time (lock.py)
creates or deletes files: blobs and document manifests (put, remove, repair,
gc). Index-only updates (``touch``, side stores) take no lock, because LMDB
serializes them and a query must not fail because an ingest is running.

torch is imported only by the calls that encode or decode tensors, so
listing, verifying and collecting an archive never load it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

import lmdb
import numpy as np

from kvblend.archive import local as edits
from kvblend.archive import maintenance
from kvblend.archive.blobs import (
    BlobReader,
    ensure_reserve,
    remove_manifest,
    spending_reserve,
    unlink_blob,
    write_manifest,
    write_segment_blobs,
)
from kvblend.archive.codec import check_codec, decode_checked
from kvblend.archive.index import DEFAULT_MAP_SIZE, Index
from kvblend.archive.local import (
    FORMAT_VERSION,
    LOCK_FILE,
    EmbeddingStore,
    JsonStore,
    Opened,
    SideStores,
    WriterLock,
    archive_exists,
    open_parts,
    stamp,
)
from kvblend.archive.records import (
    DocumentRecord,
    Model,
    SegmentRecord,
    document_db_key,
    name_db_key,
)
from kvblend.defaults import DEFAULT_CODEC, DEFAULT_LEVEL
from kvblend.errors import ArchiveError, CorruptBlobError
from kvblend.types import LayerKV

T = TypeVar("T")


class Archive(SideStores):
    """A KV archive directory. Open with :meth:`Archive.open`; close (or use ``with``) when done."""

    def __init__(self, opened: Opened, asked: Model = Model()):
        """Internal: use :meth:`open`."""
        self.path = path = opened.root
        self.readonly = opened.readonly
        self.index: Index = opened.index
        self.blobs = BlobReader(path)
        self._denied = opened.denied
        self._asked = asked  # the model this process writes with; recorded by the first segment commit
        self._lock = WriterLock(path / LOCK_FILE)
        self._meta = JsonStore(self.index, "meta", self._write)
        self._profiles = JsonStore(self.index, "profiles", self._write)
        self._tuned = JsonStore(self.index, "tuned", self._write)
        self._embeddings = EmbeddingStore(self.index, self._write)
        self._closed = False
        self.model_name: str | None = opened.model.name
        self.model_fingerprint: str | None = opened.model.fingerprint

    # ------------------------------------------------------------ open / close

    exists = staticmethod(archive_exists)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, create: bool = True, model_name: str | None = None,
             model_fingerprint: str | None = None, readonly: bool = False, defer_binding: bool = False,
             initial_map_size: int = DEFAULT_MAP_SIZE) -> Archive:
        """Open (or create) the archive at ``path``.

        Refuses, with one actionable line, an archive written by a newer
        format (ArchiveVersionError), one built with another model
        (ArchiveModelMismatchError, when ``model_fingerprint`` is given), a
        damaged one (ArchiveDamagedError, naming the repair command), and a
        missing archive when ``create`` is False. ``readonly`` writes nothing
        at all; a writable open (``create`` False) of a directory this user
        cannot write is read-only too, and refuses only actual writes.

        The first writable open with a model records it, so later opens can
        check it; with ``defer_binding`` it is checked now but recorded with
        the first committed segment (a run that fails before storing
        anything, e.g. its model does not load, binds nothing).
        """
        asked = Model(model_name, model_fingerprint)
        opened = open_parts(path, create=create, readonly=readonly, asked=asked, defer_binding=defer_binding,
                            map_size=initial_map_size)
        return cls(opened, asked)

    def close(self) -> None:
        """Release the writer lock if held, close blob descriptors and the index. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._lock.close()
        self.blobs.close()
        self.index.close()

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
        return self.index.map_size

    # ------------------------------------------------------------ writing

    @contextmanager
    def writer(self, wait: bool | float = False) -> Iterator[Archive]:
        """Hold the archive's exclusive writer lock for the block (re-entrant).

        ``wait``: False fails at once if another process writes
        (ArchiveBusyError naming its pid), True blocks, a number waits that
        many seconds. Blob-writing methods called outside this take the lock
        themselves for the call, without waiting.
        """
        self._check_writable()
        with self._lock.hold(wait):
            if self._lock.depth == 1:
                ensure_reserve(self.path)  # room for gc/rm on a disk this writer may fill
            yield self

    @property
    def holds_writer(self) -> bool:
        return self._lock.held

    def ensure_writer(self) -> AbstractContextManager[object]:
        """Run under the writer lock: reuse ours if held, else take it (no waiting) for the call."""
        return nullcontext() if self.holds_writer else self.writer(wait=False)

    def _check_writable(self) -> None:
        if self.readonly:  # checked here, not by the index: one environment may serve both kinds
            if self._denied:
                raise ArchiveError(f"{self._denied}; this command needs to write to it (use another --archive)")
            raise ArchiveError("archive was opened read-only; cannot write to it")

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """One index write transaction."""
        self._check_writable()
        return self.index.write(fn)

    def commit(self, edit: Callable[[lmdb.Transaction], tuple[T, list[str]]], frees: bool = False) -> T:
        """Run an index edit returning (result, blobs it unreferenced); unlink those blobs after the commit.

        If the commit fails the blobs stay as orphans for gc: deleting them
        could race a commit that did land (e.g. interrupted after LMDB returned).
        ``frees``: the edit exists to free space (gc, rm, repair), so it may
        spend the disk reserve (reserve.py) and run on a full disk.
        """
        with spending_reserve(self.path) if frees else nullcontext():
            result, blobs = self._write(edit)
            for rel in blobs:
                self.blobs.invalidate(rel)
                unlink_blob(self.path, rel)
        return result

    # ------------------------------------------------------------ segments

    def has_segment(self, key: str) -> bool:
        return self.index.get("segments", name_db_key(key, "segment")) is not None

    def get_segment(self, key: str) -> SegmentRecord | None:
        raw = self.index.get("segments", name_db_key(key, "segment"))
        return None if raw is None else SegmentRecord.from_json(raw)

    def iter_segments(self) -> Iterator[SegmentRecord]:
        """Every segment record, in key order (read in batches; see :meth:`Index.items`)."""
        for _, raw in self.index.items("segments"):
            yield SegmentRecord.from_json(raw)

    def count_segments(self) -> int:
        return self.index.count("segments")

    def put_segment(self, record: SegmentRecord, layers: Sequence[LayerKV], codec: str = DEFAULT_CODEC,
                    level: int = DEFAULT_LEVEL) -> SegmentRecord:
        """Encode and store one segment's KV (every layer) and commit its index record.

        ``record`` carries key, token_ids, text, base_position, extra; shape,
        dtype, codec and layer entries are filled in here. The blob is durable
        on disk before the index commits (see FORMAT.md). Replacing an
        existing key is atomic too: the old blob is deleted only after the new
        record commits. Takes the writer lock for the call unless held.
        """
        return self.put_segments([(record, layers)], codec=codec, level=level)[0]

    def put_segments(self, items: Iterable[tuple[SegmentRecord, Sequence[LayerKV]]], codec: str = DEFAULT_CODEC,
                     level: int = DEFAULT_LEVEL, embeddings: dict[str, np.ndarray] | None = None,
                     ) -> list[SegmentRecord]:
        """Batch :meth:`put_segment`: write and fsync every blob, then commit ONE index transaction.

        One commit (two LMDB fsyncs) for the batch instead of per segment is
        what makes ingesting many small chunks fast. Repeated keys in a batch
        are stored once (first wins). ``embeddings`` (key -> vector) commit in
        the same transaction, so no crash can leave a segment that retrieval
        cannot see.
        """
        codec = check_codec(codec)  # records hold canonical names ("lossless" is an alias)
        with self.ensure_writer():
            model = Model(self.model_name or self._asked.name, self.model_fingerprint or self._asked.fingerprint)
            records = write_segment_blobs(self.path, items, codec, level, self.get_segment, model, embeddings)
            rows = EmbeddingStore.rows((embeddings or {}).items())

            def edit(txn: lmdb.Transaction) -> tuple[tuple[list[SegmentRecord], Model], list[str]]:
                bound = stamp(txn, self.index.dbs["meta"], self.path, self._asked)  # re-checked in the commit
                stored, replaced = edits.commit_segments(txn, self.index.dbs, records, rows)
                return (stored, bound), replaced

            stored, bound = self.commit(edit)
            self.model_name, self.model_fingerprint = bound.name, bound.fingerprint
            return stored

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

    def read_layer_raw(self, key_or_record: str | SegmentRecord, layer: int) -> bytes:
        """Layer ``layer``'s payload, checksum-verified but still compressed: one ``pread``.

        Split from :meth:`read_layer` so a loader can time (or thread) I/O and
        decompression separately. Raises CorruptBlobError(key, layer).
        """
        rec = self._record(key_or_record, layer)
        data, reason = self.blobs.read_checked(rec.blob, rec.layers[layer])
        if data is None:
            raise CorruptBlobError(f"segment {rec.key} layer {layer}: {reason} ({self.path / rec.blob})",
                                   rec.key, layer)
        return data

    def decode(self, record: SegmentRecord, layer: int, data: bytes, lazy: bool = False) -> LayerKV:
        """Decode a payload from :meth:`read_layer_raw` and check it matches the record's shape and dtype.

        ``lazy``: a lossy codec's layer comes back still quantized (see :func:`decode_layer`).
        """
        return decode_checked(record, layer, data, lazy)

    def read_layer(self, key_or_record: str | SegmentRecord, layer: int) -> LayerKV:
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
        now = time.time()
        try:
            return self._write(lambda txn: edits.bump_usage(txn, self.index.dbs, unique, now))
        except (lmdb.Error, ArchiveError):
            return 0

    # ------------------------------------------------------------ documents

    def put_document(self, doc: DocumentRecord) -> DocumentRecord:
        """Store (or replace) a document record; its path is made absolute.

        Under the writer lock, because its manifest (manifests.py) is a file
        that ``gc`` may collect. Takes the lock for the call unless held.
        """
        doc = _absolute(doc)
        key = document_db_key(doc.path)
        with self.ensure_writer():
            write_manifest(self.path, doc)
            self._write(lambda txn: txn.put(key, doc.to_json().encode(), db=self.index.dbs["documents"]))
        return doc

    def replace_document(self, doc: DocumentRecord) -> list[str]:
        """Store ``doc`` and delete segments only its previous version used; returns their keys.

        For re-ingesting a changed file: chunks that changed get new keys, and
        the old ones would otherwise stay in the archive unreferenced. One
        index transaction (blobs unlinked after it); takes the writer lock for
        the call unless held.
        """
        doc = _absolute(doc)
        with self.ensure_writer():
            write_manifest(self.path, doc)
            return self.commit(lambda txn: edits.replace_document(txn, self.index.dbs, doc))

    def get_document(self, path: str | os.PathLike[str]) -> DocumentRecord | None:
        raw = self.index.get("documents", document_db_key(os.path.abspath(path)))
        return None if raw is None else DocumentRecord.from_json(raw)

    def iter_documents(self) -> Iterator[DocumentRecord]:
        for _, raw in self.index.items("documents"):
            yield DocumentRecord.from_json(raw)

    def count_documents(self) -> int:
        return self.index.count("documents")

    def remove_documents(self, paths: Iterable[str | os.PathLike[str]]) -> list[str]:
        """Forget documents and delete the segments no remaining document uses; returns removed paths.

        Index first, blobs after: a crash in between leaves orphans, never a
        record without its blob. Segments shared with a kept document stay.
        """
        wanted = [os.path.abspath(p) for p in paths]
        with self.ensure_writer():
            removed = self.commit(lambda txn: edits.remove_documents(txn, self.index.dbs, wanted), frees=True)
            for path in removed:
                remove_manifest(self.path, path)
            return removed

    # ------------------------------------------------------------ maintenance (see maintenance.py)

    def verify(self, repair: bool = False, deep: bool = False) -> maintenance.VerifyReport:
        return maintenance.verify(self, repair=repair, deep=deep)

    def gc(self, max_size_bytes: int | None = None, dry_run: bool = False) -> maintenance.GcReport:
        return maintenance.gc(self, max_size_bytes=max_size_bytes, dry_run=dry_run)

    def stats(self) -> dict[str, Any]:
        return maintenance.stats(self)

    def size_bytes(self, include_index: bool = True) -> int:
        return maintenance.size_bytes(self, include_index=include_index)


def _absolute(doc: DocumentRecord) -> DocumentRecord:
    return dataclasses.replace(doc, path=os.path.abspath(doc.path), ingested=doc.ingested or time.time())

