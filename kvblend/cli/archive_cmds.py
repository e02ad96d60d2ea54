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
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from kvblend.archive import Archive, RebuildReport, VerifyReport, rebuild_index, resolve_archive_path
from kvblend.cli.common import ArchiveOpt, JsonOpt, WaitOpt, err, human_bytes, out, parse_size, print_json
from kvblend.errors import ArchiveError, UsageError


def register(app: typer.Typer) -> None:
    app.command("ls")(list_documents)
    app.command()(show)
    app.command()(stats)
    app.command("rm")(remove)
    app.command()(verify)
    app.command()(gc)
    app.command()(path)


def _open(archive: Optional[Path], write: bool = False) -> Archive:
    """Open an existing archive: read-only unless the command changes it (never creates one)."""
    location = _location(archive)
    if not location.exists():
        raise ArchiveError(f"no archive at {location} (run `kvblend ingest PATH` first, or pass --archive)")
    return Archive.open(location, create=False, readonly=not write)


def _location(archive: Optional[Path]) -> Path:
    return resolve_archive_path(str(archive) if archive else None)


def _ago(ts: float | None) -> str:
    if not ts:
        return "never"
    d = time.time() - ts
    for unit, sec in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= sec:
            return f"{d / sec:.0f}{unit} ago"
    return "just now"


def list_documents(archive: Optional[Path] = ArchiveOpt, as_json: bool = JsonOpt) -> None:
    """List archived documents: path, segments, tokens, size, last used."""
    with _open(archive) as arc:
        rows = []
        for doc in arc.iter_documents():
            segs = [arc.get_segment(k) for k in doc.segment_keys]
            present = [s for s in segs if s is not None]
            rows.append({
                "path": doc.path,
                "segments": len(doc.segment_keys),
                "missing_segments": len(segs) - len(present),
                "tokens": doc.n_tokens,
                "bytes": sum(sum(layer.length for layer in s.layers) for s in present),
                "last_used": max((s.last_access or 0 for s in present), default=0) or None,
                "ingested": doc.ingested,
            })
    if as_json:
        print_json(rows)
        return
    if not rows:
        err.print("archive is empty")
        return
    table = Table()
    table.add_column("document", overflow="fold")
    for col in ("segments", "tokens", "size", "last used"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        segs = f"{r['segments']}" + (f" ({r['missing_segments']} missing)" if r["missing_segments"] else "")
        table.add_row(r["path"], segs, f"{r['tokens']:,}", human_bytes(r["bytes"]), _ago(r["last_used"]))
    out.print(table)


def show(
    target: str = typer.Argument(..., help="A segment key (or unique prefix) or a document path."),
    archive: Optional[Path] = ArchiveOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Show a segment's metadata and per-layer sizes, or a document's segments."""
    with _open(archive) as arc:
        doc = arc.get_document(target) or arc.get_document(str(Path(target).expanduser().resolve()))
        if doc is not None:
            info = {"document": doc.path, "content_hash": doc.content_hash, "tokens": doc.n_tokens,
                    "ingested": doc.ingested, "segments": doc.segment_keys}
            if as_json:
                print_json(info)
            else:
                for k, v in info.items():
                    out.print(f"[bold]{k}[/]: {v}")
            return
        rec = arc.get_segment(target)
        if rec is None and len(target) >= 4:
            matches = [r for r in arc.iter_segments() if r.key.startswith(target)]
            if len(matches) > 1:
                raise UsageError(f"segment prefix {target} is ambiguous ({len(matches)} matches)")
            rec = matches[0] if matches else None
        if rec is None:
            raise UsageError(f"no segment or document named {target} in the archive")
        info = {
            "key": rec.key, "tokens": rec.n_tokens, "dtype": rec.dtype, "codec": rec.codec,
            "layers": rec.n_layers, "kv_heads": rec.kv_heads, "head_dim": rec.head_dim,
            "base_position": rec.base_position, "blob": rec.blob, "created": rec.created,
            "last_access": rec.last_access, "hits": rec.hits,
            "layer_bytes": [layer.length for layer in rec.layers], "text": rec.text,
        }
    if as_json:
        print_json(info)
        return
    for k in ("key", "tokens", "dtype", "codec", "layers", "kv_heads", "head_dim", "base_position", "blob", "hits"):
        out.print(f"[bold]{k}[/]: {info[k]}")
    out.print(f"[bold]stored[/]: {human_bytes(sum(info['layer_bytes']))} "
              f"(per layer min {min(info['layer_bytes'])} / max {max(info['layer_bytes'])} bytes)")
    out.print(f"[bold]created[/]: {_ago(rec.created)}; [bold]last used[/]: {_ago(rec.last_access)}")
    preview = rec.text[:300].replace("\n", " ")
    out.print(f"[bold]text[/]: {preview}{'…' if len(rec.text) > 300 else ''}")


def stats(archive: Optional[Path] = ArchiveOpt, as_json: bool = JsonOpt) -> None:
    """Totals: segments, tokens, bytes per token raw vs stored, compression ratio, hits."""
    with _open(archive) as arc:
        s = arc.stats()
        s["archive"] = str(arc.path)
        s["model"] = arc.model_name
    if as_json:
        print_json(s)
        return
    table = Table(show_header=False, title=f"archive {s['archive']}")
    for k, v in s.items():
        if k == "archive":
            continue
        if isinstance(v, float):
            v = f"{v:,.3f}"
        elif isinstance(v, int) and "bytes" in k:
            v = f"{human_bytes(v)} ({v:,} B)"
        elif isinstance(v, dict):  # codecs: segments each, bytes per token each
            v = ", ".join(f"{name}: {x:,.0f}" if isinstance(x, float) else f"{name}: {x}" for name, x in v.items())
        table.add_row(k, str(v))
    out.print(table)


def remove(
    documents: List[str] = typer.Argument(..., help="Document paths to remove (their unshared segments go too)."),
    wait: bool = WaitOpt,
    archive: Optional[Path] = ArchiveOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Remove documents and the segments no other document uses."""
    with _open(archive, write=True) as arc:
        resolved = []
        for d in documents:
            doc = arc.get_document(d) or arc.get_document(str(Path(d).expanduser().resolve()))
            if doc is None:
                raise UsageError(f"no such document in the archive: {d} (see `kvblend ls`)")
            resolved.append(doc.path)
        with arc.writer(wait=wait):
            removed = arc.remove_documents(resolved)
    if as_json:
        print_json({"removed": removed})
    else:
        for r in removed:
            out.print(f"removed {r}")


def verify(
    repair: bool = typer.Option(False, "--repair", help="Drop corrupt or missing segments from the index."),
    rebuild: bool = typer.Option(False, "--rebuild-index", help="Rebuild a lost or damaged index from the blobs (keeps the old one)."),
    deep: bool = typer.Option(False, "--deep", help="Also decode every layer (slower; loads torch)."),
    wait: bool = WaitOpt,
    archive: Optional[Path] = ArchiveOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Check every blob's checksums; exit 1 naming each corrupt or missing segment."""
    if repair and rebuild:
        raise UsageError("--repair and --rebuild-index are alternatives; pick one")
    if rebuild:
        _print_rebuild(rebuild_index(_location(archive), wait=wait), as_json)
        return
    with _open(archive, write=repair) as arc:
        if repair:
            with arc.writer(wait=wait):
                report = arc.verify(repair=True, deep=deep)
        else:
            report = arc.verify(repair=False, deep=deep)
    bad = _problems_by_segment(report)
    if as_json:
        problems = [{"segment": p.key, "layer": p.layer, "reason": p.reason} for p in report.problems]
        print_json({"ok": report.ok, "segments_checked": report.segments_checked, "problems": problems,
                    "repaired": bool(repair and problems), "codecs": report.codecs})
    else:
        for key, line in bad.items():
            err.print(f"[red]corrupt[/] segment {escape(key)}: {escape(line)}")
        if report.ok:
            codecs = ", ".join(f"{n} {c}" for c, n in sorted(report.codecs.items()))
            out.print(f"ok: {report.segments_checked} segments verified" + (f" ({codecs})" if codecs else ""))
        elif repair:
            out.print(f"repaired: dropped {len(bad)} segments from the index")
    if bad and not repair:
        raise typer.Exit(1)


def _problems_by_segment(report: VerifyReport) -> dict[str, str]:
    """One line per bad segment (not per layer): each reason once, with the layers it hit."""
    grouped: dict[str, dict[str, list[int]]] = {}
    for p in report.problems:
        reason = re.sub(r" \(layer needs bytes [^)]*\)$", "", p.reason)
        grouped.setdefault(p.key, {}).setdefault(reason, [])
        if p.layer is not None:
            grouped[p.key][reason].append(p.layer)
    return {key: "; ".join(f"{reason}{_layers(layers)}" for reason, layers in reasons.items())
            for key, reasons in grouped.items()}


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
    out.print(f"rebuilt the index from the blobs: {report.segments_restored} segments "
              f"({report.segments_from_old_index} as the old index had them), {report.documents_restored} documents")
    for path in report.incomplete_documents:
        err.print(f"warning: document {path} lost segments; ingest it again to recompute them")
    if report.unlinked_segments:
        err.print(f"warning: {report.unlinked_segments} segments belong to no known document; ingesting their "
                  "documents again relinks them without recomputing")
    for entry in report.lost_blobs:
        err.print(f"warning: could not restore {entry}; moved to lost+found/")
    for rel in report.unreadable_manifests:
        err.print(f"warning: unreadable document manifest {rel}")
    for problem in report.problems:
        err.print(f"note: {problem}")
    if report.old_index:
        err.print(f"the replaced index was kept at {report.old_index}; delete it once the archive works")


def gc(
    max_size: Optional[str] = typer.Option(None, "--max-size", help="Evict least-recently-used segments until the archive fits, e.g. 5GB."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only report what would be freed (needs no writer lock)."),
    wait: bool = WaitOpt,
    archive: Optional[Path] = ArchiveOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Delete orphan blobs; with --max-size, evict least-recently-used segments."""
    budget = parse_size(max_size) if max_size is not None else None
    with _open(archive, write=not dry_run) as arc:
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
    out.print(f"{verb} {human_bytes(data['freed_bytes'])}: "
              f"{len(data['orphans'])} orphan files, {len(data['evicted'])} segments evicted")


def path(archive: Optional[Path] = ArchiveOpt, as_json: bool = JsonOpt) -> None:
    """Print where the archive is (--archive, else $KVBLEND_ARCHIVE, else the XDG cache)."""
    location = resolve_archive_path(str(archive) if archive else None)
    if as_json:
        print_json({"path": str(location), "exists": Archive.exists(location)})
        return
    out.print(str(location))
