"""The prefix sink measured from the archive (issue 20, point 3).

`ingest --sink prefix` prefills every passage after the default template's
instruction prefix (its KV dropped); `--sink none` prefills it alone. Which one
answers closer to `full` depends on the prompt the passages then sit in, so each
archive is benchmarked (`kvblend bench`, passages archived with that sink,
streamed from the archive) under three templates:

- default: what `kvblend query` uses (the sink is exactly its prefix);
- default + another --system: the sink no longer matches the prompt's prefix;
- musique: the bench's (the paper's) template, another prefix altogether;

on musique_dev (records 0-19, where the sink was first measured, KV in memory)
and on records outside it (20-29). Modes full and blend at the default ratio
and policy; answers of up to 16 tokens (answer KL over full's first 16).

    .venv/bin/python scripts/bench_sinks.py        # → bench-out/sinks.json, markdown on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import ROOT, SHARED_DATA, command_line, machine, write_result  # noqa: E402

SINKS = ("none", "prefix")
OTHER_SYSTEM = "You are a careful research assistant. Answer from the passages in as few words as you can."
TEMPLATES = {
    "default": ["--template", "default"],
    "default + --system": ["--template", "default", "--system", OTHER_SYSTEM],
    "musique": ["--template", "musique"],
}
RECORD_SETS = {"musique_dev (0-19)": ["--limit", "20"], "outside (20-29)": ["--offset", "20", "--limit", "10"]}


def bench(sink: str, template: list[str], records: list[str]) -> dict:
    args = ["bench", str(SHARED_DATA / "musique_dev.json"), *records, *template, "--sink", sink,
            "--modes", "full,blend", "--max-tokens", "16", "--json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "kvblend"), *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"kvblend {' '.join(args)} failed:\n{proc.stderr}")
    report = json.loads(proc.stdout)
    rows = {r["mode"]: r for r in report["results"]}
    return {
        "command": "kvblend " + " ".join(args),
        "blend_kl": rows["blend"]["kl_vs_full"],
        "blend_answer_kl": rows["blend"]["answer_kl_vs_full"],
        "blend_f1": rows["blend"]["f1"],
        "full_f1": rows["full"]["f1"],
        "ratio": rows["blend"]["ratio"],
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| records | template | sink | blend first-token KL | blend answer KL | blend F1 | full F1 |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['records']} | {r['template']} | {r['sink']} | {r['blend_kl']:.4f} | {r['blend_answer_kl']:.4f} "
            f"| {r['blend_f1']:.3f} | {r['full_f1']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    rows = []
    for records, record_args in RECORD_SETS.items():
        for template, template_args in TEMPLATES.items():
            for sink in SINKS:
                row = {"records": records, "template": template, "sink": sink,
                       **bench(sink, template_args, record_args)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    data = {"command": command_line(), "machine": machine(), "rows": rows, "markdown": markdown(rows)}
    write_result("sinks", data)
    print(data["markdown"])
    return data


if __name__ == "__main__":
    main()
