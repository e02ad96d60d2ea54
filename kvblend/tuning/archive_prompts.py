"""Calibration prompts made of the archive's own passages, so `tune` measures blending on what users ask about.

The bundled calibration set is MuSiQue: six Wikipedia passages and a multi-hop
question. An archive of manuals or meeting notes looks nothing like it, and a
ratio calibrated there can be far off (issue 20: on 3 hold-out passages the
bundled set's KL bound was missed at every ratio up to 0.3). So, by default,
`tune` builds its prompts from the archive itself:

* each prompt holds several archived passages (up to top-k, the number a query
  retrieves), in a shuffled order, as a query would stitch them;
* its question needs one of them: a sentence of that passage cut in two,
  asking how it ends. The first answer token then depends on reading the right
  passage through the other passages' KV: exactly the cross-attention that
  reuse loses and blend must restore. The sentence's end is the gold answer
  (for the F1 bound).

Everything is drawn with a fixed seed from the archive's segment keys, so the
same archive gives the same prompts on every run. Each prompt names its
segments, so the sweep reads their stored KV (what queries will read: the
archive's codec and sink included) instead of prefilling them again.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvblend.archive.records import SegmentRecord
from kvblend.evaluation.records import QARecord

#: A sentence worth asking about: long enough that its end is not guessable from its start alone.
MIN_WORDS, MAX_WORDS = 8, 48
#: The words of the sentence the question quotes (at least), before the part to be completed.
MIN_QUOTED = 4
SEED = 20

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Cloze:
    """A question about one passage: the start of one of its sentences, and the rest of it (the answer)."""

    quoted: str
    rest: str

    @property
    def question(self) -> str:
        return f'How does this sentence from the passages end: "{self.quoted} …"?'


def sentence_clozes(text: str) -> list[Cloze]:
    """Every sentence of `text` fit to ask about, cut after its first half (one line, markup dropped)."""
    clozes = []
    for sentence in _SENTENCE_END.split(" ".join(text.split())):
        words = [w for w in sentence.split() if not w.startswith(("#", "|", "-", "*"))]
        if not MIN_WORDS <= len(words) <= MAX_WORDS:
            continue
        cut = max(MIN_QUOTED, len(words) // 2)
        rest = " ".join(words[cut:]).rstrip(".!?")
        if rest:
            clozes.append(Cloze(" ".join(words[:cut]), rest))
    return clozes


def usable_passages(records: Iterable[SegmentRecord]) -> dict[str, tuple[SegmentRecord, list[Cloze]]]:
    """Archived passages a question can be asked about (not the instruction prefix, with a sentence to quote),
    by key in key order, each with its clozes."""
    usable = {}
    for rec in sorted(records, key=lambda r: r.key):
        clozes = sentence_clozes(rec.text) if rec.extra.get("role") != "prefix" else []
        if clozes:
            usable[rec.key] = (rec, clozes)
    return usable


def archive_calibration(records: Iterable[SegmentRecord], limit: int, per_prompt: int) -> list[QARecord]:
    """Up to `limit` prompts of up to `per_prompt` archived passages each, every one asking about a different
    passage where there are enough (empty when the archive has no passage to ask about)."""
    usable = usable_passages(records)
    if not usable or limit < 1:
        return []
    passages = [rec for rec, _ in usable.values()]
    rng = random.Random(SEED)
    targets = rng.sample(passages, len(passages))
    prompts = []
    for i in range(limit):
        target = targets[i % len(targets)]
        others = [p for p in passages if p.key != target.key]
        chosen = [target, *rng.sample(others, min(len(others), max(0, per_prompt - 1)))]
        rng.shuffle(chosen)
        cloze = rng.choice(usable[target.key][1])
        prompts.append(
            QARecord(cloze.question, [("", p.text) for p in chosen], [cloze.rest], tuple(p.key for p in chosen))
        )
    return prompts
