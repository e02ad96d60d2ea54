"""Split a document into segments of at most ``chunk_tokens`` tokens.

Segments are the unit of KV reuse: each one is prefilled on its own and stored
under a key derived from its text, so the split must be

* **deterministic** — the same text (and tokenizer, and page starts) always
  gives the same segments;
* **local** — editing one paragraph changes only the segments near it, so the
  rest of the document's cached KV stays valid;
* **structural** — a segment should be a passage a reader would cite: it
  starts at a heading where it can, and never ends mid-sentence where a
  paragraph, page or sentence end is available.

How it cuts
-----------
0. A text that fits in ``chunk_tokens`` (checked with one ``count_tokens``
   call on the whole stripped text) is one segment.
1. The text is split into *blocks*: paragraphs (at blank lines), cut again
   before every heading (a Markdown ATX line, ``#`` .. ``######``, a space, a
   title; or a title underlined with ``===`` or ``---``, as Markdown's setext
   headings and plain-text and reStructuredText documents have them; not
   inside a ``` or ~~~ fence) and at every page start in
   ``breaks`` that follows a sentence end.  Two refinements keep blocks whole:

   * a page start never cuts a sentence: where the text before a page start
     does not end a sentence (``.``, ``!``, ``?``, ``…``, CJK ``。！？`` and
     the other scripts' sentence terminals, maybe closing quotes) and no
     heading follows it, the two sides stay one block even if
     the converter put a blank line there (a sentence running over a page);
   * a *bare* heading block (the heading line and nothing else) is glued to
     the block after it, so a heading never ends a segment apart from its
     text, and ``# Title`` / ``## Section`` / text stay together.

   A block that fits in ``chunk_tokens`` is one unit.  A longer one is split
   at sentence ends (a terminal and whitespace; in Chinese and Japanese,
   which put no space between sentences, after ``。！？`` wherever they
   stand), a sentence still too long at line breaks, then at spaces
   between words, and a single giant word between characters (those last
   pieces are cut to fit exactly).
2. Units are packed greedily, in order, into segments of at most
   ``chunk_tokens`` tokens (a segment's size is estimated as the sum of its
   units' counts plus the count of any newline gap between them, then checked
   with one ``count_tokens`` call on the finished segment; if the estimate was
   too optimistic, units are moved to the next segment until it fits).
3. **Anchors.** Some blocks are *anchors*: a block is one when a hash of its
   own text, read as a number in [0, 1), is below
   ``n_tokens / (ANCHOR_SPAN * chunk_tokens)``.  An anchor block always
   starts a new segment.  Anchors depend only on the block itself, so they
   fall at the same places before and after an edit elsewhere; on average one
   falls every ``ANCHOR_SPAN * chunk_tokens`` tokens.
4. **Headings.** A block that starts with a heading starts a new segment too,
   unless the segment being filled holds fewer than
   ``chunk_tokens / HEADING_MIN_FILL`` tokens: then the heading joins it, so
   a run of tiny sections (an FAQ, or ``#`` comments in code read as text)
   packs into one segment instead of one segment each.  A bare heading at the
   very end of the text starts nothing (it has no text to introduce).

Edit locality (the property achieved)
-------------------------------------
Call the stretch from one anchor block up to (not including) the next a
*region*; packing restarts at every region.  If an edit changes only
paragraph P (its text, or by splitting/merging it with blank lines), then

* every segment before the one that holds the block before P's block is
  unchanged: packing reads left to right, and only the segment being filled
  when P is reached can see it (it may absorb P if P shrank, or close earlier
  if P grew), and
* every segment from the first anchor block after P's block onwards is
  unchanged (packing restarts there from the same state).  P's block is P
  itself unless P is, or follows, a bare heading or a page start that a
  sentence runs over; then it is the block glued or joined around P.

Only the segments between P and the next anchor can change — on average
about ``ANCHOR_SPAN / 2`` segments, whatever the document's length.  (This is
for texts longer than one chunk before and after the edit: a text that fits
in ``chunk_tokens`` is always a single segment, anchors or not.)  Heading
cuts do not weaken this: they depend only on the text since the last anchor,
and in practice packing re-synchronises at the next heading too.  Plain
greedy packing has no such bound: in a document of equal-sized paragraphs,
inserting one paragraph near the start shifts every later boundary.  The
price is that a region's last segment is usually not full (roughly one
segment in ``ANCHOR_SPAN`` is partial).  A document without headings and
page starts is split exactly as before headings and pages were known, so
archived segments of such documents keep their keys.

Text is never rewritten: each segment is an exact slice of the source with
only its leading and trailing whitespace removed.  Between two consecutive
segments the source has only whitespace, except where a giant word was cut
between characters (nothing between).  So, with ``re.sub(r"\\s+", "", s)``
as the normalisation, ``normalise("".join(segments)) == normalise(text)``;
:func:`split_into_spans` gives the exact source offsets for callers that need
to rebuild the text byte for byte, and :func:`find_headings` the headings
that name a segment's section (kvblend.provenance).
"""

from __future__ import annotations

import bisect
import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import regex

from kvblend.conversion import FENCE_LINE, UNDERLINE_RULE, fence_after
from kvblend.errors import UsageError

__all__ = [
    "ANCHOR_SPAN",
    "HEADING_MIN_FILL",
    "Heading",
    "find_headings",
    "split_into_segments",
    "split_into_spans",
]

# One anchor block every ANCHOR_SPAN * chunk_tokens tokens, on average.
ANCHOR_SPAN = 4
# A heading starts a new segment once the segment being filled holds chunk_tokens / HEADING_MIN_FILL tokens.
HEADING_MIN_FILL = 8

_PARAGRAPH_BREAK = re.compile(r"\n(?:[^\S\n]*\n)+")
# Closing quotes and brackets that may follow a sentence's final punctuation (Western and CJK).
_CLOSERS = "\"'”’)\\]」』）】〕〉》］｝"
# Full-width terminals (。．！？ and half-width ｡): CJK writes no space after a sentence, so they end one
# wherever they stand, except inside a quotation that the sentence goes on from (「本当？」と聞いた。: a closing
# bracket followed by the quotative と or って).
_CJK_TERMINALS = "。．！？｡"
# A sentence ends at Unicode's sentence terminals (. ! ? and the other scripts' ones: ؟ । ॥ ። ...; the
# `regex` module's \p{Sentence_Terminal}) or …, followed by whitespace, or at a CJK terminal, each with any
# closing quotes/brackets after it; the cut falls just after them. On Latin text this is the . ! ? … rule
# it always was, so archived segments keep their keys.
_SENTENCE_END = regex.compile(
    rf"[{_CJK_TERMINALS}]++(?:[{_CLOSERS}]++(?![とっ])|(?![{_CLOSERS}]))"  # possessive: no cut inside 「…！？」と
    rf"|[\p{{Sentence_Terminal}}…][{_CLOSERS}]*(?=\s)"
)
# A terminal that ends no sentence: a list item's number or letter alone on its line so far ("34." "b."), or an
# abbreviation that a name or example always follows ("Dr." "e.g."); a cut there parted item 34 from its text.
_LIST_MARKER = re.compile(r"\(?(?:\d{1,9}|[A-Za-z]|[ivxlcdm]{1,6})[.)]")
_ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "e.g", "i.e", "fig", "cf", "approx"}
)
# Lines of a block made of list items or table rows: cut between them before cutting inside one at a sentence.
_ITEM_OR_ROW = re.compile(r"\s*(?:[-*+•]\s|\d{1,9}[.)]\s|[A-Za-z][.)]\s|\|)")
# Text (stripped) that ends a sentence: what a page start must follow to cut there.
_ENDS_SENTENCE = regex.compile(rf"[\p{{Sentence_Terminal}}…][{_CLOSERS}]*$")
_LINE_BREAK = re.compile(r"\n")
_WORD = re.compile(r"\S+")
# CommonMark's ATX heading: up to 3 spaces, 1-6 #, a space or tab, a title (its closing #s are not part of it).
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+([^\n]*?)[ \t]*$", re.MULTILINE)
_CLOSING_HASHES = re.compile(r"(?:^|[ \t]+)#+$")
# A rule line under a title (an underlined heading, _underlined_headings): 3 or more of one character.
_UNDERLINE = re.compile(r"^ {0,3}([=\-~^*+])\1{2,}[ \t]*$", re.MULTILINE)
_UNDERLINE_HINT = re.compile(r"^ {0,3}" + UNDERLINE_RULE, re.MULTILINE)
_UNDERLINE_LEVELS = {"=": 1, "-": 2}  # reStructuredText's other rules: 3
_MAX_TITLE = 100
_WORD_CHAR = re.compile(r"\w")
# Lines that are something else: a list item, a quote, a table row, an ATX heading, a rule.
_NOT_A_TITLE = re.compile(r"(?:[-*+]|\d{1,9}[.)])(?:\s|$)|[>|#]|[=\-~^*+_]{3,}$")


@dataclass(frozen=True)
class Heading:
    """One heading: an ATX line (from its first ``#`` to its line's end) or an underlined title (from its title,
    or its overline, to its underline's end); its level and title."""

    start: int
    end: int
    level: int
    title: str


@dataclass
class _Unit:
    start: int
    end: int
    tokens: int
    anchor: bool = False  # always starts a segment
    heading: bool = False  # starts a segment once the one being filled holds enough


def find_headings(text: str) -> list[Heading]:
    """Every heading of ``text`` outside fenced code, in order (empty titles are no headings): ATX lines
    (``## Install``) and titles underlined with a rule (:func:`_underlined_headings`).

    Deterministic and linear: a ``#`` line or an underlined title inside a ``` or ~~~ fence is code, not a
    heading, so a fence opened and never closed hides every later heading (as Markdown renders it). Fences
    and headings are decided in one pass in text order: an underlined title outside a fence takes its
    ``~~~~`` rules (reStructuredText's) from the fences, and inside one its rule is a fence line that may
    close it.
    """
    if "#" not in text and not _UNDERLINE_HINT.search(text):
        return []
    # (position, order at one position: a title before a fence line there, which may be its overline)
    events: list[tuple[int, int, str, object]] = [(m.start(), 1, "fence", m) for m in FENCE_LINE.finditer(text)]
    if "#" in text:
        events += [(m.start(), 2, "atx", m) for m in _HEADING.finditer(text)]
    events += [(u.heading.start, 0, "underlined", u) for u in _underlined_headings(text)]
    events.sort(key=lambda e: (e[0], e[1]))
    headings: list[Heading] = []
    taken: set[int] = set()  # rule lines an accepted title owns: no fence
    fence: str | None = None  # the opening fence's marker while inside one
    for at, _, kind, found in events:
        if isinstance(found, _Underlined):
            if fence is None and (not headings or found.heading.start >= headings[-1].end):
                headings.append(found.heading)
                taken.update(found.rules)
        elif isinstance(found, re.Match) and kind == "fence":
            if at not in taken:
                end = text.find("\n", at)
                fence = fence_after(text[at : len(text) if end < 0 else end], fence)
        elif isinstance(found, re.Match) and fence is None:
            title = _CLOSING_HASHES.sub("", found.group(2)).strip()
            if len(title) > _MAX_TITLE:  # a paragraph pasted as a heading: its start names the section
                title = title[: _MAX_TITLE - 1].rstrip() + "…"
            if title:
                headings.append(Heading(found.start(1), found.end(), len(found.group(1)), title))
    return headings


@dataclass(frozen=True)
class _Underlined:
    """A candidate underlined heading, and where its rule lines (underline, and overline if any) start."""

    heading: Heading
    rules: tuple[int, ...]


def _underlined_headings(text: str) -> list[_Underlined]:
    """Titles underlined with a rule of ``=`` or ``-`` (Markdown's setext headings: level 1 and 2), or of ``~ ^ *
    +`` as reStructuredText also writes them (level 3), maybe with an overline too:

        Installation          ==========
        ------------          Overview
                              ==========

    Most plain-text documentation is written this way (649 of 946 text files in this VM's /usr/share/doc
    against 198 with ``#`` lines), so without them those documents had no sections to cite or to start a
    segment at. A rule under a sentence is a separator, not a heading, so a title is a short line (at most
    :data:`_MAX_TITLE` characters, a word in it) that begins its paragraph, is no list item, quote, table row
    or ``#`` heading, and does not end like a sentence part (``.`` ``,`` ``;`` ``:``); a rule of ``~ ^ * +`` is
    at least as long as its title, as reStructuredText requires. ``~`` also fences Markdown code, so a ``~``
    rule is 4 or more long and has a blank line (or the end) after it, which a fence's code does not. An
    overline begins its paragraph and is no earlier title's underline. The heading starts at its title, or at
    its overline, and ends with its underline. Whether a candidate lies inside a fence is
    :func:`find_headings`' to decide."""
    found: list[_Underlined] = []
    underlines: set[int] = set()
    for m in _UNDERLINE.finditer(text):
        if m.start() == 0:
            continue
        title_end = m.start() - 1  # the newline before the rule
        title_start = text.rfind("\n", 0, title_end) + 1
        line = text[title_start:title_end]
        title = " ".join(line.split())
        char, rule = m.group(1), m.group(0).strip()
        if not _is_title(line, title) or (char not in "=-" and len(rule) < len(title)):
            continue
        if char == "~" and (len(rule) < 4 or _line_after(text, m.end()).strip()):
            continue  # a fence: Markdown's are ~~~, and code follows them
        start = title_start + len(line) - len(line.lstrip())
        rules: tuple[int, ...] = (m.start(),)
        if title_start > 0:  # the line before the title: blank (it begins a paragraph), or its overline
            before_start = text.rfind("\n", 0, title_start - 1) + 1
            before = text[before_start : title_start - 1].strip()
            if before:
                overline = (
                    before == char * len(before)
                    and len(before) >= (4 if char == "~" else 3)
                    and before_start not in underlines
                    and (before_start == 0 or not _line_before(text, before_start).strip())
                )
                if not overline:
                    continue  # the last line of a paragraph over a separator
                start, rules = before_start, (before_start, m.start())
        underlines.add(m.start())
        found.append(_Underlined(Heading(start, m.end(), _UNDERLINE_LEVELS.get(char, 3), title), rules))
    return found


def _line_after(text: str, end: int) -> str:
    """The line after the one ending at ``end`` (its newline), "" at the end of the text."""
    if end >= len(text):
        return ""
    stop = text.find("\n", end + 1)
    return text[end + 1 : stop if stop >= 0 else len(text)]


def _line_before(text: str, start: int) -> str:
    """The line before the one starting at ``start`` (> 0)."""
    return text[text.rfind("\n", 0, start - 1) + 1 : start - 1]


def _is_title(line: str, title: str) -> bool:
    """Whether ``line`` can be an underlined heading's title (see :func:`_underlined_headings`)."""
    return (
        0 < len(title) <= _MAX_TITLE
        and len(line) - len(line.lstrip(" ")) <= 3  # four spaces: Markdown's indented code
        and _WORD_CHAR.search(title) is not None
        and _NOT_A_TITLE.match(title) is None
        and title[-1] not in ".,;:"
    )


def split_into_segments(
    text: str, count_tokens: Callable[[str], int], chunk_tokens: int = 512, breaks: Iterable[int] = ()
) -> list[str]:
    """Split ``text`` into segments of at most ``chunk_tokens`` tokens.

    ``count_tokens(s)`` must return the number of tokens in ``s`` (e.g.
    ``len(tokenizer.encode(s, add_special_tokens=False))``).  ``breaks``:
    offsets into ``text`` where a page begins (``Document.page_starts``),
    cut candidates like paragraph breaks.  Empty or whitespace-only text
    gives ``[]``.  See the module docstring for where cuts fall and what an
    edit can change.
    """
    return [text[a:b] for a, b in split_into_spans(text, count_tokens, chunk_tokens, breaks)]


def split_into_spans(
    text: str, count_tokens: Callable[[str], int], chunk_tokens: int = 512, breaks: Iterable[int] = ()
) -> list[tuple[int, int]]:
    """Same split as :func:`split_into_segments`, as ``(start, end)`` offsets into ``text``."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise UsageError(f"chunk size must be a positive number of tokens, got {chunk_tokens!r}")
    cache: dict[str, int] = {}

    def count(start: int, end: int) -> int:
        piece = text[start:end]
        n = cache.get(piece)
        if n is None:
            n = int(count_tokens(piece))
            cache[piece] = n
        return n

    units: list[_Unit] = []
    for start, end, heading in _blocks(text, breaks):
        n = count(start, end)
        first = len(units)
        if n <= chunk_tokens:
            units.append(_Unit(start, end, n))
        else:
            pieces = _split_long(text, start, end, count, chunk_tokens, _order(text, start, end))
            units.extend(_with_its_heading(text, pieces, end, count, chunk_tokens) if heading else pieces)
        units[first].anchor = _is_anchor(text[start:end], n, chunk_tokens)
        units[first].heading = heading
    if not units:
        return []
    # A text that fits in one chunk is one segment, anchors or not.
    estimate = sum(u.tokens for u in units) + sum(_gap_cost(text, a, b, count) for a, b in zip(units, units[1:]))
    if estimate <= chunk_tokens * 1.1 and count(units[0].start, units[-1].end) <= chunk_tokens:
        return [(units[0].start, units[-1].end)]
    return _pack(text, units, count, chunk_tokens)


# ─────────────────────────────── internals ───────────────────────────────


def _paragraph_spans(text: str) -> list[tuple[int, int]]:
    spans = []
    pos = 0
    for m in _PARAGRAPH_BREAK.finditer(text):
        spans.append((pos, m.start()))
        pos = m.end()
    spans.append((pos, len(text)))
    return [s for s in (_strip(text, a, b) for a, b in spans) if s is not None]


def _blocks(text: str, breaks: Iterable[int]) -> list[tuple[int, int, bool]]:
    """(start, end, starts with a heading) of each block: paragraphs cut before headings and at page starts
    after a sentence end, joined over page starts a sentence runs across, bare headings glued to what follows."""
    headings = {h.start: h for h in find_headings(text)}
    starts = sorted(headings)
    pages = sorted({b for b in breaks if 0 < b < len(text)})
    blocks: list[tuple[int, int]] = []
    for start, end in _paragraph_spans(text):
        cuts = _between(starts, start, end)
        cuts += [b for b in _between(pages, start, end) if _ends_sentence(text, start, b)]
        pos = start
        for c in sorted(set(cuts)) + [end]:
            piece = _strip(text, pos, c)
            if piece is not None:
                blocks.append(piece)
            pos = c
    if pages:  # a page start that a sentence runs across (no sentence end before, no heading after) cuts nothing
        joined: list[tuple[int, int]] = []
        for start, end in blocks:
            if joined and start not in headings and _page_between(pages, joined[-1][1], start):
                prev_start, prev_end = joined[-1]
                if not _ends_sentence(text, prev_start, prev_end):
                    joined[-1] = (prev_start, end)
                    continue
            joined.append((start, end))
        blocks = joined
    out: list[tuple[int, int, bool]] = []
    glue: int | None = None  # start of the bare headings waiting for the block they introduce
    for i, (start, end) in enumerate(blocks):
        heading = headings.get(start)
        if heading is not None and end <= heading.end and i + 1 < len(blocks):  # bare: glued to the next block
            glue = start if glue is None else glue
            continue
        first = start if glue is None else glue
        bare = heading is not None and end <= heading.end  # only the last block can be: headings introducing nothing
        out.append((first, end, first in headings and not bare))
        glue = None
    return out


def _between(offsets: list[int], start: int, end: int) -> list[int]:
    """The sorted offsets strictly between start and end (bisect: a long document has many of both)."""
    return offsets[bisect.bisect_right(offsets, start) : bisect.bisect_left(offsets, end)]


def _ends_sentence(text: str, start: int, end: int) -> bool:
    """Whether text[start:end], stripped, ends a sentence (only its tail is read: blocks can be long)."""
    while end > start and text[end - 1].isspace():
        end -= 1
    return _ENDS_SENTENCE.search(text[max(start, end - 32) : end]) is not None


def _page_between(pages: list[int], left: int, right: int) -> bool:
    """Whether a page starts in [left, right] (pages sorted)."""
    i = bisect.bisect_left(pages, left)
    return i < len(pages) and pages[i] <= right


def _strip(text: str, start: int, end: int) -> tuple[int, int] | None:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if start < end else None


def _is_anchor(block: str, n_tokens: int, chunk_tokens: int) -> bool:
    """Whether this block always starts a segment (depends on nothing else)."""
    digest = hashlib.blake2b(block.encode("utf-8"), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2.0**64
    return u < n_tokens / (ANCHOR_SPAN * chunk_tokens)


def _cut_points(text: str, start: int, end: int, level: int) -> list[tuple[int, int]]:
    """Split text[start:end] into stripped pieces at sentence ends (0) or line breaks (1)."""
    region = text[start:end]
    if level == 0:
        cuts = [m.end() for m in _SENTENCE_END.finditer(region) if _ends_a_sentence(region, m.start(), m.end())]
    else:
        cuts = [m.start() for m in _LINE_BREAK.finditer(region)]
    pieces = []
    pos = 0
    for c in cuts + [len(region)]:
        s = _strip(text, start + pos, start + c)
        if s is not None:
            pieces.append(s)
        pos = c
    return pieces


def _ends_a_sentence(region: str, at: int, end: int) -> bool:
    """Whether the terminal found at region[at:end] ends a sentence: not a list marker alone on its line so
    far, not an abbreviation (:data:`_LIST_MARKER`, :data:`_ABBREVIATIONS`)."""
    # look back only as far as a list marker or an abbreviation reaches: the whole region each time was
    # quadratic in a long block (a 470k-character novel took 22 s)
    lo = max(0, at - 64)
    start = region.rfind("\n", lo, at) + 1
    if (start or lo == 0) and _LIST_MARKER.fullmatch(region[start:end].strip()):
        return False
    before = region[max(start, at - 16) : at]
    word = before.rsplit(None, 1)[-1] if before.strip() else ""
    return word.lstrip("(\"'").lower() not in _ABBREVIATIONS


def _lines_first(text: str, start: int, end: int) -> bool:
    """Whether a block is a list or a table (most of its lines items or rows): its lines are its units."""
    lines = [line for line in text[start:end].split("\n") if line.strip()]
    return len(lines) >= 3 and 2 * sum(1 for line in lines if _ITEM_OR_ROW.match(line)) >= len(lines)


def _split_long(text, start, end, count, chunk_tokens, order: tuple[int, ...] = (0, 1)) -> list[_Unit]:
    """Units for a span longer than chunk_tokens, cut by each kind in ``order`` in turn (0: sentence ends, 1: line
    breaks; a list or a table tries its lines first), then between words or characters."""
    if not order:
        return _hard_split(text, start, end, count, chunk_tokens)
    units: list[_Unit] = []
    pieces = _cut_points(text, start, end, order[0])
    if len(pieces) <= 1:
        return _split_long(text, start, end, count, chunk_tokens, order[1:])
    for a, b in pieces:
        n = count(a, b)
        if n <= chunk_tokens:
            units.append(_Unit(a, b, n))
        else:
            units.extend(_split_long(text, a, b, count, chunk_tokens, order[1:]))
    return units


def _with_its_heading(text: str, units: list[_Unit], end: int, count, chunk_tokens: int) -> list[_Unit]:
    """The units of an over-long block that opens with headings, the headings kept with the first text under
    them: a text with no cut before the budget (one long line) was split to the full budget, which left the
    heading a segment of its own. The rest is split again with the headings' room taken from it."""
    k = 0
    while k < len(units) and _only_headings(text[units[k].start : units[k].end]):
        k += 1
    if k == 0 or k == len(units):
        return units
    head = count(units[0].start, units[k].start)  # the headings and the gap after them
    if 2 * head > chunk_tokens:
        return units  # a heading as long as half a segment: no room to share
    rest = _split_long(text, units[k].start, end, count, chunk_tokens - head, _order(text, units[k].start, end))
    merged = _Unit(units[0].start, rest[0].end, count(units[0].start, rest[0].end))
    return units if merged.tokens > chunk_tokens else [merged, *rest[1:]]


def _only_headings(piece: str) -> bool:
    """Whether a piece of text is nothing but headings."""
    covered = 0
    for h in find_headings(piece):
        if piece[covered : h.start].strip():
            return False
        covered = h.end
    return covered > 0 and not piece[covered:].strip()


def _order(text: str, start: int, end: int) -> tuple[int, ...]:
    return (1, 0) if _lines_first(text, start, end) else (0, 1)


def _longest_fit(bounds: list[int], lo_start: int, count, chunk_tokens: int, cap: int) -> int:
    """Largest k (1 <= k <= len(bounds)) with count(lo_start, bounds[k-1]) <= chunk_tokens.

    ``bounds`` are increasing candidate end offsets.  Returns 0 if even the
    first does not fit.  Binary search, so O(log n) count calls.
    """
    hi = min(len(bounds), cap)
    if hi == 0 or count(lo_start, bounds[0]) > chunk_tokens:
        return 0
    lo = 1  # bounds[lo-1] fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(lo_start, bounds[mid - 1]) <= chunk_tokens:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _hard_split(text, start, end, count, chunk_tokens) -> list[_Unit]:
    """Cut a span with no usable sentence/line breaks between words, else characters."""
    words = [(start + m.start(), start + m.end()) for m in _WORD.finditer(text[start:end])]
    units: list[_Unit] = []
    i = 0
    while i < len(words):
        a = words[i][0]
        k = _longest_fit([w[1] for w in words[i:]], a, count, chunk_tokens, cap=chunk_tokens)
        if k == 0:  # a single word longer than chunk_tokens: cut between characters
            units.extend(_char_split(text, words[i][0], words[i][1], count, chunk_tokens))
            i += 1
            continue
        b = words[i + k - 1][1]
        units.append(_Unit(a, b, count(a, b)))
        i += k
    return units


def _char_split(text, start, end, count, chunk_tokens) -> list[_Unit]:
    units: list[_Unit] = []
    a = start
    while a < end:
        bounds = list(range(a + 1, min(end, a + 16 * chunk_tokens) + 1))
        k = max(1, _longest_fit(bounds, a, count, chunk_tokens, cap=len(bounds)))
        b = bounds[k - 1]
        units.append(_Unit(a, b, count(a, b)))
        a = b
    return units


def _gap_cost(text: str, prev: _Unit, unit: _Unit, count) -> int:
    """Tokens the whitespace between two units adds: 0 for spaces, else its own count."""
    gap = text[prev.end : unit.start]
    if gap == "" or "\n" not in gap:
        return 0
    return count(prev.end, unit.start)


def _pack(text: str, units: list[_Unit], count, chunk_tokens: int) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    min_fill = chunk_tokens / HEADING_MIN_FILL
    i = 0
    while i < len(units):
        j = i + 1  # units[i:j] go into this segment
        estimate = units[i].tokens
        while j < len(units) and not units[j].anchor and not (units[j].heading and estimate >= min_fill):
            add = units[j].tokens + _gap_cost(text, units[j - 1], units[j], count)
            if estimate + add > chunk_tokens:
                break
            estimate += add
            j += 1
        # Check the real count; move units to the next segment while it is too long.
        while j - i > 1 and count(units[i].start, units[j - 1].end) > chunk_tokens:
            j -= 1
        spans.append((units[i].start, units[j - 1].end))
        i = j
    return spans
