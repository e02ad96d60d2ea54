"""What a per-query recompute ratio could gain at best (issue 33, point 2): an oracle bound.

An adaptive ratio spends more recompute on the queries that need it and less on easy ones, holding the
average share. Before looking for a signal that predicts which queries those are, this script bounds what
any such policy can reach: every record runs blend at several fixed ratios (in memory, passages prefilled
after the instruction prefix as `ingest --sink prefix` archives them; the default probe selection), and the
best allocation per record, chosen knowing each run's answer KL and agreement with full, is computed under
the share of the default ratio and under the issue's 16% bound. A target the oracle misses is out of reach
of every adaptive ratio over these levels.

    .venv/bin/python scripts/bench_ratio_oracle.py --offset 0 --limit 20
    .venv/bin/python scripts/bench_ratio_oracle.py --offset 20 --limit 20 --append
    .venv/bin/python scripts/bench_ratio_oracle.py --analyse-only         # the table from bench-out's rows
"""

from __future__ import annotations

import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, record_sets_main

LEVELS = (0.06, 0.12, 0.18, 0.24)
NAME = "ratio_oracle"


def run_records(offset: int, limit: int, levels: tuple[float, ...]) -> list[dict]:
    from kvblend.evaluation.harness import RecordRunner
    from kvblend.evaluation.metrics import exact_match, rouge_l
    from kvblend.evaluation.records import DEFAULT_CHUNKS, load_records
    from kvblend.evaluation.specs import RunSpec
    from kvblend.model import load_model

    runner = load_model(None, compute="cpu")
    records = load_records(SHARED_DATA / "musique_dev.json", offset + limit)[offset:]
    memory = dict(source="memory", sink="shared-prefix")
    harness = RecordRunner(runner, chunks=DEFAULT_CHUNKS, reference_spec=RunSpec("full", **memory))
    specs = [RunSpec("blend", r, **memory) for r in levels] + [RunSpec("reuse", **memory)]
    rows = []
    for i, record in enumerate(records):
        kv: dict = {}
        reference, _ = harness.run(i, record, [], memory=kv)
        _, runs = harness.run(i, record, specs, reference=reference, memory=kv)
        row: dict = {"record": offset + i, "full": reference.answer, "runs": {}}
        for r in runs:
            name = "reuse" if r.spec.mode == "reuse" else str(r.spec.ratio)
            row["runs"][name] = {
                "kl1": r.kl_vs_full,
                "akl": r.answer_kl_vs_full,
                "share": r.recompute_share,
                "em": exact_match(r.answer, reference.answer),
                "rl": rouge_l(r.answer, reference.answer),
                "answer": r.answer,
            }
        rows.append(row)
        print(offset + i, {k: (round(v["akl"], 4), v["em"]) for k, v in row["runs"].items()}, flush=True)
    return rows


def _mean(rows: list[dict], pick, key: str) -> float:
    return statistics.fmean(r["runs"][pick(r)][key] for r in rows)


def oracle(rows: list[dict], levels: list[str], budget: float, key: str) -> dict[int, str]:
    """Per record the level that serves `key` best (least answer KL, or most exact agreement, then least answer
    KL) with the mean share at most `budget`: exact, by dynamic programming over the summed share in 0.1% steps."""
    best: dict[int, tuple[float, float, list[str]]] = {0: (0.0, 0.0, [])}
    for r in rows:
        nxt: dict[int, tuple[float, float, list[str]]] = {}
        for units, (gain, tie, picks) in best.items():
            for level in levels:
                x = r["runs"][level]
                step = (-x["akl"], 0.0) if key == "akl" else (x["em"], -x["akl"])
                cand = (gain + step[0], tie + step[1], [*picks, level])
                u = units + round(x["share"] * 1000)
                if u not in nxt or cand[:2] > nxt[u][:2]:
                    nxt[u] = cand
        best = nxt
    cap = budget * 1000 * len(rows)
    _, _, picks = max((v for u, v in best.items() if u <= cap), key=lambda v: v[:2])
    return {r["record"]: p for r, p in zip(rows, picks)}


def _line(part: list[dict], reuse: dict, label: str, pick) -> dict:
    m = {k: _mean(part, pick, k) for k in ("share", "kl1", "akl", "em", "rl")}
    ratios = {"akl_x_reuse": m["akl"] / reuse["akl"], "kl1_x_reuse": m["kl1"] / reuse["kl1"]}
    return {"policy": label, **m, **ratios, "rl_minus_reuse": m["rl"] - reuse["rl"]}


def _policies(part: list[dict], levels: list[str]) -> list[tuple[str, object]]:
    """Reuse, blend at each fixed level, and the oracles under the default level's share and under 16%."""
    out: list[tuple[str, object]] = [("reuse", lambda r: "reuse")]
    out += [(f"blend {level}", lambda r, level=level: level) for level in levels]
    default_share = _mean(part, lambda r: "0.12", "share")
    for budget in (default_share, 0.16):
        for key, what in (("akl", "least answer KL"), ("em", "most agreement")):
            picks = oracle(part, levels, budget, key)
            out.append((f"oracle, {what}, share ≤ {budget:.1%}", lambda r, picks=picks: picks[r["record"]]))
    return out


def analyse(rows: list[dict]) -> dict:
    levels = [str(x) for x in LEVELS if str(x) in rows[0]["runs"]]
    sets = []
    for lo in sorted({r["record"] // 20 * 20 for r in rows}):
        part = [r for r in rows if lo <= r["record"] < lo + 20]
        reuse = {k: _mean(part, lambda r: "reuse", k) for k in ("akl", "kl1", "rl", "em", "share")}
        lines = [_line(part, reuse, label, pick) for label, pick in _policies(part, levels)]
        reachable = statistics.fmean(max(r["runs"][k]["em"] for k in levels) for r in part)
        sets.append({"records": f"{lo}–{lo + len(part) - 1}", "rows": lines, "any_level_agrees": reachable})
    return {"sets": sets}


def render(data: dict) -> str:
    out = []
    for s in data["analysis"]["sets"]:
        out.append(
            f"Records {s['records']} (a level at which blend's answer equals full's exists for "
            f"{s['any_level_agrees']:.0%} of them):\n"
        )
        out.append(
            "| policy | share | KL 1st (× reuse) | answer KL (× reuse) | EM vs full | ROUGE-L vs full (− reuse) |"
        )
        out.append("|---|---:|---:|---:|---:|---:|")
        for r in s["rows"]:
            out.append(
                f"| {r['policy']} | {r['share']:.1%} | {r['kl1']:.4f} ({r['kl1_x_reuse']:.2f}×) | "
                f"{r['akl']:.4f} ({r['akl_x_reuse']:.2f}×) | {r['em']:.2f} | {r['rl']:.3f} "
                f"({r['rl_minus_reuse']:+.3f}) |"
            )
        out.append("")
    return "\n".join(out)


def main() -> None:
    record_sets_main(
        NAME, __doc__.split("\n\n")[0], lambda offset, limit: run_records(offset, limit, LEVELS), analyse, render
    )


if __name__ == "__main__":
    main()
