"""The loading controller: delay model, ratio choice, storage choice, `profile`/`tune` CLI, tuned ratio in the engine."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvblend import controller as ctl
from kvblend.controller import (
    CostModel,
    cheapest_storage,
    choose_ratio,
    fit_cost_model,
    hide_ratio,
    load_time,
    quality_floor,
    recompute_time,
    tuned_key,
)
from kvblend.errors import UsageError

CTX = 4096  # the paper's example context


def synthetic_profile(
    label: str,
    t_load_s: float,
    recompute_15_s: float,
    bytes_per_token_layer: float = 16384,
    L: int = CTX,
    path: str | None = None,
    machine: dict | None = None,
    compute: str = "cpu",
    fingerprint: str = "fp",
    created: float | None = None,
) -> dict:
    """A profile whose storage loads one layer of L tokens in t_load_s and recomputes 15% in recompute_15_s."""
    read_MBps = bytes_per_token_layer * L / t_load_s / 1e6
    return {
        "name": f"test|{label}",
        "created": created if created is not None else time.time(),
        "machine": machine or {"hostname": "h", "cpu": "c", "gpu": None},
        "model": {"name": "m", "fingerprint": fingerprint},
        "compute": compute,
        "storage": {"label": label, "path": path},
        "read_cold_MBps": read_MBps,
        "read_warm_MBps": read_MBps * 10,
        "decompress_MBps": None,
        "kv_bytes_per_token_layer": bytes_per_token_layer,
        "layer_cost": CostModel.from_point(0.15, L, recompute_15_s).to_dict(),
    }


# ───────────────────────── the delay model ─────────────────────────


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
    assert recompute_time(0.15, 2048, model.to_dict()) == pytest.approx(0.15 * full)
    assert recompute_time(0.15, 2048, (1e-5, 1e-9)) == pytest.approx(0.15 * full)


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
    assert ctl.profile_load_time(prof, CTX) == pytest.approx(0.016)
    d = ctl.decide(prof, r_quality=0.15, L=CTX)
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
    d = ctl.decide(prof, r_quality=0.15, L=CTX)
    assert d.ratio == 0.15 and d.r_hide == pytest.approx(0.0857, abs=1e-3)
    assert d.bottleneck == "recompute"
    row = next(r for r in d.table if r["L"] == CTX)
    assert row["hidden"] and row["t_recompute_s"] == pytest.approx(0.007)


def test_choose_ratio_bounds():
    assert choose_ratio(0.15, 0.05) == 0.15
    assert choose_ratio(0.15, 1.0) == 1.0
    assert choose_ratio(0.2, None) == 0.2
    assert choose_ratio(None, None) == ctl.PAPER_QUALITY_RATIO
    assert hide_ratio(5.0, 1.0) == 1.0  # loading slower than a full recompute
    assert hide_ratio(0.0, 1.0) == 0.0
    d = ctl.decide(synthetic_profile("hdd", t_load_s=0.2, recompute_15_s=0.003), 0.15, CTX)
    assert d.ratio == 1.0 and any("slower than `--mode full`" in n for n in d.notes)


# ───────────────────────── storage choice ─────────────────────────

COSTS = {"ram": 5.0, "nvme": 0.1, "ssd": 0.05, "hdd": 0.02}


def test_storage_70b_prefers_cheaper_slower_device_only_while_it_hides():
    # recompute at 15% = 7 ms per layer; ram 0.5 ms, nvme 4 ms, ssd 6 ms hide it, hdd 16 ms does not
    profiles = [
        synthetic_profile("ram", 0.0005, 0.007),
        synthetic_profile("nvme", 0.004, 0.007),
        synthetic_profile("ssd", 0.006, 0.007),
        synthetic_profile("hdd", 0.016, 0.007),
    ]
    d = cheapest_storage(profiles, COSTS, 0.15, CTX, archive_bytes=100e9)
    assert d.choice.label == "ssd"  # cheaper than nvme and still hides; hdd is cheaper but adds delay
    assert d.choice.monthly_cost == pytest.approx(5.0)  # 100 GB × $0.05
    by = {o.label: o for o in d.candidates}
    assert by["hdd"].hides is False and by["nvme"].hides and by["ram"].hides
    assert by["hdd"].t_load_s == pytest.approx(0.016) and by["hdd"].t_recompute_s == pytest.approx(0.007)
    # without the ssd, nvme; with only hdd priced, nothing qualifies
    assert cheapest_storage(profiles, {"ram": 5, "nvme": 0.1, "hdd": 0.02}, 0.15, CTX).choice.label == "nvme"
    assert cheapest_storage(profiles, {"hdd": 0.02}, 0.15, CTX).choice is None


def test_storage_7b_needs_ram_at_15_percent_but_nvme_hides_at_80():
    profiles = [
        synthetic_profile("ram", 0.0005, 0.003),
        synthetic_profile("nvme", 0.016, 0.003),
        synthetic_profile("hdd", 0.064, 0.003),
    ]
    assert cheapest_storage(profiles, COSTS, 0.15, CTX).choice.label == "ram"
    assert cheapest_storage(profiles, COSTS, 0.8, CTX).choice.label == "nvme"
    d = cheapest_storage(profiles, COSTS, 0.8, CTX)
    assert d.unprofiled == ["ssd"]


def test_storage_uses_latest_profile_per_label_and_given_cost_model():
    old = synthetic_profile("hdd", 0.001, 0.007, created=1.0)
    new = synthetic_profile("hdd", 0.050, 0.007, created=2.0)
    assert cheapest_storage([new, old], {"hdd": 0.02}, 0.15, CTX).choice is None
    # the recompute side from the compute device in use, not the stored one
    fast_compute = CostModel.from_point(0.15, CTX, 0.100)
    assert cheapest_storage([new], {"hdd": 0.02}, 0.15, CTX, cost_model=fast_compute).choice.label == "hdd"


def test_parse_costs_and_ratios():
    assert ctl.parse_costs("ram=5, nvme=0.1,hdd=0.02") == {"ram": 5.0, "nvme": 0.1, "hdd": 0.02}
    for bad in ("ram", "ram=x", "=3", "ram=-1"):
        with pytest.raises(UsageError):
            ctl.parse_costs(bad)
    assert ctl.parse_ratios("0.3,0.05,0.15") == [0.05, 0.15, 0.3]
    for bad in ("0", "1.5", "a,b", ""):
        with pytest.raises(UsageError):
            ctl.parse_ratios(bad)


# ───────────────────────── quality floor ─────────────────────────


def test_quality_floor_is_smallest_ratio_from_which_all_larger_pass():
    results = {
        0.05: {"f1_drop": 0.10, "kl": 0.30},
        0.10: {"f1_drop": 0.01, "kl": 0.12},  # F1 fine, KL too high
        0.15: {"f1_drop": 0.02, "kl": 0.08},
        0.20: {"f1_drop": -0.01, "kl": 0.05},
        0.30: {"f1_drop": 0.00, "kl": 0.02},
    }
    assert quality_floor(results, 0.02, 0.1) == 0.15
    assert quality_floor(results, 0.02, 0.2) == 0.10
    assert quality_floor(results, 0.0, 0.1) == 0.20
    # a lucky small ratio does not count when a larger one fails
    lucky = {0.05: {"f1_drop": 0.0, "kl": 0.01}, 0.15: {"f1_drop": 0.2, "kl": 0.5}, 0.3: {"f1_drop": 0.0, "kl": 0.01}}
    assert quality_floor(lucky, 0.02, 0.1) == 0.3
    assert quality_floor({0.3: {"f1_drop": 0.5, "kl": 0.01}}, 0.02, 0.1) is None
    assert quality_floor({0.3: {"f1_drop": None, "kl": 0.01}}, 0.02, 0.1) is None


# ───────────────────────── keys ─────────────────────────


def test_tuned_key_is_stable_per_location(tmp_path, monkeypatch):
    a = tmp_path / "arch"
    a.mkdir()
    monkeypatch.chdir(tmp_path)
    k = tuned_key("SmolLM2", "cpu", a)
    assert k == tuned_key("SmolLM2", "cpu", str(a) + "/")
    assert k == tuned_key("SmolLM2", "cpu", "arch")
    assert k == tuned_key("SmolLM2", "cpu", Path("arch"))
    assert k != tuned_key("SmolLM2", "cuda", a)
    assert k != tuned_key("Other", "cpu", a)
    assert k != tuned_key("SmolLM2", "cpu", tmp_path / "elsewhere")
    assert len(tuned_key("x" * 1000, "cpu", a).encode()) < 480  # fits an LMDB key


# ───────────────────────── measurement functions ─────────────────────────


def test_measure_disk_read_layout_and_cleanup(tmp_path):
    segments = [[os.urandom(50_000 + 1000 * i) for i in range(4)] for _ in range(3)]
    m = ctl.measure_disk_read(tmp_path, segments, cold_runs=1, warm_runs=1)
    assert m.scratch_bytes == sum(len(p) for s in segments for p in s)
    assert m.reads == 12
    assert m.read_cold_MBps > 0 and m.read_warm_MBps > 0
    assert m.cold_resident_fraction is None or 0.0 <= m.cold_resident_fraction <= 1.0
    assert list(tmp_path.iterdir()) == []  # scratch file removed
    with pytest.raises(UsageError):
        ctl.measure_disk_read(tmp_path / "missing", segments)
    ram = ctl.measure_ram_read(segments, runs=1)
    assert ram.read_cold_MBps == ram.read_warm_MBps > 0


def test_measure_decompress_reports_compressed_and_raw_rates():
    import torch

    from kvblend.archive_format import encode_layer

    k = torch.randn(2, 64, 16).half()
    payloads = [encode_layer(k, k.clone(), "zstd-shuffle", 3) for _ in range(3)]
    m = ctl.measure_decompress(payloads, "zstd-shuffle", min_seconds=0.01)
    assert m.raw_bytes == 3 * 2 * k.numel() * 2
    assert m.decompress_MBps > 0
    assert m.decompress_raw_MBps == pytest.approx(m.decompress_MBps * m.raw_bytes / m.compressed_bytes)


def test_measure_layer_cost_on_tiny_model():
    from conftest import tiny_runner

    runner = tiny_runner("llama")
    cost = ctl.measure_layer_cost(runner, [32, 64, 128], repeats=1)
    assert [r["L"] for r in cost["per_length"]] == [32, 64, 128]
    assert cost["a_s_per_token"] >= 0 and cost["b_s_per_token2"] >= 0
    assert all(r["layer_s"] > 0 for r in cost["per_length"])
    assert cost["selective_check"]["L"] == 128 and cost["selective_check"]["measured_s"] > 0


# ───────────────────────── the engine uses the tuned ratio ─────────────────────────


def test_engine_uses_tuned_ratio_and_ratio_flag_overrides(tmp_path):
    from conftest import tiny_runner

    from kvblend.engine import DEFAULT_RATIO, Engine, QueryOptions

    runner = tiny_runner("llama")
    with Engine(archive=tmp_path / "archive", runner=runner) as engine:
        _, ratio = engine.blend_config(QueryOptions())
        assert ratio == DEFAULT_RATIO  # nothing tuned yet
        archive = engine.archive()
        # a tuned entry for another location is not ours
        archive.put_tuned(tuned_key(runner.name, runner.device.type, tmp_path / "other"), {"ratio": 0.5})
        assert engine.blend_config(QueryOptions())[1] == DEFAULT_RATIO
        archive.put_tuned(tuned_key(runner.name, runner.device.type, engine.archive_path), {"ratio": 0.3})
        cfg, ratio = engine.blend_config(QueryOptions())
        assert ratio == 0.3 and cfg.ratios == (0.3,)
        cfg, ratio = engine.blend_config(QueryOptions(ratio=0.2))
        assert ratio == 0.2 and cfg.ratios == (0.2,)


# ───────────────────────── CLI ─────────────────────────


def _cli(args: list[str]):
    from typer.testing import CliRunner

    from kvblend.cli.main import app

    result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return result


def _default_model_identity() -> tuple[str, str]:
    from kvblend.model import resolve_model_source, source_fingerprint

    try:
        source = resolve_model_source(None)
    except Exception as exc:  # pragma: no cover - the default model is part of `make install`
        pytest.skip(f"default model not installed: {exc}")
    return source.name, source_fingerprint(source)


def test_tune_cli_from_stored_profiles(tmp_path):
    """`tune --r-quality` (no calibration) on synthetic profiles of this machine: ratio, storage, stored entry."""
    from kvblend.archive_format import Archive

    name, fp = _default_model_identity()
    path = tmp_path / "archive"
    machine = ctl.machine_info()
    here = synthetic_profile("nvme", 0.004, 0.007, bytes_per_token_layer=4096, path=ctl.normalize_path(path),
                             machine=machine, fingerprint=fp, L=3072)
    others = [
        synthetic_profile("hdd", 0.016, 0.007, bytes_per_token_layer=4096, path="/mnt/hdd", machine=machine,
                          fingerprint=fp, L=3072),
        synthetic_profile("ram", 0.0005, 0.007, bytes_per_token_layer=4096, machine=machine, fingerprint=fp, L=3072),
        # not applicable: another machine, another model
        synthetic_profile("ssd", 0.001, 0.007, machine={"hostname": "elsewhere", "cpu": "?", "gpu": None},
                          fingerprint=fp, L=3072),
        synthetic_profile("ssd", 0.001, 0.007, machine=machine, fingerprint="another-model", L=3072),
    ]
    with Archive.open(path, create=True, model_name=name, model_fingerprint=fp) as ar:
        for i, p in enumerate([here, *others]):
            ar.put_profile(f"p{i}", p)
    res = _cli(["tune", "--archive", str(path), "--compute", "cpu", "--r-quality", "0.15", "--context-tokens", "3072",
                "--storage-costs", "ram=5,nvme=0.1,ssd=0.05,hdd=0.02", "--archive-size", "100GB", "--json"])
    out = json.loads(res.stdout)
    assert out["ratio"] == 0.15 and out["r_quality"] == 0.15
    assert out["r_hide"] == pytest.approx(0.0857, abs=1e-3)
    assert out["storage"]["choice"]["label"] == "nvme"  # hdd is cheaper but adds delay; ssd is not from here
    assert out["storage"]["choice"]["monthly_cost"] == pytest.approx(10.0)
    assert out["storage"]["unprofiled"] == ["ssd"]
    with Archive.open(path, create=False) as ar:
        stored = ar.get_tuned(tuned_key(name, "cpu", path))
    assert stored["ratio"] == 0.15 and stored["r_hide"] == out["r_hide"]
    # the human-readable form prints the decision
    text = _cli(["tune", "--archive", str(path), "--compute", "cpu", "--r-quality", "0.1",
                 "--context-tokens", "3072"]).stdout
    assert "ratio = max(r_quality, r_hide) = 0.100" in text


def test_tune_without_profile_says_what_to_run(tmp_path):
    from typer.testing import CliRunner

    from kvblend.archive_format import Archive
    from kvblend.cli.main import app

    name, fp = _default_model_identity()
    Archive.open(tmp_path / "a", create=True, model_name=name, model_fingerprint=fp).close()
    result = CliRunner().invoke(app, ["tune", "--archive", str(tmp_path / "a"), "--compute", "cpu", "--r-quality", "0.15"])
    assert isinstance(result.exception, UsageError) and "kvblend profile" in str(result.exception)


@pytest.mark.e2e
def test_profile_quick_cli_stores_and_shows_profile(tmp_path):
    path = tmp_path / "archive"
    res = _cli(["profile", "--quick", "--json", "--archive", str(path), "--compute", "cpu", "--device", "ssd"])
    prof = json.loads(res.stdout)
    for key in ("read_cold_MBps", "read_warm_MBps", "decompress_MBps", "layer_cost_s_per_token", "per_length"):
        assert key in prof, key
    assert prof["read_cold_MBps"] > 0 and prof["read_warm_MBps"] > 0 and prof["decompress_MBps"] > 0
    assert prof["layer_cost_s_per_token"] > 0
    assert [r["L"] for r in prof["per_length"]] == list(ctl.QUICK_LENGTHS)
    assert prof["storage"]["label"] == "ssd" and prof["storage"]["path"] == ctl.normalize_path(path)
    assert prof["compute"] == "cpu" and prof["model"]["fingerprint"]
    assert not [p for p in path.iterdir() if p.name.endswith(".scratch")]  # scratch file deleted

    shown = json.loads(_cli(["profile", "--show", "--json", "--archive", str(path)]).stdout)
    assert [p["name"] for p in shown["profiles"]] == [prof["name"]]
    assert shown["profiles"][0]["flags"] == []
    assert shown["profiles"][0]["read_cold_MBps"] == prof["read_cold_MBps"]

    # a profile from elsewhere is flagged
    from kvblend.archive_format import Archive

    with Archive.open(path, create=False) as ar:
        ar.put_profile("foreign", {**prof, "name": "foreign", "machine": {"hostname": "far", "cpu": "?", "gpu": None},
                                   "model": {**prof["model"], "fingerprint": "other"}})
    shown = json.loads(_cli(["profile", "--show", "--json", "--archive", str(path)]).stdout)
    flags = {p["name"]: p["flags"] for p in shown["profiles"]}
    assert flags["foreign"] == ["other machine", "other model"] and flags[prof["name"]] == []
    assert "other machine" in _cli(["profile", "--show", "--archive", str(path)]).stdout


@pytest.mark.e2e
def test_measure_quality_plumbing_on_default_model(default_runner):
    """One short calibration record through precompute → assemble → full/blend → KL and F1."""
    record = {
        "question": "Who manages the Bergen office?",
        "answers": ["Marit Haugen"],
        "ctxs": [
            {"title": "Offices", "text": "The Bergen office is managed by Marit Haugen. It has forty staff."},
            {"title": "Plants", "text": "The Gdansk plant builds circuit boards and employs 180 people."},
        ],
    }
    q = ctl.measure_quality(default_runner, [record], [0.3, 1.0], max_new_tokens=3)
    assert q["records"] == 1 and set(q["by_ratio"]) == {0.3, 1.0}
    full_equivalent = q["by_ratio"][1.0]  # ratio 1.0 recomputes everything: the same as full
    assert full_equivalent["kl"] == pytest.approx(0.0, abs=1e-4)
    assert full_equivalent["f1_drop"] == pytest.approx(0.0) and full_equivalent["same_as_full"] == 1.0
    assert q["by_ratio"][0.3]["kl"] >= 0
    assert q["reuse_kl"] > 0 and q["kl_bound"] is None  # reuse skips the cross-attention, so it deviates
    bounded = ctl.measure_quality(default_runner, [record], [0.3, 1.0], max_new_tokens=3,
                                  tolerance=1.0, kl_bound_vs_reuse=0.5)
    assert bounded["kl_bound"] == pytest.approx(0.5 * bounded["reuse_kl"])


def test_profile_flags_name_machine_model_and_age():
    """`profile --show` flags: another machine, another model, or a model file newer than the profile."""
    machine = ctl.machine_info()
    mine = {"machine": dict(machine), "model": {"fingerprint": "abc"}, "created": 1000.0}
    assert ctl.profile_flags(mine, machine, "abc", model_changed_at=900.0) == []
    assert ctl.profile_flags(mine, machine, "abc", model_changed_at=1100.0) == ["older than the model"]
    assert ctl.profile_flags(mine, machine, "xyz", model_changed_at=1100.0) == ["other model"]
    elsewhere = dict(mine, machine={**machine, "hostname": machine["hostname"] + "-other", "cpu": "another cpu"})
    assert "other machine" in ctl.profile_flags(elsewhere, machine, "abc")
