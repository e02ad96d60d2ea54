"""kvblend's decode beside llama.cpp's, on the same GGUF and the same ~3,000 prompt token ids.

The prompt is kvblend's own assembly of a MuSiQue record's passages under the
default template (as many passages as reach ~3,000 tokens). Both engines get
those ids, no tokenizer in between. Per engine and setting, in one run:

* TTFT: `full` prefill of the whole prompt to the first token's logits
  (kvblend: kvblend.fusion.fuse "full"; llama.cpp: eval of the ids), and prefill tok/s;
* decode tok/s and the median inter-token latency (ITL) at batch 1, greedy, 32 tokens;
* the step at batch 8 (eight sequences over that prompt's KV, decoding one token each), as tok/s: llama.cpp
  shares the prompt's cells among its eight sequences (`seq_cp` in a unified KV cache);
* greedy agreement with kvblend fp32's 32 tokens (the same model, so a measure of numerics).

kvblend runs every `--weights` format (kvblend.model.weights; prefill reads the
loaded weights under all of them, so TTFT differs only by noise), each with the
decode KV it takes by default (fp32; fp16 under int8 and int4 on the CPU, where
kvblend's attention kernel reads it), bf16 weights once more with fp16
decode KV, and int4 and int8 once more with each decode step in torch operations around
the kernels (what the step was before it ran in one C call, kvblend.model.fused_step); two rounds,
formats interleaved, best of the two. llama.cpp runs the GGUF's own Q4_1 in a
subprocess of the benchmark's own venv (`make bench-venv`: llama-cpp-python,
pinned, never a kvblend dependency), between kvblend's two rounds; without
that venv its rows are left out and the markdown says so.

    .venv/bin/python scripts/bench_decode.py [--llama-python .bench-venv/bin/python]

`--model gemma3-270m --weights fp32,native,int4` measures another GGUF (bench-out/decode-MODEL.json, so the
default model's decode.json stays): `native` is what `--weights auto` loads with no profile, for Gemma 3's
Q4_K_M file its own Q5_0/Q4_K/Q6_K/Q8_0 blocks (kvblend.model.gguf_blocks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import ROOT, SHARED_DATA, command_line, machine, publish

from kvblend.fusion import fuse
from kvblend.generation import DecodeState, decode_step
from kvblend.model import load_model
from kvblend.model.source import resolve_model_source
from kvblend.model.weights import WEIGHT_FORMATS
from kvblend.prompt import MUSIQUE_TEMPLATE, assemble_prompt
from kvblend.types import Segment

CONTEXT_TOKENS = 3000
STEPS = 32
BATCH = 8
BENCH_VENV_PYTHON = ROOT / ".bench-venv" / "bin" / "python"
LLAMA_SETTINGS = {"Q4_1": {}, "Q4_1, flash attention": {"flash_attn": True}}


def prompt_segments(runner) -> list[Segment]:
    """Record 20's passages under the MuSiQue template, as many as reach CONTEXT_TOKENS."""
    record = json.loads((SHARED_DATA / "musique_dev.json").read_text())[20]
    passages: list[Segment] = []
    for c in record["ctxs"]:
        passages.append(Segment(runner.tokenize(f"{c['title']}\n\n{c['text']}\n\n")))
        if sum(len(p.token_ids) for p in passages) >= CONTEXT_TOKENS:
            break
    return assemble_prompt(runner, MUSIQUE_TEMPLATE, record["question"], passages)


def kvblend_side(runner, prompt: list[Segment], kv_dtype: torch.dtype | None = None, eager: bool = False) -> dict:
    """One setting's timings; `eager`: every decode step in torch ops around the kernels, as before the C step
    (kvblend.model.fused_step), to show what the one-call step gains."""
    fused_step, runner.fused_step = runner.fused_step, None if eager else runner.fused_step
    try:
        return _kvblend_timings(runner, prompt, kv_dtype)
    finally:
        runner.fused_step = fused_step


def _kvblend_timings(runner, prompt: list[Segment], kv_dtype: torch.dtype | None) -> dict:
    with torch.inference_mode():
        fuse(runner, prompt, "full")  # warm-up
        t0 = time.perf_counter()
        fused = fuse(runner, prompt, "full")
        token = int(fused.last_logits.argmax())
        ttft = time.perf_counter() - t0
        state = DecodeState(runner, fused, STEPS + 1, kv_dtype)
        tokens, gaps = [token], []
        for _ in range(STEPS - 1):
            t = time.perf_counter()
            token = int(decode_step(runner, [state], [token])[0].argmax())
            gaps.append(time.perf_counter() - t)
            tokens.append(token)
        states = [DecodeState(runner, fused, 8, kv_dtype) for _ in range(BATCH)]
        decode_step(runner, states, [tokens[0]] * BATCH)  # warm-up
        batch_steps = []
        for _ in range(6):
            t = time.perf_counter()
            decode_step(runner, states, [tokens[0]] * BATCH)
            batch_steps.append(time.perf_counter() - t)
    n = len(fused.token_ids)
    return {
        "ttft_s": ttft,
        "prefill_tok_s": n / ttft,
        "decode_tok_s": len(gaps) / sum(gaps),
        "itl_ms": statistics.median(gaps) * 1000,
        "batch8_tok_s": BATCH / statistics.median(batch_steps),
        "tokens": tokens,
        "prompt_ids": fused.token_ids,
    }


def _setting_name(fmt: str, kv_dtype: torch.dtype, runner=None) -> str:
    if fmt == "native" and runner is not None:  # what `auto` resolved to
        fmt = f"auto ({runner.weights_name})"
    if kv_dtype == torch.float32:
        return f"kvblend {fmt}"
    return f"kvblend {fmt}, {'fp16' if kv_dtype == torch.float16 else kv_dtype} KV"


def llama_side(python: Path, gguf: Path, prompt_ids: list[int], threads: int) -> dict:
    request = {
        "gguf": str(gguf),
        "prompt_ids": prompt_ids,
        "steps": STEPS,
        "threads": threads,
        "settings": LLAMA_SETTINGS,
    }
    proc = subprocess.run(
        [str(python), str(ROOT / "scripts" / "llamacpp_side.py")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp side failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def best(a: dict, b: dict) -> dict:
    """Of two rounds: the faster of each timing."""
    out = dict(a)
    for key in ("ttft_s", "itl_ms"):
        out[key] = min(a[key], b[key])
    for key in ("prefill_tok_s", "decode_tok_s", "batch8_tok_s"):
        if key in a:
            out[key] = max(a[key], b[key])
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-python", type=Path, default=BENCH_VENV_PYTHON)
    parser.add_argument("--model", default=None, help="a GGUF (name or path); default: the bundled SmolLM2")
    parser.add_argument("--weights", default=",".join(WEIGHT_FORMATS), help="formats, fp32 first (and `native`)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    formats = args.weights.split(",")
    if formats[0] != "fp32":
        parser.error("--weights must start with fp32 (the greedy reference)")
    runners = {fmt: load_model(args.model, "cpu", None, fmt) for fmt in formats}
    prompt = prompt_segments(runners["fp32"])
    # each format with the decode KV it takes by default (fp16 under int8/int4 on the CPU: ModelRunner.decode_kv_dtype)
    settings = {_setting_name(fmt, runners[fmt].decode_kv_dtype, runners[fmt]): (fmt, None, False) for fmt in formats}
    if "bf16" in runners:
        settings["kvblend bf16, fp16 KV"] = ("bf16", torch.float16, False)
    for fmt in ("int4", "int8", "native", "gguf"):  # the formats whose steps run in one C call, stepped eagerly too
        if fmt in runners and runners[fmt].fused_step is not None:
            name = _setting_name(fmt, runners[fmt].decode_kv_dtype, runners[fmt])
            settings[f"{name}, eager step"] = (fmt, None, True)
    rounds: dict[str, list[dict]] = {name: [] for name in settings}
    llama: list[dict] = []
    source = resolve_model_source(args.model)
    gguf = source.directory / (source.gguf_file or "")
    have_llama = args.llama_python.exists()
    for round_ in range(2):
        for name, (fmt, kv_dtype, eager) in settings.items():
            rounds[name].append(kvblend_side(runners[fmt], prompt, kv_dtype, eager))
        if have_llama:
            ids = rounds["kvblend fp32"][0]["prompt_ids"]
            llama.append(llama_side(args.llama_python, gguf, ids, threads))
    rows = {name: best(*runs) for name, runs in rounds.items()}
    for name in LLAMA_SETTINGS if have_llama else ():
        label = name if args.model is None else name.replace("Q4_1", "the file's own blocks")
        rows[f"llama.cpp {label}"] = best(llama[0][name], llama[1][name])
    reference = rows["kvblend fp32"]["tokens"]
    for row in rows.values():
        row["agreement"] = sum(a == b for a, b in zip(row["tokens"], reference)) / len(reference)
        row.pop("prompt_ids", None)
    data = {
        "command": command_line(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "threads": threads,
        "context_tokens": len(rounds["kvblend fp32"][0]["prompt_ids"]),
        "gguf": gguf.name,
        "llama_cpp": have_llama,
        "rows": rows,
    }
    if args.model is not None:
        data["model"] = source.name
    return publish("decode" if args.model is None else f"decode-{source.name}", data, markdown)


def markdown(data: dict) -> str:
    rows = data["rows"]
    llama_rows = [r for n, r in rows.items() if n.startswith("llama.cpp")]
    llama_best = max((r["decode_tok_s"] for r in llama_rows), default=None)
    lines = [
        f"{data['context_tokens']} prompt tokens, the same ids in both engines; {data['gguf']}; "
        f"{data['threads']} threads; greedy, {STEPS} tokens; best of two interleaved rounds.",
        "",
        "| engine, weights | TTFT | prefill tok/s | decode tok/s (batch 1) | ITL | batch 8 tok/s "
        "| decode vs llama.cpp's best | greedy agreement with kvblend fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        b8 = f"{r['batch8_tok_s']:.1f}" if "batch8_tok_s" in r else "not measured"
        vs = f"{r['decode_tok_s'] / llama_best:.2f}×" if llama_best else "-"
        lines.append(
            f"| {name} | {r['ttft_s']:.2f} s | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} "
            f"| {r['itl_ms']:.1f} ms | {b8} | {vs} | {r['agreement']:.0%} |"
        )
    if not data["llama_cpp"]:
        lines += ["", "llama.cpp not measured: no benchmark venv (`make bench-venv`)."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
