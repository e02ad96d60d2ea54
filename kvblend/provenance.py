"""Where a segment came from (its pages and section in its document), and how an answer cites it.

Ingest computes one source per (document, segment) from the segment's offsets
in the document's text: the pages it spans (``Document.page_starts``), the
section it belongs to (the nearest Markdown heading at or before its text, as
:func:`kvblend.segmenter.find_headings` finds them) and, for a spreadsheet or a
CSV file, the rows it holds (``Document.row_marks``). The archive keeps them in
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

__all__ = ["cite", "describe", "page_range", "row_range", "section_of", "sections_of", "segment_sources"]


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


def row_range(
    text: str,
    row_marks: Sequence[tuple[int, int]],
    start: int,
    end: int,
    sheet_starts: Sequence[int] = (),
    mark_starts: Sequence[int] | None = None,
) -> list[int] | None:
    """``[first, last]`` row numbers of the sheet rows ``text[start:end]`` touches; None when it touches none
    (a document without rows, or a segment of headings and header rows only).

    ``row_marks``: (offset where a data row's line begins, its row number), sorted by offset. A row touches the
    span when its line, up to its newline, overlaps it: a segment cut inside a row too long for one segment
    still cites that row. ``sheet_starts``: sorted offsets where a sheet begins (its ``##`` heading); a
    segment holding small sheets' rows cites those of its first sheet, the one its section names, since a
    range over two sheets' numbering ("rows 11-3") means nothing. ``mark_starts``: the marks' offsets, if known
    (:func:`segment_sources` lists them once for all of a document's segments, not once per segment).
    """
    if not row_marks:
        return None
    starts = [at for at, _ in row_marks] if mark_starts is None else mark_starts
    first = bisect.bisect_right(starts, start) - 1  # the row whose line begins at or before the span, ...
    if first < 0 or _line_end(text, starts[first]) <= start:
        first += 1  # ... unless its line ends before the span does begin
    if first < len(starts):
        following = bisect.bisect_right(sheet_starts, starts[first])
        if following < len(sheet_starts):
            end = min(end, sheet_starts[following])  # the next sheet's rows are not this sheet's
    last = bisect.bisect_left(starts, end) - 1  # the last row beginning inside the span
    if first > last:
        return None
    return [row_marks[first][1], row_marks[last][1]]


def _line_end(text: str, at: int) -> int:
    end = text.find("\n", at)
    return len(text) if end < 0 else end


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


def sections_of(
    text: str, headings: Sequence[Heading], start: int, end: int, starts: Sequence[int] | None = None
) -> list[str]:
    """Every section ``text[start:end]`` holds text of, in order: the one it opens in (:func:`section_of`), then
    each heading that starts inside it with text after it there. A passage that opens before the first heading
    (a README's opening paragraph, then ``## Install`` and ``## Usage``) holds no section's text at first and
    then the sections that follow: those (it cited none). The segmenter fills a segment with whole small
    sections (three short e-mails of a mailbox, a FAQ's questions), so the first alone would cite the rest
    wrongly."""
    first = section_of(text, headings, start, end, starts)
    starts = [h.start for h in headings] if starts is None else starts
    titles = [] if first is None else [first]
    pos = _skip_space(text, start, end)
    for i in range(bisect.bisect_right(starts, pos), bisect.bisect_left(starts, end)):
        body = _skip_space(text, headings[i].end, end)  # where its text begins, if it has any in the segment
        has_text = body < end and not (i + 1 < len(headings) and headings[i + 1].start == body)
        if has_text and (not titles or headings[i].title != titles[-1]):
            titles.append(headings[i].title)
    return titles


def segment_sources(
    text: str,
    spans: Sequence[tuple[int, int]],
    page_starts: Sequence[int] = (),
    row_marks: Sequence[tuple[int, int]] = (),
) -> list[dict[str, Any]]:
    """One ``{"pages": [first, last] or None, "section": str or None}`` per span of ``text``, in order, with
    ``"sections"`` (every section it holds, :func:`sections_of`) where that is more than one, and ``"rows":
    [first, last] or None`` where the document has rows: what a document record stores in ``sources``."""
    headings = find_headings(text)
    starts = [h.start for h in headings]
    pages = sorted(page_starts)
    rows_at = [at for at, _ in row_marks]
    sources = []
    for a, b in spans:
        first = section_of(text, headings, a, b, starts)
        titles = sections_of(text, headings, a, b, starts)  # the first is section_of's, where there is one
        source: dict[str, Any] = {"pages": page_range(pages, a, b), "section": first}
        if len(titles) > 1 or (first is None and titles):  # (opening before any heading: even one)
            source["sections"] = titles
        if row_marks:
            source["rows"] = row_range(text, row_marks, a, b, starts, rows_at)
        sources.append(source)
    return sources


def describe(
    pages: Sequence[int] | None,
    section: str | None,
    rows: Sequence[int] | None = None,
    sections: Sequence[str] | None = None,
) -> str:
    """``p. 3 § Specifications``, ``pp. 3-4``, ``§ Install``, ``§ Parts rows 26-50``, or "" when nothing is known;
    a passage holding several sections names its first and last as a page range does: ``§ Install … Upgrade``
    (a sheet's rows are its first one's: ``§ Pumps rows 11-15 … Valves``)."""
    parts = []
    if pages:
        parts.append(_span("p.", "pp.", pages))
    title = section or (sections[0] if sections else None)  # none: it opens before any heading, then holds these
    if title:
        parts.append(f"§ {title}")
    if rows:  # a sheet's rows are its first section's (provenance.row_range)
        parts.append(_span("row", "rows", rows))
    if sections and len(sections) > 1:
        parts.append(f"… {sections[-1]}")
    return " ".join(parts)


def _span(one: str, many: str, pair: Sequence[int]) -> str:
    """``p. 3`` or ``pp. 3-4``, ``row 7`` or ``rows 2-26``."""
    first, last = pair[0], pair[-1]
    return f"{one} {first}" if first == last else f"{many} {first}-{last}"


def cite(segments: Iterable[Any]) -> str:
    """The sources of an answer's passages, one document after another in prompt order:
    ``manual.pdf p. 3 § Specifications, p. 5 § Safety; guide.md § Install``.

    ``segments``: objects or dicts with ``document``, ``pages``, ``section`` and maybe ``sections`` and ``rows``
    (SegmentInfo, or
    its JSON).
    Passages of no ingested document (a ``--context-file``, a client's chunk) are left out; "" when none is left.
    """
    by_document: dict[str, list[str]] = {}
    for seg in segments:
        document = _field(seg, "document")
        if not document:
            continue
        where = describe(_field(seg, "pages"), _field(seg, "section"), _field(seg, "rows"), _field(seg, "sections"))
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
