"""Archive upkeep: ``verify`` (and repair), ``gc`` (orphans, LRU eviction), ``stats``, ``size_bytes``.

Kept apart from the facade because none of it is on a query's path: these
walk the whole archive. ``verify --repair`` and ``gc`` create no blobs but
delete them, so they run under the writer lock (a temp file seen then is never
a live writer's), and may spend the disk reserve (reserve.py). ``verify``
and ``gc --dry-run`` take no lock: they run beside an ingest, and on an
archive this user cannot write.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import lmdb

from kvblend.archive.blobs import (
    BLOB_SUFFIX,
    iter_manifest_files,
    manifest_relpath,
    scan_blob_dir,
    unlink_blob,
)
from kvblend.archive.index import DB_NAMES
from kvblend.archive.local import Dbs, drop_segments, index_bytes, strip_dangling
from kvblend.archive.records import SegmentRecord
from kvblend.errors import ArchiveError, CorruptBlobError

if TYPE_CHECKING:
    from kvblend.archive.facade import Archive


class VerifyProblem(NamedTuple):
    """One finding of :func:`verify`; ``layer`` is None when the whole segment is affected."""

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
    codecs: dict[str, int] = field(default_factory=dict)  # segments checked per codec (an archive may mix them)

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
    orphan_manifests: list[str] = field(default_factory=list)  # documents/ files of no indexed document

    @property
    def orphans(self) -> list[str]:
        """Every leftover file deleted (or, dry run, to delete): orphan blobs and temp files."""
        return self.orphan_blobs + self.temp_files

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "orphans": self.orphans}


# ---------------------------------------------------------------- verify


def verify(archive: Archive, repair: bool = False, deep: bool = False) -> VerifyReport:
    """Re-read every layer of every segment and check its checksum (``deep``: also decode it).

    Also checks that each document's segments exist. With ``repair``, bad
    segments are dropped from the index (their documents lose them and are
    marked incomplete) so queries recompute instead of failing; orphaned
    blobs are left for ``gc``.
    """
    report = VerifyReport()
    bad: set[str] = set()
    with archive.ensure_writer() if repair else nullcontext():
        present: set[str] = set()
        referenced: set[str] = set()
        for rec in archive.iter_segments():
            report.segments_checked += 1
            report.codecs[rec.codec] = report.codecs.get(rec.codec, 0) + 1
            present.add(rec.key)
            referenced.add(rec.blob)
            problems = _verify_segment(archive, rec, report, deep)
            if problems and not repair and _replaced_meanwhile(archive, rec):
                continue  # a concurrent writer replaced or removed it: not corruption
            report.problems.extend(problems)
            bad.update(p.key for p in problems)
        dangling = _dangling_references(archive, present, repair, report)
        _walk_side_tables(archive)
        for rel, _, is_temp in scan_blob_dir(archive.path):
            if is_temp:
                report.temp_files += 1
            elif rel.endswith(BLOB_SUFFIX) and rel not in referenced:
                report.orphan_blobs += 1
        if repair and (bad or dangling):
            marked = archive.commit(lambda txn: _repair_txn(txn, archive.index.dbs, bad, dangling), frees=True)
            report.repaired_segments = sorted(bad)
            report.repaired_documents = sorted(set(marked))
    return report


def _verify_segment(archive: Archive, rec: SegmentRecord, report: VerifyReport, deep: bool) -> list[VerifyProblem]:
    if len(rec.layers) != rec.n_layers:
        reason = f"record lists {len(rec.layers)} layers but says n_layers={rec.n_layers}"
        return [VerifyProblem(rec.key, None, reason)]
    if not (archive.path / rec.blob).is_file():
        return [VerifyProblem(rec.key, None, f"blob file is missing ({rec.blob})")]
    problems = []
    for i, entry in enumerate(rec.layers):
        report.layers_checked += 1
        data, reason = archive.blobs.read_checked(rec.blob, entry)
        if data is None:
            problems.append(VerifyProblem(rec.key, i, reason))
            continue
        report.bytes_checked += len(data)
        if deep:
            try:
                archive.decode(rec, i, data)
            except CorruptBlobError as e:
                problems.append(VerifyProblem(rec.key, i, str(e)))
    return problems


def _walk_side_tables(archive: Archive) -> None:
    """Read every record of the other tables, so a damaged page anywhere in the index is found.

    LMDB keeps no checksums: a bad page shows only when read, and listing
    segments and documents does not read embeddings or profiles. A damaged
    one raises ArchiveDamagedError (index.py), which names the repair.
    """
    for name in DB_NAMES:
        if name not in ("segments", "documents"):
            for _ in archive.index.items(name):
                pass


def _replaced_meanwhile(archive: Archive, rec: SegmentRecord) -> bool:
    now = archive.get_segment(rec.key)
    return now is None or now.blob != rec.blob or now.layers != rec.layers


def _dangling_references(archive: Archive, present: set[str], repair: bool,
                         report: VerifyReport) -> dict[str, list[str]]:
    """Document path -> its segment keys that are not in the archive (each also reported as a problem)."""
    dangling: dict[str, list[str]] = {}
    for doc in archive.iter_documents():
        report.documents_checked += 1
        missing = [k for k in doc.segment_keys if k not in present]
        if missing and not repair:  # without the lock a writer may have added it since the scan
            missing = [k for k in missing if not archive.has_segment(k)]
        for k in missing:
            report.problems.append(VerifyProblem(k, None, f"document {doc.path} lists a segment "
                                                          "that is not in the archive"))
        if missing:
            dangling[doc.path] = missing
    return dangling


def _repair_txn(txn: lmdb.Transaction, dbs: Dbs, bad: set[str],
                dangling: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """Drop bad segments and strip dangling keys from documents, in one transaction."""
    marked, blobs = drop_segments(txn, dbs, bad)
    return marked + strip_dangling(txn, dbs, dangling), blobs


# ---------------------------------------------------------------- gc


def gc(archive: Archive, max_size_bytes: int | None = None, dry_run: bool = False) -> GcReport:
    """Delete orphan blobs and temp files; with ``max_size_bytes``, evict least recently used segments.

    Eviction order is by ``last_access`` (then ``created``), oldest first,
    until the referenced blobs total at most ``max_size_bytes``. Evicted
    segments leave their documents marked incomplete.
    """
    if max_size_bytes is not None and max_size_bytes < 0:
        raise ArchiveError("gc budget must be >= 0 bytes")
    report = GcReport(dry_run=dry_run)
    with nullcontext() if dry_run else archive.ensure_writer():
        live: dict[str, tuple[float, float, str]] = {}  # blob -> (last_access, created, key)
        for rec in archive.iter_segments():
            live[rec.blob] = (rec.last_access or rec.created, rec.created, rec.key)
        sizes = _delete_leftovers(archive, live, report)
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
                marked = archive.commit(lambda txn: drop_segments(txn, archive.index.dbs, report.evicted), frees=True)
                report.incomplete_documents = sorted(set(marked))
        report.blob_bytes_after = total
        _delete_stale_manifests(archive, report)
    return report


def _delete_leftovers(archive: Archive, live: dict[str, Any], report: GcReport) -> dict[str, int]:
    """Delete (unless dry run) temp files and unreferenced blobs; return the sizes of live blobs."""
    sizes: dict[str, int] = {}
    for rel, size, is_temp in scan_blob_dir(archive.path):
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
        if not report.dry_run:
            unlink_blob(archive.path, rel)
    return sizes


def _delete_stale_manifests(archive: Archive, report: GcReport) -> None:
    """Delete temp manifests and manifests of documents the index no longer holds (manifests.py)."""
    live = {manifest_relpath(doc.path) for doc in archive.iter_documents()}
    for rel, is_temp in iter_manifest_files(archive.path):
        if is_temp or rel not in live:
            report.orphan_manifests.append(rel)
            if not report.dry_run:
                unlink_blob(archive.path, rel)


# ---------------------------------------------------------------- stats


def stats(archive: Archive) -> dict[str, Any]:
    """Totals for `kvblend stats`: counts, tokens, bytes stored vs raw fp16, compression, hits."""
    n = tokens = stored = raw = hits = 0
    codecs: dict[str, int] = {}
    per_codec: dict[str, list[int]] = {}  # codec -> [tokens, stored bytes]
    for rec in archive.iter_segments():
        n += 1
        tokens += rec.n_tokens
        stored += rec.stored_bytes
        raw += rec.raw_bytes
        hits += rec.hits
        codecs[rec.codec] = codecs.get(rec.codec, 0) + 1
        sums = per_codec.setdefault(rec.codec, [0, 0])
        sums[0] += rec.n_tokens
        sums[1] += rec.stored_bytes
    return {
        "path": str(archive.path),
        "format_version": archive.format_version,
        "model_name": archive.model_name,
        "model_fingerprint": archive.model_fingerprint,
        "segments": n,
        "documents": archive.count_documents(),
        "tokens": tokens,
        "stored_bytes": stored,
        "raw_bytes": raw,
        "bytes_per_token_raw": raw / tokens if tokens else 0.0,
        "bytes_per_token_stored": stored / tokens if tokens else 0.0,
        "compression_ratio": raw / stored if stored else 0.0,
        "hits": hits,
        "codecs": codecs,
        # An archive may mix codecs (FORMAT.md 3.2): what each one costs per token, to compare them.
        "bytes_per_token_by_codec": {c: (b / t if t else 0.0) for c, (t, b) in sorted(per_codec.items())},
        "index_bytes": index_bytes(archive.path),
    }


def size_bytes(archive: Archive, include_index: bool = True) -> int:
    """Bytes on disk: every file under ``blobs/`` (orphans included) plus, by default, the index."""
    blobs = sum(size for _, size, _ in scan_blob_dir(archive.path))
    return blobs + (index_bytes(archive.path) if include_index else 0)
