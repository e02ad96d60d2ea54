"""Engine benchmark (issue 2): TTFT of blend@0.15 vs full/prefix/reuse with the KV already in memory.

6 MuSiQue passages of ~500 tokens + a question, default model, interleaved
repetitions in one process so the ratio is measured side by side.
"""

from __future__ import annotations

import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, machine, median, write_result  # noqa: E402

from kvblend import BlendConfig, MUSIQUE_TEMPLATE, Segment, assemble_prompt, fuse, load_model, precompute_kv  # noqa: E402
from kvblend.prompt import segment_text_for_kv  # noqa: E402

MODES = [("full", None), ("prefix", None), ("reuse", None), ("blend", 0.15)]


def main(reps: int = 5, records: int = 2, compute: str = "cpu") -> dict:
    runner = load_model(compute=compute)
    data = json.loads((SHARED_DATA / "musique_dev.json").read_text())[:records]
    times: dict[str, list[float]] = {m: [] for m, _ in MODES}
    shares: dict[str, float] = {}
    prompt_tokens = []
    for rec in data:
        ids = [runner.tokenize(segment_text_for_kv(f"{c['title']}\n\n{c['text']}")) for c in rec["ctxs"][:6]]
        kvs = precompute_kv(runner, ids)
        passages = [Segment(i, kv=kv) for i, kv in zip(ids, kvs)]
        prompt = assemble_prompt(runner, MUSIQUE_TEMPLATE, rec["question"], passages)
        prompt_tokens.append(sum(len(s.token_ids) for s in prompt))
        fuse(runner, prompt, "blend")  # warm-up
        for _ in range(reps):
            for mode, ratio in MODES:
                cfg = BlendConfig.single(ratio) if ratio else None
                if runner.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fused = fuse(runner, prompt, mode, cfg)
                int(torch.argmax(fused.last_logits))  # the first token is known
                times[mode].append(time.perf_counter() - t0)
                shares[mode] = fused.recompute_share
    full = median(times["full"])
    result = {
        "machine": machine(),
        "compute": str(runner.device),
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens),
        "reps": reps * len(data),
        "modes": {
            m: {"ttft_median_s": median(t), "speedup_vs_full": full / median(t), "recompute_share": shares[m]}
            for m, t in times.items()
        },
    }
    write_result("engine", result)
    return result


def markdown(r: dict) -> str:
    lines = [
        "| mode | TTFT median | speed-up vs full | compute share |",
        "|---|---:|---:|---:|",
    ]
    for m, v in r["modes"].items():
        label = "blend @ 0.15" if m == "blend" else m
        lines.append(f"| {label} | {v['ttft_median_s'] * 1000:.0f} ms | {v['speedup_vs_full']:.2f}× | {v['recompute_share']:.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    res = main()
    print(markdown(res))
