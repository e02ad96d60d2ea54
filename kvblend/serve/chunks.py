"""Client chunks: the passages an app sends, turned into kvblend segments, and reported back.

An app that does its own retrieval sends its passages inside the user message,
either as separate text parts of an OpenAI content array or as blocks of one
string separated by CHUNK_SEPARATOR. Every block but the last is a passage; the
last is the question. Each passage becomes one segment keyed by its tokens
(Engine.key_of, the scheme ingest uses), so the same passage sent by any app,
or ingested from a file with the same text, hits the same archived KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: request parsing must not import the pipeline (torch)
    from kvblend.pipeline.results import SegmentInfo

# On a line of its own (or anywhere) in a string content: what comes before is a passage.
CHUNK_SEPARATOR = "<<<chunk>>>"


@dataclass(frozen=True)
class Conversation:
    """What a chat request asks: an optional system prompt, client passages, one question, and the earlier turns
    of a multi-turn chat as (role, text)."""

    system: str | None
    chunks: list[str]
    question: str
    history: list[tuple[str, str]] = field(default_factory=list)


def question_with_history(history: list[tuple[str, str]], question: str) -> str:
    """The question as the prompt carries it: after the passages, with the earlier turns before it.

    Earlier turns go *after* the passages, in the question's segment (always computed), so the instruction
    prefix and the passages keep their archived KV whatever the conversation said before.
    """
    if not history:
        return question
    turns = [f"{'User' if role == 'user' else 'Assistant'}: {text}" for role, text in history]
    return "Earlier in this conversation:\n" + "\n".join(turns) + "\n\nNow: " + question


def split_blocks(text: str) -> list[str]:
    """A text cut at CHUNK_SEPARATOR into stripped, non-empty blocks."""
    return [block.strip() for block in text.split(CHUNK_SEPARATOR) if block.strip()]


def conversation(system_texts: list[str], user_parts: list[str]) -> Conversation:
    """System texts and the user messages' text parts (in order) → passages + question.

    A ValueError says what is missing; the caller turns it into a 400.
    """
    blocks = [block for part in user_parts for block in split_blocks(part)]
    if not blocks:
        raise ValueError("the user message has no text: the last text part (or block) is the question")
    system = "\n\n".join(t.strip() for t in system_texts if t.strip()) or None
    return Conversation(system=system, chunks=blocks[:-1], question=blocks[-1])


def segment_source(info: SegmentInfo) -> str:
    """'hit' when the passage's archived KV was reused as is; 'computed' when this request
    computed it (a miss: prefilled alone and stored, or recomputed in the prompt)."""
    return "hit" if info.cached and not info.stored else "computed"


def segments_report(infos: list[SegmentInfo]) -> list[dict]:
    """The response's `kvblend.segments`: one entry per passage, in prompt order, with the document it came from
    and where in it (`pages` [first, last], `section`, a sheet's `rows` [first, last]: null when not known), so a
    client can cite its sources."""
    return [
        {
            "key": info.key,
            "tokens": info.tokens,
            "source": segment_source(info),
            "document": info.document,
            "pages": info.pages,
            "section": info.section,
            "sections": info.sections,
            "rows": info.rows,
        }
        for info in infos
    ]
