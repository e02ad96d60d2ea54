"""The archive: segments' KV and their records, documents, and side tables, over one store.

Every command, the pipeline and the feeds use an :class:`Archive`; what holds
the bytes is its :class:`~kvblend.archive.store.Store`, a local directory
(LMDB + blob files, local.py) or Redis (redis_store.py), chosen by the
location's form when the archive is opened. The archive adds what is the
same whatever the store: encoding and checking KV (codec.py), finding a
document or a segment the way a user names it, and the typed summaries
the CLI renders. Upkeep (verify, gc, stats) is maintenance.py's.

torch is imported only by the calls that encode or decode tensors, so
listing, verifying and collecting an archive never load it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvblend.archive import maintenance
from kvblend.archive.codec import check_codec, decode_checked
from kvblend.archive.index import DEFAULT_MAP_SIZE
from kvblend.archive.local import FORMAT_VERSION, LocalStore, archive_exists
from kvblend.archive.location import Location, resolve_location
from kvblend.archive.records import DocumentRecord, Model, SegmentRecord
from kvblend.archive.store import Store
from kvblend.defaults import DEFAULT_CODEC, DEFAULT_LEVEL
from kvblend.errors import ArchiveError, CorruptBlobError, NotFoundError, UsageError
from kvblend.types import LayerKV

#: The shortest segment-key prefix a user may name a segment by (`show`, `query --segment`): 6 hex digits
#: (16.7 million values) keep an accidental match unlikely in any archive a person browses.
SEGMENT_PREFIX_MIN = 6


@dataclass(frozen=True)
class DocumentSummary:
    """One document as `ls` shows it."""

    name: str  # as ingested, relative to its root
    path: str  # where it was read from (absolute)
    segments: int
    missing_segments: int  # listed but gone (evicted, damaged, removed): ingest it again to restore them
    tokens: int
    bytes: int  # payload bytes of its segments still present
    last_used: float | None
    ingested: float
    format: str = "text"  # what the file was read as ("text", "markdown", "pdf", ...)
    pages: int = 0  # page count; 0 for formats without pages

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Archive:
    """A KV archive. Open with :meth:`Archive.open`; close (or use ``with``) when done."""

    def __init__(self, store: Store, location: Location, asked: Model = Model()):
        """Internal: use :meth:`open`."""
        self.store = store
        self.location = location
        self._asked = asked  # the model this process writes with; recorded by the first segment commit

    # ------------------------------------------------------------ open / close

    @staticmethod
    def exists(location: str | os.PathLike[str] | Location) -> bool:
        """Whether an archive is there, without opening or creating it (a Redis archive is assumed to be:
        only connecting could tell)."""
        where = resolve_location(location)
        return where.is_redis or archive_exists(where.path or Path())

    @classmethod
    def open(
        cls,
        location: str | os.PathLike[str] | Location,
        *,
        create: bool = True,
        model_name: str | None = None,
        model_fingerprint: str | None = None,
        readonly: bool = False,
        defer_binding: bool = False,
        initial_map_size: int = DEFAULT_MAP_SIZE,
    ) -> Archive:
        """Open (or create) the archive at ``location``: a directory, or a ``redis://`` URL.

        Refuses, with one actionable line, an archive written by a newer format
        (ArchiveVersionError), one built with another model
        (ArchiveModelMismatchError, when ``model_fingerprint`` is given), a
        damaged one (ArchiveDamagedError, naming the repair command), and a
        missing archive when ``create`` is False. ``readonly`` writes nothing
        at all. The first writable open with a model records it; with
        ``defer_binding`` it is checked now but recorded with the first
        committed segment.
        """
        where = resolve_location(location)
        asked = Model(model_name, model_fingerprint)
        store: Store
        if where.redis is not None:
            from kvblend.archive.redis_store import RedisStore

            store = RedisStore.open(
                where.redis, create=create, readonly=readonly, asked=asked, defer_binding=defer_binding
            )
        else:
            store = LocalStore.open(
                where.path or Path(),
                create=create,
                readonly=readonly,
                asked=asked,
                defer_binding=defer_binding,
                map_size=initial_map_size,
            )
        return cls(store, where, asked)

    def close(self) -> None:
        """Release the writer lock if held, descriptors, connections. Idempotent."""
        self.store.close()

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Archive({self.location.display!r}, model={self.model_name!r})"

    @property
    def path(self) -> Path:
        """The archive directory (a local archive only: a Redis archive has none)."""
        if self.location.path is None:
            raise ArchiveError(f"{self.location} is a Redis archive: it has no directory")
        return Path(self.store.location)

    @property
    def readonly(self) -> bool:
        return self.store.readonly

    @property
    def model_name(self) -> str | None:
        return self.store.model.name

    @property
    def model_fingerprint(self) -> str | None:
        return self.store.model.fingerprint

    @property
    def format_version(self) -> int:
        return FORMAT_VERSION

    @property
    def map_size(self) -> int:
        """The local index's LMDB map size (grows by doubling when full)."""
        if not isinstance(self.store, LocalStore):
            raise ArchiveError("only a local archive has an LMDB map")
        return self.store.index.map_size

    # ------------------------------------------------------------ writing

    @contextmanager
    def writer(self, wait: bool | float = False) -> Iterator[Archive]:
        """Hold the archive's exclusive writer for the block (re-entrant). ``wait``: False fails at once if another
        process writes (ArchiveBusyError naming it), True blocks, a number waits that many seconds. Blob-writing
        calls made outside this take it themselves for the call, without waiting."""
        with self.store.writer(wait):
            yield self

    @property
    def holds_writer(self) -> bool:
        return self.store.holds_writer

    def ensure_writer(self) -> AbstractContextManager[object]:
        return self.store.ensure_writer()

    # ------------------------------------------------------------ segments

    def has_segment(self, key: str) -> bool:
        return self.store.has_segment(key)

    def get_segment(self, key: str) -> SegmentRecord | None:
        return self.store.get_segment(key)

    def iter_segments(self) -> Iterator[SegmentRecord]:
        """Every segment record (a local archive reads them in key order, in batches)."""
        return self.store.iter_segments()

    def count_segments(self) -> int:
        return self.store.count_segments()

    def find_segment(self, name: str) -> SegmentRecord:
        """A segment by its key or a unique key prefix of at least SEGMENT_PREFIX_MIN characters.

        NotFoundError when none matches (a server answers 404), UsageError when the prefix is ambiguous.
        """
        rec = self.store.get_segment(name) if name else None
        if rec is None and len(name) >= SEGMENT_PREFIX_MIN:
            matches = [r for r in self.store.iter_segments() if r.key.startswith(name)]
            if len(matches) > 1:
                raise UsageError(f"segment prefix {name} is ambiguous ({len(matches)} segments start with it)")
            rec = matches[0] if matches else None
        if rec is None:
            hint = "" if len(name) >= SEGMENT_PREFIX_MIN else f" (a prefix needs {SEGMENT_PREFIX_MIN}+ characters)"
            raise NotFoundError(f"no such segment in the archive: {name}{hint}")
        return rec

    def put_segment(
        self, record: SegmentRecord, layers: Sequence[LayerKV], codec: str = DEFAULT_CODEC, level: int = DEFAULT_LEVEL
    ) -> SegmentRecord:
        """Encode and store one segment's KV (every layer) and commit its record.

        ``record`` carries key, token_ids, text, base_position, extra; shape, dtype, codec and layer entries are
        filled in here. The payloads are stored before the record commits (FORMAT.md); replacing an existing
        key is atomic too.
        """
        return self.put_segments([(record, layers)], codec=codec, level=level)[0]

    def put_segments(
        self,
        items: Iterable[tuple[SegmentRecord, Sequence[LayerKV]]],
        codec: str = DEFAULT_CODEC,
        level: int = DEFAULT_LEVEL,
        embeddings: dict[str, np.ndarray] | None = None,
    ) -> list[SegmentRecord]:
        """Batch :meth:`put_segment`: every payload stored, then the records (and ``embeddings``, key -> vector)
        committed together, so no crash leaves a segment that retrieval cannot see. Repeated keys are stored
        once (first wins)."""
        return self.store.put_segments(list(items), check_codec(codec), level, embeddings, self._asked)

    def read_layer_raw(self, key_or_record: str | SegmentRecord, layer: int) -> bytes:
        """Layer ``layer``'s payload, checksum-verified but still encoded (one read). Raises CorruptBlobError."""
        rec = self._record(key_or_record, layer)
        return self.store.read_layer_raw(rec, layer)

    def read_layers_raw(self, records: Sequence[SegmentRecord], layer: int) -> list[bytes | CorruptBlobError]:
        """Layer ``layer`` of several segments in one go (a loader's fetch): each payload, or that segment's error."""
        for rec in records:
            self._record(rec, layer)
        return self.store.read_layers_raw(records, layer)

    def decode(self, record: SegmentRecord, layer: int, data: bytes, lazy: bool = False) -> LayerKV:
        """Decode a payload from :meth:`read_layer_raw`, checked against the record's shape and dtype
        (``lazy``: a lossy codec's layer comes back still quantized)."""
        return decode_checked(record, layer, data, lazy)

    def read_layer(self, key_or_record: str | SegmentRecord, layer: int) -> LayerKV:
        """Layer ``layer`` of a segment as CPU ``(k, v)`` ``[kv_heads, n_tokens, head_dim]``.

        Raises CorruptBlobError (with ``segment_key`` and ``layer``) when the payload is missing, short or fails
        its checksum: the caller should recompute that segment rather than trust it.
        """
        rec = self._record(key_or_record, layer)
        return self.decode(rec, layer, self.store.read_layer_raw(rec, layer))

    def _record(self, key_or_record: str | SegmentRecord, layer: int) -> SegmentRecord:
        if isinstance(key_or_record, SegmentRecord):
            rec = key_or_record
        else:
            found = self.store.get_segment(key_or_record)
            if found is None:
                raise CorruptBlobError(
                    f"segment {key_or_record} is not in the archive (evicted or removed)", key_or_record, layer
                )
            rec = found
        if not 0 <= layer < len(rec.layers):
            raise IndexError(f"segment {rec.key} has {len(rec.layers)} layers; layer {layer} requested")
        return rec

    def claim(self, keys: Sequence[str]) -> list[str]:
        """Of segments about to be prefilled, those this process should compute: on a shared store another node
        may be computing the rest now (wait for them: each segment is prefilled once)."""
        return self.store.claim(list(keys))

    def payload_intact(self, rec: SegmentRecord) -> bool:
        """A cheap pre-flight (no read): False when the segment's payload is surely missing or short."""
        return self.store.payload_intact(rec)

    def touch(self, keys: Iterable[str]) -> int:
        """Record a use of these segments (last access now, one more hit); returns how many were found.

        Never fails the caller: a read-only archive or a store error is 0 touched, because usage statistics
        must not break a query.
        """
        return self.store.touch(list(dict.fromkeys(keys)))

    # ------------------------------------------------------------ documents

    def put_document(self, doc: DocumentRecord) -> DocumentRecord:
        """Store (or replace) a document record; its path is made absolute."""
        doc = _absolute(doc)
        self.store.put_document(doc)
        return doc

    def replace_document(self, doc: DocumentRecord, keep: Collection[str] = frozenset()) -> list[str]:
        """Store ``doc`` and delete segments only its previous version used; returns their keys.

        For re-ingesting a changed file: chunks that changed get new keys, and the old ones would otherwise stay
        in the archive unreferenced. ``keep``: segments that documents not committed yet will list (an ingest
        found them stored and reused them), which no document lists *yet*.
        """
        return self.store.replace_document(_absolute(doc), keep)

    def get_document(self, path: str | os.PathLike[str]) -> DocumentRecord | None:
        return self.store.get_document(os.path.abspath(path))

    def iter_documents(self) -> Iterator[DocumentRecord]:
        return self.store.iter_documents()

    def count_documents(self) -> int:
        return self.store.count_documents()

    def find_document(self, name: str) -> DocumentRecord:
        """A document by its path, its name as ingested, or a unique suffix of either; NotFoundError otherwise
        (a server answers 404), UsageError when the suffix is ambiguous."""
        doc = self.get_document(name) or self.get_document(str(Path(name).expanduser().resolve()))
        if doc is not None:
            return doc
        tail = name.lstrip("/")
        matches = [
            d
            for d in self.iter_documents()
            if d.display_name == name or d.path.endswith("/" + tail) or d.display_name.endswith("/" + tail)
        ]
        if len(matches) > 1:
            raise UsageError(f"document name {name} is ambiguous ({len(matches)} documents end with it)")
        if not matches:
            raise NotFoundError(f"no such document in the archive: {name} (see `kvblend ls`)")
        return matches[0]

    def document_summaries(self) -> list[DocumentSummary]:
        """Every document as `ls` shows it, counting the segments it lists that are gone."""
        out = []
        for doc in self.iter_documents():
            present = [s for s in (self.store.get_segment(k) for k in doc.segment_keys) if s is not None]
            out.append(
                DocumentSummary(
                    name=doc.display_name,
                    path=doc.path,
                    segments=len(doc.segment_keys),
                    missing_segments=len(doc.segment_keys) - len(present),
                    tokens=doc.n_tokens,
                    bytes=sum(s.stored_bytes for s in present),
                    last_used=max((s.last_access or 0 for s in present), default=0) or None,
                    ingested=doc.ingested,
                    format=doc.format,
                    pages=doc.pages,
                )
            )
        return out

    def remove_documents(self, paths: Iterable[str | os.PathLike[str]]) -> list[str]:
        """Forget documents and delete the segments no remaining document uses; returns the removed paths.

        Index first, payloads after: a crash in between leaves orphans, never a record without its payload.
        """
        return self.store.remove_documents([os.path.abspath(p) for p in paths])

    # ------------------------------------------------------------ side tables

    def get_meta(self, name: str, default: Any = None) -> Any:
        value = self.store.get_json("meta", name)
        return default if value is None else value

    def set_meta(self, name: str, value: Any) -> None:
        """Store a JSON value under ``name`` (``format_version`` is reserved)."""
        if name == "format_version":
            raise ArchiveError(f"meta entry {name!r} is managed by the archive")
        self.store.put_json("meta", name, value)

    def put_embeddings(
        self,
        keys: Iterable[str] | Iterable[tuple[str, np.ndarray]],
        vectors: np.ndarray | Sequence[np.ndarray] | None = None,
    ) -> None:
        """Store retrieval embeddings, deleted with their segments.

        ``put_embeddings(keys, matrix)`` (row i belongs to keys[i]) or ``put_embeddings([(key, vector), ...])``.
        """
        pairs = list(keys) if vectors is None else list(zip(list(keys), vectors, strict=True))
        self.store.put_embeddings(pairs)  # type: ignore[arg-type]

    def has_embedding(self, key: str) -> bool:
        return self.store.has_embedding(key)

    def get_embeddings(self, keys: Iterable[str] | None = None) -> tuple[list[str], np.ndarray]:
        """(keys, matrix [n, dim] float32) for the given keys that have one, or for all when None."""
        return self.store.get_embeddings(keys)

    def put_profile(self, name: str, profile: dict[str, Any]) -> None:
        """Store a measured device/storage profile (see `kvblend profile`)."""
        self.store.put_json("profiles", name, profile)

    def get_profile(self, name: str) -> dict[str, Any] | None:
        return self.store.get_json("profiles", name)

    def iter_profiles(self) -> Iterator[tuple[str, dict[str, Any]]]:
        return self.store.json_items("profiles")

    def put_tuned(self, name: str, settings: dict[str, Any]) -> None:
        """Store tuned settings (ratio etc.) for a model/device/storage combination."""
        self.store.put_json("tuned", name, settings)

    def get_tuned(self, name: str) -> dict[str, Any] | None:
        return self.store.get_json("tuned", name)

    # ------------------------------------------------------------ upkeep (maintenance.py)

    def verify(self, repair: bool = False, deep: bool = False) -> maintenance.VerifyReport:
        return maintenance.verify(self.store, repair=repair, deep=deep)

    def gc(self, max_size_bytes: int | None = None, dry_run: bool = False) -> maintenance.GcReport:
        return maintenance.gc(self.store, max_size_bytes=max_size_bytes, dry_run=dry_run)

    def stats(self) -> maintenance.ArchiveStats:
        return maintenance.stats(self.store, self.location.display)

    def size_bytes(self, include_index: bool = True) -> int:
        return self.store.size_bytes(include_index=include_index)


def _absolute(doc: DocumentRecord) -> DocumentRecord:
    return dataclasses.replace(doc, path=os.path.abspath(doc.path), ingested=doc.ingested or time.time())
