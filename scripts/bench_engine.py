"""Engine benchmark (issue 2): TTFT of blend@0.15 vs full/prefix/reuse with the KV already in memory.

6 MuSiQue passages of ~500 tokens + a question, default model, interleaved
repetitions in one process so the ratio is measured side by side. The
instruction prefix is cached, as `query` has it after its first use: `full`
still computes it, `prefix` is then vLLM-style prefix caching of the template.
"""

from __future__ import annotations

import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, machine, median, write_result  # noqa: E402

from kvblend.fusion import BlendConfig, fuse  # noqa: E402
from kvblend.model import load_model  # noqa: E402
from kvblend.model.prefill import precompute_kv  # noqa: E402
from kvblend.prompt import MUSIQUE_TEMPLATE, assemble_prompt, segment_text_for_kv  # noqa: E402
from kvblend.types import Segment  # noqa: E402

# (label, fusor mode, ratio, instruction prefix cached)
MODES = [("full", "full", None, True), ("prefix", "prefix", None, True), ("reuse", "reuse", None, True),
         ("blend", "blend", 0.15, True), ("blend, prefix computed", "blend", 0.15, False)]


def main(reps: int = 5, records: int = 2, compute: str = "cpu") -> dict:
    runner = load_model(compute=compute)
    data = json.loads((SHARED_DATA / "musique_dev.json").read_text())[:records]
    times: dict[str, list[float]] = {label: [] for label, *_ in MODES}
    shares: dict[str, float] = {}
    prompt_tokens = []
    for rec in data:
        ids = [runner.tokenize(segment_text_for_kv(f"{c['title']}\n\n{c['text']}")) for c in rec["ctxs"][:6]]
        kvs = precompute_kv(runner, ids)
        passages = [Segment(i, kv=kv) for i, kv in zip(ids, kvs)]
        computed_prefix = assemble_prompt(runner, MUSIQUE_TEMPLATE, rec["question"], passages)
        # The instruction prefix as `query` has it after its first use: archived, exact at position 0.
        first = computed_prefix[0].token_ids
        prompt = [Segment(first, kv=precompute_kv(runner, [first])[0], key="prefix"), *computed_prefix[1:]]
        prompt_tokens.append(sum(len(s.token_ids) for s in prompt))
        fuse(runner, prompt, "blend")  # warm-up
        for _ in range(reps):
            for label, mode, ratio, prefix_cached in MODES:
                cfg = BlendConfig.single(ratio) if ratio else None
                if runner.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fused = fuse(runner, prompt if prefix_cached else computed_prefix, mode, cfg)
                int(torch.argmax(fused.last_logits))  # the first token is known
                times[label].append(time.perf_counter() - t0)
                shares[label] = fused.recompute_share
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
        label = m.replace("blend", "blend @ 0.15", 1)
        lines.append(f"| {label} | {v['ttft_median_s'] * 1000:.0f} ms | {v['speedup_vs_full']:.2f}× | {v['recompute_share']:.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    res = main()
    print(markdown(res))
