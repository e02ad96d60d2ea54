"""`make bench`: run every benchmark and refresh BENCHMARKS.md.

Sections run by default (SECTIONS): startup, engine, archive, query, bench (the
MuSiQue table and the variants), stages (blend's time per stage), pareto,
codecs, codecs_ttft, redis and decode (one batched decode step per batch size).
The long sections run only when named in `--only`: serve (one node, blend vs
full under load), serve_nodes (two nodes on one Redis), serve_bound (unique
long prompts under --max-archive-size), serve_bf16 (serve's load test under
--dtype bf16), each 5-45 minutes, and sinks (the
prefix sink from the archive under three templates, about an hour);
restructure_ab is written by scripts/bench_ab.py against an old checkout. Each
section writes bench-out/<name>.json; this script renders them all into
BENCHMARKS.md with the command, machine and date. `--only a,b` reruns some
sections and keeps the others' last results; `--render-only` re-renders.
Sections measured by scripts outside SECTIONS or by several runs of `kvblend
bench` (document extraction, Gemma 3, bad documents, commit latency, start-up,
stale KV, drift) live in docs/benchmark-sections.md, each with its own command,
machine and date, and are rendered after the generated ones, so a re-render
keeps them; docs/benchmark-notes*.md hold the commentary.
Running needs ../shared/data (the MuSiQue records); rendering does not.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ab  # noqa: E402
import bench_archive  # noqa: E402
import bench_codecs  # noqa: E402
import bench_engine  # noqa: E402
import bench_query  # noqa: E402
import bench_redis  # noqa: E402
import bench_serve  # noqa: E402
import bench_serve_bound  # noqa: E402
import bench_sinks  # noqa: E402
import bench_stages  # noqa: E402
import bench_decode  # noqa: E402
import bench_weights  # noqa: E402
import bench_startup  # noqa: E402
from benchlib import OUT_DIR, ROOT, SHARED_DATA, write_result  # noqa: E402

# bench also writes the variants section; restructure_ab needs an old checkout (scripts/bench_ab.py); the server
# sections take 10-60 min each (serve, serve_nodes, serve_bound): these run only when named in --only (their last
# results are kept and rendered)
SECTIONS = ["startup", "engine", "archive", "query", "bench", "stages", "pareto", "codecs", "codecs_ttft", "redis",
            "decode", "decode-gemma3-270m", "weights"]
KVBLEND = [str(Path(sys.executable).parent / "kvblend")]
SERVE_WEIGHTS = ("fp32", "bf16", "int8")  # the serve_weights section: one server run each, the same prompts


def run_cli_json(name: str, args: list[str]) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(KVBLEND + args, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr}")
    data = json.loads(proc.stdout)
    data["command"] = "kvblend " + " ".join(args)
    write_result(name, data)
    return data


def run_section(name: str) -> None:
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    if name == "engine":
        r = bench_engine.main()
    elif name == "archive":
        r = bench_archive.main()
    elif name == "query":
        r = bench_query.main()
    elif name == "bench":
        # one pass for the main table and the variants: full is the shared reference, runs are shared
        data = str(SHARED_DATA / "musique_dev.json")
        (ROOT / "docs").mkdir(exist_ok=True)
        r = run_cli_json("bench", ["bench", data, "--limit", "20", "--variants", "--json",
                                   "--plot", str(ROOT / "docs" / "bench-musique.png")])
        r["date"] = started
        write_result("variants", dict(r))
    elif name == "quality":  # the main MuSiQue table alone (bench.json), leaving the variants as they are
        data = str(SHARED_DATA / "musique_dev.json")
        (ROOT / "docs").mkdir(exist_ok=True)
        r = run_cli_json("bench", ["bench", data, "--limit", "20", "--json",
                                   "--plot", str(ROOT / "docs" / "bench-musique.png")])
        name = "bench"
    elif name == "pareto":  # every selection policy over ratios 0.05-0.5, each point a query from the archive
        data = str(SHARED_DATA / "musique_dev.json")
        (ROOT / "docs").mkdir(exist_ok=True)
        r = run_cli_json("pareto", ["bench", data, "--limit", "10", "--modes", "full", "--pareto", "--json",
                                    "--plot", str(ROOT / "docs" / "pareto-musique.png")])
        (ROOT / "docs" / "pareto-musique-ttft.png").unlink(missing_ok=True)  # full alone: nothing to compare
    elif name == "codecs":  # fidelity and size per codec, from the archive
        data = str(SHARED_DATA / "musique_dev.json")
        r = run_cli_json("codecs", ["bench", data, "--limit", "20", "--modes", "full,reuse,blend",
                                    "--codecs", "lossless,int8,int4", "--json"])
    elif name == "codecs_ttft":
        r = bench_codecs.main()
    elif name == "startup":
        r = bench_startup.main()
    elif name == "serve":
        r = bench_serve.main([str(Path(sys.executable).parent / "kvblend")])
    elif name == "serve_bf16":  # the same server load test with the servers computing in bf16 (--dtype bf16)
        args = bench_serve.parser().parse_args(["--dtype", "bf16", "--concurrency", "1,2,4,8", "--rates", "",
                                                "--out", str(OUT_DIR / "serve_bf16.json")])
        r = bench_serve.run(args)
    elif name == "serve_nodes":  # two serving nodes on one throwaway Redis, 8 clients, 200 requests, blend; cold:
        # the passages are new when the first requests send them; 7 records (an odd count) for 8 clients
        # round-robin over 2 nodes, so the same new passages reach both nodes at once, and every later request
        # for a record goes to the other node than the last one did
        args = bench_serve.parser().parse_args(["--redis", "--nodes", "2", "--modes", "blend", "--concurrency", "8",
                                                "--rates", "", "--requests", "200", "--records", "7", "--cold",
                                                "--max-tokens", "32", "--out", str(OUT_DIR / "serve_nodes.json")])
        r = bench_serve.run(args)
    elif name == "serve_weights":  # issue 34's serving must-hold: blend at 1 and 8 clients under each decode weights
        r = {"runs": {}}
        for weights in SERVE_WEIGHTS:
            args = bench_serve.parser().parse_args(["--weights", weights, "--modes", "blend", "--concurrency", "1,8",
                                                    "--rates", "", "--out", str(OUT_DIR / f"serve_weights_{weights}.json")])
            r["runs"][weights] = bench_serve.run(args)
        r["command"] = ("python scripts/bench_all.py --only serve_weights  (bench_serve.py --modes blend "
                        "--concurrency 1,8 --rates '' --weights W, for W in " + ", ".join(SERVE_WEIGHTS) + ")")
    elif name == "serve_bound":
        r = bench_serve_bound.main(bench_serve_bound.parser().parse_args([]))
    elif name == "redis":
        r = bench_redis.main()
    elif name == "stages":
        r = bench_stages.main([])
    elif name == "decode":
        r = bench_decode.main([])
    elif name == "decode-gemma3-270m":  # the second family's Q4_K_M file: its own blocks against fp32 and int4
        r = bench_decode.main(["--model", "gemma3-270m", "--weights", "fp32,native,int4"])
    elif name == "weights":
        r = bench_weights.main([])
    elif name == "sinks":  # 12 bench runs (2 sinks x 3 templates x 2 record sets): about an hour on 2 cores
        r = bench_sinks.main([])
    elif name == "variants":  # the variants alone (full is still run: it is the reference)
        data = str(SHARED_DATA / "musique_dev.json")
        r = run_cli_json("variants", ["bench", data, "--limit", "20", "--modes", "full", "--variants", "--json"])
    else:
        raise SystemExit(f"unknown section {name}")
    r["date"] = started
    write_result(name, r)


def markdown_serve_weights(r: dict) -> str:
    """One line per weights format: blend's output tok/s at 1 and 8 clients and their ratio, TTFT p90 beside it;
    then each run's own table."""
    rows = ["| --weights | output tok/s c=1 | output tok/s c=8 | c=8 / c=1 | c=8 / fp32's c=1 | TTFT p90 c=1 | "
            "TTFT p90 c=8 | TTFT p90 ratio | ITL p50 c=1 | ITL p50 c=8 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cells = {w: {c["setting"]: c for c in run["cells"] if c["mode"] == "blend"} for w, run in r["runs"].items()}
    base = cells.get("fp32", {}).get("c=1")
    for weights, by in cells.items():
        one, eight = by["c=1"], by["c=8"]
        vs_fp32 = f"{eight['output_throughput'] / base['output_throughput']:.2f}×" if base else "—"
        rows.append(f"| {weights} | {one['output_throughput']:.1f} | {eight['output_throughput']:.1f} | "
                    f"{eight['output_throughput'] / one['output_throughput']:.2f}× | {vs_fp32} | {one['p90_ttft_ms']:.0f} ms | "
                    f"{eight['p90_ttft_ms']:.0f} ms | {eight['p90_ttft_ms'] / one['p90_ttft_ms']:.1f}× | "
                    f"{one['median_itl_ms']:.0f} ms | {eight['median_itl_ms']:.0f} ms |")
    first = next(iter(r["runs"].values()))
    parts = [f"Command: `{r['command']}`  ", f"Machine: {first['machine']}  ", f"Date: {r['date']}", "", *rows, ""]
    for weights, run in r["runs"].items():
        parts += [f"`--weights {weights}`:", "", bench_serve.markdown(run), ""]
    return "\n".join(parts)


def load(name: str) -> dict | None:
    p = OUT_DIR / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def render() -> str:
    from kvblend.evaluation.report import (  # the harness renders its own tables
        markdown_codecs,
        markdown_pareto,
        markdown_results,
        markdown_variants,
    )

    parts = [
        "# Benchmarks",
        "",
        "Regenerate with `make bench` (all sections) or `.venv/bin/python scripts/bench_all.py --only engine,query`.",
        "Ratios are measured side by side in one process (modes interleaved); absolute times on these shared",
        "machines are noisy. Each section names its machine and date. Raw JSON: `bench-out/`.",
        "",
    ]
    notes = ROOT / "docs" / "benchmark-notes.md"
    manual = ROOT / "docs" / "benchmark-sections.md"
    sections = [
        ("startup", "Startup: commands that need no model (issue 12)",
         "`python scripts/bench_startup.py` — each command run 10 times as a fresh process through the installed "
         "`kvblend` script; torch must not be imported.",
         lambda r: bench_startup.markdown(r)),
        ("restructure_ab", "Before/after the restructure (issue 12)", None, lambda r: bench_ab.markdown(r)),
        ("engine", "Engine: TTFT with the KV already in memory (issue 2)",
         "`python scripts/bench_engine.py` — 6 MuSiQue passages (~600 tokens each) + question, default model, the instruction prefix cached as `query` has it after first use (`full` computes it; `blend, prefix computed` is the same blend without that cache); target blend ≥ 4× (ideal ≈ 4.65× at its 21.5% compute share).",
         lambda r: bench_engine.markdown(r)),
        ("archive", "Archive: ingest overhead, compression, layer reads (issue 3)",
         "`python scripts/bench_archive.py` — 24 MuSiQue passages as files; target overhead ≤ 10%.",
         lambda r: bench_archive.markdown(r)),
        ("query", "Query: TTFT from the on-disk archive, warm and cold (issue 4)",
         "`python scripts/bench_query.py` — 6 archived passages per question, 3 questions × 3 interleaved repetitions (medians); targets ≥ 4× warm, ≥ 3× cold, load wait ≤ 10% of TTFT. On this 2-core host the loader fetches ahead and builds each layer when the fusor asks (see notes), so its build time is counted as load wait.",
         lambda r: bench_query.markdown(r)),
        ("bench", "Quality vs latency on MuSiQue (issue 5)", None, lambda r: markdown_results(r)),
        ("variants", "Selection policies and fusor variants on MuSiQue (issues 5, 13)", None,
         lambda r: markdown_variants(r)),
        ("stages", "Where blend's time goes, per stage, before and after issue 20",
         "`python scripts/bench_stages.py` — 3 musique_dev records × 6 passages, 3 interleaved repetitions after "
         "a warm-up (medians); each stage in ms (share of TTFT).", lambda r: r["markdown"]),
        ("sinks", "The prefix sink measured from the archive (issue 20)",
         "`python scripts/bench_sinks.py` — each cell one `kvblend bench` run (command in bench-out/sinks.json): "
         "passages archived with `--sink none` or `--sink prefix`, asked under three templates.",
         lambda r: r["markdown"]),
        ("pareto", "Selection policies: first-token KL vs recompute share and TTFT (issues 13, 20)", None,
         lambda r: markdown_pareto(r.get("pareto") or [])),
        ("codecs", "Codecs: size vs fidelity on MuSiQue (issue 15)", None, lambda r: markdown_codecs(r)),
        ("codecs_ttft", "Codecs: blend TTFT from each codec's archive (issue 15)",
         "`python scripts/bench_codecs.py` — 3 MuSiQue questions × 6 passages archived once per codec, "
         "5 interleaved repetitions (medians), warm and cold page cache.",
         lambda r: bench_codecs.markdown(r)),
        ("serve", "Server under load: continuous batching, blend vs full (issues 14, 21)", "", bench_serve.markdown),
        ("serve_bf16", "Server under load in bf16 (`serve --dtype bf16`, issue 21)", "", bench_serve.markdown),
        ("serve_weights", "Server under load by decode weights: 8 clients against 1 (issue 34)", "",
         markdown_serve_weights),
        ("serve_bound", "Server under a disk bound: unique long prompts, --max-archive-size (issue 21)", "",
         bench_serve_bound.markdown),
        ("redis", "Redis archive vs local archive: TTFT, ingest, bytes per token (issue 22)", "", bench_redis.markdown),
        ("serve_nodes", "Two serving nodes on one Redis: load test (issue 22)", "", bench_serve.markdown),
        ("decode", "Decode beside llama.cpp on the same GGUF and token ids: weights formats (issue 34)",
         "`python scripts/bench_decode.py` — ~3,000 prompt tokens of a MuSiQue record, `full`; "
         "llama.cpp from the benchmark venv (`make bench-venv`).",
         lambda r: r["markdown"]),
        ("decode-gemma3-270m", "Decode of Gemma 3 270M's Q4_K_M GGUF in its own blocks, beside llama.cpp (issue 32)",
         None, lambda r: r["markdown"]),
        ("weights", "Weights in decode: each format's answers against fp32's (issue 34)",
         "`python scripts/bench_weights.py` — musique_dev records 0-19, 6 passages, one `full` prefill per record.",
         lambda r: r["markdown"]),
    ]
    for name, title, how, fmt in sections:
        r = load(name)
        parts += [f"## {title}", ""]
        if r is None:
            parts += ["(not run yet)", ""]
            continue
        if how != "":  # "": the section writes its own command / machine / date lines
            parts.append(f"Command: {how or '`' + r.get('command', '') + '`'}  ")
            parts.append(f"Machine: {r.get('machine', '?')}  ")
            parts.append(f"Date: {r.get('date', '?')}")
            parts.append("")
        parts += [fmt(r), ""]
        if name == "bench" and (ROOT / "docs" / "bench-musique.png").exists():
            parts += ["![quality vs TTFT](docs/bench-musique.png)", ""]
        if name == "pareto" and (ROOT / "docs" / "pareto-musique.png").exists():
            parts += ["![first-token KL vs recompute share and vs TTFT](docs/pareto-musique.png)", ""]
        extra = ROOT / "docs" / f"benchmark-notes-{name}.md"  # per-section commentary, kept across re-runs
        if extra.exists():
            parts += [extra.read_text(), ""]
    if manual.exists():  # sections measured by hand or by scripts outside SECTIONS, each with its command
        parts += [manual.read_text()]
    if notes.exists():
        parts += [notes.read_text()]
    return "\n".join(parts) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    if not args.render_only and not SHARED_DATA.exists():
        raise SystemExit(f"benchmark data not found at {SHARED_DATA} (make bench needs ../shared/data)")
    if not args.render_only:
        for name in args.only.split(","):
            print(f"== {name}", file=sys.stderr, flush=True)
            run_section(name.strip())
    (ROOT / "BENCHMARKS.md").write_text(render())
    print(f"wrote {ROOT / 'BENCHMARKS.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
