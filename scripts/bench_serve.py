"""Server load benchmark (issue 14): requests/s and TTFT under concurrent clients.

One `kvblend serve` process on a loopback port over an archive of the bundled
documents; clients are threads with the official `openai` client, each sending
streamed requests one after another. Every cell — concurrency 1, 4, 8 × blend
vs full × retrieval vs client chunks — sends the same questions with the same
passages: the client-chunk requests carry, as text parts, exactly the segments
retrieval picked for that question in the warm-up round, so the two differ
only in how the server finds their KV (embedding + top-k vs token key). The
warm-up also archives the instruction prefix, as any first request does.

TTFT is the client's: from sending the request to the first content chunk,
queue wait included. Bounded: `--requests` per cell (default 2 per client,
at least 4), max_tokens 4, loopback only.

    .venv/bin/python scripts/bench_serve.py        # → bench-out/serve.json, markdown on stdout
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import ROOT, command_line, machine, write_result  # noqa: E402

import openai  # noqa: E402

from kvblend.archive import Archive  # noqa: E402
from kvblend.evaluation.metrics import percentile  # noqa: E402

DOCS = ROOT / "kvblend" / "data" / "docs"
QUESTIONS = [
    "Who is the largest single customer?",
    "Which sales office serves Nordkapp Fisheries?",
    "What went wrong with the Skua-7?",
    "Where are the plants?",
    "Who leads the company?",
    "What does the travel policy say about flights?",
    "Which sonar products are sold?",
    "Who supplies the transducers?",
]
CONCURRENCY = (1, 4, 8)
MODES = ("blend", "full")
SOURCES = ("retrieval", "chunks")
MAX_TOKENS = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(kvblend: list[str], archive: Path, log: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([*kvblend, "serve", "--port", str(port), "--archive", str(archive),
                             "--compute", "cpu", "--max-queue", "64"],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    sys.exit("server did not become healthy")


def request(client: openai.OpenAI, question: str, mode: str, chunks: list[str] | None, top_k: int) -> dict:
    """One streamed request: the client's TTFT and total time, and the server's report."""
    parts = [{"type": "text", "text": t} for t in [*(chunks or []), question]]
    options = {"mode": mode} if chunks else {"mode": mode, "top_k": top_k}
    start = time.perf_counter()
    first = None
    report = {}
    stream = client.chat.completions.create(model="kvblend", messages=[{"role": "user", "content": parts}],
                                            max_tokens=MAX_TOKENS, stream=True, extra_body={"kvblend": options})
    for chunk in stream:
        if first is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            first = time.perf_counter() - start
        if chunk.choices and chunk.choices[0].finish_reason:
            report = chunk.model_extra.get("kvblend", {})
    return {"ttft_s": first, "total_s": time.perf_counter() - start, "server": report}


def run_cell(url: str, concurrency: int, n: int, mode: str, source: str, chunks_of: dict, top_k: int) -> dict:
    """`concurrency` clients share `n` requests (questions in turn); wall time gives requests/s."""
    results: list[dict] = []
    lock = threading.Lock()

    def client_loop(i: int) -> None:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        for j in range(i, n, concurrency):
            q = QUESTIONS[j % len(QUESTIONS)]
            r = request(client, q, mode, chunks_of[q] if source == "chunks" else None, top_k)
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft = [r["ttft_s"] for r in results]
    server = [r["server"] for r in results]
    return {
        "concurrency": concurrency, "mode": mode, "source": source, "requests": len(results),
        "wall_s": wall, "requests_per_s": len(results) / wall,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "server_ttft_p50_s": percentile([s["ttft_s"] for s in server], 50),
        "queue_wait_p50_s": percentile([s["queue_wait_s"] for s in server], 50),
        "recompute_share": percentile([s["recompute_share"] for s in server], 50),
        "prompt_tokens": percentile([s["prompt_tokens"] for s in server], 50),
        "hits": sum(seg["source"] == "hit" for s in server for seg in s["segments"]),
        "computed": sum(seg["source"] == "computed" for s in server for seg in s["segments"]),
    }


def warm_up(url: str, archive: Path, top_k: int) -> dict[str, list[str]]:
    """Ask every question once by retrieval; return each question's retrieved segment texts."""
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    keys = {q: [s["key"] for s in request(client, q, "blend", None, top_k)["server"]["segments"]] for q in QUESTIONS}
    with Archive.open(archive, create=False, readonly=True) as arc:
        return {q: [arc.get_segment(k).text for k in ks] for q, ks in keys.items()}


def main(kvblend: list[str], per_client: int, top_k: int, chunk_tokens: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="kvblend-bench-serve-"))
    archive, port = work / "arc", free_port()
    subprocess.run([*kvblend, "ingest", str(DOCS), "--archive", str(archive), "--chunk-tokens", str(chunk_tokens),
                    "--compute", "cpu"], check=True, stdout=subprocess.DEVNULL)
    server = start_server(kvblend, archive, work / "server.log", port)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        chunks_of = warm_up(url, archive, top_k)
        cells = []
        for c in CONCURRENCY:
            n = max(4, per_client * c)
            for mode in MODES:
                for source in SOURCES:
                    cells.append(run_cell(url, c, n, mode, source, chunks_of, top_k))
                    print(f"c={c} {mode:5} {source:9} {cells[-1]['requests_per_s']:.2f} req/s", file=sys.stderr)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
        shutil.rmtree(work, ignore_errors=True)
    return {"command": command_line(), "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "max_tokens": MAX_TOKENS, "top_k": top_k, "chunk_tokens": chunk_tokens, "cells": cells}


def markdown(r: dict) -> str:
    lines = [
        f"Command: `{r['command']}` — bundled docs ingested at {r['chunk_tokens']} tokens/segment, "
        f"top-{r['top_k']} passages per question, streamed, max_tokens {r['max_tokens']}; client TTFT "
        "(queue wait included).  ",
        f"Machine: {r['machine']}  ",
        f"Date: {r['date']}",
        "",
        "| clients | context | mode | requests | req/s | TTFT p50 | TTFT p90 | server TTFT p50 | queue wait p50 "
        "| recompute share | prompt tokens |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in r["cells"]:
        lines.append(
            f"| {c['concurrency']} | {'client chunks' if c['source'] == 'chunks' else 'retrieval'} | {c['mode']} "
            f"| {c['requests']} | {c['requests_per_s']:.2f} | {c['ttft_p50_s'] * 1000:.0f} ms "
            f"| {c['ttft_p90_s'] * 1000:.0f} ms | {c['server_ttft_p50_s'] * 1000:.0f} ms "
            f"| {c['queue_wait_p50_s'] * 1000:.0f} ms | {c['recompute_share']:.1%} | {c['prompt_tokens']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kvblend", default=str(Path(sys.executable).with_name("kvblend")),
                        help="the kvblend command to benchmark (default: this venv's script)")
    parser.add_argument("--per-client", type=int, default=2, help="requests per client in each cell (min 4 per cell)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    args = parser.parse_args()
    result = main(shlex.split(args.kvblend), args.per_client, args.top_k, args.chunk_tokens)
    write_result("serve", result)
    print(markdown(result))
