"""``kvblend verify --rebuild-index``: a new index from the blobs, for an archive whose index is lost.

Sources, most trusted first: records the old index still yields (:func:`salvage`,
kept only when they match their blob byte for byte), then what each blob says
about itself in layer 0 (records.blob_metadata), then document manifests
(blobs.py). Every blob is decompressed in full (zstd frame checksums) before
it is listed (:func:`restore_blob`): its layer entries are found again by walking
its zstd frames, and a blob with neither an old record nor a self-description
cannot be restored (its KV is useless without the token ids it came from).

The salvage walks the damaged index with plain reads (indexcheck.read_records,
never LMDB, which could be killed by the damage being repaired) and keeps every
record on a sound page, so only the records on damaged pages (and below them)
are lost; usage counts, profiles and tuned settings live only there.

Nothing is deleted. The new index is built beside the old one and swapped in
by two renames; the old one is kept as ``index.damaged-<time>/``. Blobs that
cannot be restored (written before blobs described themselves, or damaged)
move to ``lost+found/``, out of reach of ``gc``. The report names every
document that lost segments, so the user knows what to ingest again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb

from kvblend.archive.blobs import (
    BLOB_DIR,
    check_key,
    fsync_dir,
    read_manifests,
    scan_blob_dir,
    spending_reserve,
)
from kvblend.archive.codec import describe_payload, split_frames
from kvblend.archive.core import FORMAT_VERSION, check_version
from kvblend.archive.index import (
    DATA_FILE,
    DB_NAMES,
    INDEX_DIR,
    Index,
    damaged,
    has_blobs,
    index_problem,
)
from kvblend.archive.indexcheck import read_records
from kvblend.archive.local import (
    LOCK_FILE,
    WriterLock,
    archive_exists,
    embedding_rows,
    put_embedding_rows,
    writable,
)
from kvblend.archive.records import (
    DocumentRecord,
    LayerEntry,
    SegmentRecord,
    checksum,
    document_db_key,
    record_from_blob,
)
from kvblend.archive.store import dump_json
from kvblend.errors import ArchiveDamagedError, ArchiveError, CorruptBlobError

if TYPE_CHECKING:
    import numpy as np

LOST_AND_FOUND = "lost+found"


@dataclass
class RebuildReport:
    segments_restored: int = 0
    segments_from_old_index: int = 0  # of those, records the damaged index still held
    documents_restored: int = 0
    incomplete_documents: list[str] = field(default_factory=list)  # lost segments: ingest them again
    unlinked_segments: int = 0  # restored segments no restored document lists
    lost_blobs: list[str] = field(default_factory=list)  # "<relpath>: <reason>", moved to lost+found/
    unreadable_manifests: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what could not be read from the old index
    old_index: str | None = None  # where the replaced index was kept

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def rebuild_index(path: str | os.PathLike[str], wait: bool | float = False) -> RebuildReport:
    """Replace the index of the archive at ``path`` with one rebuilt from its blobs (under the writer lock)."""
    root = Path(path).expanduser().absolute()
    if not root.is_dir() or not (archive_exists(root) or has_blobs(root)):
        raise ArchiveError(f"no archive at {root} (nothing to rebuild)")
    if not writable(root):
        raise ArchiveError(f"archive directory {root} is not writable; rebuilding its index needs to write")
    report = RebuildReport()
    with WriterLock(root / LOCK_FILE).hold(wait), spending_reserve(root):
        _finish_interrupted_swap(root)
        old = salvage(root)
        report.problems = old.problems
        _refuse_newer(old, root)
        restored = _restore_segments(root, old, report)
        docs = _restore_documents(root, old, restored, report)
        fresh = _build(root, old, restored, docs)
        report.old_index = _swap(root, fresh)
        _move_lost(root, report)
    return report


def _refuse_newer(old: Salvage, root: Path) -> None:
    """A newer kvblend's archive is not ours to rebuild; a malformed version is what a rebuild repairs."""
    with contextlib.suppress(ArchiveDamagedError):
        check_version(old.tables["meta"].get(b"format_version"), partial(damaged, root))


def _restore_segments(root: Path, old: Salvage, report: RebuildReport) -> dict[str, Restored]:
    """One restored segment per key: the blob the old record names if it still matches, else the newest."""
    known = old.segments()
    by_key: dict[str, Restored] = {}
    for rel, _, is_temp in scan_blob_dir(root):
        if is_temp or not rel.endswith(".kvb"):
            continue
        try:
            got = restore_blob(root, rel, known)
        except (ArchiveError, OSError, ValueError, KeyError, TypeError) as e:
            report.lost_blobs.append(f"{rel}: {e}")
            continue
        current = by_key.get(got.record.key)
        if current is None or _better(got, current, known):
            by_key[got.record.key] = got
    report.segments_restored = len(by_key)
    report.segments_from_old_index = sum(r.from_old_index for r in by_key.values())
    return by_key


def _better(new: Restored, current: Restored, known: dict[str, dict[str, Any]]) -> bool:
    """Between two blobs of one key: the one the old index named, else the newer file."""
    named = known.get(new.record.key, {}).get("blob")
    if named in (new.record.blob, current.record.blob):
        return named == new.record.blob
    return new.mtime > current.mtime


def _restore_documents(
    root: Path, old: Salvage, restored: dict[str, Restored], report: RebuildReport
) -> list[DocumentRecord]:
    """Documents from the old index, else from manifests; each keeps only segments that were restored."""
    docs = {d["path"]: DocumentRecord.from_dict(d) for d in old.documents()}
    manifests, report.unreadable_manifests = read_manifests(root)
    for doc in manifests:
        docs.setdefault(doc.path, doc)
    listed: set[str] = set()
    for doc in docs.values():
        gone = {k for k in doc.segment_keys if k not in restored}
        if gone:
            doc.drop_segments(gone)  # their sources go with them
            doc.incomplete = True
        if doc.incomplete:
            report.incomplete_documents.append(doc.path)
        listed.update(doc.segment_keys)
    report.documents_restored = len(docs)
    report.incomplete_documents.sort()
    report.unlinked_segments = sum(
        1 for k, r in restored.items() if k not in listed and r.record.extra.get("role") != "prefix"
    )
    return list(docs.values())


def _build(root: Path, old: Salvage, restored: dict[str, Restored], docs: list[DocumentRecord]) -> Path:
    """Write the new index into ``index.rebuild/`` (a leftover of a crashed rebuild is replaced)."""
    fresh = root / f"{INDEX_DIR}.rebuild"
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir()
    index = Index(fresh)
    try:
        index.open_dbs()
        index.write(lambda txn: _fill(txn, index.dbs, old, restored, docs))
    finally:
        index.close()
    (fresh / BUILT_MARK).touch()  # from here a crash before the swap loses nothing: see _finish_interrupted_swap
    fsync_dir(fresh)
    return fresh


BUILT_MARK = "rebuilt"  # in index.rebuild/: the new index was written whole and committed


def _finish_interrupted_swap(root: Path) -> None:
    """A rebuild that crashed between its two renames left no ``index/`` but a whole ``index.rebuild/`` (its
    profiles, tuned settings and hit counts included): put it in place rather than rebuild from the blobs
    alone, which would lose them."""
    fresh = root / f"{INDEX_DIR}.rebuild"
    if not (root / INDEX_DIR).exists() and (fresh / BUILT_MARK).exists():
        os.rename(fresh, root / INDEX_DIR)
        fsync_dir(root)


def _fill(
    txn: lmdb.Transaction, dbs: dict[str, Any], old: Salvage, restored: dict[str, Restored], docs: list[DocumentRecord]
) -> None:
    for table in ("profiles", "tuned"):
        for key, raw in old.tables[table].items():
            txn.put(key, raw, db=dbs[table])
    meta = old.json_rows("meta")
    models = [(r.model_name, r.model_fingerprint) for r in restored.values() if r.model_fingerprint]
    if b"model_fingerprint" not in meta and models:
        name, fp = max(set(models), key=models.count)
        meta[b"model_name"], meta[b"model_fingerprint"] = name, fp
    meta[b"format_version"] = FORMAT_VERSION
    meta.setdefault(b"created", time.time())
    meta[b"rebuilt"] = time.time()
    for meta_key, value in meta.items():
        txn.put(meta_key, dump_json(value), db=dbs["meta"])
    rows: list[tuple[bytes, bytes]] = []
    for segment, got in restored.items():
        txn.put(segment.encode(), got.record.to_json().encode(), db=dbs["segments"])
        vector = old.tables["embeddings"].get(segment.encode())
        if vector is not None:
            rows.append((segment.encode(), vector))
        elif got.embedding is not None:
            rows.extend(embedding_rows([(segment, got.embedding)]))
    put_embedding_rows(txn, dbs, rows)
    for doc in docs:
        txn.put(document_db_key(doc.path), doc.to_json().encode(), db=dbs["documents"])


def _swap(root: Path, fresh: Path) -> str | None:
    """Keep the old index as ``index.damaged-<time>/`` and put the new one in its place."""
    current = root / INDEX_DIR
    kept = None
    if current.exists():
        kept = root / f"{INDEX_DIR}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while kept.exists():
            kept = root / f"{INDEX_DIR}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
            n += 1
        os.rename(current, kept)
    os.rename(fresh, current)
    fsync_dir(root)
    (current / BUILT_MARK).unlink()
    return str(kept) if kept else None


def _move_lost(root: Path, report: RebuildReport) -> None:
    """Move blobs that could not be restored out of ``blobs/``, where gc would delete them as orphans."""
    for entry in report.lost_blobs:
        rel = entry.split(": ", 1)[0]
        target = root / LOST_AND_FOUND / Path(rel).relative_to(BLOB_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(root / rel, target)


@dataclass
class Restored:
    """A segment record rebuilt from a blob, and what the blob said beyond the record."""

    record: SegmentRecord
    embedding: np.ndarray | None
    model_name: str | None
    model_fingerprint: str | None
    mtime: float
    from_old_index: bool


def restore_blob(root: Path, rel: str, known: dict[str, dict[str, Any]]) -> Restored:
    """The record of blob ``rel``; ``known``: segment key -> record dict salvaged from the old index.

    Raises CorruptBlobError (damaged) or ValueError (cannot be described) with a one-line reason.
    """
    path = root / rel
    key = check_key(Path(rel).name.split(".", 1)[0])
    data = path.read_bytes()
    mtime = os.stat(path).st_mtime
    frames = split_frames(data)
    if not frames:
        raise CorruptBlobError("blob is empty")
    layers = [LayerEntry(offset, length, checksum(data[offset : offset + length])) for offset, length, _ in frames]
    described = [describe_payload(raw) for _, _, raw in frames]
    first = described[0]
    for i, d in enumerate(described[1:], start=1):
        if (d["codec"], d["dtype"], d["shape"]) != (first["codec"], first["dtype"], first["shape"]):
            raise CorruptBlobError(f"layer {i} differs from layer 0 in codec, dtype or shape")
    about = first["segment"] if isinstance(first["segment"], dict) else {}
    model = (about.get("model_name"), about.get("model_fingerprint"))
    old = known.get(key)
    if old is not None and old.get("blob") == rel and _same_layers(old, layers):
        return Restored(SegmentRecord.from_dict(old), None, *model, mtime, from_old_index=True)
    if not about:
        why = "its bytes no longer match the old index record" if old else "the old index is lost"
        raise ValueError(f"written by an older kvblend, the blob does not describe its segment, and {why}")
    if about.get("key") != key:
        raise ValueError(f"the blob describes segment {about.get('key')!r} but is named for {key!r}")
    record, embedding = record_from_blob(about, first, layers, rel)
    return Restored(record, embedding, *model, mtime, from_old_index=False)


def _same_layers(old: dict[str, Any], layers: list[LayerEntry]) -> bool:
    """Whether the old record's layer entries are exactly the blob's (same offsets, lengths, CRCs)."""
    try:
        entries = [(int(x["offset"]), int(x["length"]), str(x["checksum"])) for x in old.get("layers", [])]
    except (KeyError, TypeError, ValueError):
        return False
    return entries == [(e.offset, e.length, e.checksum) for e in layers]


@dataclass
class Salvage:
    """Raw rows per table (key -> value bytes) and what went wrong while reading them."""

    tables: dict[str, dict[bytes, bytes]] = field(default_factory=lambda: {name: {} for name in DB_NAMES})
    problems: list[str] = field(default_factory=list)

    def json_rows(self, table: str) -> dict[bytes, Any]:
        """The table's rows whose value is valid JSON, parsed."""
        out = {}
        for key, raw in self.tables[table].items():
            try:
                out[key] = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                self.problems.append(f"{table} record {key[:40]!r} is not valid JSON")
        return out

    def segments(self) -> dict[str, dict[str, Any]]:
        """Segment key -> record dict, for records that at least name a key and a blob."""
        rows = self.json_rows("segments")
        return {d["key"]: d for d in rows.values() if isinstance(d, dict) and d.get("key") and d.get("blob")}

    def documents(self) -> list[dict[str, Any]]:
        return [d for d in self.json_rows("documents").values() if isinstance(d, dict) and d.get("path")]


def salvage(root: Path) -> Salvage:
    """Every record of ``root``'s index that sound pages still hold (an empty Salvage if none can be read)."""
    found = Salvage()
    problem = index_problem(root)
    if problem is not None:
        if problem not in ("is missing", "is empty"):
            found.problems.append(f"the old index {problem}: nothing could be read from it")
        return found

    # Plain reads of the sound pages (indexcheck.py), never LMDB itself: LMDB follows a damaged page's garbage
    # pointers and can kill the process, which is the very damage a rebuild is run for.
    try:
        tables, problems = read_records(root / INDEX_DIR / DATA_FILE)
    except OSError as e:
        found.problems.append(f"the old index cannot be read ({e.strerror or e})")
        return found
    for name in DB_NAMES:
        found.tables[name].update(tables.get(name, []))
    for damage in problems[:10]:
        found.problems.append(f"the old index is damaged: {damage}; the records on that page are lost")
    return found
