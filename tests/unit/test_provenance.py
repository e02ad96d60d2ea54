"""Provenance: a segment's offsets → its page range and section; how an answer cites its sources."""

from __future__ import annotations

from kvblend.pipeline.results import SegmentInfo
from kvblend.provenance import cite, describe, page_range, row_range, section_of, sections_of, segment_sources
from kvblend.segmenter import find_headings, split_into_spans

PAGES = (0, 100, 250, 400)  # pages 1..4


def test_page_range_is_the_pages_a_span_touches():
    assert page_range(PAGES, 0, 50) == [1, 1]
    assert page_range(PAGES, 90, 110) == [1, 2]
    assert page_range(PAGES, 100, 250) == [2, 2]  # the end is exclusive: 250 is page 3's first character
    assert page_range(PAGES, 260, 900) == [3, 4]
    assert page_range(PAGES, 400, 401) == [4, 4]
    assert page_range((), 0, 10) is None  # no pages: not "page 1"
    assert page_range((5, 20), 0, 3) == [1, 1]  # before the first start counts as page 1


def test_section_is_the_nearest_heading_at_or_before_the_text():
    text = "Intro text.\n\n# Manual\n\n## Specifications\n\nThe pump is rated.\n\nMore.\n\n## Safety ##\nWear gloves."
    heads = find_headings(text)

    def at(snippet: str, end: str | None = None) -> str | None:
        a = text.index(snippet)
        return section_of(text, heads, a, text.index(end) + len(end) if end else len(text))

    assert at("Intro") is None  # before any heading
    assert at("# Manual") == "Specifications"  # opens with a run of headings: the one its text falls under
    assert at("The pump") == "Specifications" and at("More.") == "Specifications"
    assert at("## Safety") == "Safety" and at("Wear") == "Safety"  # closing #s are not part of the title
    assert at("# Manual", "## Specifications") == "Specifications"  # nothing but headings: the last one


def test_segment_sources_for_a_paged_markdown_text():
    pages = [
        "# Orca-7 manual\n\nThis manual covers the pump.",
        "## Installation\n\nBolt the pump down.",
        "## Specifications\n\nThe Orca-7 pump's maximum pressure is 412 kPa.",
    ]
    text = "\n\n".join(pages)
    starts = tuple(text.index(p) for p in pages)
    spans = [(text.index(p), text.index(p) + len(p)) for p in pages]
    assert segment_sources(text, spans, starts) == [
        {"pages": [1, 1], "section": "Orca-7 manual"},
        {"pages": [2, 2], "section": "Installation"},
        {"pages": [3, 3], "section": "Specifications"},
    ]
    # one segment of the three: it names every section it holds, and cites the first and the last
    every = ["Orca-7 manual", "Installation", "Specifications"]
    whole = segment_sources(text, [(0, len(text))], starts)
    assert whole == [{"pages": [1, 3], "section": "Orca-7 manual", "sections": every}]
    assert segment_sources(text, [(0, len(text))]) == [{"pages": None, "section": "Orca-7 manual", "sections": every}]
    assert describe([1, 3], "Orca-7 manual", None, every) == "pp. 1-3 § Orca-7 manual … Specifications"
    # a segment opening inside Installation's text and ending inside Specifications'
    assert sections_of(text, find_headings(text), text.index("Bolt"), text.index("maximum")) == every[1:]
    # headings with no text of their own in the segment are not sections it holds
    glued = "# A\n## B\ntext of B\n\n# C\n# D\n\nfinal text"
    assert sections_of(glued, find_headings(glued), 0, len(glued)) == ["B", "D"]
    assert sections_of(glued, find_headings(glued), 0, glued.index("# C")) == ["B"]
    # text before the first heading is in no section, but the sections after it are the passage's too: it
    # cited none of them (a README's opening paragraph, then Install and Usage, cited nothing)
    preamble = "Release notes.\n\n# Install\n\npip install x\n"
    assert segment_sources(preamble, [(0, len(preamble))]) == [{"pages": None, "section": None, "sections": ["Install"]}]
    assert describe(None, None, None, ["Install"]) == "§ Install"
    assert describe(None, None, None, ["Install", "Usage"]) == "§ Install … Usage"
    assert segment_sources("Release notes, no heading.", [(0, 26)]) == [{"pages": None, "section": None}]
    # with the segmenter: page 3 is its own segment once the text is too long for one
    spans = split_into_spans(text, lambda s: len(s.split()), 16, breaks=starts)
    assert segment_sources(text, spans, starts)[-1] == {"pages": [3, 3], "section": "Specifications"}


def test_row_range_is_the_sheet_rows_a_span_touches():
    text = "## Parts\n\n| a | b |\n|---|---|\n| 1 | x |\n| 2 | yyyyyyyyyyyy |\n\n| a | b |\n|---|---|\n| 3 | z |"
    lines = {line: text.index(line) for line in ("| 1 |", "| 2 |", "| 3 |")}
    marks = [(lines["| 1 |"], 2), (lines["| 2 |"], 4), (lines["| 3 |"], 7)]  # row 3, 5, 6 were empty
    block2 = text.index("| a | b |", lines["| 2 |"])
    assert row_range(text, marks, 0, len(text)) == [2, 7]
    assert row_range(text, marks, 0, lines["| 2 |"]) == [2, 2]  # heading, header, row 2: its header is not a row
    assert row_range(text, marks, 0, lines["| 1 |"]) is None  # heading and header rows only
    assert row_range(text, marks, block2, len(text)) == [7, 7]  # the next block: header again, then row 7
    inside = text.index("yyyy")  # a segment cut inside a row too long for one segment cites that row
    assert row_range(text, marks, inside, inside + 4) == [4, 4] and row_range(text, marks, inside, len(text)) == [4, 7]
    assert row_range(text, [], 0, len(text)) is None
    spans = [(0, block2), (block2, len(text))]
    assert segment_sources(text, spans, (), marks) == [
        {"pages": None, "section": "Parts", "rows": [2, 4]},
        {"pages": None, "section": "Parts", "rows": [7, 7]},
    ]
    assert describe(None, "Parts", [2, 4]) == "§ Parts rows 2-4" and describe(None, None, [7, 7]) == "row 7"
    # two small sheets in one segment: the rows of the first, the sheet its section names, never "rows 11-3"
    book = "## Pumps\n\n| p | d |\n|---|---|\n| a | 1 |\n| b | 2 |\n\n## Valves\n\n| v |  s |\n|---|---|\n| c | 3 |"
    marks = [(book.index("| a |"), 11), (book.index("| b |"), 15), (book.index("| c |"), 2)]
    assert segment_sources(book, [(0, len(book))], (), marks) == [
        {"pages": None, "section": "Pumps", "sections": ["Pumps", "Valves"], "rows": [11, 15]}
    ]
    assert describe(None, "Pumps", [11, 15], ["Pumps", "Valves"]) == "§ Pumps rows 11-15 … Valves"
    assert segment_sources(book, [(book.index("| b |"), len(book))], (), marks)[0]["rows"] == [15, 15]
    assert segment_sources(book, [(book.index("## Valves"), len(book))], (), marks)[0]["rows"] == [2, 2]


def test_describe_and_cite():
    assert describe([3, 3], "Specifications") == "p. 3 § Specifications"
    assert describe([3, 4], None) == "pp. 3-4" and describe(None, "Install") == "§ Install"
    assert describe(None, None) == ""
    infos = [
        SegmentInfo("k1", "manual.pdf", 10, True, pages=[3, 3], section="Specifications"),
        SegmentInfo("k2", "guide.md", 10, True, section="Install"),
        SegmentInfo("k3", "manual.pdf", 10, True, pages=[5, 5], section="Safety"),
        SegmentInfo("k4", "manual.pdf", 10, True, pages=[3, 3], section="Specifications"),  # said once
        SegmentInfo("k5", None, 10, False),  # a --context-file passage: no document
        SegmentInfo("k6", "notes.txt", 10, True),  # nothing known but the document
    ]
    assert cite(infos) == "manual.pdf p. 3 § Specifications, p. 5 § Safety; guide.md § Install; notes.txt"
    assert cite([{"document": "a.md", "pages": None, "section": "X"}]) == "a.md § X"  # the JSON form too
    assert cite([{"document": "box.mbox", "section": "X", "sections": ["X", "Re: Y", "Z"]}]) == "box.mbox § X … Z"
    assert cite([{"document": "p.csv", "pages": None, "section": None, "rows": [2, 26]}]) == "p.csv rows 2-26"
    assert cite([SegmentInfo("k", None, 1, False)]) == ""
