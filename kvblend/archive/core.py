"""The archive core: every rule above the store, written once for every store.

A store (store.py) keeps bytes; this module says what they mean, so a local
directory and a Redis server behave alike because the same code runs over
both (tests/unit/test_store_contract.py runs every rule against each):

* **what an archive is**: :data:`FORMAT_VERSION`, and the ``meta`` entries
  that bind an archive to one format and one model. The version is checked
  first (a newer archive is refused untouched), the model is recorded by the
  first writer that names one and refused for any other, because KV from one
  model is garbage to another. A writer may defer recording the model to its
  first committed segment, so a run that fails before storing anything binds
  nothing.
* **segments**: every layer's payload is stored before the record that names
  it commits, so a reader never sees half a segment; a replaced segment keeps
  its popularity; payloads a commit unreferenced are deleted only after it,
  so a crash leaves leftovers for ``gc``, never a record without its payload.
* **documents**: a document lists its segments; replacing or removing one
  drops the segments no other document uses (but none a document about to be
  committed relies on), and dropping a segment marks the documents that
  listed it incomplete, with its provenance gone too.
* **lookups**: a segment by a unique key prefix, a document by its path, its
  name as ingested or a unique suffix; the summaries `ls` shows.

:class:`ArchiveCore` holds these over one store; the facade's ``Archive`` is
an ArchiveCore plus opening, the location and upkeep (maintenance.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvblend.archive.codec import CODECS, check_codec, decode_layer, dtype_name, encode_layer
from kvblend.archive.records import (
    DocumentRecord,
    Model,
    SegmentRecord,
    blob_metadata,
    describe,
    drop_listed,
    load_record,
)
from kvblend.archive.store import Store, Txn, dump_json, embedding_bytes, embedding_matrix, load_json
from kvblend.defaults import DEFAULT_CODEC, DEFAULT_LEVEL
from kvblend.errors import (
    ArchiveError,
    ArchiveModelMismatchError,
    ArchiveVersionError,
    CorruptBlobError,
    NotFoundError,
    UsageError,
)
from kvblend.types import LayerKV

if TYPE_CHECKING:
    import numpy as np

T = TypeVar("T")

FORMAT_VERSION = 1

#: The shortest segment-key prefix a user may name a segment by (`show`, `query --segment`): 6 hex digits
#: (16.7 million values) keep an accidental match unlikely in any archive a person browses.
SEGMENT_PREFIX_MIN = 6

# ──────────────────────────────────────────── format version and model binding

Damaged = Callable[[str], ArchiveError]  # the store's one-line error for damage (a local one names its repair)


def check_version(raw: bytes | memoryview | None, damaged: Damaged) -> int | None:
    """The stored ``format_version`` (None when absent); refuse a newer or a malformed one.

    Only positive integers are versions: 1.5, 0, -1 or "1" were never written
    by kvblend, so the records are damaged rather than of some other format.
    """
    if raw is None:
        return None
    try:
        version: Any = load_record(raw)
    except ArchiveError:
        version = bytes(raw[:20])
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise damaged(f"its format version {version!r} is not a positive integer")
    if version > FORMAT_VERSION:
        raise ArchiveVersionError(
            f"archive format v{version} is newer than this kvblend supports (v{FORMAT_VERSION}); upgrade kvblend"
        )
    return version


def recorded(meta: Callable[[str], bytes | None], store: Store, asked: Model) -> Model:
    """The model the archive records (checked against ``asked``, after the format version); refuses a mismatch.
    ``meta(name)`` reads a ``meta`` entry (from the store, or inside a transaction)."""
    check_version(meta("format_version"), store.damaged)
    have = Model(load_json(meta("model_name")), load_json(meta("model_fingerprint")))
    if asked.fingerprint and have.fingerprint and asked.fingerprint != have.fingerprint:
        raise ArchiveModelMismatchError(mismatch_message(store.location, have, asked))
    return have


def mismatch_message(location: str, have: Model, asked: Model) -> str:
    old_fp, new_fp = have.fingerprint or "", asked.fingerprint or ""
    a = have.name or f"fingerprint {old_fp[:12]}"
    b = asked.name or f"fingerprint {new_fp[:12]}"
    if a == b:  # same name, other weights (e.g. a re-quantized checkpoint)
        a, b = f"{a} (fingerprint {old_fp[:12]})", f"{b} (fingerprint {new_fp[:12]})"
    from kvblend.defaults import BUNDLED_MODELS, DEFAULT_MODEL_NAME

    if have.name in (DEFAULT_MODEL_NAME, *BUNDLED_MODELS):  # a name --model takes as it is
        hint = f"pass --model {have.name} or use another --archive"
    elif have.name:  # a file or folder's name: the path is the user's to give
        hint = f"pass the --model path it was built with (named {have.name}) or use another --archive"
    else:
        hint = "use another --archive"
    return f"archive at {location} was built with model {a}; you asked for model {b} ({hint})"


def stamp(txn: Txn, store: Store, asked: Model, *, version: bool = True, model: bool = True) -> Model:
    """Check, then record what is missing: the format version (with ``created``) and/or the model.

    A fingerprint is recorded when none is; a name when it comes with a new
    fingerprint or when nothing identifies the model yet. Each is written only
    if absent, so of two writers binding at once (two Redis nodes) one wins
    and the other is checked against it. Returns the model now recorded.
    """

    def meta(name: str) -> bytes | None:
        return txn.get("meta", name)

    have = recorded(meta, store, asked)
    if version and meta("format_version") is None:
        txn.put_new("meta", "format_version", dump_json(FORMAT_VERSION))
        txn.put_new("meta", "created", dump_json(time.time()))
    if not model:
        return have
    name, fp = have.name, have.fingerprint
    new_fp = False
    if asked.fingerprint and not fp:
        if not txn.put_new("meta", "model_fingerprint", dump_json(asked.fingerprint)):
            return recorded(meta, store, asked)  # another writer bound it first
        new_fp, fp = True, asked.fingerprint
    if asked.name and (new_fp or not (name or fp)):  # a new fingerprint brings its name
        name = asked.name
        txn.put("meta", "model_name", dump_json(name))
    return Model(name, fp)


def needs_stamp(meta: Callable[[str], bytes | None], store: Store, asked: Model, *, version: bool, model: bool) -> bool:
    """Whether :func:`stamp` would write anything (so opening an up-to-date archive needs no write)."""
    have = recorded(meta, store, asked)
    if version and meta("format_version") is None:
        return True
    return model and (
        bool(asked.fingerprint and not have.fingerprint) or bool(asked.name and not (have.name or have.fingerprint))
    )


def bind(store: Store, asked: Model, *, version: bool, model: bool) -> Model:
    """At open: check the asked model against the recorded one; record the format version and/or the model now.

    Only a creating writer stamps the version at open (so a fresh archive is
    never blank while its first payloads are written); others leave a missing
    one to the first segment commit. The model waits for that commit too
    when binding is deferred.
    """

    def meta(name: str) -> bytes | None:
        return store.get("meta", name)

    if (version or model) and needs_stamp(meta, store, asked, version=version, model=model):
        return store.write(lambda txn: stamp(txn, store, asked, version=version, model=model))
    return recorded(meta, store, asked)


# ──────────────────────────────────────────── rules inside one transaction


def commit_segments(txn: Txn, records: Sequence[SegmentRecord], embeddings: dict[str, Any]) -> list[SegmentRecord]:
    """Write segment records (and their embeddings), their payloads already stored; returns the records they
    replaced whose payloads are now unreferenced."""
    replaced = []
    for rec, old in zip(records, txn.get_many("segments", [r.key for r in records])):
        if old is not None:
            d = load_record(old)
            rec.hits = int(d.get("hits", 0))  # a replaced segment keeps its popularity
            if d.get("blob") and d["blob"] != rec.blob:
                replaced.append(_payload_owner(rec.key, d))
        txn.put("segments", rec.key, rec.to_json().encode())
        if rec.key in embeddings:
            txn.put("embeddings", rec.key, embedding_bytes(embeddings[rec.key]))
    return replaced


def _payload_owner(key: str, d: Any) -> SegmentRecord:
    """What a stored record says about its payload (a record too damaged to load still names its blob)."""
    try:
        return SegmentRecord.from_dict(d)
    except ArchiveError:
        return SegmentRecord(key=key, blob=str(d.get("blob") or "") if isinstance(d, dict) else "")


def drop_segments(txn: Txn, keys: Iterable[str], mark_documents: bool = True) -> tuple[list[str], list[SegmentRecord]]:
    """Delete segment records and their embeddings; returns (document paths marked, records whose payloads go).

    With ``mark_documents``, documents listing a dropped key lose it and get
    ``incomplete: true`` so `ingest` knows to redo them.
    """
    drop = set(keys)
    gone = []
    for key in sorted(drop):
        raw = txn.get("segments", key)
        if raw is not None:
            gone.append(_payload_owner(key, load_record(raw)))
        txn.delete("segments", key)  # also when its record is gone already (a store that lists it still)
        txn.delete("embeddings", key)
    marked: list[str] = []
    if mark_documents and drop:
        hit = [(name, d) for name, d in _documents(txn) if drop.intersection(d.get("segment_keys", []))]
        marked = [_mark_incomplete(txn, name, d, drop) for name, d in hit]
    return marked, gone


def _documents(txn: Txn) -> list[tuple[str, Any]]:
    """Every document record as a dict (so fields this kvblend does not know survive a rewrite)."""
    return [(name, load_record(raw)) for name, raw in txn.scan("documents")]


def strip_dangling(txn: Txn, dangling: dict[str, list[str]]) -> list[str]:
    """Remove keys that name no segment from their documents, marking them incomplete; returns paths."""
    marked = []
    for path, missing in dangling.items():
        raw = txn.get("documents", path)
        if raw is not None:
            _mark_incomplete(txn, path, load_record(raw), set(missing))
            marked.append(path)
    return marked


def _mark_incomplete(txn: Txn, name: str, d: dict[str, Any], gone: set[str]) -> str:
    drop_listed(d, gone)  # their sources go with them
    d["incomplete"] = True
    txn.put("documents", name, dump_json(d))
    return str(d.get("path", name))


def _unused(txn: Txn, candidates: set[str]) -> set[str]:
    """The candidate segment keys no document (in this transaction's view) lists."""
    for _, d in _documents(txn):
        candidates.difference_update(d.get("segment_keys", []))
    return candidates


def replace_document(
    txn: Txn, doc: DocumentRecord, keep: Collection[str] = frozenset()
) -> tuple[list[str], list[SegmentRecord]]:
    """Store ``doc``; drop segments only its previous version used, none in ``keep``. Returns (dropped keys,
    records whose payloads go)."""
    old = txn.get("documents", doc.path)
    txn.put("documents", doc.path, doc.to_json().encode())
    stale = set(load_record(old).get("segment_keys", [])) if old is not None else set()
    stale.difference_update(doc.segment_keys)
    stale.difference_update(keep)
    if stale:
        stale = _unused(txn, stale)
    _, gone = drop_segments(txn, stale, mark_documents=False)
    return sorted(stale), gone


def remove_documents(txn: Txn, paths: Sequence[str]) -> tuple[list[str], list[SegmentRecord]]:
    """Forget documents and drop the segments no remaining document uses. Returns (removed paths, records whose
    payloads go)."""
    removed: list[str] = []
    candidates: set[str] = set()
    for p in dict.fromkeys(paths):
        raw = txn.get("documents", p)
        if raw is None:
            continue
        d = load_record(raw)
        removed.append(d.get("path", p))
        candidates.update(d.get("segment_keys", []))
        txn.delete("documents", p)
    _, gone = drop_segments(txn, _unused(txn, candidates), mark_documents=False)
    return removed, gone


# ──────────────────────────────────────────── payloads against their records


def decode_checked(record: SegmentRecord, layer: int, data: bytes, lazy: bool = False) -> LayerKV:
    """Decode one layer's payload and check it matches the record's shape and dtype.

    ``lazy``: lossy codecs return :class:`~kvblend.archive.quant.Quantized`
    codes (same ``shape``/``dtype``) for the loader to dequantize in place.
    """
    if record.codec not in CODECS:  # written by a newer kvblend: unreadable here, so recompute
        raise CorruptBlobError(
            f"segment {record.key} uses codec {record.codec!r}, unknown to this kvblend", record.key, layer
        )
    try:
        k, v = decode_layer(data, record.codec, lazy)
    except CorruptBlobError as e:
        raise CorruptBlobError(f"segment {record.key} layer {layer}: {e}", record.key, layer) from None
    want = (record.kv_heads, record.n_tokens, record.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want or dtype_name(k.dtype) != record.dtype:
        raise CorruptBlobError(
            f"segment {record.key} layer {layer}: payload is {tuple(k.shape)} {k.dtype}, "
            f"record says {want} {record.dtype}",
            record.key,
            layer,
        )
    return k, v


def _encoded(layers: Sequence[LayerKV], codec: str, level: int, about: dict[str, Any]) -> Iterator[bytes]:
    """Each layer's payload, encoded as the store consumes it (layer 0 also describes its segment)."""
    for i, (k, v) in enumerate(layers):
        yield encode_layer(k, v, codec, level, segment=about if i == 0 else None)


# ──────────────────────────────────────────── the core over one store


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
    encoding: str = ""  # a plain-text file's encoding when not UTF-8 ("cp1252", ...); else ""
    # segments were dropped from its list (evicted by gc, or damaged and repaired): ingest it again to restore them
    incomplete: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ArchiveCore:
    """Segments, documents, side tables and lookups over one :class:`Store`, by the rules above.

    Writes that create or delete payloads or documents run under the store's writer; index-only updates
    (``touch``, side tables, embeddings) take none, so a query never fails because an ingest is running.
    """

    def __init__(self, store: Store, asked: Model = Model(), model: Model = Model()):
        self.store = store
        self.model = model  # the model the archive records (None fields: not bound yet)
        self._asked = asked  # the model this process writes with; recorded by the first segment commit

    @property
    def readonly(self) -> bool:
        return self.store.readonly

    @property
    def model_name(self) -> str | None:
        return self.model.name

    @property
    def model_fingerprint(self) -> str | None:
        return self.model.fingerprint

    @property
    def format_version(self) -> int:
        return FORMAT_VERSION

    # ── the writer ──
    @contextmanager
    def writer(self, wait: bool | float = False) -> Iterator[Any]:
        """Hold the archive's exclusive writer for the block (re-entrant). ``wait``: False fails at once if another
        process writes (ArchiveBusyError naming it), True blocks, a number waits that many seconds. Payload-writing
        calls made outside this take it themselves for the call, without waiting."""
        with self.store.writer(wait):
            yield self

    @property
    def holds_writer(self) -> bool:
        return self.store.holds_writer

    def ensure_writer(self) -> AbstractContextManager[object]:
        return self.store.ensure_writer()

    def _commit(self, edit: Callable[[Txn], tuple[T, list[SegmentRecord]]]) -> T:
        """Run an edit returning (result, records whose payloads it unreferenced); delete those payloads only
        after the commit: if it fails they stay for gc, since deleting them could race a commit that landed."""
        result, gone = self.store.write(edit)
        self.store.delete_payloads(gone)
        return result

    # ── segments ──
    def get_segment(self, key: str) -> SegmentRecord | None:
        raw = self.store.get("segments", key)
        return None if raw is None else SegmentRecord.from_json(raw)

    def has_segment(self, key: str) -> bool:
        return self.store.get("segments", key) is not None

    def segment_settings(self, keys: Sequence[str]) -> list[tuple[str, dict[str, Any]] | None]:
        """Each segment's (codec, extra), None where it is gone: what decides whether its KV is the one asked
        for, read without building the whole record (its 30 layer entries cost 4x the JSON parse)."""
        out: list[tuple[str, dict[str, Any]] | None] = []
        for raw in self.store.get_many("segments", keys) if keys else []:
            d = None if raw is None else load_record(raw)
            if not isinstance(d, dict):
                out.append(None)
            else:
                extra = d.get("extra")
                out.append((str(d.get("codec", "")), extra if isinstance(extra, dict) else {}))
        return out

    def iter_segments(self) -> Iterator[SegmentRecord]:
        """Every segment record, in key order, read in batches."""
        for _, raw in self.store.scan("segments"):
            yield SegmentRecord.from_json(raw)

    def count_segments(self) -> int:
        return self.store.count("segments")

    def find_segment(self, name: str) -> SegmentRecord:
        """A segment by its key or a unique key prefix of at least SEGMENT_PREFIX_MIN characters.

        NotFoundError when none matches (a server answers 404), UsageError when the prefix is ambiguous.
        """
        rec = self.get_segment(name) if name else None
        if rec is None and len(name) >= SEGMENT_PREFIX_MIN:
            matches = [r for r in self.iter_segments() if r.key.startswith(name)]
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
        once (first wins). The model is re-checked, and recorded if none is, in that commit."""
        codec = check_codec(codec)
        vectors: dict[str, Any] = dict(embeddings or {})
        with self.store.ensure_writer():
            model = Model(self.model.name or self._asked.name, self.model.fingerprint or self._asked.fingerprint)
            staged: list[tuple[SegmentRecord, Iterator[bytes]]] = []
            seen: set[str] = set()
            for record, layers in items:
                if record.key in seen:
                    continue
                seen.add(record.key)
                rec = describe(record, layers, codec)
                staged.append((rec, _encoded(layers, codec, level, blob_metadata(rec, model, vectors.get(rec.key)))))
            self.store.put_payloads(staged)
            records = [rec for rec, _ in staged]

            def edit(txn: Txn) -> tuple[Model, list[SegmentRecord]]:
                bound = stamp(txn, self.store, self._asked)
                return bound, commit_segments(txn, records, vectors)

            self.model = self._commit(edit)
            return records

    def read_layer_raw(self, key_or_record: str | SegmentRecord, layer: int) -> bytes:
        """Layer ``layer``'s payload, checksum-verified but still encoded (one read). Raises CorruptBlobError."""
        got = self.store.read_payloads([self._record(key_or_record, layer)], layer)[0]
        if isinstance(got, CorruptBlobError):
            raise got
        return got

    def read_layers_raw(self, records: Sequence[SegmentRecord], layer: int) -> list[bytes | CorruptBlobError]:
        """Layer ``layer`` of several segments in one go (a loader's fetch): each payload, or that segment's error."""
        for rec in records:
            self._record(rec, layer)
        return self.store.read_payloads(records, layer)

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
        return self.decode(rec, layer, self.read_layer_raw(rec, layer))

    def _record(self, key_or_record: str | SegmentRecord, layer: int) -> SegmentRecord:
        if isinstance(key_or_record, SegmentRecord):
            rec = key_or_record
        else:
            found = self.get_segment(key_or_record)
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

    def release(self, keys: Sequence[str]) -> None:
        """Give up claims this process holds (its segments are stored, or it stopped before storing them)."""
        self.store.release(list(keys))

    def payload_intact(self, rec: SegmentRecord) -> bool:
        """A cheap pre-flight (no read): False when the segment's payload is surely missing or short."""
        return self.store.payload_intact(rec)

    def touch(self, keys: Iterable[str]) -> int:
        """Record a use of these segments (last access now, one more hit); returns how many were found.

        Never fails the caller: a read-only archive or a store error is 0 touched, because usage statistics
        must not break a query.
        """
        wanted = list(dict.fromkeys(keys))
        if self.readonly or not wanted:
            return 0
        try:
            return self.store.touch(wanted)
        except ArchiveError:
            return 0

    def drop_segments(self, keys: Iterable[str]) -> list[str]:
        """Delete segments (records, embeddings, payloads); documents that listed one lose it and are marked
        incomplete. Returns those documents' paths."""
        drop = sorted(set(keys))
        if not drop:
            return []
        with self.store.ensure_writer(), self.store.freeing():
            return self._commit(lambda txn: drop_segments(txn, drop))

    def strip_dangling(self, dangling: dict[str, list[str]]) -> list[str]:
        """Remove keys that name no segment from their documents, marking them incomplete; returns paths."""
        with self.store.ensure_writer(), self.store.freeing():
            return self.store.write(lambda txn: strip_dangling(txn, dangling))

    # ── documents ──
    def put_document(self, doc: DocumentRecord) -> DocumentRecord:
        """Store (or replace) a document record; its path is made absolute."""
        doc = _absolute(doc)
        with self.store.ensure_writer():
            self.store.write(lambda txn: txn.put("documents", doc.path, doc.to_json().encode()))
        return doc

    def replace_document(self, doc: DocumentRecord, keep: Collection[str] = frozenset()) -> list[str]:
        """Store ``doc`` and delete segments only its previous version used; returns their keys.

        For re-ingesting a changed file: chunks that changed get new keys, and the old ones would otherwise stay
        in the archive unreferenced. ``keep``: segments that documents not committed yet will list (an ingest
        found them stored and reused them), which no document lists *yet*.
        """
        doc = _absolute(doc)
        with self.store.ensure_writer():
            return self._commit(lambda txn: replace_document(txn, doc, keep))

    def get_document(self, path: str | os.PathLike[str]) -> DocumentRecord | None:
        raw = self.store.get("documents", os.path.abspath(path))
        return None if raw is None else DocumentRecord.from_json(raw)

    def iter_documents(self) -> Iterator[DocumentRecord]:
        for _, raw in self.store.scan("documents"):
            yield DocumentRecord.from_json(raw)

    def count_documents(self) -> int:
        return self.store.count("documents")

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
        if len(matches) > 1:  # named by their paths: two files of one name differ only there
            shown = ", ".join(sorted(d.path for d in matches)[:3]) + (" ..." if len(matches) > 3 else "")
            raise UsageError(f"document name {name} is ambiguous ({len(matches)} documents end with it: {shown})")
        if not matches:
            raise NotFoundError(f"no such document in the archive: {name} (see `kvblend ls`)")
        return matches[0]

    def find_documents(self, name: str) -> list[DocumentRecord]:
        """:meth:`find_document`'s document, else every document read out of the file or folder ``name`` names:
        a JSONL or JSON file's records (``facts.jsonl#L3``), an archive's members (``bundle.zip/a.md``), a folder's
        files (by path, or by the name they were ingested under)."""
        try:
            return [self.find_document(name)]
        except NotFoundError:
            absolute = os.path.abspath(os.path.expanduser(name))
            docs = list(self.iter_documents())
            inside = [d for d in docs if d.path.startswith((absolute + "#", absolute + "/"))]
            if not inside and (relative := name.rstrip("/")):  # by the names they were ingested under
                inside = [d for d in docs if d.display_name.startswith((relative + "#", relative + "/"))]
                roots = {d.path[: len(d.path) - len(d.display_name)] for d in inside}
                if len(roots) > 1:  # the same folder name under two ingests: `rm` must not take both
                    shown = ", ".join(sorted(r + relative for r in roots)[:3])
                    raise UsageError(f"{name} is ambiguous ({len(roots)} ingested folders or files: {shown})") from None
                if roots:  # that folder, whole: files of it named otherwise (a run's shared names) are in it too
                    folder = next(iter(roots)) + relative
                    inside = [d for d in docs if d.path.startswith((folder + "#", folder + "/"))]
            if not inside:
                raise
            return sorted(inside, key=lambda d: d.path)

    def document_summaries(self) -> list[DocumentSummary]:
        """Every document as `ls` shows it, counting the segments it lists that are gone."""
        out = []
        for doc in self.iter_documents():
            raws = self.store.get_many("segments", doc.segment_keys) if doc.segment_keys else []
            present = [SegmentRecord.from_json(raw) for raw in raws if raw is not None]
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
                    encoding=doc.encoding,
                    incomplete=bool(doc.incomplete),
                )
            )
        return out

    def remove_documents(self, paths: Iterable[str | os.PathLike[str]]) -> list[str]:
        """Forget documents and delete the segments no remaining document uses; returns the removed paths.

        Index first, payloads after: a crash in between leaves orphans, never a record without its payload.
        """
        wanted = [os.path.abspath(p) for p in paths]
        with self.store.ensure_writer(), self.store.freeing():
            return self._commit(lambda txn: remove_documents(txn, wanted))

    # ── side tables ──
    def get_meta(self, name: str, default: Any = None) -> Any:
        value = self._get_json("meta", name)
        return default if value is None else value

    def set_meta(self, name: str, value: Any) -> None:
        """Store a JSON value under ``name`` (``format_version`` is reserved)."""
        if name == "format_version":
            raise ArchiveError(f"meta entry {name!r} is managed by the archive")
        self._put_json("meta", name, value)

    def put_profile(self, name: str, profile: dict[str, Any]) -> None:
        """Store a measured device/storage profile (see `kvblend profile`)."""
        self._put_json("profiles", name, profile)

    def get_profile(self, name: str) -> dict[str, Any] | None:
        return self._get_json("profiles", name)

    def iter_profiles(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for name, raw in self.store.scan("profiles"):
            yield name, load_json(raw)

    def put_tuned(self, name: str, settings: dict[str, Any]) -> None:
        """Store tuned settings (ratio etc.) for a model/device/storage combination."""
        self._put_json("tuned", name, settings)

    def get_tuned(self, name: str) -> dict[str, Any] | None:
        return self._get_json("tuned", name)

    def _get_json(self, table: str, name: str) -> Any:
        return load_json(self.store.get(table, name))

    def _put_json(self, table: str, name: str, value: Any) -> None:
        data = dump_json(value)
        self.store.write(lambda txn: txn.put(table, name, data))

    # ── embeddings ──
    def put_embeddings(
        self,
        keys: Iterable[str] | Iterable[tuple[str, np.ndarray]],
        vectors: np.ndarray | Sequence[np.ndarray] | None = None,
    ) -> None:
        """Store retrieval embeddings, deleted with their segments.

        ``put_embeddings(keys, matrix)`` (row i belongs to keys[i]) or ``put_embeddings([(key, vector), ...])``.
        """
        pairs = list(keys) if vectors is None else list(zip(list(keys), vectors, strict=True))
        rows = [(str(k), embedding_bytes(v)) for k, v in pairs]
        self.store.write(lambda txn: [txn.put("embeddings", k, data) for k, data in rows])

    def has_embedding(self, key: str) -> bool:
        return self.store.get("embeddings", key) is not None

    def get_embeddings(self, keys: Iterable[str] | None = None) -> tuple[list[str], np.ndarray]:
        """(keys, matrix [n, dim] float32) for the given keys that have one, or for all when None."""
        if keys is None:
            return embedding_matrix(list(self.store.scan("embeddings")))
        wanted = list(keys)
        got = self.store.get_many("embeddings", wanted) if wanted else []
        return embedding_matrix([(k, v) for k, v in zip(wanted, got) if v is not None])

    def size_bytes(self, include_index: bool = True) -> int:
        return self.store.size_bytes(include_index=include_index)


def _absolute(doc: DocumentRecord) -> DocumentRecord:
    return dataclasses.replace(doc, path=os.path.abspath(doc.path), ingested=doc.ingested or time.time())
