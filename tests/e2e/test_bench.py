"""`kvblend bench` end to end on two bundled calibration records."""

from __future__ import annotations

import json
import math

import pytest

from support import CALIBRATION, run_cli

RESULT_KEYS = {"mode", "ratio", "f1", "em_vs_full", "rouge_l_vs_full", "kl_vs_full", "answer_kl_vs_full",
               "ttft_median_s", "ttft_p90_s", "recompute_share"}
CODEC_KEYS = {"codec", "bytes_per_token", "read_MBps", "decode_MBps", "load_MBps"}  # storage side of each row
DRIFT_KEYS = {"diverged_share", "first_divergence_median", "kl_by_position",  # where answers leave full's (issue 33)
              "stale_mass_first", "stale_mass_diverging", "top_stale_share", "top_overlap_first", "stale_share"}


def test_bench_end_to_end_on_two_calibration_records(tmp_path):
    out_json, plot = tmp_path / "report.json", tmp_path / "plot.png"
    proc = run_cli("bench", CALIBRATION, "--limit", "2", "--chunks", "2", "--modes", "full,reuse,blend",
                   "--ratios", "0.15", "--max-tokens", "8", "--json", "--out", out_json, "--plot", plot, "--compute", "cpu",
                   check=True)
    report = json.loads(proc.stdout)
    assert report["settings"]["max_new_tokens"] == 8
    assert report["settings"]["answer_kl_tokens"] == 8  # the positions it is taken over (it said 16)
    assert {"model", "machine", "command", "date", "records", "results"} <= set(report)
    assert report["records"] == 2
    assert report["model"] and report["machine"] and report["command"].startswith("kvblend bench")
    assert (report["settings"]["template"], report["settings"]["sink"]) == ("musique", "prefix")  # bench's defaults
    assert json.loads(out_json.read_text()) == report
    assert plot.stat().st_size > 1000
    rows = {(r["mode"], r["ratio"]): r for r in report["results"]}
    assert list(rows) == [("full", None), ("reuse", None), ("blend", 0.15)]
    for r in report["results"]:
        assert set(r) == RESULT_KEYS | CODEC_KEYS | DRIFT_KEYS
        for k in RESULT_KEYS - {"mode", "ratio"}:
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (r["mode"], k, r[k])
        assert r["ttft_median_s"] > 0 and r["ttft_p90_s"] >= r["ttft_median_s"]
    full, reuse, blend = rows[("full", None)], rows[("reuse", None)], rows[("blend", 0.15)]
    assert full["kl_vs_full"] == 0 and full["answer_kl_vs_full"] == 0
    assert full["em_vs_full"] == 1 and full["rouge_l_vs_full"] == 1
    assert full["recompute_share"] == 1
    assert blend["recompute_share"] < 0.5
    assert reuse["recompute_share"] < blend["recompute_share"]
    assert blend["kl_vs_full"] > 0 and reuse["kl_vs_full"] > 0
    # drift along full's answer (issue 33): position 0 is the first token; full never leaves its own answer
    assert full["diverged_share"] == 0 and full["first_divergence_median"] is None
    assert set(full["kl_by_position"]) == {0.0} and len(full["kl_by_position"]) >= 1
    for r in (reuse, blend):
        assert r["kl_by_position"][0] == pytest.approx(r["kl_vs_full"], abs=1e-5)
        assert 0 <= r["diverged_share"] <= 1
        if r["diverged_share"]:  # what the diverging steps read is measured (else None)
            assert 0 < r["stale_mass_diverging"] < 1 and 0 <= r["top_stale_share"] <= 1
    assert full["stale_mass_diverging"] is None


def test_bench_pareto_measures_kl_share_and_ttft_from_the_archive(tmp_path):
    """Issue 20: `bench --pareto --plot` puts every (policy, ratio) through a query from the archive, so each point
    has a TTFT beside its KL and share, and the chart draws KL against both."""
    from kvblend.evaluation.pareto import PARETO_SERIES

    plot = tmp_path / "pareto.png"
    ratios = (0.1, 0.3)  # --pareto-ratios: a two-point line per policy keeps the test short
    proc = run_cli("bench", CALIBRATION, "--limit", "1", "--chunks", "1", "--modes", "full", "--pareto",
                   "--pareto-ratios", ",".join(map(str, ratios)),
                   "--json", "--plot", plot, "--compute", "cpu", "--template", "default", "--sink", "prefix",
                   "--system", "Answer briefly.", check=True)
    report = json.loads(proc.stdout)
    settings = report["settings"]  # the passages archived after the prefix, asked with another system prompt
    assert (settings["template"], settings["sink"], settings["system"]) == ("default + --system", "prefix",
                                                                            "Answer briefly.")
    points = report["pareto"]
    assert [(p["select"], p["ratio"]) for p in points] == [(s, r) for s in PARETO_SERIES for r in ratios]
    full_ttft = {p["full_ttft_median_s"] for p in points}
    assert len(full_ttft) == 1 and full_ttft.pop() > 0  # one full run per record, the same for every point
    for p in points:
        assert p["records"] == 1 and p["kl_vs_full"] >= 0 and p["ttft_median_s"] > 0
        assert p["speedup"] == round(p["full_ttft_median_s"] / p["ttft_median_s"], 3) or \
            abs(p["speedup"] - p["full_ttft_median_s"] / p["ttft_median_s"]) < 0.01
    for series in PARETO_SERIES:  # more recompute at a larger ratio, in every line
        shares = [p["recompute_share"] for p in points if p["select"] == series]
        assert shares == sorted(shares) and shares[0] < shares[-1] < 1, (series, shares)
    assert plot.stat().st_size > 1000
