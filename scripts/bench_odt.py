"""ODT (LibreOffice's format) to text (issue 32): odfdo's Markdown, as kvblend reads it, beside odfdo's own
Markdown export with its tables, its plain text, and lxml over content.xml (the lightest alternative: no headings,
lists or tables as such).

The input: a 50-section report written by odfdo (a heading, three paragraphs, a five-item list and a 12-row
table per section). Best of 5 in one process.

    .venv/bin/python scripts/bench_odt.py
"""

from __future__ import annotations

import io
import json
import re
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvblend import conversion  # noqa: E402


def report(path: Path, sections: int = 50) -> None:
    from odfdo import Document, Header, List, Paragraph, Table

    doc = Document("text")
    for s in range(sections):
        doc.body.append(Header(1, f"Section {s}: the Orca-{s} pump"))
        for p in range(3):
            doc.body.append(
                Paragraph(f"Paragraph {p} of section {s}: the pump's pressure is {400 + s} kPa at rated flow.")
            )
        doc.body.append(List([f"Step {i}: check seal {i}" for i in range(5)]))
        table = Table(f"T{s}", width=3, height=13)
        table.set_values([["Part", "Cost", "Site"]] + [[f"P{s}-{r}", f"{r * 3.5}", "Halifax"] for r in range(12)])
        doc.body.append(table)
    doc.save(path)


def best(fn, data: bytes, reps: int = 5) -> tuple[float, str]:
    times, out = [], ""
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(data)
        times.append(time.perf_counter() - t0)
    return min(times), out


def odfdo_markdown(data: bytes) -> str:
    import odfdo

    return odfdo.Document(io.BytesIO(data)).to_markdown()


def odfdo_plain(data: bytes) -> str:
    import odfdo

    return odfdo.Document(io.BytesIO(data)).get_formatted_text()


def lxml_text(data: bytes) -> str:
    from lxml import etree

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        root = etree.fromstring(z.read("content.xml"))
    return "\n".join(t for t in root.itertext() if t.strip())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.odt"
        report(path)
        data = path.read_bytes()
    rows = {}
    for name, fn in (
        ("kvblend (odfdo's Markdown, tables as rows by kvblend)", lambda d: conversion.convert("odt", d).text),
        ("odfdo's Markdown export, tables too", odfdo_markdown),
        ("odfdo, plain text", odfdo_plain),
        ("lxml over content.xml", lxml_text),
    ):
        seconds, text = best(fn, data)
        rows[name] = {
            "ms": 1000 * seconds,
            "MB/s": len(data) / seconds / 1e6,
            "headings as #": "# Section 7: the Orca" in text,
            "tables as rows": re.search(r"\|\s*P7\\?-3\s*\|\s*10\.5\s*\|", text) is not None,
            "Markdown escapes": text.count("\\-"),
            "chars": len(text),
        }
    print(json.dumps({"bytes": len(data), "sections": 50, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
