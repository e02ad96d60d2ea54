"""Answer-quality and distribution metrics for judging blended answers.

* Text: SQuAD-style :func:`normalize_answer`, :func:`exact_match` and
  :func:`f1_score` (max over the gold answers), and :func:`rouge_l`
  (LCS-based F1 on normalised tokens).
* Logits: :func:`kl_divergence` KL(P || Q) with P the reference (full
  prefill) and Q the candidate (blended), in float64 via log-softmax, and
  :func:`token_kls` at each position of a sequence.
* :func:`percentile` for p50/p90 summaries.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "normalize_answer",
    "exact_match",
    "f1_score",
    "rouge_l",
    "kl_divergence",
    "token_kls",
    "percentile",
]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golds(ground_truths: str | Iterable[str]) -> list[str]:
    return [ground_truths] if isinstance(ground_truths, str) else list(ground_truths)


def _f1_tokens(pred: list[str], gold: list[str]) -> float:
    if not pred or not gold:  # SQuAD v2 convention: both empty is a match
        return float(pred == gold)
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred)
    recall = same / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, ground_truths: str | Sequence[str]) -> float:
    """Token-overlap F1 of the normalised prediction, best over the gold answers (0.0 if none)."""
    pred = normalize_answer(prediction).split()
    return max((_f1_tokens(pred, normalize_answer(g).split()) for g in _golds(ground_truths)), default=0.0)


def exact_match(prediction: str, ground_truths: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(ground_truths)))


def _lcs_length(a: list[str], b: list[str]) -> int:
    if len(b) > len(a):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, reference: str | Sequence[str]) -> float:
    """ROUGE-L F1 (beta = 1): LCS precision/recall on normalised tokens.

    With several references, the best score.  Both empty → 1.0; one empty → 0.0.
    """
    pred = normalize_answer(prediction).split()
    best = 0.0
    for ref in _golds(reference):
        gold = normalize_answer(ref).split()
        if not pred or not gold:
            score = float(pred == gold)
        else:
            lcs = _lcs_length(pred, gold)
            score = 0.0 if lcs == 0 else 2 * lcs / (len(pred) + len(gold))
        best = max(best, score)
    return best


# ───────────────────────────── distributions ─────────────────────────────


def _as_rows(x) -> torch.Tensor:
    t = torch.as_tensor(x).detach().to(device="cpu", dtype=torch.float64)
    if t.dim() == 0:
        raise ValueError("logits must have a vocabulary dimension")
    return t.reshape(-1, t.shape[-1])


def _row_kl(p_logits, q_logits) -> torch.Tensor:
    p, q = _as_rows(p_logits), _as_rows(q_logits)
    if p.shape != q.shape:
        raise ValueError(f"logit shapes differ: {tuple(p.shape)} vs {tuple(q.shape)}")
    log_p = torch.log_softmax(p, dim=-1)
    log_q = torch.log_softmax(q, dim=-1)
    p_prob = log_p.exp()
    # 0 * log(0 / q) = 0: positions P rules out contribute nothing (even if Q does too).
    terms = torch.where(p_prob > 0, p_prob * (log_p - log_q), torch.zeros_like(p_prob))
    return terms.sum(dim=-1).clamp_min(0.0)  # clamp rounding noise below zero


def kl_divergence(p_logits, q_logits) -> float:
    """KL(P || Q) in nats, P = softmax(p_logits) the reference, Q = softmax(q_logits).

    Accepts tensors (or array-likes) of shape ``[vocab]`` or ``[..., vocab]``;
    with several rows, the mean over rows.  Computed in float64.  Infinite if
    Q gives zero probability where P does not.
    """
    return float(_row_kl(p_logits, q_logits).mean())


def token_kls(ref_logits, cand_logits) -> list[float]:
    """KL(ref || cand) at each position, in order (``[n, vocab]`` each): where along an answer a mode drifts."""
    return [float(x) for x in _row_kl(ref_logits, cand_logits)]


def first_divergence(ref_tokens: Sequence[int], cand_logits) -> int | None:
    """The first position whose greedy choice under teacher forcing is not the reference's token (None: none).

    ``cand_logits[i]`` are the logits before ``ref_tokens[i]``, the candidate having been fed the reference's
    tokens before it: position i is where a greedy answer would first leave the reference's, all else equal."""
    if not ref_tokens:
        return None
    chosen = _as_rows(cand_logits)[: len(ref_tokens)].argmax(dim=-1).tolist()
    return next((i for i, (a, b) in enumerate(zip(chosen, ref_tokens)) if a != b), None)


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, like numpy's default.

    NaN for no values.
    """
    xs = sorted(float(v) for v in values)
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    frac = pos - lo
    if frac == 0:
        return xs[lo]
    return xs[lo] + (xs[lo + 1] - xs[lo]) * frac
