"""Where a segment came from (its pages and section in its document), and how an answer cites it.

Ingest computes one source per (document, segment) from the segment's offsets
in the document's text: the pages it spans (``Document.page_starts``) and the
section it belongs to (the nearest Markdown heading at or before its text, as
:func:`kvblend.segmenter.find_headings` finds them). The archive keeps them in
the document's record, parallel to its segment keys (a segment's KV is shared
by every document holding the same text, its provenance is not). A query, a
server response and the bench report them; :func:`cite` writes the line
``kvblend query`` prints after an answer.

Pure functions, no I/O: the same text, spans and page starts always give the
same sources.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvblend.segmenter import Heading, find_headings

__all__ = ["cite", "describe", "page_range", "section_of", "segment_sources"]


def page_range(page_starts: Sequence[int], start: int, end: int) -> list[int] | None:
    """``[first, last]`` (1-based) pages that ``text[start:end]`` touches; None for a text without pages.

    ``page_starts[i]`` is where page ``i + 1`` begins (sorted; the first is 0). Text before the first start
    counts as page 1.
    """
    if not page_starts:
        return None
    first = max(1, bisect.bisect_right(page_starts, start))
    last = max(first, bisect.bisect_right(page_starts, max(start, end - 1)))
    return [first, last]


def section_of(
    text: str, headings: Sequence[Heading], start: int, end: int, starts: Sequence[int] | None = None
) -> str | None:
    """The title of the heading ``text[start:end]`` belongs to, without its ``#``s; None before any heading.

    That is the nearest heading at or before the segment's first line of text: a segment that opens with
    headings (``# Manual`` then ``## Specifications``, glued by the segmenter) belongs to the last of them,
    the one its text falls under.
    """
    starts = [h.start for h in headings] if starts is None else starts  # (the headings' starts, if known)
    pos = _skip_space(text, start, end)
    i = bisect.bisect_left(starts, pos)
    while i < len(headings) and headings[i].start == pos:  # leading headings: step over each
        nxt = _skip_space(text, headings[i].end, end)
        if nxt >= end:
            break  # nothing but headings: the last one names it
        pos, i = nxt, i + 1
    i = bisect.bisect_right(starts, pos) - 1
    return headings[i].title if i >= 0 else None


def segment_sources(
    text: str, spans: Sequence[tuple[int, int]], page_starts: Sequence[int] = ()
) -> list[dict[str, Any]]:
    """One ``{"pages": [first, last] or None, "section": str or None}`` per span of ``text``, in order: what a
    document record stores in ``sources``."""
    headings = find_headings(text)
    starts = [h.start for h in headings]
    pages = sorted(page_starts)
    return [{"pages": page_range(pages, a, b), "section": section_of(text, headings, a, b, starts)} for a, b in spans]


def describe(pages: Sequence[int] | None, section: str | None) -> str:
    """``p. 3 § Specifications``, ``pp. 3-4``, ``§ Install``, or "" when nothing is known."""
    parts = []
    if pages:
        first, last = pages[0], pages[-1]
        parts.append(f"p. {first}" if first == last else f"pp. {first}-{last}")
    if section:
        parts.append(f"§ {section}")
    return " ".join(parts)


def cite(segments: Iterable[Any]) -> str:
    """The sources of an answer's passages, one document after another in prompt order:
    ``manual.pdf p. 3 § Specifications, p. 5 § Safety; guide.md § Install``.

    ``segments``: objects or dicts with ``document``, ``pages`` and ``section`` (SegmentInfo, or its JSON).
    Passages of no ingested document (a ``--context-file``, a client's chunk) are left out; "" when none is left.
    """
    by_document: dict[str, list[str]] = {}
    for seg in segments:
        document = _field(seg, "document")
        if not document:
            continue
        where = describe(_field(seg, "pages"), _field(seg, "section"))
        parts = by_document.setdefault(str(document), [])
        if where and where not in parts:
            parts.append(where)
    return "; ".join(" ".join([doc, ", ".join(parts)]) if parts else doc for doc, parts in by_document.items())


def _field(seg: Any, name: str) -> Any:
    return seg.get(name) if isinstance(seg, Mapping) else getattr(seg, name, None)


def _skip_space(text: str, pos: int, end: int) -> int:
    while pos < end and text[pos].isspace():
        pos += 1
    return pos
