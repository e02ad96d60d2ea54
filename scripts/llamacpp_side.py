"""llama.cpp's side of scripts/bench_decode.py: run in the benchmark's own venv, never with kvblend.

Reads a JSON request on stdin ({"gguf", "prompt_ids", "steps", "threads", "settings": {name: Llama
kwargs}}), and per setting evaluates exactly those token ids (no BOS added, no tokenizer), then
decodes greedily one token at a time. Prints one JSON object: per setting the time to first token
(the prompt's evaluation, whose last logits give token 1), prefill tok/s, decode tok/s, the median
inter-token latency and the greedy tokens.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
from llama_cpp import Llama


def run(gguf: str, prompt: list[int], steps: int, threads: int, kwargs: dict) -> dict:
    base = dict(model_path=gguf, n_ctx=len(prompt) + steps + 16, n_threads=threads, n_threads_batch=threads)
    base.update(n_batch=512, verbose=False, **kwargs)
    try:
        llm = Llama(**base, use_extra_bufts=False)  # llama.cpp's AMX repacking of Q4_1 crashed on one Xeon
    except TypeError:
        llm = Llama(**base)
    vocab = llm.n_vocab()

    def greedy() -> int:  # the last evaluated token's logits (llama.cpp keeps only those without logits_all)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))))

    llm.eval(prompt[:8])  # warm-up: threads, weights paged in
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    token = greedy()
    ttft = time.perf_counter() - t0
    tokens, gaps = [token], []
    for _ in range(steps - 1):
        t = time.perf_counter()
        llm.eval([token])
        token = greedy()
        gaps.append(time.perf_counter() - t)
        tokens.append(token)
    return {
        "ttft_s": ttft,
        "prefill_tok_s": len(prompt) / ttft,
        "decode_tok_s": len(gaps) / sum(gaps),
        "itl_ms": statistics.median(gaps) * 1000,
        "tokens": tokens,
    }


def main() -> None:
    req = json.load(sys.stdin)
    out = {
        name: run(req["gguf"], req["prompt_ids"], req["steps"], req["threads"], kwargs)
        for name, kwargs in req["settings"].items()
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
