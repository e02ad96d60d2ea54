"""Archive upkeep: `ls`, `show`, `stats`, `rm`, `verify`, `gc`, `path`.

None of these load the model: they work on the index and blobs only, and open
the archive without a model check (upkeep must work whatever built it). The
commands that only read (`ls`, `show`, `stats`, `verify`, `gc --dry-run`)
open it read-only: they create and change nothing, take no writer lock (so
they run beside an ingest) and work on an archive the user cannot write.
"""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from kvblend.archive import (
    SEGMENT_PREFIX_MIN,
    Archive,
    RebuildReport,
    VerifyReport,
    rebuild_index,
    resolve_location,
)
from kvblend.cli.common import (
    ArchiveOpt,
    JsonOpt,
    WaitOpt,
    err,
    human_bytes,
    open_existing,
    out,
    parse_budget,
    print_json,
    printable,
)
from kvblend.errors import NotFoundError, UsageError
from kvblend.provenance import describe


def register(app: typer.Typer) -> None:
    app.command("ls")(list_documents)
    app.command()(show)
    app.command()(stats)
    app.command("rm")(remove)
    app.command()(verify)
    app.command()(gc)
    app.command()(path)


def _ago(ts: float | None) -> str:
    if not ts:
        return "never"
    d = time.time() - ts
    for unit, sec in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= sec:
            return f"{d / sec:.0f}{unit} ago"
    return "just now"


def _when(ts: float | None) -> str:
    """A time as people read it, local, with how long ago (JSON output keeps the epoch seconds)."""
    if not ts:
        return "never"
    return f"{datetime.fromtimestamp(ts).astimezone():%Y-%m-%d %H:%M:%S %Z} ({_ago(ts)})"


def list_documents(archive: Optional[str] = ArchiveOpt, as_json: bool = JsonOpt) -> None:
    """List archived documents: name, format (and pages), segments (and how many are gone), tokens, size, last used."""
    with open_existing(archive) as arc:
        docs = arc.document_summaries()
    if as_json:
        print_json([d.to_dict() for d in docs])
        return
    if not docs:
        err.print("archive is empty")
        return
    table = Table()
    table.add_column("document", overflow="fold", min_width=16)  # never squeezed away by the columns beside it
    table.add_column("format", no_wrap=True)
    table.add_column("segments", justify="right")  # may wrap its note: the name matters more
    for col in ("tokens", "size", "last used"):
        table.add_column(col, justify="right", no_wrap=True)
    for d in docs:
        segs = f"{d.segments}" + (f" ({d.missing_segments} missing)" if d.missing_segments else "")
        if d.incomplete and not d.missing_segments:  # gc evicted some: their keys left its list
            segs += " (incomplete: ingest it again)"
        fmt = (
            escape(d.format)
            + (f", {d.pages} p." if d.pages else "")
            + (f", {escape(d.encoding)}" if d.encoding else "")
        )
        table.add_row(escape(printable(d.name)), fmt, segs, f"{d.tokens:,}", human_bytes(d.bytes), _ago(d.last_used))
    out.print(table)


def show(
    target: str = typer.Argument(
        ..., help=f"A segment key (or a unique prefix of {SEGMENT_PREFIX_MIN}+ characters) or a document name or path."
    ),
    archive: Optional[str] = ArchiveOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Show a segment's metadata and per-layer sizes, or a document's segments."""
    with open_existing(archive) as arc:
        try:
            doc = arc.find_document(target)
        except NotFoundError:
            doc = None
        if doc is not None:
            info = {
                "document": doc.display_name,
                "path": doc.path,
                "content_hash": doc.content_hash,
                "format": doc.format,
                "pages": doc.pages,
                "encoding": doc.encoding or None,  # null: UTF-8, or a converted format
                "tokens": doc.n_tokens,
                "ingested": doc.ingested,
                "incomplete": doc.incomplete,
                "segments": doc.segment_keys,
            }
            if as_json:
                # where each segment came from, parallel to "segments" ({"pages", "section", "rows"}: null when unknown)
                print_json({**info, "sources": [doc.source(i) for i in range(len(doc.segment_keys))]})
            else:
                wheres = [describe(**doc.source(i)) for i in range(len(doc.segment_keys))]
                for k, v in info.items():
                    if v is None:  # an encoding only where it was not UTF-8
                        continue
                    if k == "segments":  # listed below, a line each (a long document's keys ran to a screenful)
                        shown = f"{len(doc.segment_keys)}"
                    else:
                        shown = _when(doc.ingested) if k == "ingested" else str(v)
                    out.print(f"[bold]{k}[/]: {escape(printable(shown))}")
                # each segment a line: its key's first 12 characters (what `show` takes) and where it came from
                known = any(wheres)  # records of older kvblends say nothing of where
                out.print("[bold]sources[/]:" if known else "[bold]segment keys[/]:")
                for key, where in zip(doc.segment_keys, wheres):
                    out.print(f"  {key[:12]}  {escape(where or '-')}" if known else f"  {key[:12]}")
                if not doc.segment_keys:
                    out.print("  (none left: ingest it again)")
            return
        try:
            rec = arc.find_segment(target)
        except NotFoundError:
            raise NotFoundError(f"no segment or document named {target} in the archive (see `kvblend ls`)") from None
    if as_json:
        print_json({**rec.to_dict(), "layer_bytes": [layer.length for layer in rec.layers]})
        return
    for k in ("key", "n_tokens", "dtype", "codec", "n_layers", "kv_heads", "head_dim", "base_position", "blob", "hits"):
        out.print(f"[bold]{k}[/]: {getattr(rec, k)}")
    sizes = [layer.length for layer in rec.layers]
    out.print(f"[bold]stored[/]: {human_bytes(sum(sizes))} (per layer min {min(sizes)} / max {max(sizes)} bytes)")
    out.print(f"[bold]created[/]: {_ago(rec.created)}; [bold]last used[/]: {_ago(rec.last_access)}")
    preview = rec.text[:300].replace("\n", " ")
    out.print(f"[bold]text[/]: {escape(preview)}{'…' if len(rec.text) > 300 else ''}")


def stats(archive: Optional[str] = ArchiveOpt, as_json: bool = JsonOpt) -> None:
    """Totals: segments, tokens, bytes per token raw vs stored (per codec), compression, hits, the store's usage."""
    with open_existing(archive) as arc:
        s = arc.stats()
    if as_json:
        print_json(s.to_dict())
        return
    table = Table(show_header=False, title=f"archive {escape(s.location)} ({s.store})")
    for k, v in s.to_dict().items():
        if k == "path":
            continue
        if isinstance(v, float):
            v = f"{v:,.3f}"
        elif isinstance(v, int) and "bytes" in k:
            v = f"{human_bytes(v)} ({v:,} B)"
        elif isinstance(v, dict):  # codecs: segments each, bytes per token each
            v = ", ".join(f"{name}: {x:,.0f}" if isinstance(x, float) else f"{name}: {x}" for name, x in v.items())
        table.add_row(k, escape(str(v)))
    out.print(table)


def remove(
    documents: list[str] = typer.Argument(..., help="Document paths to remove (their unshared segments go too)."),
    wait: bool = WaitOpt,
    archive: Optional[str] = ArchiveOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Remove documents (a JSONL, JSON or ZIP file, or a folder: every document read out of it) and the segments no
    other document uses."""
    with open_existing(archive, write=True) as arc:
        resolved = list(dict.fromkeys(doc.path for d in documents for doc in arc.find_documents(d)))
        with arc.writer(wait=wait):
            removed = arc.remove_documents(resolved)
    if as_json:
        print_json({"removed": removed})
    else:
        for r in removed:
            out.print(f"removed {escape(printable(r))}")


def verify(
    repair: bool = typer.Option(False, "--repair", help="Drop corrupt or missing segments from the index."),
    rebuild: bool = typer.Option(
        False, "--rebuild-index", help="Rebuild a lost or damaged index from the blobs (keeps the old one)."
    ),
    deep: bool = typer.Option(False, "--deep", help="Also decode every layer (slower; loads torch)."),
    wait: bool = WaitOpt,
    archive: Optional[str] = ArchiveOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Check every blob's checksums; exit 1 naming each corrupt or missing segment."""
    if repair and rebuild:
        raise UsageError("--repair and --rebuild-index are alternatives; pick one")
    if rebuild:
        _print_rebuild(rebuild_index(_local_dir(archive, "--rebuild-index"), wait=wait), as_json)
        return
    with open_existing(archive, write=repair) as arc:
        if repair:
            with arc.writer(wait=wait):
                report = arc.verify(repair=True, deep=deep)
        else:
            report = arc.verify(repair=False, deep=deep)
    bad = _problems_by_segment(report)
    unreadable = {p.key for p in report.problems if not p.damaged}  # --repair keeps these: exit 1 still
    if as_json:
        problems = [
            {"segment": p.key, "layer": p.layer, "reason": p.reason, "damaged": p.damaged} for p in report.problems
        ]
        print_json(
            {
                "ok": report.ok,
                "segments_checked": report.segments_checked,
                "problems": problems,
                "structure": report.structure,  # damage to the index itself: --rebuild-index
                "repaired": bool(repair and (report.repaired_segments or report.repaired_documents)),
                "repaired_segments": report.repaired_segments if repair else [],
                "repaired_documents": report.repaired_documents if repair else [],
                "codecs": report.codecs,
            }
        )
    else:
        for key, line in bad.items():
            label = "unreadable" if key in unreadable else "corrupt"
            err.print(f"[red]{label}[/] segment {escape(key)}: {escape(line)}")
        for damage in report.structure:  # said nothing, exit 0, where this was the only problem
            err.print(f"[red]damaged index[/]: {escape(damage)} (`kvblend verify --rebuild-index` rebuilds it)")
        if report.ok:
            codecs = ", ".join(f"{n} {c}" for c, n in sorted(report.codecs.items()))
            out.print(f"ok: {report.segments_checked} segments verified" + (f" ({codecs})" if codecs else ""))
        elif repair:
            marked = len(report.repaired_documents)
            out.print(
                f"repaired: dropped {len(report.repaired_segments)} segments from the index"
                + (f", marked {marked} documents incomplete (ingest them again)" if marked else "")
            )
    if (bad and (not repair or unreadable)) or report.structure:
        raise typer.Exit(1)


def _problems_by_segment(report: VerifyReport) -> dict[str, str]:
    """One line per bad segment (not per layer): each reason once, with the layers it hit."""
    grouped: dict[str, dict[str, list[int]]] = {}
    for p in report.problems:
        reason = re.sub(r" \(layer needs bytes [^)]*\)$", "", p.reason)
        grouped.setdefault(p.key, {}).setdefault(reason, [])
        if p.layer is not None:
            grouped[p.key][reason].append(p.layer)
    return {
        key: "; ".join(f"{reason}{_layers(layers)}" for reason, layers in reasons.items())
        for key, reasons in grouped.items()
    }


def _layers(layers: list[int]) -> str:
    """' (layers 1-22, 25)' for a sorted list of layer numbers; '' when the whole segment is affected."""
    if not layers:
        return ""
    spans: list[str] = []
    start = prev = layers[0]
    for n in layers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return f" (layer{'s' if len(layers) > 1 else ''} {', '.join(spans)})"


def _print_rebuild(report: RebuildReport, as_json: bool) -> None:
    if as_json:
        print_json(report.to_dict())
        return
    out.print(
        f"rebuilt the index from the blobs: {report.segments_restored} segments "
        f"({report.segments_from_old_index} as the old index had them), {report.documents_restored} documents"
    )
    for path in report.incomplete_documents:
        err.print(f"warning: document {escape(printable(path))} lost segments; ingest it again to recompute them")
    if report.unlinked_segments:
        err.print(
            f"warning: {report.unlinked_segments} segments belong to no known document; ingesting their "
            "documents again relinks them without recomputing"
        )
    for entry in report.lost_blobs:
        err.print(f"warning: could not restore {escape(printable(str(entry)))}; moved to lost+found/")
    for rel in report.unreadable_manifests:
        err.print(f"warning: unreadable document manifest {escape(printable(str(rel)))}")
    for problem in report.problems:
        err.print(f"note: {escape(printable(str(problem)))}")
    if report.old_index:
        err.print(f"the replaced index was kept at {report.old_index}; delete it once the archive works")


def gc(
    max_size: Optional[str] = typer.Option(
        None, "--max-size", help="Evict least-recently-used segments until the archive fits, e.g. 5GB."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only report what would be freed (needs no writer lock)."),
    wait: bool = WaitOpt,
    archive: Optional[str] = ArchiveOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Delete orphan blobs; with --max-size, evict least-recently-used segments."""
    budget = parse_budget(max_size, "--max-size") if max_size is not None else None
    with open_existing(archive, write=not dry_run) as arc:
        if dry_run:
            report = arc.gc(max_size_bytes=budget, dry_run=True)
        else:
            with arc.writer(wait=wait):
                report = arc.gc(max_size_bytes=budget, dry_run=False)
    data = report.to_dict()
    if as_json:
        print_json(data)
        return
    verb = "would free" if dry_run else "freed"
    out.print(
        f"{verb} {human_bytes(data['freed_bytes'])}: "
        f"{len(data['orphans'])} orphan files, {len(data['evicted'])} segments evicted"
    )
    if incomplete := data["incomplete_documents"]:
        shown = ", ".join(printable(p) for p in incomplete[:5]) + (
            f" and {len(incomplete) - 5} more" if len(incomplete) > 5 else ""
        )
        out.print(
            f"{len(incomplete)} document{'s' if len(incomplete) != 1 else ''} "
            f"{'would be' if dry_run else 'now'} incomplete (ingest again to restore): {shown}",
            markup=False,
        )


def path(archive: Optional[str] = ArchiveOpt, as_json: bool = JsonOpt) -> None:
    """Print where the archive is (--archive, else $KVBLEND_ARCHIVE, else the XDG cache)."""
    location = resolve_location(archive)
    if as_json:
        print_json(
            {
                "path": location.display,
                "store": "redis" if location.is_redis else "local",
                # path never connects: whether a Redis database holds an archive is not known here
                "exists": None if location.is_redis else Archive.exists(location),
            }
        )
        return
    out.print(location.display)


def _local_dir(archive: Optional[str], flag: str) -> Path:
    """The directory of a local archive; a Redis archive has no index file to rebuild (its records are the index)."""
    location = resolve_location(archive)
    if location.path is None:
        raise UsageError(
            f"{flag} rebuilds a local archive's index file; {location} is a Redis archive "
            "(`kvblend verify --repair` drops what is missing there)"
        )
    return location.path
