"""One batched decode step (kvblend.generation.decode_step) per batch size, with each one-query attention kernel.

Every sequence holds the KV of a ~1,850-token prompt (3 MuSiQue passages, what
scripts/bench_serve.py sends), fused by `full`. Per batch size 1, 2, 4, 8: the
median of 15 steps after 3 warm-up steps, for the kernel decoding uses
(kvblend.model.attention.last_query: grouped matmuls on CPU) and for SDPA
(what it used before), interleaved. The model's weights are read once a step
whatever the batch; each sequence's KV is read once a step for its own query.

    .venv/bin/python scripts/bench_decode.py     # → bench-out/decode.json + markdown
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, command_line, machine, write_result  # noqa: E402

import kvblend.model.runner as runner_module  # noqa: E402
from kvblend.generation import DecodeState, decode_step  # noqa: E402
from kvblend.model import load_model  # noqa: E402
from kvblend.prompt import MUSIQUE_TEMPLATE, assemble_prompt  # noqa: E402
from kvblend.types import Segment  # noqa: E402
from kvblend.fusion import fuse  # noqa: E402

BATCHES = (1, 2, 4, 8)
GROUPED = runner_module.last_query


def sdpa_last_query(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


KERNELS = {"grouped matmuls (today)": GROUPED, "SDPA (before)": sdpa_last_query}


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


def main() -> dict:
    runner = load_model(None, "cpu")
    record = json.loads((SHARED_DATA / "musique_dev.json").read_text())[20]
    passages = [runner.tokenize(f"{c['title']}\n\n{c['text']}\n\n") for c in record["ctxs"][:3]]
    prompt = assemble_prompt(runner, MUSIQUE_TEMPLATE, record["question"], [Segment(ids) for ids in passages])
    fused = fuse(runner, prompt, "full")
    results: dict[str, dict[int, list[float]]] = {name: {b: [] for b in BATCHES} for name in KERNELS}
    for _ in range(2):  # two rounds, kernels interleaved per batch size
        for batch in BATCHES:
            for name, kernel in KERNELS.items():
                runner_module.last_query = kernel
                results[name][batch].append(step_ms(runner, fused, batch))
    runner_module.last_query = GROUPED
    rows = [{"kernel": name, **{f"B{b}_ms": min(v) for b, v in per.items()}} for name, per in results.items()]
    data = {"command": command_line(), "machine": machine(), "context_tokens": len(fused.token_ids), "rows": rows}
    data["markdown"] = markdown(data)
    write_result("decode", data)
    print(data["markdown"])
    return data


def markdown(data: dict) -> str:
    lines = [f"Context {data['context_tokens']} tokens per sequence; ms per decode step (best of two medians).", "",
             "| one-query kernel | " + " | ".join(f"batch {b}" for b in BATCHES) + " | batch 8 / batch 1 |",
             "|---|" + "---:|" * (len(BATCHES) + 1)]
    for r in data["rows"]:
        cells = [f"{r[f'B{b}_ms']:.1f}" for b in BATCHES]
        lines.append(f"| {r['kernel']} | " + " | ".join(cells) + f" | {r['B8_ms'] / r['B1_ms']:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
