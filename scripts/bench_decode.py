"""One batched decode step (kvblend.generation.decode_step) per batch size, in fp32 and in bf16.

Every sequence holds the KV of a ~1,850-token prompt (3 MuSiQue passages, what
scripts/bench_serve.py sends), fused by `full`. Per compute dtype and batch size
1, 2, 4, 8: the median of 15 steps after 3 warm-up steps, two rounds with the
dtypes interleaved per batch size (best of the two medians). The model's weights
are read once a step whatever the batch; each sequence's KV is read once a step
for its own query, so a batch's step grows with its summed context: bf16 halves
both reads (and a CPU with AMX or AVX512-BF16 runs bf16 matmuls natively).

    .venv/bin/python scripts/bench_decode.py     # → bench-out/decode.json + markdown
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, command_line, machine, write_result

from kvblend.fusion import fuse
from kvblend.generation import DecodeState, decode_step
from kvblend.model import load_model
from kvblend.prompt import MUSIQUE_TEMPLATE, assemble_prompt
from kvblend.types import Segment

BATCHES = (1, 2, 4, 8)
DTYPES = ("fp32", "bf16")


def step_ms(runner, fused, batch: int, steps: int = 15) -> float:
    states = [DecodeState(runner, fused, steps + 8) for _ in range(batch)]
    tokens = [int(fused.last_logits.argmax())] * batch
    with torch.inference_mode():
        for _ in range(3):
            decode_step(runner, states, tokens)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            decode_step(runner, states, tokens)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def fused_prompt(runner):
    """`full`'s fusion of record 20's first 3 passages under the MuSiQue template, and its time in ms."""
    record = json.loads((SHARED_DATA / "musique_dev.json").read_text())[20]
    passages = [runner.tokenize(f"{c['title']}\n\n{c['text']}\n\n") for c in record["ctxs"][:3]]
    prompt = assemble_prompt(runner, MUSIQUE_TEMPLATE, record["question"], [Segment(ids) for ids in passages])
    with torch.inference_mode():
        fuse(runner, prompt, "full")  # warm-up
        t0 = time.perf_counter()
        fused = fuse(runner, prompt, "full")
    return fused, (time.perf_counter() - t0) * 1000


def main() -> dict:
    runners = {dt: load_model(None, "cpu", dt) for dt in DTYPES}
    fused = {dt: fused_prompt(r) for dt, r in runners.items()}
    results: dict[str, dict[int, list[float]]] = {dt: {b: [] for b in BATCHES} for dt in DTYPES}
    for _ in range(2):  # two rounds, dtypes interleaved per batch size
        for batch in BATCHES:
            for dt, runner in runners.items():
                results[dt][batch].append(step_ms(runner, fused[dt][0], batch))
    rows = [
        {"dtype": dt, "full_fusion_ms": fused[dt][1], **{f"B{b}_ms": min(v) for b, v in per.items()}}
        for dt, per in results.items()
    ]
    data = {
        "command": command_line(),
        "machine": machine(),
        "context_tokens": len(fused["fp32"][0].token_ids),
        "rows": rows,
    }
    data["markdown"] = markdown(data)
    write_result("decode", data)
    print(data["markdown"])
    return data


def markdown(data: dict) -> str:
    head = f"Context {data['context_tokens']} tokens per sequence; ms per decode step (best of two medians)"
    lines = [
        head + "; `full` fusion of the prompt in ms.",
        "",
        "| compute dtype | `full` fusion | " + " | ".join(f"batch {b}" for b in BATCHES) + " | batch 8 / batch 1 |",
        "|---|" + "---:|" * (len(BATCHES) + 2),
    ]
    for r in data["rows"]:
        cells = [f"{r[f'B{b}_ms']:.1f}" for b in BATCHES]
        ratio = r["B8_ms"] / r["B1_ms"]
        lines.append(f"| {r['dtype']} | {r['full_fusion_ms']:.0f} | " + " | ".join(cells) + f" | {ratio:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
