"""Where tuned settings are stored, and that the engine finds them there (tiny model)."""

from __future__ import annotations

from pathlib import Path

from kvblend.defaults import DEFAULT_RATIO
from kvblend.archive.records import profile_name, tuned_key
from support import tiny_runner


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


def test_profile_name_is_one_per_machine_model_compute_and_storage():
    base = profile_name("host", "m", "cpu", "ssd", "/data")
    assert base == profile_name("host", "m", "cpu", "ssd", "/data")  # re-profiling replaces it
    assert base != profile_name("host", "m", "cpu", "ssd", "/other")
    assert base != profile_name("host", "m", "cuda", "ssd", "/data")
    assert profile_name("host", "m", "cpu", "ram", None) == "host|m|cpu|ram"


def test_engine_uses_tuned_ratio_and_ratio_flag_overrides(tmp_path):
    from kvblend.pipeline import Engine, QueryOptions

    runner = tiny_runner("llama")
    with Engine(archive=tmp_path / "archive", runner=runner) as engine:
        _, ratio = engine.blend_config(QueryOptions())
        assert ratio == DEFAULT_RATIO  # nothing tuned yet
        archive = engine.archive()
        # a tuned entry for another location is not ours
        archive.put_tuned(tuned_key(runner.name, runner.device.type, tmp_path / "other"), {"ratio": 0.5})
        assert engine.blend_config(QueryOptions())[1] == DEFAULT_RATIO
        ours = tuned_key(runner.name, runner.device.type, engine.location)
        archive.put_tuned(ours, {"ratio": 0.3, "select": "probe"})
        cfg, ratio = engine.blend_config(QueryOptions(select="probe"))
        assert ratio == 0.3 and cfg.ratios == (0.3,)
        # a floor measured for one policy is not another's
        assert engine.blend_config(QueryOptions(select="hkvd"))[1] == DEFAULT_RATIO
        # settings stored before policies existed were measured with hkvd
        archive.put_tuned(ours, {"ratio": 0.25})
        assert engine.blend_config(QueryOptions(select="hkvd"))[1] == 0.25
        assert engine.blend_config(QueryOptions(select="probe"))[1] == DEFAULT_RATIO
        archive.put_tuned(ours, {"ratio": 0.3, "select": "probe"})
        # tuning another policy (stored under its own key now) leaves the default policy's ratio alone
        archive.put_tuned(tuned_key(runner.name, runner.device.type, engine.location, "hkvd"),
                          {"ratio": 0.4, "select": "hkvd"})
        assert engine.blend_config(QueryOptions(select="hkvd"))[1] == 0.4
        assert engine.blend_config(QueryOptions())[1] == 0.3
        cfg, ratio = engine.blend_config(QueryOptions(ratio=0.2))
        assert ratio == 0.2 and cfg.ratios == (0.2,)
