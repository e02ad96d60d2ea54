"""Side tables of the index: JSON values under short names, and retrieval embeddings.

``meta``, ``profiles`` and ``tuned`` hold small JSON objects (the archive's
identity, measured device profiles, tuned settings; their callers version the
objects they store). ``embeddings`` holds one float32 vector per segment key.
None of them needs the writer lock: LMDB serializes these small transactions,
and a query must not fail because an ingest is running.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import lmdb
import numpy as np

from kvblend.archive.index import Index
from kvblend.archive.records import load_record, name_db_key
from kvblend.errors import ArchiveError

T = TypeVar("T")
Write = Callable[[Callable[[lmdb.Transaction], T]], T]  # runs fn in one write transaction


def dump_json(value: Any) -> bytes:
    """Compact UTF-8 JSON, as every index record is stored."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def load_json(raw: bytes | None) -> Any:
    return None if raw is None else load_record(raw, "index value")


class JsonStore:
    """One table of JSON values keyed by short names."""

    def __init__(self, index: Index, table: str, write: Write):
        self.index, self.table, self._write = index, table, write

    def get(self, name: str, default: Any = None) -> Any:
        raw = self.index.get(self.table, name_db_key(name, self.table))
        return default if raw is None else load_json(raw)

    def put(self, name: str, value: Any) -> None:
        kb, data = name_db_key(name, self.table), dump_json(value)
        self._write(lambda txn: txn.put(kb, data, db=self.index.dbs[self.table]))

    def items(self) -> Iterator[tuple[str, Any]]:
        for k, raw in self.index.items(self.table):
            yield k.decode(), load_json(raw)


class EmbeddingStore:
    """Retrieval embeddings, float32 little-endian raw bytes under the segment key.

    Deleted with the segment of the same key (see :func:`kvblend.archive.edits.drop_segments`).
    """

    def __init__(self, index: Index, write: Write):
        self.index, self._write = index, write

    @staticmethod
    def rows(pairs: Iterable[tuple[str, np.ndarray]]) -> list[tuple[bytes, bytes]]:
        """(db key, float32 little-endian bytes) per (segment key, vector)."""
        return [(name_db_key(k, "embedding"), np.ascontiguousarray(np.asarray(v, dtype="<f4").reshape(-1)).tobytes())
                for k, v in pairs]

    @staticmethod
    def put_rows(txn: lmdb.Transaction, dbs: dict[str, Any], rows: Sequence[tuple[bytes, bytes]]) -> None:
        """Write encoded rows inside a caller's transaction (a segment batch commits its embeddings with it)."""
        for kb, data in rows:
            txn.put(kb, data, db=dbs["embeddings"])

    def put(self, pairs: Iterable[tuple[str, np.ndarray]]) -> None:
        rows = self.rows(pairs)
        self._write(lambda txn: self.put_rows(txn, self.index.dbs, rows))

    def has(self, key: str) -> bool:
        return self.index.get("embeddings", name_db_key(key, "embedding")) is not None

    def get(self, keys: Iterable[str] | None = None) -> tuple[list[str], np.ndarray]:
        """(keys, matrix [n, dim] float32) for the given keys that have one, or for all when None."""
        if keys is None:
            rows = [(k.decode(), v) for k, v in self.index.items("embeddings")]
        else:
            wanted = [name_db_key(k, "embedding") for k in keys]
            db = self.index.dbs["embeddings"]
            got = [] if db is None else self.index.read(lambda txn: [(kb.decode(), txn.get(kb, db=db)) for kb in wanted])
            rows = [(k, v) for k, v in got if v is not None]
        if not rows:
            return [], np.zeros((0, 0), dtype=np.float32)
        if len({len(v) for _, v in rows}) != 1:
            raise ArchiveError("archive holds embeddings of different sizes; re-ingest with one embedder")
        matrix = np.frombuffer(b"".join(v for _, v in rows), dtype="<f4").reshape(len(rows), -1)
        return [k for k, _ in rows], matrix.astype(np.float32, copy=True)


class SideStores:
    """The archive's methods over its side tables (meta, embeddings, profiles, tuned).

    A mixin of :class:`kvblend.archive.facade.Archive`, which sets the four
    stores in its constructor; kept here so the facade stays about segments.
    """

    _meta: JsonStore
    _profiles: JsonStore
    _tuned: JsonStore
    _embeddings: EmbeddingStore

    def get_meta(self, name: str, default: Any = None) -> Any:
        return self._meta.get(name, default)

    def set_meta(self, name: str, value: Any) -> None:
        """Store a JSON value under ``name`` (``format_version`` is reserved)."""
        if name == "format_version":
            raise ArchiveError(f"meta entry {name!r} is managed by the archive")
        self._meta.put(name, value)

    def put_embeddings(self, keys: Iterable[str] | Iterable[tuple[str, np.ndarray]],
                       vectors: np.ndarray | Sequence[np.ndarray] | None = None) -> None:
        """Store retrieval embeddings, deleted with their segments.

        ``put_embeddings(keys, matrix)`` (row i belongs to keys[i]) or ``put_embeddings([(key, vector), ...])``.
        """
        self._embeddings.put(list(keys) if vectors is None else list(zip(list(keys), vectors, strict=True)))

    def has_embedding(self, key: str) -> bool:
        return self._embeddings.has(key)

    def get_embeddings(self, keys: Iterable[str] | None = None) -> tuple[list[str], np.ndarray]:
        """(keys, matrix [n, dim] float32) for the given keys that have one, or for all when None."""
        return self._embeddings.get(keys)

    def put_profile(self, name: str, profile: dict[str, Any]) -> None:
        """Store a measured device/storage profile (see `kvblend profile`)."""
        self._profiles.put(name, profile)

    def get_profile(self, name: str) -> dict[str, Any] | None:
        return self._profiles.get(name)

    def iter_profiles(self) -> Iterator[tuple[str, dict[str, Any]]]:
        return self._profiles.items()

    def put_tuned(self, name: str, settings: dict[str, Any]) -> None:
        """Store tuned settings (ratio etc.) for a model/device/storage combination."""
        self._tuned.put(name, settings)

    def get_tuned(self, name: str) -> dict[str, Any] | None:
        return self._tuned.get(name)
