"""Segmenter: size bound, exact slices, cut preferences, determinism, edit locality."""

from __future__ import annotations

import random
import re

import pytest

from kvblend.errors import UsageError
from kvblend.provenance import segment_sources
from kvblend.segmenter import _is_anchor, _paragraph_spans, find_headings, split_into_segments, split_into_spans


def words(s: str) -> int:
    """Additive toy tokenizer: one token per whitespace-separated word."""
    return len(s.split())


def chars4(s: str) -> int:
    """Non-additive toy tokenizer: ~4 characters a token, whitespace included."""
    return (len(s) + 3) // 4


def no_ws(s: str) -> str:
    return re.sub(r"\s+", "", s)


VOCAB = (
    "sonar plant vessel depth manager engineer harbour survey beam cable "
    "housing firmware ceramic order fleet quay trial signal echo board"
).split()


def make_doc(seed: int, n_paragraphs: int, lo: int = 10, hi: int = 35) -> list[str]:
    """Paragraphs of lo..hi words in sentences of 4..9 words; every paragraph unique."""
    rng = random.Random(seed)
    paragraphs = []
    for p in range(n_paragraphs):
        n = rng.randint(lo, hi)
        ws = [f"p{p}"] + [rng.choice(VOCAB) for _ in range(n - 1)]
        sentences, i = [], 0
        while i < n:
            k = rng.randint(4, 9)
            sentences.append(" ".join(ws[i : i + k]).capitalize() + ".")
            i += k
        paragraphs.append(" ".join(sentences))
    return paragraphs


def test_empty_and_whitespace_only_give_no_segments():
    assert split_into_segments("", words) == []
    assert split_into_segments("  \n\n\t \n ", words) == []


def test_short_text_is_one_stripped_segment():
    assert split_into_segments("\n\n  Hello there.\n\nSecond para.  \n", words, 50) == [
        "Hello there.\n\nSecond para."
    ]


def test_bad_chunk_size_is_a_usage_error():
    with pytest.raises(UsageError):
        split_into_segments("text", words, 0)


@pytest.mark.parametrize("count", [words, chars4])
@pytest.mark.parametrize("seed", range(6))
def test_segments_fit_are_exact_slices_and_cover_the_text(count, seed):
    text = "\n\n".join(make_doc(seed, 40, 3, 60))
    limit = 40
    spans = split_into_spans(text, count, limit)
    segments = split_into_segments(text, count, limit)
    assert segments == [text[a:b] for a, b in spans]
    assert len(segments) > 5
    for seg in segments:
        assert count(seg) <= limit
        assert seg == seg.strip() and seg
    # Consecutive, non-overlapping; only whitespace between segments.
    for (a, b), (c, d) in zip(spans, spans[1:]):
        assert b <= c and text[b:c].strip() == ""
    assert no_ws("".join(segments)) == no_ws(text)


def test_packs_whole_paragraphs_when_they_fit():
    paragraphs = make_doc(1, 30)
    text = "\n\n".join(paragraphs)
    segments = split_into_segments(text, words, 80)
    assert len(segments) < len(paragraphs)  # packing did happen
    for seg in segments:
        # every segment is a run of whole paragraphs
        assert all(p in paragraphs for p in seg.split("\n\n"))
    assert "\n\n".join(segments) == text


def test_keeps_source_formatting_inside_segments():
    text = "Line one\nline two   with  spaces.\n\n\n   Indented para\twith tab."
    assert split_into_segments(text, words, 100) == [
        "Line one\nline two   with  spaces.\n\n\n   Indented para\twith tab."
    ]


def test_long_paragraph_is_cut_at_sentence_ends():
    paragraph = " ".join(f"Sentence number {i} has exactly seven words." for i in range(20))
    segments = split_into_segments(paragraph, words, 30)
    assert len(segments) >= 5
    for seg in segments:
        assert words(seg) <= 30
        assert seg.startswith("Sentence number") and seg.endswith("words.")
    assert " ".join(segments) == paragraph


def test_long_sentence_is_cut_between_words_and_giant_word_between_chars():
    sentence = " ".join(f"w{i}" for i in range(100))  # no sentence end anywhere
    segments = split_into_segments(sentence, words, 30)
    assert [words(s) for s in segments] == [30, 30, 30, 10]
    assert " ".join(segments) == sentence

    giant = "x" * 1000
    segments = split_into_segments(f"Short intro.\n\n{giant}\n\nOutro.", chars4, 64)
    assert all(chars4(s) <= 64 for s in segments)
    assert no_ws("".join(segments)) == no_ws(f"Short intro.{giant}Outro.")
    assert sum(1 for s in segments if set(s) == {"x"}) >= 1000 // 256


def test_real_count_is_checked_when_the_estimate_is_optimistic():
    # Joining pieces costs 3 extra tokens per newline here, which the estimate misses.
    def sneaky(s: str) -> int:
        return len(s.split()) + 3 * s.count("\n")

    text = "\n".join(" ".join(f"w{i}{j}" for j in range(9)) for i in range(40))
    segments = split_into_segments(text, sneaky, 50)
    assert all(sneaky(s) <= 50 for s in segments)
    assert no_ws("".join(segments)) == no_ws(text)


def test_deterministic():
    text = "\n\n".join(make_doc(7, 50, 3, 90))
    first = split_into_segments(text, chars4, 64)
    assert first == split_into_segments(text, chars4, 64)
    assert first == split_into_segments(str(text), chars4, 64)


def test_counts_pieces_not_characters():
    text = "\n\n".join(make_doc(3, 200))
    calls: list[int] = []

    def counting(s: str) -> int:
        calls.append(len(s))
        return words(s)

    segments = split_into_segments(text, counting, 64)
    # one count per paragraph plus one check per segment (+ a cached gap count)
    assert len(calls) <= 200 + len(segments) + 2
    assert sum(calls) <= 2.2 * len(text)


# ─────────────────────────────── edit locality ───────────────────────────────


def _segments_for(paragraphs, limit=60):
    return split_into_segments("\n\n".join(paragraphs), words, limit)


def test_editing_one_middle_paragraph_changes_few_segments():
    paragraphs = make_doc(11, 19)
    before = _segments_for(paragraphs)
    assert len(before) == 10
    k = 9  # the middle paragraph
    edited = list(paragraphs)
    edited[k] = paragraphs[k] + " An extra clause was added to this one."
    after = _segments_for(edited)

    hit = next(i for i, s in enumerate(before) if paragraphs[k] in s.split("\n\n"))
    assert 3 <= hit <= 6
    # everything before the segment holding the edit is identical
    assert after[:hit] == before[:hit]
    # and most segments after it are too (same text, same order, at the end)
    tail = before[hit + 1 :]
    unchanged = 0
    while unchanged < len(tail) and after[len(after) - 1 - unchanged] == tail[len(tail) - 1 - unchanged]:
        unchanged += 1
    assert unchanged >= (len(tail) + 1) // 2
    assert paragraphs[k] + " An extra" in "\n\n".join(after)


@pytest.mark.parametrize("seed", range(40))
def test_edit_never_reaches_past_the_next_anchor(seed):
    """The documented guarantee, for random edits (change, grow, shrink, split, insert)."""
    rng = random.Random(1000 + seed)
    limit = 50
    paragraphs = make_doc(seed, 60, 3, 45)
    k = rng.randrange(5, 55)
    edited = list(paragraphs)
    kind = seed % 5
    if kind == 0:
        edited[k] = paragraphs[k] + " Grown by a few words here."
    elif kind == 1:
        edited[k] = " ".join(paragraphs[k].split()[:2]) + "."
    elif kind == 2:
        edited[k] = paragraphs[k].replace(" ", " changed ", 1)
    elif kind == 3:
        ws = paragraphs[k].split()
        edited[k : k + 1] = [" ".join(ws[: len(ws) // 2]), " ".join(ws[len(ws) // 2 :])]
    else:
        edited.insert(k, "A brand new inserted paragraph about the quay.")
    before, after = _segments_for(paragraphs, limit), _segments_for(edited, limit)

    def seg_index(segs, paragraph):
        return next(i for i, s in enumerate(segs) if paragraph in s.split("\n\n"))

    # Prefix: all segments before the one holding paragraph k-1 are unchanged.
    keep = seg_index(before, paragraphs[k - 1])
    assert after[:keep] == before[:keep]

    # Suffix: from the first anchor after the edit, segments are unchanged.
    first_after = k + (2 if kind == 3 else 1)
    anchors = [
        j
        for j in range(first_after, len(edited))
        if _is_anchor(edited[j], words(edited[j]), limit)
    ]
    if anchors:
        a = seg_index(after, edited[anchors[0]])
        assert after[a].startswith(edited[anchors[0]])  # an anchor starts its segment
        n_tail = len(after) - a
        assert after[a:] == before[len(before) - n_tail :]


def test_anchors_resynchronise_where_plain_greedy_would_not():
    # Equal-sized paragraphs: greedy packing alone would shift every later
    # boundary after one inserted paragraph.
    rng = random.Random(5)
    paragraphs = [
        " ".join([f"q{p}"] + [rng.choice(VOCAB) for _ in range(19)]) + "." for p in range(120)
    ]
    before = _segments_for(paragraphs, 50)  # two paragraphs a segment
    inserted = " ".join(["Inserted"] + VOCAB[:19]) + "."  # also 20 words
    edited = paragraphs[:4] + [inserted] + paragraphs[4:]
    after = _segments_for(edited, 50)
    assert len(before) >= 50
    assert len(set(after) & set(before)) >= 0.75 * len(before)


def test_anchor_rate_matches_the_documented_span():
    paragraphs = make_doc(2, 2000, 10, 40)
    limit = 64
    n_anchor = sum(_is_anchor(p, words(p), limit) for p in paragraphs)
    total = sum(words(p) for p in paragraphs)
    expected = total / (4 * limit)
    assert 0.7 * expected <= n_anchor <= 1.3 * expected


def test_paragraph_spans_split_on_blank_lines_only():
    text = "a\nb\n\nc\n \t\n\nd\n"
    assert [text[a:b] for a, b in _paragraph_spans(text)] == ["a\nb", "c", "d"]


# ───────────────────────── real tokenizer (slower) ─────────────────────────


def test_text_that_fits_is_one_segment_even_with_an_anchor_paragraph():
    paragraphs = make_doc(4, 400, 10, 40)
    limit = 200
    anchor = next(p for p in paragraphs[1:] if _is_anchor(p, words(p), limit))
    text = f"{paragraphs[0]}\n\n{anchor}"
    assert words(text) <= limit
    assert split_into_segments(text, words, limit) == [text]
    # once the text no longer fits, the anchor starts a segment again
    long_text = "\n\n".join(paragraphs[1:12]) + "\n\n" + anchor
    assert split_into_segments(long_text, words, limit)[-1].startswith(anchor)


# ─────────────────────────── structure: headings and pages ───────────────────────────


def section(title: str, n_paragraphs: int, seed: int, level: int = 2) -> str:
    return "#" * level + f" {title}\n\n" + "\n\n".join(make_doc(seed, n_paragraphs))


def test_find_headings_reads_atx_lines_outside_code_fences():
    text = (
        "# Title #\n\n  ## Indented up to three ##\n\n    # four spaces is code\n\n#hashtag\n\n"
        "```sh\n# a shell comment\n```\n\n~~~\n# still code\n~~~\n\n###### Six\n\n####### seven is text\n\n#\n"
    )
    found = find_headings(text)
    assert [(h.level, h.title) for h in found] == [(1, "Title"), (2, "Indented up to three"), (6, "Six")]
    assert all(text[h.start] == "#" and text[h.start : h.end].endswith(("#", "Six")) for h in found)
    assert find_headings("no hashes at all") == []
    # a fence line with an info string opens a fence but never closes one, in the segmenter as in the converters
    nested = "````md\n```python\n# in the sample\n```python\n# still in it\n````\n\n# After\n"
    assert [h.title for h in find_headings(nested)] == ["After"]
    assert [h.title for h in find_headings("```\n# code\n```sh\n# still code\n```\n# Out\n")] == ["Out"]


def test_find_headings_reads_underlined_titles_as_plain_text_markdown_and_rst_write_them():
    text = (
        "README for Debian\n=================\n\nIntro.\n\nipv6 keys\n---------\nModern kernels have it.\n\n"
        "========\nOverview\n========\n\nSub part\n~~~~~~~~\n\nA sentence over a separator.\n-----------\n\n"
        "Lines of a\nparagraph\n---\n\n- a list item\n---\n\n> a quote\n---\n\n## ATX\n---\n\n"
        "Run this:\n~~~\nInside\n------\n~~~\n\nShort\n^^\n\n    code title\n    ----------\n\nLast\n----\n"
    )
    found = find_headings(text)
    assert [(h.level, h.title) for h in found] == [
        (1, "README for Debian"), (2, "ipv6 keys"), (1, "Overview"), (3, "Sub part"), (2, "ATX"), (2, "Last")]
    over = found[2]  # with an overline, the heading starts there; each ends with its underline
    assert text[over.start : over.end] == "========\nOverview\n========"
    assert text[found[0].start : found[0].end] == "README for Debian\n================="
    # "Run this:" over ~~~ is a fence (so "Inside" is code); "Sub part" over a ~~~~~~~~ as long is an underline
    assert [h.title for h in find_headings("Intro\n\nNote\n~~~~\n\n# after\n")] == ["Note", "after"]
    assert [h.title for h in find_headings("Intro\n\nRun:\n~~~~\n\n# in code\n")] == []
    # ~ also fences Markdown code: a fence's closing line is no underline, a fence before code none either, nor
    # is a ~~~ fence an overline; each fence still closes, so the headings after it are found
    fenced = {
        "# Setup\n\nRun:\n\n~~~~~~~~~~\na = 1\n\nb = 2\n~~~~~~~~~~\n\n# Usage\n": ["Setup", "Usage"],
        "# Tool\n\nUsage\n~~~~~~~~~~~~~\n$ tool --help\n~~~~~~~~~~~~~\n\n## Options\n\nExamples\n--------\n": [
            "Tool", "Options", "Examples"],
        "Intro text.\n\n~~~\nls\n~~~\n\nInstall\n=======\n": ["Install"],
        "Example\n~~~~~~~~~~\ncode here\n~~~~~~~~~~\n": [],
        "~~~~~~~~\nTitle\n~~~~~~~~\n\nText.\n\nNext\n====\n": ["Title", "Next"],  # reStructuredText's
        "B title\n=======\nC title\n=======\n": ["B title"],  # an underline is no overline of the next line
    }
    for text, titles in fenced.items():
        assert [h.title for h in find_headings(text)] == titles, text


def test_an_underlined_title_starts_a_segment_and_names_its_section():
    text = "\n\n".join(f"Part {i}\n{'-' * 6}\n\n" + "\n\n".join(make_doc(i, 4)) for i in range(3))
    spans = split_into_spans(text, words, 150)
    assert [text[a:b].split("\n", 1)[0] for a, b in spans] == ["Part 0", "Part 1", "Part 2"]
    assert [src["section"] for src in segment_sources(text, spans)] == ["Part 0", "Part 1", "Part 2"]


def test_a_heading_starts_a_new_segment():
    text = section("Install", 4, 1) + "\n\n" + section("Usage", 4, 2) + "\n\n" + section("Limits", 4, 3)
    segments = split_into_segments(text, words, 150)
    assert [s.split("\n", 1)[0] for s in segments] == ["## Install", "## Usage", "## Limits"]
    assert "\n\n".join(segments) == text


def test_a_long_section_still_splits_at_paragraphs_within_the_budget():
    preamble = "\n\n".join(make_doc(40, 2))
    text = preamble + "\n\n" + section("Long", 30, 4) + "\n\n" + section("Next", 2, 5)
    segments = split_into_segments(text, words, 80)
    assert all(words(s) <= 80 for s in segments)
    assert segments[0] == preamble
    assert segments[1].startswith("## Long") and sum(s.startswith("## Long") for s in segments) == 1
    assert segments[-1].startswith("## Next")
    assert "\n\n".join(segments) == text  # every cut at a paragraph break


def test_a_heading_joins_a_segment_that_holds_too_little_yet():
    text = "Short preamble.\n\n" + section("Long", 30, 4)
    segments = split_into_segments(text, words, 80)
    assert segments[0].startswith("Short preamble.\n\n## Long\n\n")  # 2 words alone would be a tiny segment


def test_headings_run_together_and_never_end_a_segment_apart_from_their_text():
    body = "\n\n".join(make_doc(6, 12))
    text = "# Manual\n\n## Overview\n\n### Scope\n\n" + body + "\n\n## Next\n\n" + body.replace("p", "q")
    segments = split_into_segments(text, words, 60)
    assert segments[0].startswith("# Manual\n\n## Overview\n\n### Scope\n\n")  # one block: a heading run + text
    for seg in segments:  # no segment ends with a heading line
        assert not seg.rsplit("\n", 1)[-1].startswith("#")
    assert sum(s.startswith("## Next") for s in segments) == 1


def test_tiny_sections_pack_together_instead_of_a_segment_each():
    faq = "\n\n".join(f"### Question {i}?\nAnswer {i} is short." for i in range(40))  # 7 words a section
    segments = split_into_segments(faq, words, 128)  # a heading cuts once a segment holds 128 / 8 = 16 words
    assert all(words(s) <= 128 for s in segments)
    assert all(words(s) >= 16 for s in segments[:-1]) and len(segments) == 14  # 3 sections each, not 1
    assert all(s.startswith("### Question") for s in segments)  # cut only at headings


def test_a_trailing_bare_heading_joins_the_last_segment():
    text = section("Only", 12, 7) + "\n\n## Appendix"
    segments = split_into_segments(text, words, 80)
    assert segments[-1].endswith("## Appendix") and segments[-1] != "## Appendix"


def test_a_text_without_headings_or_pages_splits_as_before():
    text = "\n\n".join(make_doc(8, 60, 3, 45))
    assert split_into_spans(text, words, 50) == split_into_spans(text, words, 50, breaks=())
    # page starts at paragraph starts after a sentence end change nothing either
    starts = [m.end() for m in re.finditer(r"\n\n", text)][::5]
    assert split_into_spans(text, words, 50, breaks=[0, *starts]) == split_into_spans(text, words, 50)


def test_page_starts_are_cut_candidates_after_a_sentence_end():
    pages = [" ".join(make_doc(20 + i, 3)) for i in range(6)]  # each page one long paragraph of sentences
    text = " ".join(pages)  # no blank lines at all: only the page starts (and sentences) can cut
    starts, pos = [], 0
    for page in pages:
        starts.append(pos)
        pos += len(page) + 1
    with_pages = split_into_spans(text, words, 200, breaks=starts)
    assert all(a in starts for a, _ in with_pages)  # each segment begins a page
    assert len(with_pages) < len(pages)  # short pages are not one segment each
    assert all(words(text[a:b]) <= 200 for a, b in with_pages)


def test_a_sentence_running_over_a_page_start_is_never_cut_there():
    first = " ".join(make_doc(30, 6)) + " The pump's maximum pressure is"
    second = "412 kPa at the rated flow. " + " ".join(make_doc(31, 6))
    text = first + "\n\n" + second  # the converter's blank line between pages, mid-sentence
    spans = split_into_spans(text, words, 80, breaks=[0, len(first) + 2])
    sentence = "The pump's maximum pressure is\n\n412 kPa"
    assert any(sentence in text[a:b] for a, b in spans)
    # without the page start it is a paragraph break like any other
    assert not any(sentence in text[a:b] for a, b in split_into_spans(text, words, 80))


@pytest.mark.parametrize("seed", range(8))
def test_structured_documents_still_fit_cover_and_repeat(seed):
    rng = random.Random(seed)
    parts = []
    for i in range(rng.randint(5, 15)):
        parts.append("#" * rng.randint(1, 3) + f" Section {i}")
        parts.extend(make_doc(seed * 100 + i, rng.randint(0, 6), 3, 70))
    text = "\n\n".join(parts)
    breaks = sorted(rng.sample(range(1, len(text)), 6))
    for count in (words, chars4):
        spans = split_into_spans(text, count, 48, breaks=breaks)
        assert spans == split_into_spans(text, count, 48, breaks=list(reversed(breaks)))
        assert all(count(text[a:b]) <= 48 for a, b in spans)
        assert all(b <= c and text[b:c].strip() == "" for (_, b), (c, _) in zip(spans, spans[1:]))
        assert no_ws("".join(text[a:b] for a, b in spans)) == no_ws(text)


def chars(s: str) -> int:
    """One token per character (CJK text has no spaces for `words` to count)."""
    return len(s.strip())


# Japanese prose as a converter hands it over: one paragraph, no spaces, sentences ended by 。！？
JAPANESE = (
    "ソナー工場は港の北側にあり、毎朝八時に操業を始める。"
    "工場長は三年前に着任した技術者で、品質の管理を最も重視している。"
    "「今月の出荷は間に合うのか？」と営業部長が尋ねた。"
    "新しい試験設備が導入され、検査の時間は半分になった！"
    "ただし、深海用のセラミック部品は今も手作業で検査されている。"
    "次の試験航海は来月の予定である。"
)


def test_japanese_is_cut_only_after_a_sentence_end_though_it_has_no_spaces():
    paragraph = JAPANESE * 3
    spans = split_into_spans(paragraph, chars, 80)
    assert len(spans) >= 4 and all(chars(paragraph[a:b]) <= 80 for a, b in spans)
    for a, b in spans:  # before: past the budget, a paragraph without spaces was cut between characters
        assert paragraph[b - 1] in "。！", paragraph[a:b]
    assert "".join(paragraph[a:b] for a, b in spans) == paragraph
    # a terminal inside a quotation that the sentence goes on from (「…？」と) does not end the sentence
    assert any("「今月の出荷は間に合うのか？」と営業部長が尋ねた。" in paragraph[a:b] for a, b in spans)


def test_no_cut_inside_a_quotation_the_sentence_goes_on_from():
    from kvblend.segmenter import _SENTENCE_END

    for text in ("「えっ！？」と驚いた。", "「本当。。」と言った。", "『「はい。」』と答えた。", "「行く？」って聞いた。"):
        assert [m.end() for m in _SENTENCE_END.finditer(text)] == [len(text)], text


def test_a_quotation_that_ends_a_sentence_is_a_cut():
    text = "「おはようございます。」「今日は試験の日です。」それから二人は港へ向かった。" * 4
    spans = split_into_spans(text, chars, 40)
    assert all(text[b - 1] in "。」" for a, b in spans)
    assert "".join(text[a:b] for a, b in spans) == text


def test_a_japanese_page_start_cuts_after_a_sentence_and_never_inside_one():
    first = JAPANESE + "この部品の最大圧力は"
    second = "定格流量で四一二キロパスカルである。" + JAPANESE
    text = first + "\n\n" + second  # a sentence running over the page start
    spans = split_into_spans(text, chars, 150, breaks=[0, len(first) + 2])
    assert any("この部品の最大圧力は\n\n定格流量で" in text[a:b] for a, b in spans)
    ended = JAPANESE + "\n\n" + JAPANESE  # the page start follows 。: it is a cut
    assert len(ended) > 160 and [a for a, _ in split_into_spans(ended, chars, 160, breaks=[len(JAPANESE) + 2])] == [
        0,
        len(JAPANESE) + 2,
    ]


def test_other_scripts_sentence_terminals_end_sentences():
    hindi = "सोनार कारखाना बंदरगाह के उत्तर में है। प्रबंधक हर सुबह आते हैं। परीक्षण अगले महीने होगा। " * 6
    spans = split_into_spans(hindi.strip(), words, 20)
    assert len(spans) > 1 and all(hindi.strip()[b - 1] == "।" for a, b in spans)


def test_a_list_is_cut_between_its_items_and_a_number_or_abbreviation_ends_no_sentence():
    """A 60-item list over budget was cut at "34." (any '.' then a space was a sentence end), so item 34's number
    ended one segment and its text began the next; a cut also fell after "Dr." and inside table rows."""
    items = "\n".join(f"{i}. Check the pressure gauge and note the reading in the log. Then wait." for i in range(1, 61))
    text = "## Service procedure\n\n" + items
    segs = split_into_segments(text, words, chunk_tokens=60)
    assert len(segs) > 1 and all(words(s) <= 60 for s in segs)
    for seg in segs:
        assert re.match(r"(## Service procedure\n\n)?\d+\. Check", seg) and seg.endswith("Then wait."), seg
    table = "| part | note |\n|---|---|\n" + "\n".join(
        f"| Part {i} | Replace it every {i} h. Check the seal weekly. |" for i in range(40))
    assert all(s.startswith("|") and s.endswith("|") for s in split_into_segments(table, words, chunk_tokens=40))
    prose = "It was redesigned by Dr. Smith and later Dr. Jones, e.g. for the sea. It sank. " * 4
    cuts = split_into_segments(prose, words, chunk_tokens=16)
    assert not any(s.endswith(("Dr.", "e.g.")) for s in cuts), cuts


def test_a_heading_stays_with_the_text_it_introduces_when_that_text_has_no_cut():
    """A heading glued to one long line of text with no sentence end became a segment of its own (the line was
    split to the full budget, which left no room for the heading)."""
    text = "# Log export\n\n" + " ".join(f"field{i}=value" for i in range(300))
    segs = split_into_segments(text, words, chunk_tokens=64)
    assert segs[0].startswith("# Log export\n\nfield0=value") and all(words(s) <= 64 for s in segs)
    assert " ".join(segs).split() == text.split()  # every word, once, in order


def test_a_heading_pasted_as_a_paragraph_names_its_section_by_its_start():
    title = "Service bulletin " + "and a very long pasted sentence " * 10
    (heading,) = find_headings(f"# {title}\n\ntext")
    assert len(heading.title) == 100 and heading.title.endswith("…") and title.startswith(heading.title[:-1])
