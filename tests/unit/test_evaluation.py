"""The bench harness without a model: aggregation on hand-made runs, specs, records, tables, the plot."""

from __future__ import annotations

import json

import pytest

from kvblend.errors import UsageError
from kvblend.evaluation.plot import plot_report
from kvblend.evaluation.records import load_records, parse_modes
from kvblend.evaluation.report import markdown_results, markdown_variants
from kvblend.evaluation.specs import FULL, RunRecord, RunSpec, main_specs, variant_specs
from kvblend.evaluation.summary import summarize
from kvblend.tuning.quality import calibration_file, load_calibration
from support import CALIBRATION, one_line_error, run_cli

RESULT_KEYS = {"mode", "ratio", "f1", "em_vs_full", "rouge_l_vs_full", "kl_vs_full", "answer_kl_vs_full",
               "ttft_median_s", "ttft_p90_s", "recompute_share",
               "codec", "bytes_per_token", "read_MBps", "decode_MBps", "load_MBps",
               "diverged_share", "first_divergence_median", "kl_by_position",
               "stale_mass_first", "stale_mass_diverging", "top_stale_share", "top_overlap_first", "stale_share"}


def _run(record: int, spec: RunSpec, answer: str, golds, ttft: float, share: float, kl: float, akl: float):
    return RunRecord(record, spec, answer, list(golds), ttft, share, kl, akl)


def test_summary_means_percentiles_and_agreement_is_against_fulls_answer():
    blend = RunSpec("blend", 0.15)
    golds = [["Ingrid Solberg"], ["Bergen", "Bergen, Norway"], ["1962"], ["red"]]
    full_answers = {0: "Ingrid Solberg", 1: "Oslo", 2: "in 1962", 3: "the red one"}
    full_runs = [_run(i, FULL, full_answers[i], golds[i], t, 1.0, 0.0, 0.0) for i, t in enumerate([4.0, 2.0, 3.0, 1.0])]
    blend_runs = [
        _run(0, blend, "Ingrid Solberg", golds[0], 0.4, 0.20, 0.1, 0.2),  # = full, = gold
        _run(1, blend, "Oslo", golds[1], 0.1, 0.22, 0.3, 0.4),  # = full, ≠ gold: EM vs full counts it
        _run(2, blend, "1962", golds[2], 0.3, 0.24, 0.5, 0.6),  # = gold; vs full "in 1962": EM 0, ROUGE-L 2/3
        _run(3, blend, "blue", golds[3], 0.2, 0.26, 0.7, 0.8),  # wrong everywhere
    ]
    rows = summarize(blend_runs + full_runs, full_answers, [FULL, blend])
    assert [r["mode"] for r in rows] == ["full", "blend"]
    full, bl = rows
    assert set(full) == RESULT_KEYS
    assert full["ratio"] is None and bl["ratio"] == 0.15
    assert full["em_vs_full"] == 1.0 and full["rouge_l_vs_full"] == 1.0
    assert full["kl_vs_full"] == 0.0 and full["answer_kl_vs_full"] == 0.0
    assert full["f1"] == pytest.approx((1.0 + 0.0 + 2 / 3 + 2 / 3) / 4)  # "in 1962" vs "1962": P=1/2, R=1
    assert full["ttft_median_s"] == pytest.approx(2.5)
    assert full["ttft_p90_s"] == pytest.approx(3.7)  # sorted 1,2,3,4: position 2.7 → 3 + 0.7
    assert bl["f1"] == pytest.approx((1.0 + 0.0 + 1.0 + 0.0) / 4)
    assert bl["em_vs_full"] == pytest.approx(2 / 4)
    assert bl["rouge_l_vs_full"] == pytest.approx((1.0 + 1.0 + 2 * 1 / (1 + 2) + 0.0) / 4)
    assert bl["kl_vs_full"] == pytest.approx(0.4)
    assert bl["answer_kl_vs_full"] == pytest.approx(0.5)
    assert bl["recompute_share"] == pytest.approx(0.23)
    assert bl["ttft_median_s"] == pytest.approx(0.25)
    assert bl["ttft_p90_s"] == pytest.approx(0.37)


def test_specs_full_always_first_blend_per_ratio_and_identical_runs_shared():
    specs = main_specs(("reuse", "blend"), (0.05, 0.3))
    assert [s.label for s in specs] == ["full", "reuse", "blend@0.05", "blend@0.3"]
    # non-blend modes ignore blend knobs, so equal runs compare (and are run) once
    assert RunSpec("reuse", 0.3, deviation="k") == RunSpec("reuse")
    variants = variant_specs(0.15)
    assert {g for g, _, _ in variants} == {"select", "deviation", "check_layers", "sink"}
    unique = set(s for _, _, s in variants)
    assert RunSpec("blend", 0.15) in unique  # the default policy, layer 1: the main blend@0.15 run
    # the default policy is check layer 1's run; hkvd is the HKVD baseline's default deviation
    assert len(unique) == len(variants) - 2
    with pytest.raises(UsageError):
        RunSpec("blend", 0.15, sink="shared-prefix")  # the archive only holds chunks prefilled alone
    assert RunSpec("full", source="memory").label == "full [alone, in memory]"


def test_plot_has_two_panels_written_as_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        {"mode": "full", "ratio": None, "f1": 0.5, "answer_kl_vs_full": 0.0, "ttft_median_s": 2.0},
        {"mode": "reuse", "ratio": None, "f1": 0.2, "answer_kl_vs_full": 0.6, "ttft_median_s": 0.3},
        {"mode": "blend", "ratio": 0.05, "f1": 0.3, "answer_kl_vs_full": 0.3, "ttft_median_s": 0.5},
        {"mode": "blend", "ratio": 0.15, "f1": 0.45, "answer_kl_vs_full": 0.1, "ttft_median_s": 0.7},
    ]
    data = {"model": "m", "machine": "here", "records": 3, "settings": {"answer_kl_tokens": 16}, "results": rows}
    path = plot_report(data, tmp_path / "q.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_tables_for_benchmarks_md():
    row = {"f1": 0.5, "em_vs_full": 1.0, "rouge_l_vs_full": 1.0, "kl_vs_full": 0.0, "answer_kl_vs_full": 0.0,
           "ttft_median_s": 2.0, "ttft_p90_s": 2.5, "recompute_share": 1.0}
    data = {"model": "m", "records": 2, "settings": {"chunks": 6, "variant_ratio": 0.15},
            "results": [{"mode": "full", "ratio": None, **row},
                        {"mode": "blend", "ratio": 0.15, **row, "ttft_median_s": 0.5, "recompute_share": 0.2}],
            "variants": [{"group": "deviation", "name": "v", "mode": "blend", "kv_source": "archive", **row}]}
    md = markdown_results(data)
    assert "| blend | 0.15 |" in md and "4.00×" in md and "20.0%" in md
    assert "| deviation | v | blend |" in markdown_variants(data)


# ───────────────────────────── records ─────────────────────────────


def test_load_records_reads_the_bundled_calibration_set_and_limits():
    records = load_records(CALIBRATION, limit=2)
    assert len(records) == 2
    assert len(records[0].passages) == 6 and records[0].answers
    texts = records[0].passage_texts(3)
    assert len(texts) == 3 and texts[0].startswith(records[0].passages[0][0] + "\n\n")
    assert len(records[0].passage_texts()) == 6
    with pytest.raises(UsageError):
        load_records(CALIBRATION, limit=0)


def test_calibration_set_is_package_data():
    """Read through importlib.resources (works from a wheel), and the same records as the file in the tree."""
    assert calibration_file().is_file()
    assert load_calibration(limit=3) == load_records(CALIBRATION, limit=3)
    assert parse_modes("full, blend") == ("full", "blend")


@pytest.mark.parametrize("case", ["missing", "schema", "limit0", "ratio", "pareto_ratio", "mode", "passage",
                                  "template", "system", "sink", "offset_limit0", "plot_suffix", "ratios_unused",
                                  "codec_zstd"])
def test_bad_input_is_one_line_and_nonzero(case, tmp_path):
    args = {
        "missing": [tmp_path / "nope.json"],
        "schema": [tmp_path / "wrong.json"],
        "limit0": [CALIBRATION, "--limit", "0"],
        "ratio": [CALIBRATION, "--ratios", "0.15,1.5"],
        "pareto_ratio": [CALIBRATION, "--pareto", "--pareto-ratios", "0.1,0"],
        "mode": [CALIBRATION, "--modes", "full,turbo"],
        "passage": [tmp_path / "passage.json"],
        "template": [CALIBRATION, "--template", "chatml"],
        "system": [CALIBRATION, "--system", " "],
        "sink": [CALIBRATION, "--sink", "everything"],
        "offset_limit0": [CALIBRATION, "--offset", "1", "--limit", "0"],  # said "no records past --offset 1"
        "plot_suffix": [CALIBRATION, "--plot", tmp_path / "chart.txt"],  # a traceback after the whole run
        "ratios_unused": [CALIBRATION, "--modes", "full,reuse", "--ratios", "abc"],  # was not read, exit 0
        "codec_zstd": [CALIBRATION, "--codecs", "lossless,zstd"],  # measured zstd-shuffle's blobs, called zstd
    }[case]
    (tmp_path / "wrong.json").write_text(json.dumps([{"question": "q?", "answers": ["a"], "contexts": []}]))
    (tmp_path / "passage.json").write_text(json.dumps([{"question": "q?", "answers": ["a"], "ctxs": [{"title": "t"}]}]))
    line = one_line_error(run_cli("bench", *args))
    assert line.startswith("kvblend: error:")
    assert {"missing": "no such", "schema": "ctxs", "limit0": "--limit", "ratio": "1.5", "pareto_ratio": "--pareto-ratios", "mode": "turbo",
            "passage": "ctxs[0]", "template": "chatml", "system": "--system", "sink": "--sink",
            "offset_limit0": "--limit must be at least 1, not 0", "plot_suffix": "matplotlib writes no .txt",
            "ratios_unused": "--ratios takes comma-separated numbers", "codec_zstd": "plain zstd"}[case] in line


def test_bench_tables_show_their_cells_as_text_and_records_by_their_number_in_the_dataset():
    """Rich read a row's "reuse [int4]" as a markup tag and dropped it: two runs of different codecs showed as two
    rows named "reuse". And with --offset 3, the first record was "record 0"."""
    from rich.console import Console

    from kvblend.cli.bench_cmds import _table
    from kvblend.evaluation.summary import BenchReport

    console = Console(width=100, record=True)
    console.print(_table("t", ["run", "KL"], [["reuse [int4]", "0.1"], ["reuse [zstd-shuffle]", "0.2"]]))
    text = console.export_text()
    assert "reuse [int4]" in text and "reuse [zstd-shuffle]" in text
    report = BenchReport(model="m", machine="x", command="c", date="d", records=1, results=[],
                         questions=["q?"], first_record=3)
    assert [r["record"] for r in report.per_record()] == [3]


def test_pareto_grid_shows_kl_share_and_speedup_per_policy_and_ratio():
    from kvblend.evaluation.report import pareto_grid

    points = [
        {"select": "probe", "ratio": 0.1, "kl_vs_full": 0.05, "recompute_share": 0.11, "speedup": 4.2},
        {"select": "probe", "ratio": 0.2, "kl_vs_full": 0.02, "recompute_share": 0.21, "speedup": 3.1},
        {"select": "hkvd", "ratio": 0.2, "kl_vs_full": 0.04, "recompute_share": 0.2},  # saved before TTFTs
    ]
    headers, rows = pareto_grid(points)
    assert headers == ["policy", "r=0.1", "r=0.2"]
    assert rows == [["probe", "0.0500 (11.0%, 4.20×)", "0.0200 (21.0%, 3.10×)"], ["hkvd", "—", "0.0400 (20.0%)"]]


def test_bench_names_its_template():
    import dataclasses

    from kvblend.evaluation.bench import template_name
    from kvblend.options import MUSIQUE_TEMPLATE, PromptTemplate

    assert template_name(MUSIQUE_TEMPLATE) == "musique" and template_name(PromptTemplate()) == "default"
    assert template_name(PromptTemplate(system="Be terse.")) == "default + --system"
    assert template_name(dataclasses.replace(MUSIQUE_TEMPLATE, system="Be terse.")) == "musique + --system"
    assert template_name(PromptTemplate(before_passages="Docs:\n")) == "custom"


def test_answers_carry_each_records_sources_as_a_query_reports_them():
    """`bench --answers`: per record, the passages its prompts held, cited like a query's segments."""
    from kvblend.evaluation.bench import record_sources
    from kvblend.evaluation.records import QARecord
    from kvblend.evaluation.summary import BenchReport
    from kvblend.provenance import cite

    record = QARecord("Who?", [("Harbour", "A."), ("", "B."), ("Plants", "C.")], ["x"])
    sources = record_sources(record, chunks=2)
    assert sources == [{"document": "Harbour", "pages": None, "section": None, "sections": None, "rows": None},
                       {"document": None, "pages": None, "section": None, "sections": None, "rows": None}]
    report = BenchReport("m", "cpu", "", "", 1, [], runs=[_run(0, FULL, "x", ["x"], 1.0, 1.0, 0.0, 0.0)],
                         questions=["Who?"], sources=[sources])
    (rec,) = report.to_dict(answers=True)["per_record"]
    assert rec["sources"] == sources and rec["runs"][0]["answer"] == "x" and cite(rec["sources"]) == "Harbour"
    assert rec["runs"][0]["diverges_at"] is None and rec["runs"][0]["stale_reading"] is None
    assert "per_record" not in report.to_dict()


def test_drift_is_kl_per_position_and_the_first_token_greedy_decoding_would_change():
    """Issue 33: where along full's answer a mode drifts. Teacher-forced logits before each of full's tokens:
    the first position whose argmax is not full's token is the divergence; KL is taken per position."""
    import torch

    from kvblend.evaluation.metrics import first_divergence, token_kls

    full_tokens = [3, 1, 4, 1]
    agree = torch.full((4, 6), -5.0)
    agree[torch.arange(4), torch.tensor(full_tokens)] = 5.0
    drifts = agree.clone()
    drifts[2] = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 9.0])  # position 2 prefers 5 over full's 4
    assert first_divergence(full_tokens, agree) is None
    assert first_divergence(full_tokens, drifts) == 2
    assert first_divergence([], drifts) is None
    kls = token_kls(agree, drifts)
    assert kls[:2] == [0.0, 0.0] and kls[3] == 0.0 and kls[2] > 1.0

    blend = RunSpec("blend", 0.15)
    runs = [_run(i, blend, "x", ["x"], 0.1, 0.2, 0.0, 0.0) for i in range(3)]
    for run, kls_, at in zip(runs, ([0.1, 0.3, 0.5], [0.3, 0.1], [0.2, 0.2, 0.2]), (None, 1, 3)):
        run.position_kls, run.diverges_at = kls_, at
    (row,) = summarize(runs, {i: "x" for i in range(3)}, [blend])
    assert row["kl_by_position"] == pytest.approx([0.2, 0.2, 0.35])  # position 2: the two answers that reach it
    assert row["diverged_share"] == pytest.approx(2 / 3) and row["first_divergence_median"] == pytest.approx(2.0)
    assert row["stale_mass_diverging"] is None  # no diverging run was read
    from kvblend.evaluation.drift import StaleReading

    for run, mass in zip(runs[1:], (0.2, 0.4)):  # what the two diverging steps read: averaged over them
        run.stale = StaleReading(run.diverges_at, 0.8, mass, mass / 2, 1.0, 0.5, [7], [(0, 1, mass)])
    (row,) = summarize(runs, {i: "x" for i in range(3)}, [blend])
    assert row["stale_mass_diverging"] == pytest.approx(0.3) and row["stale_mass_first"] == pytest.approx(0.15)
    assert row["top_stale_share"] == 1.0 and row["top_overlap_first"] == 0.5 and row["stale_share"] == 0.8


def test_the_demo_says_slower_where_a_mode_lost_to_full():
    """On a GPU the bundled model prefills faster than the archive streams its KV: blend at 0.1x full's speed
    must read as ten times slower, not as "0.1x faster"."""
    from kvblend.cli.query_cmds import _relative_speed

    assert _relative_speed(4.52) == "4.5x faster"
    assert _relative_speed(1.0) == "1.0x faster"
    assert _relative_speed(0.1) == "10.0x slower"
    assert _relative_speed(0.25) == "4.0x slower"


def test_the_drift_table_names_each_runs_codec_when_several_ran():
    """Two `reuse` rows with different numbers and nothing to tell the lossless run from the int4 one."""
    from rich.console import Console

    from kvblend.cli import bench_cmds

    def row(codec, kl):
        return {"mode": "reuse", "ratio": None, "codec": codec, "bytes_per_token": 1.0, "kl_by_position": [kl],
                "diverged_share": 0.0, "first_divergence_median": None}

    console = Console(width=200, record=True)
    bench_cmds._print_drift(console, [row("zstd-shuffle", 0.19), row("int4", 0.24)])
    text = console.export_text()
    assert "reuse [zstd-shuffle]" in text and "reuse [int4]" in text


def test_the_plot_draws_one_line_per_mode_and_codec_when_several_codecs_ran():
    """bench --codecs lossless,int4 drew both codecs' blend points as one 'recompute ratio' line, unlabelled."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from kvblend.evaluation.plot import _draw_panel

    def row(mode, codec, ratio, kl, ttft):
        return {"mode": mode, "ratio": ratio, "codec": codec, "bytes_per_token": None if mode == "full" else 1.0,
                "f1": 0.3, "answer_kl_vs_full": kl, "ttft_median_s": ttft}

    rows = [row("full", "zstd-shuffle", None, 0.0, 2.0)] + [
        row("blend", c, r, kl, t) for c in ("zstd-shuffle", "int4") for r, kl, t in ((0.12, 0.03, 0.5), (0.3, 0.01, 0.9))
    ]
    ax = Figure().subplots()
    _draw_panel(ax, rows, "answer_kl_vs_full", "KL", "t", 2.0)
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["full", "blend (recompute ratio r) [zstd-shuffle]", "blend (recompute ratio r) [int4]"]
    assert [len(line.get_xdata()) for line in ax.get_lines()] == [1, 2, 2]


def test_variant_rows_name_the_sink_the_archived_passages_were_prefilled_after():
    """--variants said `"sink": "alone"` for every run that read the archive's passages, archived after the
    prefix sink (bench's default --sink): a row's sink is the archive's where its KV came from the archive."""
    from kvblend.evaluation.bench import _variant_rows

    archived, in_memory = RunSpec("reuse"), RunSpec("reuse", sink="template", source="memory")
    runs = [_run(0, spec, "a", ["a"], 0.1, 1.0, 0.0, 0.0) for spec in (FULL, archived, in_memory)]
    rows = _variant_rows([("sink", "archive", archived), ("sink", "memory", in_memory)], runs, {0: "a"}, "prefix")
    assert [(r["name"], r["sink"], r["kv_source"]) for r in rows] == [
        ("archive", "prefix", "archive"), ("memory", "template", "memory")]
