"""Prompt assembly: chat template around segments, cut into token segments.

The chat template is rendered once with a marker where the passages go, then
split there: the part before is the instruction prefix, the part after holds
the question. Prefix and question are always computed; each passage keeps the
token ids it was archived with, so its KV can be reused as is. The prompt is
*defined* as the concatenation of these token lists, and every mode (full
included) runs on exactly the same ids, so comparisons are fair.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvblend.defaults import SINK_TOKENS
from kvblend.errors import UsageError
from kvblend.options import MUSIQUE_TEMPLATE, PromptTemplate
from kvblend.types import Segment

if TYPE_CHECKING:  # annotations only: assembling a prompt needs a tokenizer, not torch
    from kvblend.model.runner import ModelRunner

__all__ = [
    "MUSIQUE_TEMPLATE",
    "PromptTemplate",
    "assemble_prompt",
    "segment_text_for_kv",
    "split_template",
    "template_sink",
]

CONTEXT_MARKER = "\u2063KVBLEND_PASSAGES\u2063"
SEGMENT_SEPARATOR = "\n\n"


def segment_text_for_kv(text: str) -> str:
    """The exact text whose tokens a passage segment is archived with (separator included)."""
    return text.strip() + SEGMENT_SEPARATOR


def split_template(runner: ModelRunner, template: PromptTemplate, question: str) -> tuple[str, str]:
    """Render the chat template with a marker for the passages; return (before, after) text."""
    if not question or not question.strip():
        raise UsageError("empty question")
    user = template.before_passages + CONTEXT_MARKER + template.after_passages.format(question=question.strip())
    messages = [{"role": "user", "content": user}]
    if template.system:
        messages.insert(0, {"role": "system", "content": template.system})
    tok = runner.tokenizer
    if getattr(tok, "chat_template", None):
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    else:  # base models: plain text, after the BOS their tokenizer would add (Gemma is lost without it)
        rendered = _bos_text(tok) + (template.system + "\n\n" if template.system else "") + user
        # a completion to continue: the answer comes after "Answer:" (and ends at its line, see stop_token_ids)
        rendered += "" if rendered.rstrip().endswith("Answer:") else "\nAnswer:"
    before, _, after = rendered.partition(CONTEXT_MARKER)
    return before, after


def _bos_text(tokenizer) -> str:
    """The BOS token's text if the tokenizer starts every encoded text with it, else "".

    Prompts are tokenized without special tokens (they are concatenations of fragments), so a
    base model without a chat template would otherwise never see the BOS it was trained behind.
    """
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    ids = tokenizer.encode("x", add_special_tokens=True)
    return bos if ids and ids[0] == bos_id else ""


def assemble_prompt(
    runner: ModelRunner,
    template: PromptTemplate,
    question: str,
    passages: list[Segment],
) -> list[Segment]:
    """[instruction prefix] + passages (cached or not) + [question], as token segments."""
    before, after = split_template(runner, template, question)
    return [Segment(runner.tokenize(before), key="prefix"), *passages, Segment(runner.tokenize(after), key="question")]


def template_sink(runner: ModelRunner, n: int | None = SINK_TOKENS) -> list[int]:
    """A fixed sink: the first `n` tokens of the default template's instruction prefix (the same for
    every question and every template's opening turn), for segments prefilled after it
    (`ingest --sink template`); with `n` None the whole prefix (`ingest --sink prefix`): a passage
    prefilled after it has, when it comes first in a default-template prompt, exactly its KV there."""
    before, _ = split_template(runner, PromptTemplate(), "?")
    ids = runner.tokenize(before)
    return ids if n is None else ids[:n]
