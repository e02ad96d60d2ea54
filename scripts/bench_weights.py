"""Each `--weights` format's answers against fp32's, from the same `full` prefill (issue 34's fidelity).

Per MuSiQue record (6 passages under the MuSiQue template): one `full` fusion
with the weights as loaded (prefill reads them under every format, bit for bit:
tests/unit/test_weights.py, so the first token's KL is 0 by construction), then greedy decoding (≤32 tokens) with each format, and fp32's first ≤16
answer tokens teacher-forced through each. Reported per format: first-token
KL, answer KL (mean over the forced positions), exact answer agreement and
the first position where a greedy answer would leave fp32's.

    .venv/bin/python scripts/bench_weights.py [--offset 0 --limit 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, command_line, machine, publish

from kvblend.evaluation.metrics import first_divergence, token_kls
from kvblend.evaluation.records import DEFAULT_CHUNKS, load_records
from kvblend.fusion import fuse
from kvblend.generation import SamplingConfig, generate
from kvblend.model import load_model
from kvblend.model.weights import WEIGHT_FORMATS
from kvblend.prompt import MUSIQUE_TEMPLATE, assemble_prompt
from kvblend.types import Segment

MAX_TOKENS = 32
FORCED = 16


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--limit", type=int, default=20)
    args = parser.parse_args(argv)
    records = load_records(SHARED_DATA / "musique_dev.json")[args.offset : args.offset + args.limit]
    runners = {fmt: load_model(None, "cpu", None, fmt) for fmt in WEIGHT_FORMATS}
    base = runners["fp32"]
    per: dict[str, dict[str, list]] = {f: {"first_kl": [], "answer_kl": [], "same": [], "div": []} for f in runners}
    greedy = SamplingConfig(max_new_tokens=MAX_TOKENS)
    for rec in records:
        passages = [Segment(base.tokenize(t + "\n\n")) for t in rec.passage_texts(DEFAULT_CHUNKS)]
        with torch.inference_mode():
            fused = fuse(base, assemble_prompt(base, MUSIQUE_TEMPLATE, rec.question, passages), "full")
        reference = generate(base, fused, greedy)
        forced = reference.token_ids[:FORCED]
        ref_steps = torch.stack(generate(base, fused, forced_tokens=forced, keep_logits=True).step_logits)
        for fmt, runner in runners.items():  # prefill reads the loaded weights under every format: one fusion
            answer = generate(runner, fused, greedy)
            steps = torch.stack(generate(runner, fused, forced_tokens=forced, keep_logits=True).step_logits)
            kls = token_kls(ref_steps, steps)
            p = per[fmt]
            p["first_kl"].append(kls[0])
            p["answer_kl"].append(statistics.fmean(kls))
            p["same"].append(answer.token_ids == reference.token_ids)
            p["div"].append(first_divergence(forced, steps))
    rows = {
        fmt: {
            "first_token_kl": statistics.fmean(p["first_kl"]),
            "answer_kl": statistics.fmean(p["answer_kl"]),
            "exact_agreement": sum(p["same"]) / len(p["same"]),
            "diverged": sum(d is not None for d in p["div"]) / len(p["div"]),
        }
        for fmt, p in per.items()
    }
    data = {
        "command": command_line(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "records": f"musique_dev {args.offset}-{args.offset + len(records) - 1}",
        "rows": rows,
    }
    return publish("weights", data, markdown)


def markdown(data: dict) -> str:
    lines = [
        f"`full` with each weight format against `full` with fp32 weights, {data['records']}: the same prefill, "
        f"greedy ≤{MAX_TOKENS} tokens; answer KL over fp32's first ≤{FORCED} tokens, teacher-forced.",
        "",
        "| weights | first-token KL | answer KL | exact answer agreement | greedy leaves fp32's within 16 tokens |",
        "|---|---:|---:|---:|---:|",
    ]
    for fmt, r in data["rows"].items():
        lines.append(
            f"| {fmt} | {r['first_token_kl']:.2e} | {r['answer_kl']:.2e} | {r['exact_agreement']:.0%} "
            f"| {r['diverged']:.0%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
