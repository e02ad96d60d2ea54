"""ODP (LibreOffice Impress) to text (issue 32): kvblend's reading (a page per slide, titles as headings, tables as
pipe rows, notes) beside odfdo's own per-page formatted text (no title role, a table as a cell a line). A
30-slide deck written by odfdo: a title and a five-item list per slide, a 5-row table on every third. Best of 5.

    .venv/bin/python scripts/bench_odp.py
"""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvblend import conversion  # noqa: E402

SLIDES = 30


def deck() -> bytes:
    from odfdo import Document, DrawPage, Frame, List, Table

    doc = Document("presentation")
    doc.body.clear()
    for n in range(1, SLIDES + 1):
        page = DrawPage(f"p{n}", name=f"Slide {n}")
        page.append(Frame.text_frame(f"Pump station {n}", size=("20cm", "2cm"), position=("1cm", "1cm"),
                                     presentation_class="title"))
        items = List([f"Station {n} pump {i}: rated {400 + i} kPa" for i in range(5)])
        page.append(Frame.text_frame(items, size=("20cm", "8cm"), position=("1cm", "4cm"),
                                     presentation_class="outline"))
        if n % 3 == 0:
            table = Table("T", width=3, height=6)
            table.set_values([["Part", "Cost", "Site"]] + [[f"P{n}-{r}", r * 3.5, "Halifax"] for r in range(5)])
            frame = Frame(size=("10cm", "5cm"), position=("1cm", "12cm"))
            frame.append(table)
            page.append(frame)
        doc.body.append(page)
    out = io.BytesIO()
    doc.save(out)
    return out.getvalue()


def best(fn, reps: int = 5) -> tuple[float, str]:
    times, out = [], ""
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def odfdo_pages(data: bytes) -> str:
    from odfdo import Document

    return "\n".join(page.get_formatted_text() for page in Document(io.BytesIO(data)).body.get_draw_pages())


def main() -> None:
    data = deck()
    megabytes = len(data) / 1e6
    rows = {}
    readers = (("kvblend", lambda: conversion.convert("odp", data).text), ("odfdo pages", lambda: odfdo_pages(data)))
    for name, fn in readers:
        seconds, text = best(fn)
        rows[name] = {"ms": round(1000 * seconds, 1), "ms per slide": round(1000 * seconds / SLIDES, 2),
                      "ms per MB": round(1000 * seconds / megabytes), "chars": len(text),
                      "tables as pipe rows": "| Part | Cost | Site |" in text}
    print(json.dumps({"slides": SLIDES, "bytes": len(data), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
