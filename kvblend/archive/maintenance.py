"""Archive upkeep: ``verify`` (and repair), ``gc`` (leftovers, LRU eviction), ``stats``.

Kept apart from the facade because none of it is on a query's path: these walk
the whole archive. They talk to the archive core (core.py) and its
:class:`~kvblend.archive.store.Store` interface only, so a local archive and a
Redis one are checked, collected and counted by the same code; what differs (a
blob file or a layer key left by a crashed write, the index's own pages) the
store reports.

``verify --repair`` and ``gc`` delete, so they run under the store's writer (a
temp file seen then is never a live writer's) and may spend the disk reserve.
``verify`` and ``gc --dry-run`` take no lock: they run beside an ingest, and on
an archive this user cannot write.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvblend.archive.core import FORMAT_VERSION, ArchiveCore, decode_checked
from kvblend.archive.records import SegmentRecord
from kvblend.archive.store import JSON_TABLES, load_json
from kvblend.errors import ArchiveError, BlobUnreadableError, CorruptBlobError

MISSING = "blob file is missing"  # the local store's reason for a payload that is not there at all


class VerifyProblem(NamedTuple):
    """One finding of :func:`verify`; ``layer`` is None when the whole segment (or the store) is affected."""

    key: str
    layer: int | None
    reason: str
    damaged: bool = True  # False: it could not be read (permissions, I/O), so --repair leaves it


@dataclass
class VerifyReport:
    segments_checked: int = 0
    layers_checked: int = 0
    bytes_checked: int = 0
    documents_checked: int = 0
    problems: list[VerifyProblem] = field(default_factory=list)
    orphan_blobs: int = 0  # payloads no record names (harmless; `gc` deletes them)
    temp_files: int = 0  # leftovers of interrupted writes (harmless; `gc` deletes them)
    repaired_segments: list[str] = field(default_factory=list)  # dropped
    repaired_documents: list[str] = field(default_factory=list)  # now marked incomplete
    codecs: dict[str, int] = field(default_factory=dict)  # segments checked per codec (an archive may mix them)
    structure: list[str] = field(default_factory=list)  # damage to the store's own structures (index pages)

    @property
    def ok(self) -> bool:
        """True when every layer of every segment read back intact and every document's segments exist."""
        return not self.problems and not self.structure

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
        """Every leftover deleted (or, dry run, to delete): orphan payloads and temp files."""
        return self.orphan_blobs + self.temp_files

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "orphans": self.orphans}


@dataclass(frozen=True)
class ArchiveStats:
    """What `kvblend stats` shows: counts, tokens, bytes stored against raw fp16, per codec, and the store's own."""

    location: str
    store: str  # "local" or "redis"
    format_version: int
    model_name: str | None
    model_fingerprint: str | None
    segments: int
    documents: int
    tokens: int
    stored_bytes: int
    raw_bytes: int
    hits: int
    codecs: dict[str, int]
    bytes_per_token_by_codec: dict[str, float]  # an archive may mix codecs (FORMAT.md 3.2): what each costs
    usage: dict[str, Any]  # the store's own: index bytes on disk, or Redis memory

    @property
    def bytes_per_token_raw(self) -> float:
        return self.raw_bytes / self.tokens if self.tokens else 0.0

    @property
    def bytes_per_token_stored(self) -> float:
        return self.stored_bytes / self.tokens if self.tokens else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        usage = d.pop("usage")
        return {
            "path": self.location,
            **d,
            "bytes_per_token_raw": self.bytes_per_token_raw,
            "bytes_per_token_stored": self.bytes_per_token_stored,
            "compression_ratio": self.compression_ratio,
            **usage,
        }


# ---------------------------------------------------------------- verify


def verify(archive: ArchiveCore, repair: bool = False, deep: bool = False) -> VerifyReport:
    """Re-read every layer of every segment and check its checksum (``deep``: also decode it).

    Also reads every record of every table (so garbage in any of them is found, not only in the ones a query
    reads), checks each document's segments exist, and asks the store for damage to its own structures.
    With ``repair``, bad segments are dropped (their documents lose them and are marked incomplete) so
    queries recompute instead of failing; leftovers are left for ``gc``.
    """
    store = archive.store
    report = VerifyReport(structure=store.structure_problems())
    bad: set[str] = set()
    with store.ensure_writer() if repair else nullcontext():
        present: set[str] = set()
        for rec in archive.iter_segments():
            report.segments_checked += 1
            report.codecs[rec.codec] = report.codecs.get(rec.codec, 0) + 1
            present.add(rec.key)
            problems = _verify_segment(archive, rec, report, deep)
            # a concurrent writer replaced or removed it: not corruption (under --repair too: a store with no
            # writer lock, Redis, has other nodes storing while this one reads)
            if problems and _replaced_meanwhile(archive, rec):
                continue
            report.problems.extend(problems)
            bad.update(p.key for p in problems if p.damaged)
        for key in store.lost_segments():  # a cache evicted the record: the segment is gone
            report.problems.append(
                VerifyProblem(
                    key,
                    None,
                    "its record is gone from the store (evicted); "
                    "ingest its document again, or let a query recompute it",
                )
            )
            bad.add(key)
        dangling = _dangling_references(archive, present, report)
        for table in JSON_TABLES:
            for _, raw in store.scan(table):
                load_json(raw)
        archive.get_embeddings(None)
        for item in store.leftovers():
            if item.temp:
                report.temp_files += 1
            else:
                report.orphan_blobs += 1
        if repair and (bad or dangling):
            marked = archive.drop_segments(bad) if bad else []
            marked += archive.strip_dangling(dangling) if dangling else []
            report.repaired_segments = sorted(bad)
            report.repaired_documents = sorted(set(marked))
    return report


def _verify_segment(archive: ArchiveCore, rec: SegmentRecord, report: VerifyReport, deep: bool) -> list[VerifyProblem]:
    if len(rec.layers) != rec.n_layers:
        reason = f"record lists {len(rec.layers)} layers but says n_layers={rec.n_layers}"
        return [VerifyProblem(rec.key, None, reason)]
    problems = []
    for i in range(len(rec.layers)):
        report.layers_checked += 1
        try:
            data = archive.read_layer_raw(rec, i)
        except BlobUnreadableError as e:  # e.g. a blob another user owns: not damage, and not to be dropped
            problems.append(VerifyProblem(rec.key, i, f"{e.reason}; not known to be damaged, --repair keeps it", False))
            continue
        except CorruptBlobError as e:
            reason = e.reason
            if i == 0 and reason.startswith(MISSING):
                return [VerifyProblem(rec.key, None, reason)]
            problems.append(VerifyProblem(rec.key, i, reason))
            continue
        report.bytes_checked += len(data)
        if deep:
            try:
                decode_checked(rec, i, data)
            except CorruptBlobError as e:
                problems.append(VerifyProblem(rec.key, i, str(e)))
    return problems


def _replaced_meanwhile(archive: ArchiveCore, rec: SegmentRecord) -> bool:
    now = archive.get_segment(rec.key)
    return now is None or now.blob != rec.blob or now.layers != rec.layers


def _dangling_references(archive: ArchiveCore, present: set[str], report: VerifyReport) -> dict[str, list[str]]:
    """Document path -> its segment keys that are not in the archive (each also reported as a problem)."""
    dangling: dict[str, list[str]] = {}
    for doc in archive.iter_documents():
        report.documents_checked += 1
        missing = [k for k in doc.segment_keys if k not in present]
        if missing:  # a writer may have added it since the scan (on Redis, even under --repair)
            missing = [k for k in missing if not archive.has_segment(k)]
        for k in missing:
            report.problems.append(
                VerifyProblem(k, None, f"document {doc.path} lists a segment that is not in the archive")
            )
        if missing:
            dangling[doc.path] = missing
    return dangling


# ---------------------------------------------------------------- gc


def gc(archive: ArchiveCore, max_size_bytes: int | None = None, dry_run: bool = False) -> GcReport:
    """Delete leftovers (orphan payloads, temp files); with ``max_size_bytes``, evict least recently used segments.

    Eviction order is by ``last_access`` (then ``created``), oldest first, until the segments total at most
    ``max_size_bytes``. Evicted segments leave their documents marked incomplete.
    """
    if max_size_bytes is not None and max_size_bytes < 0:
        raise ArchiveError("gc budget must be >= 0 bytes")
    store = archive.store
    report = GcReport(dry_run=dry_run)
    with nullcontext() if dry_run else store.ensure_writer():
        live = {rec.key: rec for rec in archive.iter_segments()}
        leftovers = store.leftovers()
        for item in leftovers:
            (report.temp_files if item.temp else report.orphan_blobs).append(item.name)
            report.blob_bytes_before += item.size
            report.freed_bytes += item.size
        if not dry_run and leftovers:
            store.delete_leftovers(leftovers)
        sizes = {key: store.segment_bytes(rec) for key, rec in live.items()}
        total = sum(sizes.values())
        report.blob_bytes_before += total
        if max_size_bytes is not None and total > max_size_bytes:
            order = sorted(live.values(), key=lambda r: (r.last_access or r.created, r.created))
            for rec in order:
                if total <= max_size_bytes:
                    break
                report.evicted.append(rec.key)
                total -= sizes[rec.key]
                report.freed_bytes += sizes[rec.key]
            if report.evicted and not dry_run:
                report.incomplete_documents = sorted(set(archive.drop_segments(report.evicted)))
            elif report.evicted:  # what the real run would mark incomplete
                evicted = set(report.evicted)
                report.incomplete_documents = sorted(
                    d.path for d in archive.iter_documents() if evicted.intersection(d.segment_keys)
                )
        report.blob_bytes_after = total
        report.orphan_manifests = store.after_gc(dry_run)
    return report


# ---------------------------------------------------------------- stats


def stats(archive: ArchiveCore, location: str) -> ArchiveStats:
    """Totals for `kvblend stats`: counts, tokens, bytes stored vs raw fp16, per codec, hits, the store's usage."""
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
    return ArchiveStats(
        location=location,
        store=archive.store.kind,
        format_version=FORMAT_VERSION,
        model_name=archive.model.name,
        model_fingerprint=archive.model.fingerprint,
        segments=n,
        documents=archive.count_documents(),
        tokens=tokens,
        stored_bytes=stored,
        raw_bytes=raw,
        hits=hits,
        codecs=codecs,
        bytes_per_token_by_codec={c: (b / t if t else 0.0) for c, (t, b) in sorted(per_codec.items())},
        usage=archive.store.usage(),
    )
