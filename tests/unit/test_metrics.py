"""Metrics on hand-computed cases."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from kvblend.evaluation.metrics import (
    exact_match,
    f1_score,
    kl_divergence,
    normalize_answer,
    percentile,
    rouge_l,
    token_kls,
)


def test_normalize_answer_drops_case_punctuation_articles_and_spaces():
    assert normalize_answer("  The Tern-4, an  Echo-Sounder!  ") == "tern4 echosounder"
    assert normalize_answer("A theory of an apple") == "theory of apple"
    assert normalize_answer("Theatre") == "theatre"  # 'the' only as a whole word


def test_f1_hand_computed():
    # "the cat sat" -> [cat, sat]; "cat sat down" -> [cat, sat, down]
    # overlap 2: P = 2/2, R = 2/3, F1 = 2PR/(P+R) = 0.8
    assert f1_score("the cat sat", ["cat sat down"]) == pytest.approx(0.8)
    assert f1_score("Solberg", ["Ingrid Solberg"]) == pytest.approx(2 / 3)
    assert f1_score("nothing shared", ["Ingrid Solberg"]) == 0.0
    # repeated tokens count only as often as they overlap: P = 1/3, R = 1 -> 0.5
    assert f1_score("cat cat cat", ["cat"]) == pytest.approx(0.5)


def test_f1_and_em_take_the_best_gold_answer():
    golds = ["Magnus Eide", "Ingrid Solberg", "Solberg"]
    assert f1_score("Ingrid Solberg.", golds) == 1.0
    assert f1_score("Mrs Solberg", golds) == pytest.approx(2 / 3)
    assert exact_match("the solberg", golds) == 1.0
    assert exact_match("Solberg Ingrid", golds) == 0.0
    assert f1_score("x", []) == 0.0 and exact_match("x", []) == 0.0
    assert f1_score("Nagoya", "Nagoya") == 1.0  # a bare string is one gold answer


def test_empty_answers():
    assert f1_score("", [""]) == 1.0
    assert f1_score("the", ["cat"]) == 0.0  # normalises to empty
    assert exact_match("The.", [""]) == 1.0


def test_rouge_l_uses_order_unlike_f1():
    # same bag of words, reversed: F1 = 1 but LCS = 1 -> 2*1/(3+3)
    assert f1_score("cat sat mat", ["mat sat cat"]) == 1.0
    assert rouge_l("cat sat mat", "mat sat cat") == pytest.approx(1 / 3)
    # [police, killed, gunman] vs [police, kill, gunman]: LCS 2 -> 2*2/(3+3)
    assert rouge_l("police killed the gunman", "police kill the gunman") == pytest.approx(2 / 3)
    # LCS 3 of pred 4 and ref 5: P=3/4, R=3/5, F=2PR/(P+R)=2/3
    assert rouge_l("w x y z", "w q x r y") == pytest.approx(2 * 0.75 * 0.6 / 1.35)
    assert rouge_l("Same Text!", "same text") == 1.0
    assert rouge_l("abc", "def") == 0.0
    assert rouge_l("", "") == 1.0 and rouge_l("", "x") == 0.0
    assert rouge_l("x y", ["q", "x y"]) == 1.0


def test_kl_of_identical_is_zero_and_shift_invariant():
    x = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert kl_divergence(x, x) == pytest.approx(0.0, abs=1e-12)
    assert kl_divergence(x, x + 3.5) == pytest.approx(0.0, abs=1e-12)


def test_kl_two_class_by_hand_and_asymmetry():
    p = torch.tensor([0.0, 0.0], dtype=torch.float64)  # P = (1/2, 1/2)
    q = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)  # Q = (1/4, 3/4)
    forward = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # = 0.5 ln(4/3)
    backward = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert kl_divergence(p, q) == pytest.approx(forward, rel=1e-12)
    assert kl_divergence(q, p) == pytest.approx(backward, rel=1e-12)
    assert abs(forward - backward) > 0.01


def test_kl_is_nonnegative_and_mean_over_rows():
    g = torch.Generator().manual_seed(1)
    p = torch.randn(8, 30, generator=g) * 3
    q = torch.randn(8, 30, generator=g) * 3
    rows = [kl_divergence(p[i], q[i]) for i in range(8)]
    assert all(r > 0 for r in rows)
    assert kl_divergence(p, q) == pytest.approx(sum(rows) / 8, rel=1e-12)
    assert statistics.fmean(token_kls(p, q)) == pytest.approx(sum(rows) / 8, rel=1e-12)  # the harness's answer KL
    assert token_kls(p.unsqueeze(0), q.unsqueeze(0)) == pytest.approx(rows, rel=1e-12)  # leading dims flattened


def test_kl_is_stable_for_extreme_fp16_logits():
    p = torch.tensor([[60000.0, 0.0, -60000.0]], dtype=torch.float16)
    q = torch.tensor([[0.0, 60000.0, -60000.0]], dtype=torch.float16)
    kl = kl_divergence(p, q)
    assert math.isfinite(kl) and kl == pytest.approx(60000.0, rel=1e-3)


def test_kl_handles_masked_vocabulary():
    inf = float("inf")
    # P never picks index 2, so Q's -inf there costs nothing
    assert kl_divergence([1.0, 2.0, -inf], [1.0, 2.0, -inf]) == 0.0
    # Q rules out what P allows -> infinite
    assert kl_divergence([1.0, 2.0, 0.0], [1.0, 2.0, -inf]) == inf


def test_kl_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        kl_divergence(torch.zeros(3, 4), torch.zeros(3, 5))


def test_percentile():
    values = [10, 1, 4, 3, 2]  # sorted: 1 2 3 4 10
    assert percentile(values, 50) == 3
    assert percentile(values, 0) == 1 and percentile(values, 100) == 10
    assert percentile(values, 90) == pytest.approx(4 + 0.6 * 6)  # pos 3.6
    assert percentile([5.0], 90) == 5.0
    assert math.isnan(percentile([], 50))
    assert percentile([1.0, float("inf")], 0) == 1.0
    with pytest.raises(ValueError):
        percentile(values, 101)
