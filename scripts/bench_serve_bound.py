"""Serving under a disk bound (issue 21): unique long prompts against `kvblend serve --max-archive-size`.

Every request sends a prompt nobody sent before (about --tokens tokens, as
client chunks of MuSiQue passages, each chunk made unique by a request-numbered
first line), so every passage is a miss that the server computes and stores;
without a bound the archive would grow by ~100 MB per request. The server runs
with `--max-archive-size` (and `--max-stored-tokens` raised so the whole prompt
may be stored, which is what makes the bound do the work). Afterwards: every
request answered, and the archive's size on disk (payloads and index) against
the bound.

    .venv/bin/python scripts/bench_serve_bound.py --requests 200   # → bench-out/serve_bound.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_serve import Prompt, send, servers  # noqa: E402
from bench_serve import parser as serve_parser  # noqa: E402
from benchlib import SHARED_DATA, command_line, machine, write_result  # noqa: E402

from kvblend.archive import Archive  # noqa: E402
from kvblend.cli.common import parse_size  # noqa: E402


def unique_prompts(n: int, tokens: int) -> list[Prompt]:
    """n prompts of about `tokens` tokens (≈ 4 characters a token), every chunk unique to its request."""
    records = json.loads((SHARED_DATA / "musique_dev.json").read_text())
    pool = [f"{c['title']}\n\n{c['text']}" for r in records for c in r["ctxs"]]
    prompts = []
    for i in range(n):
        chunks, chars, j = [], 0, i * 7
        while chars < tokens * 4:
            chunk = f"Request {i}, passage {len(chunks)}.\n{pool[j % len(pool)]}"
            chunks.append(chunk)
            chars += len(chunk)
            j += 1
        prompts.append(Prompt(tuple(chunks), "Which passage names a place first?"))
    return prompts


def main(args: argparse.Namespace) -> dict:
    kvblend = shlex.split(args.kvblend)
    bound = parse_size(args.max_archive_size)
    work = Path(tempfile.mkdtemp(prefix="kvblend-bench-bound-"))
    logs = work / "logs"
    logs.mkdir()
    archive = work / "arc"
    args.serve_args = ["--max-archive-size", args.max_archive_size, "--max-stored-tokens", str(args.tokens * 2)]
    results, sizes = [], []
    t0 = time.perf_counter()
    try:
        with servers(kvblend, str(archive), 1, logs, args) as urls:
            client = openai.OpenAI(base_url=urls[0], api_key="unused", max_retries=0, timeout=args.timeout)
            for i, prompt in enumerate(unique_prompts(args.requests, args.tokens)):
                r = send(client, prompt, "blend", args.max_tokens, args.timeout)
                results.append({k: r[k] for k in ("ok", "ttft", "e2el", "input_tokens", "output_tokens", "error")})
                sizes.append(dir_size(archive))
                print(f"{i + 1}/{args.requests}: {'ok' if r['ok'] else r['error']}, {r['input_tokens']} prompt "
                      f"tokens, archive {sizes[-1] / 1e6:.0f} MB", file=sys.stderr)
        with Archive.open(archive, readonly=True) as ar:
            payload = ar.size_bytes(include_index=False)
            total = ar.size_bytes(include_index=True)
            segments = ar.count_segments()
        result = {
            "command": command_line(), "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "requests": args.requests, "answered": sum(r["ok"] for r in results),
            "errors": sorted({r["error"] for r in results if r["error"]})[:5],
            "mean_prompt_tokens": sum(r["input_tokens"] for r in results) / max(len(results), 1),
            "bound_bytes": bound, "payload_bytes": payload, "archive_bytes_with_index": total,
            "max_dir_bytes_between_requests": max(sizes, default=0), "segments_left": segments,
            "seconds": time.perf_counter() - t0,
        }
        write_result("serve_bound", result)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def dir_size(path: Path) -> int:
    """Bytes of every file under the archive directory, as `du` would count them (apparent sizes)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def markdown(r: dict) -> str:
    return "\n".join([
        f"Command: `{r['command']}`  ",
        f"Machine: {r['machine']}  ",
        f"Date: {r['date']}",
        "",
        f"- {r['answered']}/{r['requests']} requests answered (prompts of {r['mean_prompt_tokens']:.0f} tokens on "
        f"average, every passage new), {r['seconds'] / 60:.1f} min",
        f"- bound {r['bound_bytes'] / 1e6:.0f} MB: payloads afterwards {r['payload_bytes'] / 1e6:.1f} MB, with the "
        f"index {r['archive_bytes_with_index'] / 1e6:.1f} MB; largest directory size seen between requests "
        f"{r['max_dir_bytes_between_requests'] / 1e6:.1f} MB (LMDB's data file is sparse: apparent size); "
        f"{r['segments_left']} segments left",
    ])


def parser() -> argparse.ArgumentParser:
    p = serve_parser()
    p.description = __doc__.split("\n")[0]
    p.set_defaults(requests=200, max_tokens=8)
    p.add_argument("--tokens", type=int, default=6000, help="prompt tokens per request, roughly")
    p.add_argument("--max-archive-size", default="500MB")
    return p


if __name__ == "__main__":
    print(markdown(main(parser().parse_args())))
