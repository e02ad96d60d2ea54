"""The store interface: the narrow, byte-level layer under an archive.

A store keeps bytes and knows nothing of what they mean. Everything an archive
*is* (which record names which payload, documents and the segments they share,
the format version and the model binding, lookups by name) is core.py's,
written once over this interface, so every store obeys the same rules. A store
offers only:

* records: small values in named tables (:data:`TABLES`), read by name or
  scanned, and written in a transaction (:class:`Txn`);
* payloads: each segment's per-layer KV bytes, stored before the record that
  names them, read back checksum-verified, deleted after that record is gone;
* the writer lock, use counts (``touch``), and what no record names
  (``leftovers``), with the numbers ``stats`` shows.

Two stores stand behind it:

    local.py        a directory: an LMDB index plus one blob file per segment (the embedded default)
    redis_store.py  a Redis server or cluster, shared by several serving nodes

A few things only some stores can do are optional methods with a neutral
default (``claim``, ``payload_intact``, ``lost_segments``,
``structure_problems``, ``after_gc``, ``measure_reads``), so no caller ever
asks which store it has.

What every store promises, whatever it keeps underneath:

* a payload read comes back checksum-verified or not at all
  (:class:`CorruptBlobError` naming the segment and layer), so a damaged or
  evicted layer is recomputed, never trusted;
* a transaction's steps land in order (LMDB: all at once; Redis: one by one),
  so a record written after its payloads is never seen without them;
* records are JSON and payloads are the codec's bytes (codec.py): nothing is
  ever unpickled.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvblend.archive.records import SegmentRecord, load_record
from kvblend.errors import ArchiveDamagedError, ArchiveError, CorruptBlobError

if TYPE_CHECKING:
    import numpy as np

T = TypeVar("T")

#: Every table a store keeps: segment and document records, retrieval embeddings (raw float32, not JSON), and
#: side tables of small JSON values (:data:`JSON_TABLES`).
TABLES: tuple[str, ...] = ("meta", "segments", "documents", "embeddings", "profiles", "tuned")
JSON_TABLES: tuple[str, ...] = ("meta", "profiles", "tuned")


def dump_json(value: Any) -> bytes:
    """Compact UTF-8 JSON, as every record is stored."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def load_json(raw: bytes | memoryview | None) -> Any:
    return None if raw is None else load_record(raw, "index value")


def embedding_bytes(vector: Any) -> bytes:
    """A retrieval embedding as stored: float32 little-endian raw bytes."""
    import numpy as np

    return np.ascontiguousarray(np.asarray(vector, dtype="<f4").reshape(-1)).tobytes()


def embedding_matrix(rows: Sequence[tuple[str, bytes]]) -> tuple[list[str], np.ndarray]:
    """(keys, [n, dim] float32) from stored rows; one embedder per archive."""
    import numpy as np

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


class Txn(ABC):
    """One write transaction over a store's tables; ``name`` is a segment key, a document path, an entry name.

    Rules run inside it as plain functions of a Txn, so they are written once; a store may run the function
    again from scratch (LMDB, after growing a full map), so it must only read and write through the Txn.
    """

    @abstractmethod
    def get(self, table: str, name: str) -> bytes | None: ...

    def get_many(self, table: str, names: Sequence[str]) -> list[bytes | None]:
        """:meth:`get` of several names (a store that pays a round trip per read batches them)."""
        return [self.get(table, name) for name in names]

    @abstractmethod
    def put(self, table: str, name: str, value: bytes) -> None: ...

    @abstractmethod
    def put_new(self, table: str, name: str, value: bytes) -> bool:
        """Write only if nothing is stored under ``name``; whether it wrote (of two writers binding an
        archive at once, one wins)."""

    @abstractmethod
    def delete(self, table: str, name: str) -> None:
        """Delete ``name`` if present (absent is not an error)."""

    @abstractmethod
    def scan(self, table: str) -> Iterator[tuple[str, bytes]]:
        """Every (name, value) of a table as this transaction sees it."""


class Store(ABC):
    """Records and payloads of one archive, as one store keeps them (see the module docstring)."""

    location: str  # for messages: a directory, or a URL without its password
    readonly: bool

    @property
    def kind(self) -> str:
        """ "local" or "redis": what `stats` and `path` show."""
        return "local"

    @abstractmethod
    def close(self) -> None:
        """Release what the store holds (locks, descriptors, connections). Idempotent."""

    # ── records ──
    @abstractmethod
    def get_many(self, table: str, names: Sequence[str]) -> list[bytes | None]:
        """The values stored under ``names`` (None where absent), in one read where the store can."""

    def get(self, table: str, name: str) -> bytes | None:
        return self.get_many(table, [name])[0]

    @abstractmethod
    def scan(self, table: str) -> Iterator[tuple[str, bytes]]:
        """Every (name, value) of a table in name order, read in batches (records written meanwhile may or
        may not appear; no transaction is held while the caller works)."""

    def count(self, table: str) -> int:
        return sum(1 for _ in self.scan(table))

    @abstractmethod
    def write(self, edit: Callable[[Txn], T]) -> T:
        """Run ``edit`` in one write transaction and commit it; returns what ``edit`` returned."""

    @abstractmethod
    def touch(self, keys: Sequence[str]) -> int:
        """Record a use of these segments (last access now, one more hit); never fails the caller. Returns how
        many were found. A store keeps use counts its own way (in the record, or in counters beside it)."""

    # ── payloads ──
    @abstractmethod
    def put_payloads(self, staged: Sequence[tuple[SegmentRecord, Iterable[bytes]]]) -> None:
        """Store each segment's layer payloads, filling in its ``blob`` (where they live) and ``layers``
        (length and checksum of each); durable before this returns. Nothing names them until their record
        commits; on failure, what was written is removed or left for ``gc``."""

    @abstractmethod
    def read_payloads(self, recs: Sequence[SegmentRecord], layer: int) -> list[bytes | CorruptBlobError]:
        """Layer ``layer`` of each segment (a loader's one fetch per layer), checksum-verified but still
        encoded: each payload, or the error for that segment (missing, short or damaged)."""

    @abstractmethod
    def delete_payloads(self, recs: Sequence[SegmentRecord]) -> None:
        """Delete the payloads these (no longer committed) records named; never fails the caller, since what
        is left is a leftover for ``gc``."""

    # ── the writer lock ──
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

    def freeing(self) -> AbstractContextManager[object]:
        """Around an edit that frees space (gc, rm, repair): a store that keeps a disk reserve spends it."""
        return nullcontext()

    # ── upkeep ──
    @abstractmethod
    def leftovers(self) -> list[Leftover]:
        """What no record names (crashed writes' orphans and temp files, or layers without a record)."""

    @abstractmethod
    def delete_leftovers(self, leftovers: Sequence[Leftover]) -> int:
        """Delete them (under the writer); returns the bytes freed."""

    @abstractmethod
    def usage(self) -> dict[str, Any]:
        """Store-specific numbers for `stats` (index bytes on disk, or Redis memory)."""

    @abstractmethod
    def size_bytes(self, include_index: bool = True) -> int:
        """Everything the archive occupies (payloads, and by default the index)."""

    def segment_bytes(self, rec: SegmentRecord) -> int:
        """Bytes this segment occupies in the store (what `gc --max-size` counts)."""
        return rec.stored_bytes

    def damaged(self, what: str) -> ArchiveError:
        """The one-line error for damage to the store's records (a local store names its repair command)."""
        return ArchiveDamagedError(f"archive at {self.location} is damaged: {what}")

    # ── what only some stores can do (neutral defaults) ──
    def payload_intact(self, rec: SegmentRecord) -> bool:
        """A cheap pre-flight before a query streams the segment (no payload read): False when its payload is
        surely missing or short. Stores where asking costs a round trip answer True and let the read tell."""
        return True

    def claim(self, keys: Sequence[str]) -> list[str]:
        """Of `keys` about to be prefilled, those this process should compute; the others another writer is
        computing now (a shared store), so waiting for them stores each segment once. A store with one writer
        at a time hands back all of them."""
        return list(keys)

    def release(self, keys: Sequence[str]) -> None:
        """Give up this process's claims on `keys` once they are stored (or will not be): nobody waits for them.
        A store whose `claim` holds nothing has nothing to give up."""
        return None

    def lost_segments(self) -> list[str]:
        """Segments the store lists whose record is gone (a cache evicted it); `verify` names them."""
        return []

    def structure_problems(self) -> list[str]:
        """Damage to the store's own structures that reading every record would not show (an LMDB page a
        write would touch); each is one line. None by default."""
        return []

    def after_gc(self, dry_run: bool = False) -> list[str]:
        """Store-specific upkeep after `gc` (e.g. document manifests of no document); returns what it deleted
        (with ``dry_run``, would delete)."""
        return []

    def measure_reads(self, segments: Sequence[Sequence[bytes]], runs: int = 3) -> list[float] | None:
        """MB/s of reading scratch payloads back as the loader does, per run, for a store no disk probe can
        measure (a network store); None where the store is files in a directory that `kvblend profile`
        measures itself (page cache evicted, cold and warm)."""
        return None
