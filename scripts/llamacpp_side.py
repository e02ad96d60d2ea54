"""llama.cpp's side of scripts/bench_decode.py: run in the benchmark's own venv, never with kvblend.

Reads a JSON request on stdin ({"gguf", "prompt_ids", "steps", "threads", "settings": {name: Llama
kwargs}}), and per setting evaluates exactly those token ids (no BOS added, no tokenizer), then
decodes greedily one token at a time, then eight sequences at once over the same prompt. Prints one JSON
object: per setting the time to first token (the prompt's evaluation, whose last logits give token 1),
prefill tok/s, decode tok/s, the median inter-token latency, the greedy tokens, and the batch-8 step's
median and tok/s (with whether its sequences decoded the batch-1 tokens).
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


def batch_decode(gguf: str, prompt: list[int], steps: int, threads: int, kwargs: dict, batch: int = 8) -> dict:
    """`batch` sequences decoding at once over the same prompt's KV, as a server batches its clients: the prompt
    is evaluated once in sequence 0 and shared with the others (llama.cpp's unified KV cache, `seq_cp`), then
    each step decodes one token per sequence in one `llama_decode`. Returns the step's median and tok/s."""
    import llama_cpp as lc

    loader = Llama(model_path=gguf, n_ctx=64, n_threads=threads, verbose=False)  # the weights; its context idles
    params = lc.llama_context_default_params()
    params.n_ctx = len(prompt) + batch * (steps + 2) + 64
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = batch
    params.kv_unified = True
    params.n_threads = params.n_threads_batch = threads
    if kwargs.get("flash_attn"):
        params.flash_attn_type = 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = lc.llama_init_from_model(loader._model.model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not make a batched context")
    vocab = loader.n_vocab()
    chunk = 512
    b = lc.llama_batch_init(max(chunk, batch), 0, batch)

    def fill(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits)
        b.n_tokens = len(entries)
        for i, (token, pos, seq, want) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, want
            b.seq_id[i][0] = seq
        if lc.llama_decode(ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def greedy(i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(vocab,))))

    try:
        for start in range(0, len(prompt), chunk):
            part = prompt[start : start + chunk]
            fill([(t, start + i, 0, start + i == len(prompt) - 1) for i, t in enumerate(part)])
        first = greedy((len(prompt) - 1) % chunk)  # the last position's row in the last chunk
        memory = lc.llama_get_memory(ctx)
        for seq in range(1, batch):
            lc.llama_memory_seq_cp(memory, 0, seq, -1, -1)
        tokens = [first] * batch
        gaps, first_sequence = [], [first]
        for step in range(steps - 1):
            t = time.perf_counter()
            fill([(tokens[s], len(prompt) + step, s, True) for s in range(batch)])
            tokens = [greedy(s) for s in range(batch)]
            gaps.append(time.perf_counter() - t)
            first_sequence.append(tokens[0])
            if len(set(tokens)) != 1:
                raise RuntimeError("batched sequences over one prompt decoded different greedy tokens")
    finally:
        lc.llama_batch_free(b)
        lc.llama_free(ctx)
    step = statistics.median(gaps[1:] or gaps)
    return {"batch8_step_ms": step * 1000, "batch8_tok_s": batch / step, "batch8_tokens": first_sequence}


def main() -> None:
    req = json.load(sys.stdin)
    out = {}
    for name, kwargs in req["settings"].items():
        out[name] = run(req["gguf"], req["prompt_ids"], req["steps"], req["threads"], kwargs)
        out[name].update(batch_decode(req["gguf"], req["prompt_ids"], req["steps"], req["threads"], kwargs))
        out[name]["batch8_agrees"] = out[name].pop("batch8_tokens") == out[name]["tokens"]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
