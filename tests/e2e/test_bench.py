"""`kvblend bench` end to end on two bundled calibration records."""

from __future__ import annotations

import json
import math

from support import CALIBRATION, run_cli

RESULT_KEYS = {"mode", "ratio", "f1", "em_vs_full", "rouge_l_vs_full", "kl_vs_full", "answer_kl_vs_full",
               "ttft_median_s", "ttft_p90_s", "recompute_share"}
CODEC_KEYS = {"codec", "bytes_per_token", "read_MBps", "decode_MBps", "load_MBps"}  # storage side of each row


def test_bench_end_to_end_on_two_calibration_records(tmp_path):
    out_json, plot = tmp_path / "report.json", tmp_path / "plot.png"
    proc = run_cli("bench", CALIBRATION, "--limit", "2", "--chunks", "3", "--modes", "full,reuse,blend",
                   "--ratios", "0.15", "--json", "--out", out_json, "--plot", plot, "--compute", "cpu", check=True)
    report = json.loads(proc.stdout)
    assert {"model", "machine", "command", "date", "records", "results"} <= set(report)
    assert report["records"] == 2
    assert report["model"] and report["machine"] and report["command"].startswith("kvblend bench")
    assert json.loads(out_json.read_text()) == report
    assert plot.stat().st_size > 1000
    rows = {(r["mode"], r["ratio"]): r for r in report["results"]}
    assert list(rows) == [("full", None), ("reuse", None), ("blend", 0.15)]
    for r in report["results"]:
        assert set(r) == RESULT_KEYS | CODEC_KEYS
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
