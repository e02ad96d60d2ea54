"""Index edits that keep segments, embeddings and documents consistent.

Each function runs inside one caller's LMDB write transaction (and so may be
rerun from scratch after the map grows: they only read and write ``txn``).
Those that drop segments return ``(result, blobs)``, the blobs being files the
dropped records named: the caller unlinks them only after the transaction
commits (``Archive.commit``), so a crash in between leaves orphans for
``gc``, never a record without its blob.

Records already in the index are updated as dicts, not dataclasses, so fields
written by a newer kvblend survive (FORMAT.md, version policy).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import lmdb

from kvblend.archive.records import DocumentRecord, SegmentRecord, document_db_key, load_record
from kvblend.archive.stores import EmbeddingStore, dump_json

Dbs = dict[str, Any]  # the index's named sub-databases


def commit_segments(txn: lmdb.Transaction, dbs: Dbs, records: list[SegmentRecord],
                    embedding_rows: Sequence[tuple[bytes, bytes]] = ()) -> tuple[list[SegmentRecord], list[str]]:
    """Write segment records (and their embeddings); returns (the records, blobs of replaced records)."""
    EmbeddingStore.put_rows(txn, dbs, embedding_rows)
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


def drop_segments(txn: lmdb.Transaction, dbs: Dbs, keys: Iterable[str],
                  mark_documents: bool = True) -> tuple[list[str], list[str]]:
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
    marked = []
    if mark_documents and drop:
        updates = []
        for kb, raw in txn.cursor(db=dbs["documents"]):
            d = load_record(raw)
            if drop.intersection(d.get("segment_keys", [])):
                updates.append((bytes(kb), d))
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
    d["segment_keys"] = [k for k in d.get("segment_keys", []) if k not in gone]
    d["incomplete"] = True
    txn.put(kb, dump_json(d), db=dbs["documents"])
    return d.get("path", kb.decode("utf-8", "replace"))


def _unused(txn: lmdb.Transaction, dbs: Dbs, candidates: set[str]) -> set[str]:
    """The candidate segment keys no document (in this transaction's view) lists."""
    for _, raw in txn.cursor(db=dbs["documents"]):
        candidates.difference_update(load_record(raw).get("segment_keys", []))
    return candidates


def replace_document(txn: lmdb.Transaction, dbs: Dbs, doc: DocumentRecord) -> tuple[list[str], list[str]]:
    """Store ``doc``; drop segments only its previous version used. Returns (dropped keys, blobs)."""
    key = document_db_key(doc.path)
    old = txn.get(key, db=dbs["documents"])
    txn.put(key, doc.to_json().encode(), db=dbs["documents"])
    stale = set(load_record(old).get("segment_keys", [])) if old is not None else set()
    stale.difference_update(doc.segment_keys)
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
