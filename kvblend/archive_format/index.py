"""The archive index: small JSON records in an LMDB environment.

The index holds only metadata (a few KB per segment); KV payloads live in
blob files (see :mod:`kvblend.archive_format.blobs`). Keeping LMDB small keeps
its copy-on-write B-tree cheap to commit and its map easy to grow.

Records are JSON so the format is inspectable (``python -m lmdb``) and never
needs pickle. Readers ignore fields they do not know, so format v1 may gain
optional fields without a version bump (see FORMAT.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from kvblend.errors import ArchiveError

T = TypeVar("T")

#: Named sub-databases of the LMDB environment under ``index/``.
DB_NAMES: tuple[str, ...] = ("meta", "segments", "documents", "embeddings", "profiles", "tuned")

DEFAULT_MAP_SIZE = 1 << 30  # 1 GiB; sparse on Linux, grown by doubling on MapFullError
_LMDB_KEY_LIMIT = 480  # LMDB's default max key size is 511 bytes; keep a margin


def checksum(data: bytes) -> str:
    """Checksum of one stored payload: CRC-32 (zlib), 8 hex digits.

    It guards against torn writes and bit rot, not against an adversary, and it
    runs on every layer of every query: zlib's CRC-32 checks ~3 GB/s per core
    where BLAKE2b managed ~0.6 GB/s, which on a 2-core host was ~3% of a
    blended query's time stolen from the fusor.
    """
    return f"{zlib.crc32(data):08x}"


def _from_dict(cls: type[T], d: dict[str, Any]) -> T:
    """Build a dataclass from a dict, ignoring unknown keys (forward-compatible reads)."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class LayerEntry:
    """Where layer i of a segment lies in its blob: one contiguous (offset, length) read."""

    offset: int
    length: int
    checksum: str  # CRC-32 (8 hex digits) of the compressed payload bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SegmentRecord:
    """Index record of one cached segment (a chunk's KV, every layer)."""

    key: str
    n_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    dtype: str = ""
    codec: str = ""
    n_layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    base_position: int = 0  # position of the first token when the KV was prefilled
    layers: list[LayerEntry] = field(default_factory=list)
    blob: str = ""  # path of the blob file, relative to the archive root
    created: float = 0.0
    last_access: float = 0.0
    hits: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [layer.to_dict() if isinstance(layer, LayerEntry) else dict(layer) for layer in self.layers]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SegmentRecord:
        rec = _from_dict(cls, d)
        rec.layers = [_from_dict(LayerEntry, x) for x in d.get("layers", [])]
        return rec

    @classmethod
    def from_json(cls, data: str | bytes) -> SegmentRecord:
        return cls.from_dict(json.loads(data))

    @property
    def stored_bytes(self) -> int:
        """Compressed bytes of all layers."""
        return sum(layer.length for layer in self.layers)

    @property
    def raw_bytes(self) -> int:
        """Size of this segment's KV as fp16 (K and V, every layer): the uncompressed reference."""
        return 2 * 2 * self.n_layers * self.kv_heads * self.head_dim * self.n_tokens


@dataclass
class DocumentRecord:
    """Index record of one ingested document: its segments in order."""

    path: str  # absolute path
    content_hash: str = ""
    segment_keys: list[str] = field(default_factory=list)
    n_tokens: int = 0
    ingested: float = 0.0
    size: int = 0  # bytes of the source file
    mtime: float = 0.0  # source file mtime at ingest, lets ingest skip unchanged files cheaply
    incomplete: bool = False  # some segments were dropped (evicted or corrupt): re-ingest to restore
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DocumentRecord:
        return _from_dict(cls, d)

    @classmethod
    def from_json(cls, data: str | bytes) -> DocumentRecord:
        return cls.from_dict(json.loads(data))


def document_db_key(path: str) -> bytes:
    """LMDB key of a document: its path, or a hash of it when the path exceeds LMDB's key limit."""
    raw = path.encode("utf-8", "surrogateescape")
    if len(raw) <= _LMDB_KEY_LIMIT:
        return raw
    return b"#blake2b:" + hashlib.blake2b(raw, digest_size=32).hexdigest().encode()


def name_db_key(name: str, what: str) -> bytes:
    """LMDB key of a short name (segment key, profile, meta entry); long names are a usage error."""
    raw = name.encode("utf-8")
    if not raw or len(raw) > _LMDB_KEY_LIMIT:
        raise ArchiveError(f"{what} name must be 1-{_LMDB_KEY_LIMIT} bytes, got {len(raw)}")
    return raw


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
    """

    def __init__(self, path: Path, *, readonly: bool = False, map_size: int = DEFAULT_MAP_SIZE):
        self.path = path
        self.readonly = readonly
        self._rw = _SharedExclusiveLock()
        try:
            self.env = lmdb.open(str(path), map_size=map_size, subdir=True, readonly=readonly,
                                 create=not readonly, max_dbs=len(DB_NAMES) + 2, readahead=False,
                                 meminit=False, lock=True)
        except lmdb.Error as e:
            raise ArchiveError(f"cannot open archive index {path}: {_lmdb_reason(e)}") from None
        self.dbs: dict[str, Any] = {}
        self._refs = 1
        self._registry_key = ""

    def peek_meta(self, key: str) -> bytes | None:
        """Read a ``meta`` entry before the other tables are opened (or created).

        Opening checks the format version with this first, so a newer archive
        is refused before this process creates or touches anything in it.
        """
        try:
            db = self._open_existing(b"meta")
        except lmdb.NotFoundError:
            return None
        return self.read(lambda txn: txn.get(key.encode(), db=db))

    def _open_existing(self, name: bytes) -> Any:
        # No txn argument: py-lmdb then commits its own short transaction, which keeps the
        # handle valid (a handle opened inside a `with env.begin()` read block is not).
        while True:
            try:
                with self._rw.shared():
                    return self.env.open_db(name, create=False)
            except lmdb.MapResizedError:
                self._adopt_resize()

    def open_dbs(self) -> None:
        """Open every named table, creating missing ones unless read-only."""
        if self.readonly:
            for name in DB_NAMES:
                try:
                    self.dbs[name] = self._open_existing(name.encode())
                except lmdb.NotFoundError:
                    raise ArchiveError(f"archive index {self.path} lacks table {name!r}; "
                                       "open it once without read-only to upgrade it") from None
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
                        return fn(txn)
            except lmdb.MapFullError:
                self._grow()
            except lmdb.MapResizedError:
                self._adopt_resize()
            except lmdb.Error as e:  # e.g. ENOSPC while data.mdb grows: the transaction was aborted
                raise ArchiveError(f"index write failed, nothing was committed ({e}); "
                                   f"free space or check {self.path}") from None

    def read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in a read transaction (a consistent snapshot); results must be copied out."""
        while True:
            try:
                with self._rw.shared():
                    with self.env.begin(write=False, buffers=False) as txn:
                        return fn(txn)
            except lmdb.MapResizedError:
                self._adopt_resize()

    def get(self, db: str, key: bytes) -> bytes | None:
        return self.read(lambda txn: txn.get(key, db=self.dbs[db]))

    def count(self, db: str) -> int:
        return int(self.read(lambda txn: txn.stat(self.dbs[db])["entries"]))

    def items(self, db: str, batch: int = 256) -> Iterator[tuple[bytes, bytes]]:
        """All (key, value) pairs of a sub-db in key order, read ``batch`` at a time.

        Not one snapshot: records written meanwhile may or may not appear. That
        is what listing commands want, and it never holds a transaction open
        while the caller works (which would block map growth).
        """
        after: bytes | None = None
        while True:
            def chunk(txn: lmdb.Transaction) -> list[tuple[bytes, bytes]]:
                cur = txn.cursor(db=self.dbs[db])
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


def open_index(path: Path, *, readonly: bool = False, map_size: int = DEFAULT_MAP_SIZE) -> Index:
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
                raise ArchiveError(f"archive index {path} is already open read-only in this process; "
                                   "close it before opening it for writing")
            index._refs += 1
            return index
        index = Index(path, readonly=readonly, map_size=map_size)
        index._registry_key = key
        _OPEN[key] = index
        return index


def _lmdb_reason(e: lmdb.Error) -> str:
    """One line for an LMDB error (its text may end with the raw errno description)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
