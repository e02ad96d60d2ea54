"""Profiles and tuned settings as stored: typed records ⇄ versioned JSON, and which profiles apply here."""

from __future__ import annotations

import json
import time

import pytest

from kvblend.errors import KvblendError
from kvblend.tuning.delay import RatioQuality
from kvblend.machine import Machine, machine_info
from kvblend.tuning.profile import (
    PROFILE_VERSION,
    LengthTiming,
    Profile,
    SelectiveCheck,
    applicable_profiles,
    list_profiles,
    location_profile,
    profile_flags,
)
from kvblend.archive.records import normalize_path
from kvblend.tuning.quality import QualitySweep
from kvblend.tuning.storage import StorageDecision, cheapest_storage
from kvblend.tuning.tune import TUNED_VERSION, ModelRef, TunedSetting, decide
from tuning_helpers import CTX, synthetic_profile


def _full_profile() -> Profile:
    p = synthetic_profile("ssd", 0.004, 0.007, path="/data")
    p.layer_cost.per_length = [LengthTiming(256, 0.001, 4e-6, 0.0011), LengthTiming(512, 0.002, 4e-6, 0.0021)]
    p.layer_cost.selective_check = SelectiveCheck(0.15, 512, 0.0004, 0.0003, 4 / 3)
    p.storage.cold_runs_MBps = [100.0, 120.0]
    return p


def test_profile_json_round_trip_keeps_every_field():
    p = _full_profile()
    d = json.loads(json.dumps(p.to_dict()))  # what the archive's side-store holds
    assert d["version"] == PROFILE_VERSION
    assert d["storage"]["label"] == "ssd" and d["layer_cost"]["per_length"][1]["L"] == 512
    back = Profile.from_dict(d)
    assert back == p
    assert back.cost_model == p.cost_model and back.load_model() == p.load_model()


def test_profile_refuses_a_newer_version_and_reads_unversioned_ones():
    p = _full_profile()
    d = p.to_dict()
    with pytest.raises(KvblendError, match="newer"):
        Profile.from_dict({**d, "version": PROFILE_VERSION + 1})
    legacy = {k: v for k, v in d.items() if k != "version"}  # written before versions existed
    assert Profile.from_dict(legacy) == p
    nameless = {k: v for k, v in d.items() if k != "name"}
    assert Profile.from_dict(nameless, name="store-key").name == "store-key"


def _tuned() -> TunedSetting:
    prof = synthetic_profile("nvme", 0.004, 0.007)
    d = decide(prof, 0.15, CTX)
    quality = QualitySweep(2, 0.5, 0.3, 0.15, {0.15: RatioQuality(0.01, 0.1, 0.49, 0.2, 1.0)}, [0.05], 3.0)
    storage = cheapest_storage([prof], {"nvme": 0.1, "hdd": 0.02}, d.ratio, CTX, archive_bytes=1e9)
    return TunedSetting(d.ratio, d.r_quality, "calibration", d.r_hide, d.L, "given", d.t_load_s, d.t_recompute_s,
                        d.bottleneck, d.table, "today", 1.0, prof.name, ModelRef("m", "fp"), "cpu", "/a", 0.02, 0.5,
                        quality, storage, 10**9, ["note"])


def test_tuned_setting_json_round_trip_and_version_refusal():
    t = _tuned()
    d = json.loads(json.dumps(t.to_dict()))
    assert d["version"] == TUNED_VERSION and d["ratio"] == t.ratio  # `query` reads "ratio"
    assert d["quality"]["by_ratio"]["0.15"]["kl"] == 0.1  # ratio keys as JSON strings
    assert d["storage"]["choice"]["label"] == "nvme" and d["storage"]["unprofiled"] == ["hdd"]
    back = TunedSetting.from_dict(d)
    assert back == t
    assert isinstance(back.storage, StorageDecision) and back.quality.by_ratio[0.15].same_as_full == 1.0
    with pytest.raises(KvblendError, match="newer"):
        TunedSetting.from_dict({**d, "version": TUNED_VERSION + 1})


def test_profile_flags_name_machine_model_and_age():
    """`profile --show` flags: another machine, another model, or a model file newer than the profile."""
    machine = machine_info()
    mine = synthetic_profile("ssd", 0.004, 0.007, machine=machine, fingerprint="abc", created=1000.0)
    assert profile_flags(mine, machine, "abc", model_changed_at=900.0) == []
    assert profile_flags(mine, machine, "abc", model_changed_at=1100.0) == ["older than the model"]
    assert profile_flags(mine, machine, "xyz", model_changed_at=1100.0) == ["other model"]
    elsewhere = synthetic_profile("ssd", 0.004, 0.007, fingerprint="abc", created=1000.0,
                                  machine=Machine(machine.hostname + "-other", "another cpu", 2, None))
    assert "other machine" in profile_flags(elsewhere, machine, "abc")


def test_applicable_and_location_profiles(tmp_path):
    machine = machine_info()
    here = normalize_path(tmp_path)
    old = synthetic_profile("ssd", 0.004, 0.007, path=here, machine=machine, created=1.0)
    new = synthetic_profile("ssd", 0.004, 0.007, path=here, machine=machine, created=2.0)
    gpu = synthetic_profile("ssd", 0.004, 0.007, path=here, machine=machine, compute="cuda", created=3.0)
    other_model = synthetic_profile("ssd", 0.004, 0.007, path=here, machine=machine, fingerprint="x", created=4.0)
    ok = applicable_profiles([old, new, gpu, other_model], machine, "fp", "cpu")
    assert ok == [old, new]
    assert location_profile(ok, tmp_path) is new
    assert location_profile(ok, tmp_path / "elsewhere") is None


def test_list_profiles_flags_foreign_ones(tmp_path):
    from kvblend.archive import Archive

    machine = machine_info()
    now = time.time()  # newer than the default model's files, so "older than the model" does not apply
    mine = synthetic_profile("ssd", 0.004, 0.007, machine=machine, fingerprint="fp", created=now)
    foreign = synthetic_profile("hdd", 0.004, 0.007, machine=Machine("far", "?"), fingerprint="other", created=now - 1)
    with Archive.open(tmp_path / "a", create=True, model_name="m", model_fingerprint="fp") as ar:
        ar.put_profile(mine.name, mine.to_dict())
        ar.put_profile("foreign", {**foreign.to_dict(), "name": None})  # the store key names it
    listing = list_profiles(tmp_path / "a")
    assert [p.name for p in listing.profiles] == ["foreign", mine.name]  # oldest first
    assert listing.flags == [["other machine", "other model"], []]
    shown = listing.to_dict()
    assert shown["model_fingerprint"] == "fp" and shown["profiles"][1]["flags"] == []


def test_dtype_auto_takes_the_fastest_prefill_within_the_kl_bound(tmp_path):
    """`--dtype auto`: the fastest measured prefill among the dtypes close enough to fp32, None (the device's
    default) when nothing was measured; the archive's latest applicable profile decides."""
    from kvblend.archive import Archive, resolve_location
    from kvblend.model.weights import AUTO_MAX_KL
    from kvblend.tuning.profile import dtype_choice

    p = _full_profile()
    assert p.dtype_choice() is None  # measured nothing: the default dtype
    p.prefill_dtypes = {"fp32": {"prefill_ms": 900.0, "kl": 0.0}, "bf16": {"prefill_ms": 6000.0, "kl": 0.001}}
    assert p.dtype_choice() == "fp32"  # bf16 measured 6.7x slower (a CPU without AVX-512)
    p.prefill_dtypes["bf16"]["prefill_ms"] = 400.0
    assert p.dtype_choice() == "bf16"  # AVX512-BF16 or AMX
    p.prefill_dtypes["bf16"]["kl"] = AUTO_MAX_KL * 2
    assert p.dtype_choice() == "fp32"  # faster, but too far from fp32
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))).prefill_dtypes == p.prefill_dtypes

    here = machine_info()
    p.machine, p.compute, p.model.fingerprint = here, "cpu", "fp-1"
    p.prefill_dtypes["bf16"]["kl"] = 0.001
    path = tmp_path / "arc"
    with Archive.open(path) as ar:
        ar.put_profile(p.name, p.to_dict())
    assert dtype_choice(resolve_location(path), "fp-1", "cpu") == "bf16"
    assert dtype_choice(resolve_location(path), "another model", "cpu") is None
    assert dtype_choice(resolve_location(tmp_path / "none"), "fp-1", "cpu") is None


def test_the_cpu_is_named_with_the_instruction_sets_that_decide_what_pays(tmp_path):
    """Two cloud VMs both called "vm" with an "AMD EPYC" are not one machine when one has AVX-512 and BF16 (its
    bf16 matmuls run ~2x its fp32 ones) and the other AVX2 only: a profile of one must not be applied on the other."""
    from kvblend.machine import cpu_model, same_machine

    def cpuinfo(flags: str) -> str:
        path = tmp_path / f"cpuinfo-{len(flags)}"
        path.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
        return str(path)

    zen4 = cpu_model(cpuinfo("avx2 avx512f avx512bw avx512_bf16 avx512_vnni"))
    zen2 = cpu_model(cpuinfo("avx2 fma"))
    assert zen4 == "AMD EPYC (AVX512-BF16, AVX-512, AVX2)" and zen2 == "AMD EPYC (AVX2)"
    assert cpu_model(cpuinfo("")) == "AMD EPYC"  # no vector flags listed: the name alone
    assert not same_machine(Machine("vm", zen4, 2), Machine("vm", zen2, 2))
    assert cpu_model(str(tmp_path / "missing")) != ""  # no /proc: what `platform` knows
