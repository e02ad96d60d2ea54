"""Segmenter: size bound, exact slices, cut preferences, determinism, edit locality."""

from __future__ import annotations

import random
import re

import pytest

from kvblend.errors import UsageError
from kvblend.segmenter import _is_anchor, _paragraph_spans, split_into_segments, split_into_spans


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
