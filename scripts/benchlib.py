"""Shared helpers for the `make bench` scripts: machine description, timing, markdown."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
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


def evict_page_cache(path: Path) -> None:
    """Drop a file's pages from the page cache (cold reads) without root: fsync + POSIX_FADV_DONTNEED."""
    for p in ([path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]):
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


def command_line() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])
