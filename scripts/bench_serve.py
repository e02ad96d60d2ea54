"""Server load benchmark (issue 14) in `vllm bench serve`'s terms: throughput, TTFT, TPOT, ITL, E2EL under load.

The script starts its own `kvblend serve` process(es) on free loopback ports
(or drives running ones with `--url`), over a fresh temporary archive, a given
`--archive` (a directory or a redis:// URL), or a throwaway Redis (`--redis`).
`--nodes N` starts N servers over the same archive and spreads requests over
them round-robin: the "serving nodes on one Redis" scenario, checked at the end
against the archive's own count of stored segments.

Prompts are MuSiQue records outside the dev set (records 20.. by default): each
request sends `--passages` passages of one record as client chunks (text parts
of the user message) and the record's question as the last part. A warm-up
sends every distinct prompt once, untimed, so the timed requests measure the
archive's hits (`--cold` skips it: the first cell then pays the misses).

Two load shapes, each for blend and full: fixed concurrency (C client threads
sending back to back, vLLM's --max-concurrency with an infinite rate) and
Poisson arrivals (exponential gaps from a seeded RNG, the same schedule for
every mode, each request on its own thread, at most --max-in-flight at once).
Every request is streamed with temperature 0 and `ignore_eos`, so it decodes
exactly --max-tokens tokens and the modes do the same decode work.

Timings are the client's, from the official `openai` client's stream, with
vLLM's definitions: TTFT from sending to the first content chunk (queue wait
included), ITL every gap between successive content chunks, TPOT
(e2e - TTFT) / (output tokens - 1), E2EL the whole request; output and input
tokens from the stream's usage. The clients share the host with the server(s):
on a small machine they take some CPU from them, as a load generator always does.

    .venv/bin/python scripts/bench_serve.py                  # → bench-out/serve.json, markdown on stdout
    .venv/bin/python scripts/bench_serve.py --redis --nodes 2 --concurrency 1,4 --rates 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, command_line, free_ports, machine, stop, throwaway_redis, write_result

MODES = ("blend", "full")
METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's latency metrics, each reported as mean/median/std/p90/p99 in ms
PERCENTILES = (90, 99)
HEALTH_TIMEOUT_S = 300  # model load; ~3 s per server on the 2-core dev machine, far more on a cold page cache


@dataclass(frozen=True)
class Prompt:
    """One distinct request: passages of one MuSiQue record, then its question."""

    passages: tuple[str, ...]
    question: str


# ---------------------------------------------------------------- servers


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, what: str) -> None:
    """Block until /health answers: the server answers it only once the model is loaded."""
    deadline = time.time() + HEALTH_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}; last log lines:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{what} did not become healthy in {HEALTH_TIMEOUT_S} s; log: {log}")


def server_env(nodes: int, args: argparse.Namespace) -> dict[str, str]:
    """Each server's environment: torch's threads split between the nodes that share this machine's cores.

    Two processes each running torch's default of one thread per core oversubscribe the cores, and OpenMP's
    spinning threads then slow both by an order of magnitude (measured: a 3-passage request took 76 s instead
    of ~4 s with two nodes on 2 cores). On separate machines each node would have its own cores."""
    threads = getattr(args, "threads", None) or max(1, (os.cpu_count() or 1) // nodes)
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


@contextmanager
def servers(kvblend: list[str], archive: str, n: int, logs: Path, args: argparse.Namespace):
    """Start n `kvblend serve` processes over one archive; yield their /v1 URLs; stop every one on the way out.

    They start together (the model loads in parallel) and each gets its own session, so a Ctrl-C at the
    terminal reaches only this script, which then stops them with one SIGTERM each (two signals would make
    uvicorn force its exit)."""
    procs: list[subprocess.Popen] = []
    try:
        ports = free_ports(n)
        for i, port in enumerate(ports):
            log = logs / f"node{i}.log"
            dtype = ["--dtype", args.dtype] if args.dtype else []
            weights = ["--weights", args.weights] if args.weights else []
            cmd = [*kvblend, "serve", "--port", str(port), "--archive", archive, "--compute", args.compute, *dtype,
                   *weights,
                   "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
                   *getattr(args, "serve_args", [])]
            with log.open("w") as fh:
                procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                              env=server_env(n, args)))
        for i, (proc, port) in enumerate(zip(procs, ports)):
            wait_healthy(proc, port, logs / f"node{i}.log", f"server {i} (port {port})")
        yield [f"http://127.0.0.1:{port}/v1" for port in ports]
    finally:
        for proc in procs:
            stop(proc)


def tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def log_findings(logs: Path) -> dict[str, list[str]]:
    """Each server log's warning / error / traceback lines (the first 20): what went wrong server side."""
    found = {}
    for log in sorted(logs.glob("node*.log")):
        bad = [line for line in log.read_text(errors="replace").splitlines()
               if any(word in line for word in ("ERROR", "WARNING", "Traceback", "Exception"))]
        found[log.name] = bad[:20]
    return found


def archive_stats(kvblend: list[str], archive: str) -> dict:
    """`kvblend stats --json`, run once the servers are stopped (segments, and on Redis segments_stored_total)."""
    proc = subprocess.run([*kvblend, "stats", "--json", "--archive", archive], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-500:]}
    return json.loads(proc.stdout)


# ---------------------------------------------------------------- prompts


def load_prompts(offset: int, records: int, passages: int) -> list[Prompt]:
    """`records` MuSiQue records from `offset`: the first `passages` passages ("title\\n\\ntext") and the question."""
    data = json.loads((SHARED_DATA / "musique_dev.json").read_text())[offset : offset + records]
    if len(data) < records:
        raise SystemExit(f"musique_dev.json has only {offset + len(data)} records; lower --offset or --records")
    return [Prompt(tuple(f"{c['title']}\n\n{c['text']}" for c in r["ctxs"][:passages]), r["question"]) for r in data]


# ---------------------------------------------------------------- one request


def send(client: openai.OpenAI, prompt: Prompt, mode: str, max_tokens: int, timeout: float) -> dict:
    """One streamed request, timed per content chunk as `vllm bench serve` times it; failures are recorded, not raised.

    The whole request is bounded by `timeout` (the client's own timeout bounds each read; this bounds the sum)."""
    parts = [{"type": "text", "text": t} for t in (*prompt.passages, prompt.question)]
    r: dict = {"ok": False, "ttft": None, "itl": [], "e2el": None, "output_tokens": 0, "input_tokens": 0,
               "chunks": 0, "report": {}, "error": None}
    start = last = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model="kvblend", messages=[{"role": "user", "content": parts}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "kvblend": {"mode": mode, "store": True}})
        with stream:
            for chunk in stream:
                now = time.perf_counter()
                if now - start > timeout:
                    raise TimeoutError(f"request took over {timeout} s")
                if chunk.choices:
                    choice = chunk.choices[0]
                    if choice.delta is not None and choice.delta.content:
                        if r["ttft"] is None:
                            r["ttft"] = now - start
                        else:
                            r["itl"].append(now - last)
                        last = now
                        r["chunks"] += 1
                    if choice.finish_reason:
                        r["report"] = (chunk.model_extra or {}).get("kvblend") or {}
                if chunk.usage is not None:
                    r["output_tokens"] = chunk.usage.completion_tokens
                    r["input_tokens"] = chunk.usage.prompt_tokens
        r["e2el"] = time.perf_counter() - start
        r["ok"] = r["ttft"] is not None and r["output_tokens"] > 0
        if not r["ok"]:
            r["error"] = "stream ended without content or usage"
    except Exception as exc:  # a failed request is a result (vLLM's `failed`), not the end of the benchmark
        r["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return r


# ---------------------------------------------------------------- load shapes


def run_concurrency(clients: list[openai.OpenAI], prompts: list[Prompt], mode: str, c: int, n: int,
                    args: argparse.Namespace) -> tuple[list[dict], float]:
    """C client threads, each sending its next request as soon as its last one finished, until n are sent."""
    results: list[dict] = []
    lock = threading.Lock()
    todo = iter(range(n))

    def client_loop() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            r = send(clients[i % len(clients)], prompts[i % len(prompts)], mode, args.max_tokens, args.timeout)
            with lock:
                results.append({**r, "node": i % len(clients)})

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def run_poisson(clients: list[openai.OpenAI], prompts: list[Prompt], mode: str, rate: float, n: int,
                args: argparse.Namespace) -> tuple[list[dict], float]:
    """n requests arriving as a Poisson process (the first at once), each on its own thread.

    The schedule comes from an RNG seeded by --seed alone, so every mode sees the same arrivals. As in vLLM, a
    request over --max-in-flight waits client side and its timing starts when it is actually sent."""
    rng = random.Random(args.seed)
    gate = threading.Semaphore(args.max_in_flight)
    results: list[dict] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        with gate:
            r = send(clients[i % len(clients)], prompts[i % len(prompts)], mode, args.max_tokens, args.timeout)
        with lock:
            results.append({**r, "node": i % len(clients)})

    start = time.perf_counter()
    due = 0.0
    threads = []
    for i in range(n):
        time.sleep(max(0.0, start + due - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
        due += rng.expovariate(rate)
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def warm_up(clients: list[openai.OpenAI], prompts: list[Prompt], args: argparse.Namespace) -> dict:
    """Every distinct prompt once in blend, one after another, round-robin over the nodes, untimed: it archives
    each passage (so the timed requests hit) and gives every node its first, slower request."""
    start = time.perf_counter()
    results = [{**send(clients[j % len(clients)], p, "blend", args.max_tokens, args.timeout), "node": j % len(clients)}
               for j, p in enumerate(prompts)]
    return {"requests": len(results), "failed": sum(not r["ok"] for r in results),
            "duration": time.perf_counter() - start, **segment_counts(results),
            "per_node_requests": per_node(results, len(clients)),
            "errors": [r["error"] for r in results if r["error"]][:5]}


# ---------------------------------------------------------------- metrics


def ms_stats(name: str, seconds: list[float]) -> dict:
    """vLLM's mean/median/std/p90/p99 of one metric, in ms (None where no request gave a value)."""
    if not seconds:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))}
    xs = np.asarray(seconds) * 1000
    return {f"mean_{name}_ms": float(xs.mean()), f"median_{name}_ms": float(np.median(xs)),
            f"std_{name}_ms": float(xs.std()),
            **{f"p{p}_{name}_ms": float(np.percentile(xs, p)) for p in PERCENTILES}}


def segment_counts(results: list[dict]) -> dict:
    """Passages reused from the archive vs computed by the request, from each response's kvblend report."""
    sources = [s["source"] for r in results if r["ok"] for s in r["report"].get("segments", [])]
    hits = sources.count("hit")
    return {"segments_hit": hits, "segments_computed": len(sources) - hits,
            "hit_rate": hits / len(sources) if sources else None}


def per_node(results: list[dict], nodes: int) -> list[int]:
    counts = Counter(r["node"] for r in results)
    return [counts[i] for i in range(nodes)]


def summarize(results: list[dict], duration: float, nodes: int, max_tokens: int) -> dict:
    """One cell's numbers under vLLM's JSON names (completed requests only), plus kvblend's own."""
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["input_tokens"] for r in ok)
    tpots = [(r["e2el"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    reports = [r["report"] for r in ok]
    cell = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **ms_stats("ttft", [r["ttft"] for r in ok]), **ms_stats("tpot", tpots),
        **ms_stats("itl", [g for r in ok for g in r["itl"]]), **ms_stats("e2el", [r["e2el"] for r in ok]),
        **segment_counts(results),
        "content_chunks": sum(r["chunks"] for r in ok),  # < total_output_tokens: some tokens' text arrived merged
        "short_requests": sum(r["output_tokens"] != max_tokens for r in ok),  # ignore_eos not honoured
        "mean_server_ttft_ms": mean_ms([rep.get("ttft_s") for rep in reports]),
        "mean_queue_wait_ms": mean_ms([rep.get("queue_wait_s") for rep in reports]),
        "mean_recompute_share": mean([rep.get("recompute_share") for rep in reports]),
        "per_node_requests": per_node(results, nodes),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
    }
    return cell


def mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def mean_ms(xs: list) -> float | None:
    m = mean(xs)
    return None if m is None else m * 1000


def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(cells: list[dict]) -> dict:
    """The issue's ratios: per mode, the highest concurrency against the lowest (1 by default) for output
    throughput, p90 TTFT and p90 ITL (ITL while new prompts keep arriving vs a lone stream); and blend's
    request throughput over full's at every concurrency and rate."""
    per_mode = {}
    for mode in MODES:
        conc = sorted((c for c in cells if c["mode"] == mode and c["shape"] == "concurrency"),
                      key=lambda c: c["max_concurrency"])
        if len(conc) < 2:
            continue
        lo, hi = conc[0], conc[-1]
        per_mode[mode] = {
            "low_concurrency": lo["max_concurrency"], "high_concurrency": hi["max_concurrency"],
            "output_throughput": div(hi["output_throughput"], lo["output_throughput"]),
            "p90_ttft": div(hi["p90_ttft_ms"], lo["p90_ttft_ms"]),
            "p90_itl": div(hi["p90_itl_ms"], lo["p90_itl_ms"]),
        }
    blend_over_full = {}
    for b in (c for c in cells if c["mode"] == "blend"):
        f = next((c for c in cells if c["mode"] == "full" and c["setting"] == b["setting"]), None)
        if f is not None:
            blend_over_full[b["setting"]] = div(b["request_throughput"], f["request_throughput"])
    return {"high_over_low_concurrency": per_mode, "blend_over_full_request_throughput": blend_over_full}


# ---------------------------------------------------------------- the run


def run_cells(clients: list[openai.OpenAI], prompts: list[Prompt], args: argparse.Namespace) -> list[dict]:
    """Every shape × setting × mode; the modes alternate inside a setting, so a slow drift in the machine
    (another job, thermal) touches both alike."""
    plan = [("concurrency", c, max(args.requests, c, 4)) for c in args.concurrency]
    plan += [("poisson", r, max(args.requests, 4)) for r in args.rates]
    cells = []
    for shape, value, n in plan:
        for mode in args.modes:
            if shape == "concurrency":
                results, duration = run_concurrency(clients, prompts, mode, value, n, args)
                head = {"max_concurrency": value, "request_rate": "inf", "setting": f"c={value}"}
            else:
                results, duration = run_poisson(clients, prompts, mode, value, n, args)
                head = {"max_concurrency": args.max_in_flight, "request_rate": value, "burstiness": 1.0,
                        "setting": f"rate={value:g}"}
            cells.append({"mode": mode, "shape": shape, **head, "num_prompts": n,
                          **summarize(results, duration, len(clients), args.max_tokens)})
            c = cells[-1]
            print(f"{mode:5} {c['setting']:9} {c['completed']}/{n} ok, {c['request_throughput']:.2f} req/s, "
                  f"TTFT p50 {fmt_ms(c['median_ttft_ms'])}", file=sys.stderr)
    return cells


def run(args: argparse.Namespace) -> dict:
    """Start (or find) the servers, warm up, run every cell, stop the servers, read the archive's stats."""
    kvblend = shlex.split(args.kvblend)
    prompts = load_prompts(args.offset, args.records, args.passages)
    distinct = len({p for prompt in prompts for p in prompt.passages})
    work = Path(tempfile.mkdtemp(prefix="kvblend-bench-serve-"))
    logs = work / "logs"  # kept after the run, for a look at what the servers said
    logs.mkdir()
    stats: dict = {}
    finished = False
    with ExitStack() as stack:
        archive = args.archive
        if args.redis:
            archive = stack.enter_context(throwaway_redis(work))
        elif archive is None and not args.url:
            archive = str(work / "arc")  # a fresh archive: the server creates it
            stack.callback(shutil.rmtree, work / "arc", ignore_errors=True)
        if archive:  # unwinds after the servers stop (their writes are done) and before a throwaway Redis goes
            stack.callback(lambda: finished and stats.update(archive_stats(kvblend, archive)))
        urls = args.url or stack.enter_context(servers(kvblend, archive, args.nodes, logs, args))
        clients = [openai.OpenAI(base_url=u, api_key="unused", max_retries=0, timeout=args.timeout) for u in urls]
        warm = None if args.cold else warm_up(clients, prompts, args)
        cells = run_cells(clients, prompts, args)
        finished = True
    return {
        "command": command_line(), "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {**vars(args), "archive": archive, "urls": urls, "distinct_prompts": len(prompts),
                     "distinct_passages": distinct, "logs": str(logs)},
        "warmup": warm, "cells": cells, "ratios": ratios(cells),
        "archive_stats": stats or None, "stored_check": stored_check(stats, distinct, warm, cells),
        "server_log_findings": log_findings(logs),
    }


def stored_check(stats: dict | None, distinct: int, warm: dict | None, cells: list[dict]) -> dict | None:
    """'Every passage prefilled once across all nodes': segments the archive stored (Redis counts every write,
    a second store of the same passage included, as segments_stored_total) against the distinct passages sent;
    the instruction prefix, archived by the first request, is one segment more."""
    if not stats or "error" in stats:
        return None
    nodes = len(cells[0]["per_node_requests"]) if cells else len((warm or {}).get("per_node_requests", []))
    requests = [sum(c["per_node_requests"][i] for c in cells) + (warm["per_node_requests"][i] if warm else 0)
                for i in range(nodes)]
    return {"distinct_passages": distinct, "segments_in_archive": stats.get("segments"),
            "segments_stored_total": stats.get("segments_stored_total"), "per_node_requests": requests}


# ---------------------------------------------------------------- markdown


def fmt_ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.0f} ms" if x >= 10 else f"{x:.1f} ms"


def fmt_x(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def markdown(r: dict) -> str:
    """The tables for BENCHMARKS.md: one row per mode × shape × setting, then the ratios and the nodes check."""
    if "settings" not in r:
        return "(bench-out/serve.json predates the load benchmark: re-run `python scripts/bench_serve.py`)"
    s = r["settings"]
    warm = "no warm-up (cold archive)" if s["cold"] else "each distinct prompt sent once untimed first (warm archive)"
    lines = [
        f"Command: `{r['command']}` — {s['distinct_prompts']} MuSiQue records from #{s['offset']}, "
        f"{s['passages']} passages each as client chunks, {warm}; streamed, max_tokens {s['max_tokens']} with "
        f"ignore_eos, temperature 0; {len(s['urls'])} server(s), --dtype {s.get('dtype') or 'default'}, "
        f"--weights {s.get('weights') or 'default'}, "
        f"--max-batch {s['max_batch']}, --max-queue "
        f"{s['max_queue']}, Poisson cells capped at {s['max_in_flight']} in flight. Client-side timings, "
        "vLLM's definitions (TTFT includes queue wait).  ",
        f"Machine: {r['machine']}  ",
        f"Date: {r['date']}",
        "",
        "| mode | shape | setting | ok/failed | req/s | output tok/s | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 "
        "| ITL p50 | ITL p90 | ITL p99 | E2EL p50 | E2EL p90 | hit rate |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in r["cells"]:
        hit = "–" if c["hit_rate"] is None else f"{c['hit_rate']:.0%}"
        lines.append(
            f"| {c['mode']} | {c['shape']} | {c['setting']} | {c['completed']}/{c['failed']} "
            f"| {c['request_throughput']:.2f} | {c['output_throughput']:.1f} | {fmt_ms(c['median_ttft_ms'])} "
            f"| {fmt_ms(c['p90_ttft_ms'])} | {fmt_ms(c['p99_ttft_ms'])} | {fmt_ms(c['median_tpot_ms'])} "
            f"| {fmt_ms(c['median_itl_ms'])} | {fmt_ms(c['p90_itl_ms'])} | {fmt_ms(c['p99_itl_ms'])} "
            f"| {fmt_ms(c['median_e2el_ms'])} | {fmt_ms(c['p90_e2el_ms'])} | {hit} |")
    lines.append("")
    for mode, q in r["ratios"]["high_over_low_concurrency"].items():
        lines.append(f"- {mode}, c={q['high_concurrency']} vs c={q['low_concurrency']}: output throughput "
                     f"{fmt_x(q['output_throughput'])}, p90 TTFT {fmt_x(q['p90_ttft'])}, p90 ITL {fmt_x(q['p90_itl'])}")
    bf = r["ratios"]["blend_over_full_request_throughput"]
    if bf:
        lines.append("- blend / full request throughput: " + ", ".join(f"{k} {fmt_x(v)}" for k, v in bf.items()))
    check = r.get("stored_check")
    if check:
        lines.append(f"- archive afterwards: {check['segments_in_archive']} segments, segments_stored_total "
                     f"{check['segments_stored_total']}, for {check['distinct_passages']} distinct passages sent; "
                     f"requests per node (warm-up included): {check['per_node_requests']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def csv(kind):
    """An argparse type: a comma-separated list ('' for none, to skip a shape)."""
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kvblend", default=str(Path(sys.executable).with_name("kvblend")),
                   help="the kvblend command to serve (default: this venv's)")
    p.add_argument("--archive", help="archive for the servers: a directory or redis:// URL (default: a fresh temp one)")
    p.add_argument("--redis", action="store_true", help="serve from a throwaway redis-server (the venv's)")
    p.add_argument("--nodes", type=int, default=1, help="servers over the same archive, requests round-robin")
    p.add_argument("--url", action="append", help="drive this running server's /v1 URL instead (repeatable)")
    p.add_argument("--compute", default="cpu")
    p.add_argument("--dtype", help="the servers' --dtype (default: theirs, fp32 on CPU)")
    p.add_argument("--weights", help="the servers' --weights for decode steps (default: theirs, auto)")
    p.add_argument("--threads", type=int, help="torch threads per server (default: the cores shared by --nodes)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=32)
    p.add_argument("--records", type=int, default=8, help="MuSiQue records, one distinct prompt each")
    p.add_argument("--offset", type=int, default=20, help="first record (0-19 are the dev set)")
    p.add_argument("--passages", type=int, default=3, help="passages per prompt (client chunks)")
    p.add_argument("--cold", action="store_true", help="no warm-up: the first requests find an empty archive")
    p.add_argument("--modes", type=csv(str), default=list(MODES))
    p.add_argument("--concurrency", type=csv(int), default=[1, 2, 4, 8], help="fixed-concurrency cells ('' none)")
    p.add_argument("--rates", type=csv(float), default=[0.5, 1, 2], help="Poisson cells, requests/s ('' none)")
    p.add_argument("--max-in-flight", type=int, default=32, help="Poisson cells: cap on requests in flight")
    p.add_argument("--requests", type=int, default=16, help="requests per cell (at least max(C, 4))")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request decodes (ignore_eos)")
    p.add_argument("--timeout", type=float, default=300, help="seconds one request may take in all")
    p.add_argument("--seed", type=int, default=0, help="Poisson arrivals' RNG seed")
    p.add_argument("--out", help="write the JSON here instead of bench-out/serve.json")
    return p


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if unknown := set(args.modes) - set(MODES):
        p.error(f"--modes: unknown {', '.join(sorted(unknown))}")
    if args.url and (args.redis or args.nodes != 1):
        p.error("--url drives running servers: --redis and --nodes start servers")
    if args.redis and args.archive:
        p.error("--redis and --archive both choose the archive")
    if args.nodes < 1 or args.records < 1 or args.passages < 1 or args.max_tokens < 1 or args.max_in_flight < 1:
        p.error("--nodes, --records, --passages, --max-tokens and --max-in-flight must be at least 1")
    if any(c < 1 for c in args.concurrency) or any(r <= 0 for r in args.rates):
        p.error("concurrencies must be at least 1 and rates above 0")


def main(kvblend: list[str] | None = None, *_legacy) -> dict:
    """scripts/bench_all.py's entry point (`--only serve`): the defaults, with its kvblend command; its other old
    positional knobs (requests per client, top-k, chunk tokens) belong to the previous benchmark and are ignored."""
    args = parser().parse_args([])
    if kvblend:
        args.kvblend = shlex.join(kvblend)
    return run(args)


def interrupt(*_) -> None:
    raise KeyboardInterrupt  # SIGTERM to the benchmark: unwind, so every server is stopped


if __name__ == "__main__":
    cli = parser()
    options = cli.parse_args()
    check(cli, options)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        result = run(options)
    except KeyboardInterrupt:
        sys.exit("interrupted: every server was stopped, nothing written")
    if options.out:
        Path(options.out).write_text(json.dumps(result, indent=2, default=str))
    else:
        write_result("serve", result)
    print(markdown(result))
