"""CSV as pipe rows under a repeated header (issue 32): conversion time and token cost against the raw text.

A 5,000-row ledger (the rows of bench_extract.py's XLSX: an item, a quarter, a cost, a date, a derived cost)
written by Python's csv module, and the same as Excel writes it where the decimal mark is a comma (";",
Windows-1252). Times are the best of 7 in one process; tokens are SmolLM2's (the bundled tokenizer).

    .venv/bin/python scripts/bench_csv.py
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvblend import conversion  # noqa: E402


def ledger(rows: int = 5000, delimiter: str = ",", decimal: str = ".") -> str:
    out = io.StringIO()
    writer = csv.writer(out, delimiter=delimiter, lineterminator="\r\n")
    writer.writerow(["Item", "Quarter", "Cost (EUR)", "Ordered", "With VAT"])
    for i in range(1, rows + 1):
        cost = round(80 + 0.37 * i, 2)
        day = (dt.date(2026, 1, 1) + dt.timedelta(days=i % 365)).isoformat()
        writer.writerow(
            [
                f"Part {i % 97}",
                f"Q{i % 4 + 1}",
                str(cost).replace(".", decimal),
                day,
                str(round(cost * 1.2, 4)).replace(".", decimal),
            ]
        )
    return out.getvalue()


def best(fn, reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    from kvblend.model import load_model

    count = load_model(None, "cpu").count_tokens  # the bundled model's tokenizer
    rows = {}
    for name, data in (
        ("comma, UTF-8", ledger().encode("utf-8")),
        ("semicolon, decimal comma, cp1252", ledger(delimiter=";", decimal=",").encode("cp1252")),
    ):
        raw, _ = conversion.decode_text(data)
        table = conversion.delimited_table(raw, "csv").text
        rows[name] = {
            "bytes": len(data),
            "read as text ms": 1000 * best(lambda: conversion.decode_text(data)),
            "read as CSV table ms": 1000
            * best(lambda: conversion.delimited_table(conversion.decode_text(data)[0], "csv").text),
            "tokens as text": count(raw),
            "tokens as table": count(table),
        }
    print(json.dumps({"python": platform.python_version(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
