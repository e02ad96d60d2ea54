"""QA records in the MuSiQue schema, and the bench's options that name modes and ratios.

One parser for every QA file kvblend reads — the `kvblend bench` dataset and
`kvblend tune`'s calibration set alike — so both fail the same way on the same
mistakes: one line naming the file, the record and what is wrong. No torch here
(the CLI checks a dataset before it loads a model).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvblend.archive.codec import check_codec
from kvblend.defaults import DEFAULT_RATIO
from kvblend.documents import read_user_text
from kvblend.errors import UsageError
from kvblend.options import MODES, check_ratio

#: `kvblend bench` settings when not told (each spelled once: the CLI shows them in --help).
DEFAULT_BENCH_MODES = ("full", "prefix", "reuse", "blend")
DEFAULT_BENCH_RATIOS = (0.05, DEFAULT_RATIO, 0.3)
DEFAULT_CHUNKS = 6
DEFAULT_BENCH_MAX_NEW_TOKENS = 32
ANSWER_KL_TOKENS = 16  # full's first answer tokens that every mode is teacher-forced through
DEFAULT_VARIANT_RATIO = DEFAULT_RATIO
#: `bench --pareto`: the ratios every policy's line runs (`--pareto-ratios`)
PARETO_RATIOS = (0.05, 0.1, DEFAULT_RATIO, 0.2, 0.3, 0.5)

_SCHEMA = 'a JSON list of {"ctxs": [{"title", "text"}, ...], "question", "answers"}'


@dataclass
class QARecord:
    """One QA item: passages (title, text) in retrieval order, a question, gold answers.

    `segment_keys`, when the passages are archived segments (tune's calibration prompts), name them in the same
    order, so their stored KV can be read instead of prefilled again.
    """

    question: str
    passages: list[tuple[str, str]]
    answers: list[str]
    segment_keys: tuple[str, ...] = ()

    def passage_texts(self, chunks: int | None = None) -> list[str]:
        """The first `chunks` passages (all with None) as archived: ``"{title}\\n\\n{text}"``."""
        return [f"{title}\n\n{text}" for title, text in self.passages[:chunks]]


def _passages(where: str, ctxs: Any) -> list[tuple[str, str]]:
    if not isinstance(ctxs, list) or not ctxs:
        raise UsageError(f"{where}: 'ctxs' must be a non-empty list of passages")
    passages = []
    for j, c in enumerate(ctxs):
        if not isinstance(c, dict) or not isinstance(c.get("text"), str) or not isinstance(c.get("title", ""), str):
            raise UsageError(f"{where}: ctxs[{j}] must be an object with string 'title' and 'text'")
        if not c["text"].strip():
            raise UsageError(f"{where}: ctxs[{j}] has an empty 'text'")
        passages.append((c.get("title", "") or "", c["text"]))
    return passages


def _record(where: str, item: Any) -> QARecord:
    if not isinstance(item, dict):
        raise UsageError(f"{where} is not an object; expected {_SCHEMA}")
    missing = [k for k in ("ctxs", "question", "answers") if k not in item]
    if missing:
        raise UsageError(f"{where} lacks {', '.join(repr(m) for m in missing)}; expected {_SCHEMA}")
    question, answers = item["question"], item["answers"]
    if not isinstance(question, str) or not question.strip():
        raise UsageError(f"{where}: 'question' must be a non-empty string")
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise UsageError(f"{where}: 'answers' must be a non-empty list of strings")
    return QARecord(question.strip(), _passages(where, item["ctxs"]), list(answers))


def load_records(path: str | os.PathLike[str], limit: int | None = None, what: str = "dataset") -> list[QARecord]:
    """Read a QA file (:data:`_SCHEMA`), the first `limit` records.

    Raises UsageError, with one line naming the problem, for a missing or
    unreadable file, invalid JSON, or records that do not follow the schema.
    """
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be at least 1, not {limit}")
    p = Path(path)
    try:
        data = json.loads(read_user_text(p, f"{what} file"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} {p} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, list) or not data:
        raise UsageError(f"{what} {p} must be {_SCHEMA}")
    return [_record(f"{what} {p}, record {i}", item) for i, item in enumerate(data[:limit])]


# ───────────────────────────────── options naming runs ─────────────────────────────────


def parse_modes(text: str | Sequence[str]) -> tuple[str, ...]:
    """'full,reuse,blend' → ('full', 'reuse', 'blend'); unknown or repeated modes are errors."""
    items = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    if not items:
        raise UsageError("--modes needs at least one mode")
    for m in items:
        if m not in MODES:
            raise UsageError(f"unknown mode {m!r} in --modes; choose from {', '.join(MODES)}")
    if len(set(items)) != len(items):
        raise UsageError("--modes lists a mode twice")
    return tuple(items)


def parse_codecs(text: str | Sequence[str]) -> tuple[str, ...]:
    """'lossless,int8,int4' → ('zstd-shuffle', 'int8', 'int4'): canonical names, in order, repeats dropped."""
    items = [c.strip() for c in (text.split(",") if isinstance(text, str) else text) if c.strip()]
    if not items:
        raise UsageError("--codecs needs at least one codec")
    try:
        codecs = tuple(dict.fromkeys(check_codec(c) for c in items))
    except UsageError as e:
        raise UsageError(f"--codecs: {e}") from None
    if "zstd" in codecs:  # lossless codecs share their keys: the passages stored for the full run were read back
        raise UsageError(  # as zstd-shuffle and reported as zstd
            "--codecs compares lossless (zstd-shuffle), int8 and int4; plain zstd stores the same KV under the "
            "same keys as lossless, so a benchmark cannot tell them apart (`kvblend ingest --codec zstd` sizes it)"
        )
    return codecs


def parse_ratios(text: str | Sequence[float], flag: str = "--ratios") -> tuple[float, ...]:
    """'0.05,0.15' → (0.05, 0.15), in the order given, repeats dropped; each in (0, 1].

    `default` stands for the ratio a query uses when none is given or tuned (issue 33: a benchmark of
    "the default" follows the default when it changes)."""
    if isinstance(text, str):
        try:
            values = [DEFAULT_RATIO if x.strip() == "default" else float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"{flag} takes comma-separated numbers in (0, 1] or `default`, not {text!r}") from None
    else:
        values = [float(x) for x in text]
    if not values:
        raise UsageError(f"{flag} needs at least one ratio")
    return tuple(dict.fromkeys(check_ratio(r, flag) for r in values))
