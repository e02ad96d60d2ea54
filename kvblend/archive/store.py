"""The store interface: where an archive's records and KV payloads live.

An archive (facade.py) and its upkeep (maintenance.py) talk only to a
:class:`Store`, so no command, fusor or feed knows which one it has. Two stores
stand behind it:

    local.py        a directory: an LMDB index plus one blob file per segment (the embedded default)
    redis_store.py  a Redis server or cluster, shared by several serving nodes

What every store promises, whatever it keeps underneath:

* a segment is visible only once all its layers are stored: its record is
  written last, so a reader never sees half a segment;
* a layer comes back checksum-verified or not at all (:class:`CorruptBlobError`
  naming the segment and layer), so a damaged or evicted layer is recomputed,
  never trusted;
* an archive built with another model or format version is refused at open,
  in one line;
* records are JSON and payloads are the codec's bytes (codec.py): nothing is
  ever unpickled.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvblend.archive.records import DocumentRecord, Model, SegmentRecord, load_record
from kvblend.errors import ArchiveError, CorruptBlobError
from kvblend.types import LayerKV

#: Side tables of small JSON values under short names, besides segments, documents and embeddings.
JSON_TABLES: tuple[str, ...] = ("meta", "profiles", "tuned")


def dump_json(value: Any) -> bytes:
    """Compact UTF-8 JSON, as every record is stored."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def load_json(raw: bytes | memoryview | None) -> Any:
    return None if raw is None else load_record(raw, "index value")


def embedding_bytes(vector: Any) -> bytes:
    """A retrieval embedding as stored: float32 little-endian raw bytes."""
    return np.ascontiguousarray(np.asarray(vector, dtype="<f4").reshape(-1)).tobytes()


def embedding_matrix(rows: Sequence[tuple[str, bytes]]) -> tuple[list[str], np.ndarray]:
    """(keys, [n, dim] float32) from stored rows; one embedder per archive."""
    if not rows:
        return [], np.zeros((0, 0), dtype=np.float32)
    if len({len(v) for _, v in rows}) != 1:
        raise ArchiveError("archive holds embeddings of different sizes; re-ingest with one embedder")
    matrix = np.frombuffer(b"".join(v for _, v in rows), dtype="<f4").reshape(len(rows), -1)
    return [k for k, _ in rows], matrix.astype(np.float32, copy=True)


@dataclass(frozen=True)
class Leftover:
    """Something a store holds that no record names: a crashed write's orphan or temp file, or layers of a
    segment whose record never landed. Harmless to readers; ``gc`` deletes them."""

    name: str  # a path relative to the archive, or a key
    size: int  # bytes it occupies
    temp: bool = False  # an interrupted write's temp file (local stores only)


class Store(ABC):
    """Records, payloads and side tables of one archive, as one store keeps them."""

    location: str  # for messages: a directory, or a URL without its password
    readonly: bool
    model: Model  # the model the store records (None fields: not bound yet)

    # ── life ──
    @abstractmethod
    def close(self) -> None:
        """Release what the store holds (locks, descriptors, connections). Idempotent."""

    @property
    def kind(self) -> str:
        """ "local" or "redis": what `stats` and `path` show."""
        return "local"

    # ── writing ──
    def writer(self, wait: bool | float = False) -> AbstractContextManager[object]:
        """The store's exclusive writer for a block (re-entrant). Stores whose writes are safe
        from any number of writers at once (each record lands atomically) need none."""
        self.check_writable()
        return nullcontext()

    @property
    def holds_writer(self) -> bool:
        return False

    def ensure_writer(self) -> AbstractContextManager[object]:
        """Run under the writer: reuse ours if held, else take it (no waiting) for the call."""
        return nullcontext() if self.holds_writer else self.writer(wait=False)

    def check_writable(self) -> None:
        if self.readonly:
            raise ArchiveError("archive was opened read-only; cannot write to it")

    # ── segments ──
    @abstractmethod
    def get_segment(self, key: str) -> SegmentRecord | None: ...

    def has_segment(self, key: str) -> bool:
        return self.get_segment(key) is not None

    @abstractmethod
    def iter_segments(self) -> Iterator[SegmentRecord]: ...

    @abstractmethod
    def count_segments(self) -> int: ...

    @abstractmethod
    def put_segments(
        self,
        items: Sequence[tuple[SegmentRecord, Sequence[LayerKV]]],
        codec: str,
        level: int,
        embeddings: dict[str, Any] | None,
        asked: Model,
    ) -> list[SegmentRecord]:
        """Encode and store every layer of each segment, then commit their records (and embeddings):
        a record only once its layers are all stored. Repeated keys are stored once (first wins); the
        model `asked` is checked against the recorded one and recorded if none is. Returns the records."""

    @abstractmethod
    def read_layer_raw(self, rec: SegmentRecord, layer: int) -> bytes:
        """One layer's payload, checksum-verified but still encoded; CorruptBlobError(key, layer) if it is
        missing, short or damaged."""

    def read_layers_raw(self, recs: Sequence[SegmentRecord], layer: int) -> list[bytes | CorruptBlobError]:
        """Layer `layer` of several segments at once (a loader's one fetch per layer): each payload, or the
        error for that segment. Stores that pay a round trip per read batch them."""
        out: list[bytes | CorruptBlobError] = []
        for rec in recs:
            try:
                out.append(self.read_layer_raw(rec, layer))
            except CorruptBlobError as exc:
                out.append(exc)
        return out

    def payload_intact(self, rec: SegmentRecord) -> bool:
        """A cheap pre-flight before a query streams the segment (no payload read): False when its payload is
        surely missing or short. Stores where asking costs a round trip answer True and let the read tell."""
        return True

    def claim(self, keys: Sequence[str]) -> list[str]:
        """Of `keys` about to be prefilled, those this process should compute; the others another writer is
        computing now (a shared store), so waiting for them stores each segment once. A store with one writer
        at a time hands back all of them."""
        return list(keys)

    def lost_segments(self) -> list[str]:
        """Segments the store lists whose record is gone (a cache evicted it); `verify` names them."""
        return []

    @abstractmethod
    def touch(self, keys: Sequence[str]) -> int:
        """Record a use (last access now, one more hit); never fails the caller. Returns how many were found."""

    @abstractmethod
    def drop_segments(self, keys: Iterable[str]) -> list[str]:
        """Delete segments (records, embeddings, payloads); documents that listed one lose it and are
        marked incomplete. Returns those documents' paths."""

    # ── documents ──
    @abstractmethod
    def get_document(self, path: str) -> DocumentRecord | None: ...

    @abstractmethod
    def iter_documents(self) -> Iterator[DocumentRecord]: ...

    @abstractmethod
    def count_documents(self) -> int: ...

    @abstractmethod
    def put_document(self, doc: DocumentRecord) -> None: ...

    @abstractmethod
    def replace_document(self, doc: DocumentRecord, keep: Collection[str] = frozenset()) -> list[str]:
        """Store `doc`, dropping segments only its previous version used, but none in `keep` (segments a
        document not yet committed relies on); returns their keys."""

    @abstractmethod
    def remove_documents(self, paths: Sequence[str]) -> list[str]:
        """Forget documents and drop the segments no remaining document uses; returns the paths removed."""

    @abstractmethod
    def strip_dangling(self, dangling: dict[str, list[str]]) -> list[str]:
        """Remove keys that name no segment from their documents, marking them incomplete; returns paths."""

    # ── side tables ──
    @abstractmethod
    def get_json(self, table: str, name: str) -> Any: ...

    @abstractmethod
    def put_json(self, table: str, name: str, value: Any) -> None: ...

    @abstractmethod
    def json_items(self, table: str) -> Iterator[tuple[str, Any]]: ...

    @abstractmethod
    def put_embeddings(self, pairs: Sequence[tuple[str, Any]]) -> None: ...

    @abstractmethod
    def has_embedding(self, key: str) -> bool: ...

    @abstractmethod
    def get_embeddings(self, keys: Iterable[str] | None = None) -> tuple[list[str], np.ndarray]:
        """(keys, [n, dim] float32) for the given keys that have one, or for every segment when None."""

    # ── upkeep ──
    @abstractmethod
    def leftovers(self) -> list[Leftover]:
        """What no record names (crashed writes' orphans and temp files, or layers without a record)."""

    @abstractmethod
    def delete_leftovers(self, leftovers: Sequence[Leftover]) -> int:
        """Delete them (under the writer); returns the bytes freed."""

    @abstractmethod
    def segment_bytes(self, rec: SegmentRecord) -> int:
        """Bytes this segment occupies in the store (what `gc --max-size` counts)."""

    def structure_problems(self) -> list[str]:
        """Damage to the store's own structures that reading every record would not show (an LMDB page a
        write would touch); each is one line. None by default."""
        return []

    def after_gc(self, dry_run: bool = False) -> list[str]:
        """Store-specific upkeep after `gc` (e.g. document manifests of no document); returns what it deleted
        (with ``dry_run``, would delete)."""
        return []

    @abstractmethod
    def usage(self) -> dict[str, Any]:
        """Store-specific numbers for `stats` (index bytes on disk, or Redis memory)."""

    @abstractmethod
    def size_bytes(self, include_index: bool = True) -> int:
        """Everything the archive occupies (payloads, and by default the index)."""
