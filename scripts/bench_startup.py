"""Startup benchmark (issue 12): how long `kvblend --help` and `kvblend ls` take, and that they skip torch.

Commands that touch no model must answer like `hf cache ls` or `llm --help` do:
well under half a second. Each command runs `runs` times as a fresh process (the
installed console script); the median wall time is reported, plus whether torch
was imported (checked with `-X importtime` on the same entry point).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, write_result  # noqa: E402

KVBLEND = str(Path(sys.executable).parent / "kvblend")


def wall_times(args: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([KVBLEND, *args], capture_output=True, check=False)
        times.append(time.perf_counter() - t0)
    return times


def imports_torch(args: list[str]) -> bool:
    code = f"import sys; sys.argv = ['kvblend', *{args!r}]\nfrom kvblend.cli.main import main\ntry:\n main()\nexcept SystemExit:\n pass"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True)
    return any(line.rstrip().endswith("| torch") for line in proc.stderr.splitlines())


def main(runs: int = 10) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="kvblend-startup-"))
    commands = {"--help": ["--help"], "ls": ["ls", "--archive", str(scratch / "none")],
                "path": ["path"], "query --help": ["query", "--help"]}
    result = {"machine": machine(), "runs": runs, "commands": {}}
    for label, args in commands.items():
        times = wall_times(args, runs)
        result["commands"][label] = {"median_s": statistics.median(times), "max_s": max(times),
                                     "imports_torch": imports_torch(args)}
    write_result("startup", result)
    return result


def markdown(r: dict) -> str:
    lines = ["| command | median wall time | max | imports torch |", "|---|---:|---:|---|"]
    for label, v in r["commands"].items():
        lines.append(f"| `kvblend {label}` | {v['median_s'] * 1000:.0f} ms | {v['max_s'] * 1000:.0f} ms | "
                     f"{'yes' if v['imports_torch'] else 'no'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(main()))
