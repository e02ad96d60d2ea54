"""The delay model: load and recompute times, the ratio that balances them, the quality floor."""

from __future__ import annotations

import pytest

from kvblend.defaults import DEFAULT_RATIO
from kvblend.tuning.delay import (
    CostModel,
    RatioQuality,
    choose_ratio,
    fit_cost_model,
    hide_ratio,
    load_time,
    quality_floor,
    recompute_time,
)
from kvblend.tuning.tune import decide
from tuning_helpers import CTX, synthetic_profile


def test_load_time_adds_read_and_decompression():
    # 1000 B/token-layer × 1000 tokens = 1 MB: 10 ms at 100 MB/s, plus 1 ms decompressing at 1000 MB/s
    assert load_time(1000, 1000, 100) == pytest.approx(0.010)
    assert load_time(1000, 1000, 100, 1000) == pytest.approx(0.011)
    with pytest.raises(ValueError):
        load_time(1000, 1000, 0)


def test_recompute_time_is_ratio_times_layer_cost():
    model = CostModel(a=1e-5, b=1e-9)
    full = 1e-5 * 2048 + 1e-9 * 2048**2
    assert recompute_time(1.0, 2048, model) == pytest.approx(full)
    assert recompute_time(0.15, 2048, model) == pytest.approx(0.15 * full)
    assert recompute_time(0.15, 2048, CostModel.from_dict(model.to_dict())) == pytest.approx(0.15 * full)


def test_fit_cost_model_recovers_linear_and_quadratic_terms():
    a, b = 5e-5, 1e-8
    lengths = [512, 1024, 2048, 4096]
    fitted = fit_cost_model(lengths, [a * L + b * L * L for L in lengths])
    assert fitted.a == pytest.approx(a, rel=1e-6)
    assert fitted.b == pytest.approx(b, rel=1e-6)
    # noise that would make a coefficient negative is not allowed to
    only_linear = fit_cost_model([256, 512], [0.0101, 0.0200])
    assert only_linear.a >= 0 and only_linear.b >= 0
    assert only_linear.cost(512) == pytest.approx(0.0200, rel=0.05)


# ───────────────────────── the paper's two examples ─────────────────────────


def test_llama7b_4k_nvme_loading_hides_recompute():
    """Recomputing 15% takes 3 ms per layer, loading a layer from NVMe 16 ms: up to ~80% is free."""
    model = CostModel.from_point(0.15, CTX, 0.003)
    assert recompute_time(0.15, CTX, model) == pytest.approx(0.003)
    t_load = 0.016
    r_hide = hide_ratio(t_load, recompute_time(1.0, CTX, model))
    assert r_hide > 0.15
    assert r_hide == pytest.approx(16 / 3 * 0.15)  # 0.8
    assert choose_ratio(0.15, r_hide) == pytest.approx(0.8)
    assert recompute_time(choose_ratio(0.15, r_hide), CTX, model) == pytest.approx(t_load)  # no extra delay

    # the same through a profile (bytes, read throughput) and the tune decision
    prof = synthetic_profile("nvme", t_load_s=0.016, recompute_15_s=0.003)
    assert prof.load_model().time(CTX) == pytest.approx(0.016)
    d = decide(prof, r_quality=0.15, L=CTX)
    assert d.r_hide == pytest.approx(0.8)
    assert d.ratio == pytest.approx(0.8)
    assert d.bottleneck == "recompute" or d.t_load_s == pytest.approx(d.t_recompute_s)
    assert any("free" in n for n in d.notes)


def test_llama70b_4k_nvme_loading_does_not_hide_recompute():
    """Recomputing 15% takes 7 ms, loading 4 ms: r_hide ≈ 0.086 < 0.15, so r = r_quality = 0.15."""
    model = CostModel.from_point(0.15, CTX, 0.007)
    r_hide = hide_ratio(0.004, recompute_time(1.0, CTX, model))
    assert r_hide == pytest.approx(0.0857, abs=1e-3)
    assert choose_ratio(0.15, r_hide) == 0.15

    prof = synthetic_profile("nvme", t_load_s=0.004, recompute_15_s=0.007, bytes_per_token_layer=4096)
    d = decide(prof, r_quality=0.15, L=CTX)
    assert d.ratio == 0.15 and d.r_hide == pytest.approx(0.0857, abs=1e-3)
    assert d.bottleneck == "recompute"
    row = next(r for r in d.table if r.L == CTX)
    assert row.hidden and row.t_recompute_s == pytest.approx(0.007)


def test_choose_ratio_bounds():
    assert choose_ratio(0.15, 0.05) == 0.15
    assert choose_ratio(0.15, 1.0) == 1.0
    assert choose_ratio(0.2, None) == 0.2
    assert choose_ratio(None, None) == DEFAULT_RATIO  # the paper's r* when nothing is known
    assert hide_ratio(5.0, 1.0) == 1.0  # loading slower than a full recompute
    assert hide_ratio(0.0, 1.0) == 0.0
    d = decide(synthetic_profile("hdd", t_load_s=0.2, recompute_15_s=0.003), 0.15, CTX)
    assert d.ratio == 1.0 and any("slower than `--mode full`" in n for n in d.notes)


# ───────────────────────── quality floor ─────────────────────────


def _q(f1_drop, kl) -> RatioQuality:
    return RatioQuality(f1_drop=f1_drop, kl=kl)


def test_quality_floor_is_smallest_ratio_from_which_all_larger_pass():
    results = {
        0.05: _q(0.10, 0.30),
        0.10: _q(0.01, 0.12),  # F1 fine, KL too high
        0.15: _q(0.02, 0.08),
        0.20: _q(-0.01, 0.05),
        0.30: _q(0.00, 0.02),
    }
    assert quality_floor(results, 0.02, 0.1) == 0.15
    assert quality_floor(results, 0.02, 0.2) == 0.10
    assert quality_floor(results, 0.0, 0.1) == 0.20
    # a lucky small ratio does not count when a larger one fails
    lucky = {0.05: _q(0.0, 0.01), 0.15: _q(0.2, 0.5), 0.3: _q(0.0, 0.01)}
    assert quality_floor(lucky, 0.02, 0.1) == 0.3
    assert quality_floor({0.3: _q(0.5, 0.01)}, 0.02, 0.1) is None
    assert quality_floor({0.3: _q(None, 0.01)}, 0.02, 0.1) is None
