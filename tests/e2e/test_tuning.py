"""`kvblend profile` and `kvblend tune`'s quality sweep on the real default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvblend.archive import Archive
from kvblend.evaluation.records import QARecord
from kvblend.archive.records import normalize_path
from kvblend.tuning.profile import Profile
from kvblend.tuning.profiling import QUICK_LENGTHS
from kvblend.tuning.quality import measure_quality
from support import FIXTURES, run_cli


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory) -> tuple[Path, dict]:
    """`profile --quick` run once for the module (~15 s on 2 cores): its archive and its JSON. The tune tests
    store this real measurement under their own archive's location instead of profiling again."""
    path = tmp_path_factory.mktemp("profiled") / "archive"
    proc = run_cli("profile", "--quick", "--json", "--archive", path, "--compute", "cpu", "--device", "ssd", check=True)
    return path, json.loads(proc.stdout)


def test_profile_quick_cli_stores_and_shows_profile(quick_profile, tmp_path):
    path, prof = quick_profile
    for key in ("read_cold_MBps", "read_warm_MBps", "decompress_MBps", "layer_cost_s_per_token", "per_length"):
        assert key in prof, key
    assert prof["read_cold_MBps"] > 0 and prof["read_warm_MBps"] > 0 and prof["decompress_MBps"] > 0
    assert prof["layer_cost_s_per_token"] > 0
    assert [r["L"] for r in prof["per_length"]] == list(QUICK_LENGTHS)
    assert prof["storage"]["label"] == "ssd" and prof["storage"]["path"] == normalize_path(path)
    assert prof["compute"] == "cpu" and prof["model"]["fingerprint"]
    assert not [p for p in path.iterdir() if p.name.endswith(".scratch")]  # scratch file deleted
    # each weight format's decode step, and what `--weights auto` takes from it
    assert set(prof["weights"]) == {"fp32", "bf16", "int8", "int4"}
    assert all(m["step_ms_1"] > 0 for m in prof["weights"].values())
    assert 0 < prof["weights"]["int4"]["kl"] < 0.05  # the GGUF's Q4_1 projections, an int8 LM head
    # each compute dtype's prefill, and what `--dtype auto` takes from it
    assert set(prof["prefill_dtypes"]) == {"fp32", "bf16"} and prof["prefill_context_tokens"] > 0
    assert all(m["prefill_ms"] > 0 for m in prof["prefill_dtypes"].values())
    assert prof["prefill_dtypes"]["fp32"]["kl"] == 0 and 0 < prof["prefill_dtypes"]["bf16"]["kl"] < 0.05
    context = tmp_path / "passage.txt"
    context.write_text("The Bergen office is managed by Marit Haugen. It has forty staff.")
    asked = ["query", "Who manages the Bergen office?", "--context-file", context, "--top-k", "0", "--archive", path]
    answer = json.loads(run_cli(*asked, "--json", "--max-tokens", "4", "--dtype", "auto", check=True).stdout)
    assert answer["weights"] == Profile.from_dict(prof).weights_choice()[0]  # --weights auto, the default
    assert answer["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[Profile.from_dict(prof).dtype_choice()]

    shown = json.loads(run_cli("profile", "--show", "--json", "--archive", path, check=True).stdout)
    assert [p["name"] for p in shown["profiles"]] == [prof["name"]]
    assert shown["profiles"][0]["flags"] == []
    assert shown["profiles"][0]["read_cold_MBps"] == prof["read_cold_MBps"]

    # a profile from elsewhere is flagged
    foreign = Profile.from_dict(prof)
    foreign.name, foreign.machine = "foreign", type(foreign.machine)("far", "?")
    foreign.model.fingerprint = "other"
    with Archive.open(path, create=False) as ar:
        ar.put_profile("foreign", foreign.to_dict())
    shown = json.loads(run_cli("profile", "--show", "--json", "--archive", path, check=True).stdout)
    flags = {p["name"]: p["flags"] for p in shown["profiles"]}
    assert flags["foreign"] == ["other machine", "other model"] and flags[prof["name"]] == []
    assert "other machine" in run_cli("profile", "--show", "--archive", path, check=True).stdout

    # a later profile of this machine and model where int8 measured fastest: auto follows it
    later = Profile.from_dict(prof)
    later.name, later.created = "later", prof["created"] + 1
    later.weights = {"fp32": {"kl": 0.0, "step_ms_1": 90.0}, "int8": {"kl": 0.002, "step_ms_1": 30.0}}
    later.prefill_dtypes = {"fp32": {"kl": 0.0, "prefill_ms": 900.0}, "bf16": {"kl": 0.002, "prefill_ms": 300.0}}
    with Archive.open(path, create=False) as ar:
        ar.put_profile("later", later.to_dict())
    answer = json.loads(run_cli(*asked, "--json", "--max-tokens", "4", "--dtype", "auto", check=True).stdout)
    assert answer["weights"] == "int8" and answer["dtype"] == "bfloat16"
    answer = json.loads(run_cli(*asked, "--json", "--max-tokens", "4", "--weights", "fp32", check=True).stdout)
    assert answer["weights"] == "fp32"


RECORD = QARecord(
    question="Who manages the Bergen office?",
    passages=[("Offices", "The Bergen office is managed by Marit Haugen. It has forty staff."),
              ("Plants", "The Gdansk plant builds circuit boards and employs 180 people.")],
    answers=["Marit Haugen"],
)


def test_measure_quality_through_the_harness_on_default_model(default_runner):
    """One short record through prefill alone → assemble → full/reuse/blend → KL and F1."""
    q = measure_quality(default_runner, [RECORD], [0.3, 1.0], max_new_tokens=3)
    assert q.records == 1 and set(q.by_ratio) == {0.3, 1.0}
    full_equivalent = q.by_ratio[1.0]  # ratio 1.0 recomputes everything: the same as full
    assert full_equivalent.kl == pytest.approx(0.0, abs=1e-4)
    assert full_equivalent.f1_drop == pytest.approx(0.0) and full_equivalent.same_as_full == 1.0
    assert q.by_ratio[0.3].kl >= 0
    assert q.reuse_kl > 0 and q.kl_bound is None  # reuse skips the cross-attention, so it deviates
    bounded = measure_quality(default_runner, [RECORD], [0.3, 1.0], max_new_tokens=3,
                              tolerance=1.0, kl_bound_vs_reuse=0.5)
    assert bounded.kl_bound == pytest.approx(0.5 * bounded.reuse_kl)
    strict = measure_quality(default_runner, [RECORD], [0.3, 1.0], max_new_tokens=3,
                             tolerance=-1.0, kl_bound_vs_reuse=0.5)  # nothing passes: stop after the largest
    assert list(strict.by_ratio) == [1.0] and strict.skipped == [0.3]


def test_the_sweep_reads_archived_passages_when_a_record_names_them(default_runner):
    """tune's prompts name their archived segments: the sweep then runs on the KV the archive returns for them
    (here built by hand), not on a fresh prefill; a segment that does not read back falls back to the prefill."""
    from dataclasses import replace

    from kvblend.model.prefill import precompute_kv
    from kvblend.prompt import segment_text_for_kv
    from kvblend.types import Segment

    named = replace(RECORD, segment_keys=("offices", "plants"))
    ids = [default_runner.tokenize(segment_text_for_kv(t)) for t in RECORD.passage_texts()]
    stored = dict(zip(named.segment_keys, zip(ids, precompute_kv(default_runner, ids))))  # key → (ids, KV)
    asked: list[str] = []

    def archived(key: str, scale: float = 1.0, missing: str = "") -> Segment | None:
        asked.append(key)
        tokens, layers = stored[key]
        kv = [(k * scale, v * scale) for k, v in layers]
        return None if key == missing else Segment(tokens, kv=kv, key=key)

    def sweep(record, reader=None):
        return measure_quality(default_runner, [record], [0.3], max_new_tokens=2, archived=reader)

    prefilled = sweep(RECORD, archived)  # a record naming no segment is prefilled as before
    assert not asked
    same = sweep(named, archived)
    assert asked == ["offices", "plants"]
    assert same.reuse_kl == pytest.approx(prefilled.reuse_kl, abs=1e-6)
    assert same.by_ratio[0.3].kl == pytest.approx(prefilled.by_ratio[0.3].kl, abs=1e-6)
    other = sweep(named, lambda key: archived(key, scale=0.5))  # other stored KV, another measurement
    assert abs(other.reuse_kl - prefilled.reuse_kl) > 1e-3
    fallback = sweep(named, lambda key: archived(key, missing="plants"))
    assert fallback.reuse_kl == pytest.approx(prefilled.reuse_kl, abs=1e-6)


def _tune_with_profile(path, measured: dict):
    """The module's `profile --quick` measurement stored as this archive's location's profile, then `tune`
    calibrating on one prompt made of the archive's own passages: its JSON."""
    here = Profile.from_dict(measured)
    here.storage.path = normalize_path(path)
    with Archive.open(path, create=False) as ar:
        ar.put_profile(here.name, here.to_dict())
    proc = run_cli("tune", "--archive", path, "--compute", "cpu", "--limit", "1", "--top-k", "2",
                   "--ratios", "0.15,0.5",
                   "--json", check=True)
    return json.loads(proc.stdout)


def _assert_tuned_from_the_archive(out, path=None):
    assert out["calibration"].startswith("archive: 1 prompt of up to 2"), out["calibration"]
    assert out["quality"]["records"] == 1 and out["quality"]["by_ratio"]
    assert out["r_quality_source"] in ("calibration", "fallback")
    assert 0 < out["ratio"] <= 0.5, out  # issue 20: a ratio a user can live with, never 1.0
    if path is None:
        return
    shown = json.loads(run_cli("query", "--archive", path, "--compute", "cpu", "--max-tokens", "1", "--json",
                               "What is this about?", check=True).stdout)
    assert shown["ratio"] == pytest.approx(out["ratio"])  # queries take the stored ratio


def test_tune_on_three_musique_passages_stores_a_usable_ratio(quick_profile, tmp_path):
    """Issue 20: a `profile --quick` measurement + `tune` on an archive of 3 MuSiQue passages stores a ratio
    <= 0.5, calibrated on a prompt made of two of those passages (one prompt: each costs four runs of 16 tokens,
    and more prompts go through the same code), and `query` then recomputes at it."""
    docs = tmp_path / "docs"
    docs.mkdir()
    record = json.loads((FIXTURES / "musique_sample.json").read_text())[0]
    for i, ctx in enumerate(record["ctxs"][:3]):
        (docs / f"passage{i}.txt").write_text(ctx["text"])
    run_cli("ingest", docs, "--archive", tmp_path / "archive", "--compute", "cpu", check=True)
    _assert_tuned_from_the_archive(_tune_with_profile(tmp_path / "archive", quick_profile[1]), tmp_path / "archive")
