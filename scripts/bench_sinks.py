"""The prefix sink measured from the archive (issue 20, point 3).

`ingest --sink prefix` prefills every passage after the default template's
instruction prefix (its KV dropped); `--sink none` prefills it alone. Which one
answers closer to `full` depends on the prompt the passages then sit in, so the
passages are archived both ways (two archives, one model) and every record is
asked under three templates:

- default: what `kvblend query` uses (the sink is exactly its prefix);
- default + another --system: the sink no longer matches the prompt's prefix;
- musique: the bench's (the paper's) template, another prefix altogether;

on musique_dev (records 0-19, where the sink was first measured, KV in memory)
and on records outside it (20-29). Per record and template, `full` runs once
(the reference) and blend at the default ratio and policy once from each
archive, through the same harness as `kvblend bench` (KV streamed from the
archive, answers of up to 16 tokens, answer KL over full's first 16).

    .venv/bin/python scripts/bench_sinks.py        # → bench-out/sinks.json, markdown on stdout
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, command_line, machine, write_result  # noqa: E402

from kvblend.defaults import DEFAULT_RATIO  # noqa: E402
from kvblend.evaluation.harness import RecordRunner  # noqa: E402
from kvblend.evaluation.metrics import f1_score  # noqa: E402
from kvblend.evaluation.records import load_records  # noqa: E402
from kvblend.evaluation.specs import FULL, RunSpec  # noqa: E402
from kvblend.model import load_model  # noqa: E402
from kvblend.options import MUSIQUE_TEMPLATE, PromptTemplate  # noqa: E402
from kvblend.pipeline import Engine  # noqa: E402

SINKS = ("none", "prefix")
OTHER_SYSTEM = "You are a careful research assistant. Answer from the passages in as few words as you can."
TEMPLATES = {
    "default": PromptTemplate(),
    "default + --system": dataclasses.replace(PromptTemplate(), system=OTHER_SYSTEM),
    "musique": MUSIQUE_TEMPLATE,
}
RECORD_SETS = {"musique_dev (0-19)": (0, 20), "outside (20-29)": (20, 10)}
BLEND = RunSpec("blend", DEFAULT_RATIO)
MAX_NEW_TOKENS = 16


def run_set(engines: dict, runner, offset: int, limit: int, log) -> list[dict]:
    records = load_records(SHARED_DATA / "musique_dev.json", offset + limit)[offset:]
    cells: dict[tuple[str, str], list] = {(t, s): [] for t in TEMPLATES for s in SINKS}
    full_f1: dict[str, list[float]] = {t: [] for t in TEMPLATES}
    for name, template in TEMPLATES.items():
        runners = {s: RecordRunner(runner, template, MAX_NEW_TOKENS, engine=engines[s]) for s in SINKS}
        for i, record in enumerate(records):
            reference, runs = runners[SINKS[0]].run(i, record, [FULL, BLEND])
            full_f1[name].append(f1_score(reference.answer, record.answers))
            cells[name, SINKS[0]].append(next(r for r in runs if r.spec == BLEND))
            for sink in SINKS[1:]:
                cells[name, sink].append(runners[sink].run(i, record, [BLEND], reference=reference)[1][0])
            log(f"{name} record {offset + i}: " + ", ".join(
                f"{s} KL {cells[name, s][-1].kl_vs_full:.4f}" for s in SINKS))
    mean = statistics.fmean
    return [
        {
            "template": t, "sink": s, "ratio": DEFAULT_RATIO, "records": len(runs),
            "blend_kl": round(mean(r.kl_vs_full for r in runs), 6),
            "blend_answer_kl": round(mean(r.answer_kl_vs_full for r in runs), 6),
            "blend_f1": round(mean(f1_score(r.answer, r.golds) for r in runs), 4),
            "full_f1": round(mean(full_f1[t]), 4),
            "recompute_share": round(mean(r.recompute_share for r in runs), 4),
        }
        for (t, s), runs in cells.items()
    ]


def markdown(rows: list[dict]) -> str:
    lines = [
        "| records | template | sink | blend first-token KL | blend answer KL | blend F1 | full F1 | recompute share |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['set']} | {r['template']} | {r['sink']} | {r['blend_kl']:.4f} | {r['blend_answer_kl']:.4f} "
            f"| {r['blend_f1']:.3f} | {r['full_f1']:.3f} | {r['recompute_share']:.1%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    runner = load_model(None, "cpu")
    root = Path(tempfile.mkdtemp(prefix="kvblend-sinks-"))
    engines = {s: Engine(root / s, runner=runner, sink=s) for s in SINKS}
    rows = []
    for name, (offset, limit) in RECORD_SETS.items():
        for row in run_set(engines, runner, offset, limit, lambda m: print(m, file=sys.stderr, flush=True)):
            rows.append({"set": name, **row})
    data = {"command": command_line(), "machine": machine(), "max_new_tokens": MAX_NEW_TOKENS, "rows": rows,
            "markdown": markdown(rows)}
    write_result("sinks", data)
    print(data["markdown"])
    return data


if __name__ == "__main__":
    main()
