"""Recomputing during decode (issue 33, point 2's last candidate): is recompute spent after the first token
worth as much as recompute spent before it?

Blend spends its whole budget before the first token. A decode-time *refresh* spends part of it later: the
prefill fuses at a smaller ratio (a shorter TTFT), and the first decode step carries extra rows that recompute
more cached tokens through every layer over the fused KV, writing their fresh K/V in place before that step's
own query reads it (as a chunked-prefill row batch rides along a decode step in a server). The first token comes
from the prefill alone; every later token reads the refreshed KV.

Which tokens the refresh recomputes: the probe's next-ranked ones. The probe's scores do not depend on the ratio,
so blend at ratio b selects a superset of blend at a < b; the refresh recomputes S_b \\ S_a (*next*), or all of
S_b (*again*: the first selection once more, now over the next-ranked tokens' fresh KV, plus those).

Arms, per record (in memory, passages prefilled after the instruction prefix as `ingest --sink prefix` archives
them; the default probe selection; greedy ≤ 32 tokens; answer KL over full's first ≤ 16 tokens teacher-forced):
blend 0.06, 0.12 (the default), 0.15 in one pass; 0.06 + refresh next(0.12), 0.06 + refresh again(0.12),
0.12 + refresh next(0.15); reuse. The share counts the refresh rows in every layer.

    .venv/bin/python scripts/bench_decode_refresh.py --offset 0 --limit 20
    .venv/bin/python scripts/bench_decode_refresh.py --offset 20 --limit 20 --append
    .venv/bin/python scripts/bench_decode_refresh.py --analyse-only
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, record_sets_main

NAME = "decode_refresh"
ONE_PASS = (0.06, 0.12, 0.15)
REFRESHES = (
    ("0.06+next(0.12)", 0.06, 0.12, "next"),
    ("0.06+again(0.12)", 0.06, 0.12, "again"),
    ("0.12+next(0.15)", 0.12, 0.15, "next"),
)


@torch.inference_mode()
def refresh(runner, fused, positions: torch.Tensor):
    """`fused` with the tokens at `positions` recomputed through every layer over its KV (patched in place,
    layer by layer, before the layer's attention, as the fusor patches its active rows). A copy: `fused` is
    left as it was."""
    kv = [(k.clone(), v.clone()) for k, v in fused.kv]
    ids = torch.tensor([fused.token_ids], device=runner.device)[:, positions]
    cos, sin = runner.rope(positions[None])
    hidden = runner.embed(ids)
    for layer in range(runner.n_layers):
        q, k, v = runner.project_qkv(layer, hidden, cos, sin)
        layer_k, layer_v = kv[layer]
        layer_k[:, :, positions] = k.to(layer_k.dtype)
        layer_v[:, :, positions] = v.to(layer_v.dtype)
        attn = runner.attend(layer, q, layer_k, layer_v, query_positions=positions)
        hidden = runner.finish_layer(layer, hidden, attn)
    extra = int(positions.numel()) * runner.n_layers
    return replace(fused, kv=kv, recomputed_token_layers=fused.recomputed_token_layers + extra)


def run_records(offset: int, limit: int) -> list[dict]:
    from kvblend.evaluation.harness import Answer, RecordRunner, blend_config
    from kvblend.evaluation.metrics import exact_match, rouge_l
    from kvblend.evaluation.records import DEFAULT_CHUNKS, load_records
    from kvblend.evaluation.specs import RunSpec
    from kvblend.fusion import fuse
    from kvblend.generation import generate
    from kvblend.model import load_model
    from kvblend.prompt import assemble_prompt

    runner = load_model(None, compute="cpu")
    records = load_records(SHARED_DATA / "musique_dev.json", offset + limit)[offset:]
    memory = dict(source="memory", sink="shared-prefix")
    harness = RecordRunner(runner, chunks=DEFAULT_CHUNKS, reference_spec=RunSpec("full", **memory))
    rows = []
    for i, record in enumerate(records):
        kv: dict = {}
        reference, _ = harness.run(i, record, [], memory=kv)
        _, [reuse] = harness.run(i, record, [RunSpec("reuse", **memory)], reference=reference, memory=kv)
        prompt = assemble_prompt(runner, harness.template, record.question, list(kv["shared-prefix"]))
        fused, ttft = {}, {}
        for ratio in ONE_PASS:
            t0 = time.perf_counter()
            fused[ratio] = fuse(
                runner, prompt, "blend", blend_config(RunSpec("blend", ratio, **memory), runner.n_layers)
            )
            ttft[ratio] = time.perf_counter() - t0
        arms = {str(r): (fused[r], ttft[r], 0.0) for r in ONE_PASS}
        for label, first, then, how in REFRESHES:
            chosen = fused[then].selected
            if how == "next":
                chosen = chosen[~torch.isin(chosen, fused[first].selected)]
            chosen = chosen[fused[first].approximate_mask[chosen]]  # cached tokens only (the rest are fresh)
            t0 = time.perf_counter()
            arms[label] = (
                refresh(runner, fused[first], chosen.to(runner.device)),
                ttft[first],
                time.perf_counter() - t0,
            )
        row: dict = {"record": offset + i, "full": reference.answer, "runs": {}}
        row["runs"]["reuse"] = _summary(reuse, reference.answer, exact_match, rouge_l, 0.0)
        for label, (f, t, refresh_s) in arms.items():
            gen = generate(runner, f, harness.sampling)
            ans = Answer(gen.text, gen.token_ids, f, t + gen.first_token_s, f.recompute_share, len(f.token_ids))
            scored = harness._score(i, record, reference, RunSpec("blend", 0.12, **memory), ans)
            row["runs"][label] = _summary(scored, reference.answer, exact_match, rouge_l, refresh_s)
        rows.append(row)
        print(
            offset + i,
            {k: (round(v["akl"], 4), v["em"], round(v["share"], 3)) for k, v in row["runs"].items()},
            flush=True,
        )
    return rows


def _summary(run, full_answer: str, exact_match, rouge_l, refresh_s: float) -> dict:
    return {
        "kl1": run.kl_vs_full,
        "akl": run.answer_kl_vs_full,
        "share": run.recompute_share,
        "em": exact_match(run.answer, full_answer),
        "rl": rouge_l(run.answer, full_answer),
        "ttft": run.ttft_s,
        "refresh_s": refresh_s,
        "answer": run.answer,
    }


def analyse(rows: list[dict]) -> dict:
    sets = []
    for lo in sorted({r["record"] // 20 * 20 for r in rows}):
        part = [r for r in rows if lo <= r["record"] < lo + 20]
        reuse = {k: statistics.fmean(r["runs"]["reuse"][k] for r in part) for k in ("kl1", "akl", "rl")}
        lines = []
        for arm in part[0]["runs"]:
            m = {
                k: statistics.fmean(r["runs"][arm][k] for r in part)
                for k in ("share", "kl1", "akl", "em", "rl", "ttft", "refresh_s")
            }
            lines.append(
                {
                    "arm": arm,
                    **m,
                    "kl1_x": m["kl1"] / reuse["kl1"],
                    "akl_x": m["akl"] / reuse["akl"],
                    "rl_minus": m["rl"] - reuse["rl"],
                }
            )
        sets.append({"records": f"{lo}–{lo + len(part) - 1}", "rows": lines})
    return {"sets": sets}


def render(data: dict) -> str:
    out = []
    for s in data["analysis"]["sets"]:
        out.append(f"Records {s['records']}:\n")
        out.append(
            "| arm | share | KL 1st (× reuse) | answer KL (× reuse) | EM vs full | ROUGE-L vs full (− reuse) "
            "| TTFT mean | refresh mean |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in s["rows"]:
            name = "reuse" if r["arm"] == "reuse" else f"blend {r['arm']}"
            out.append(
                f"| {name} | {r['share']:.1%} | {r['kl1']:.4f} ({r['kl1_x']:.2f}×) | {r['akl']:.4f} "
                f"({r['akl_x']:.2f}×) | {r['em']:.2f} | {r['rl']:.3f} ({r['rl_minus']:+.3f}) | {r['ttft']:.2f} s "
                f"| {r['refresh_s']:.2f} s |"
            )
        out.append("")
    return "\n".join(out)


def main() -> None:
    record_sets_main(NAME, __doc__.split("\n\n")[0], run_records, analyse, render)


if __name__ == "__main__":
    main()
