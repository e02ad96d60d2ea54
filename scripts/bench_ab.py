"""Before/after benchmark of two source trees in one run (issue 12: a refactor must not slow anything).

Runs the engine and query benchmarks of OLD (another checkout, e.g. a git worktree
of the previous commit) and of this tree alternately, `rounds` times each, with the
same interpreter and virtualenv, and prints one table of their medians. Usage:

    git worktree add /tmp/kvblend-before HEAD~1
    .venv/bin/python scripts/bench_ab.py /tmp/kvblend-before
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run_bench(tree: Path, script: str) -> dict:
    """One benchmark script of `tree`, imported from `tree` (PYTHONPATH first), its JSON result."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, str(tree / "scripts" / f"{script}.py")], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return json.loads((tree / "bench-out" / f"{script.removeprefix('bench_')}.json").read_text())


def headline(script: str, r: dict) -> dict[str, float]:
    if script == "bench_engine":
        return {"engine full TTFT s": r["modes"]["full"]["ttft_median_s"],
                "engine blend TTFT s": r["modes"]["blend"]["ttft_median_s"],
                "engine speed-up": r["modes"]["blend"]["speedup_vs_full"]}
    return {"query warm speed-up": r["speedup_warm"], "query cold speed-up": r["speedup_cold"],
            "query blend warm TTFT s": r["median"]["blend/warm"]["ttft"],
            "query load-wait share": r["load_wait_share_warm"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("--new", type=Path, default=ROOT,
                    help="the tree to compare with OLD (default: this one); e.g. the refactor's own commit, so "
                         "later algorithm changes do not mix into a refactor's before/after")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    trees = {"before": args.old.resolve(), "after": args.new.resolve()}
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    values: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for _ in range(args.rounds):
        for script in ("bench_engine", "bench_query"):
            for label, tree in trees.items():
                for k, v in headline(script, run_bench(tree, script)).items():
                    values[label].setdefault(k, []).append(v)
    rows = {k: {"before": statistics.median(values["before"][k]), "after": statistics.median(values["after"][k])}
            for k in values["before"]}
    result = {"machine": machine(), "date": started, "rounds": args.rounds, "before": str(trees["before"]),
              "after": str(trees["after"]), "rows": rows,
              "command": "python scripts/bench_ab.py " + " ".join(sys.argv[1:])}
    write_result("restructure_ab", result)
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = [f"| measure (median of {r['rounds']} alternating runs) | before | after | after/before |",
             "|---|---:|---:|---:|"]
    for k, v in r["rows"].items():
        lines.append(f"| {k} | {v['before']:.3f} | {v['after']:.3f} | {v['after'] / v['before']:.3f} |")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
