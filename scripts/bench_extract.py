"""Document extraction benchmark (issue 32): kvblend's converters beside the alternatives, time and quality.

For each format, kvblend's conversion (kvblend.conversion: pypdfium2, trafilatura, python-docx, python-pptx,
markdownify) and the libraries it was chosen over are timed on the committed fixtures (fixtures/documents/) and
on larger files made here with the same producers (a 50-page PDF, a 50-section web page and DOCX, a 50-slide
deck, a 50-chapter book), best of 5 runs (of 2 for
an extractor slower than a second), in one process. Reported: ms per file, ms per page (PDF), MB/s of input,
and quality checks that say whether the table survives as rows, headings come out as '#' lines, the page-3
fact is found, and whether the web page's boilerplate (navigation, cookie banner, footer, scripts) is
dropped. Also the cold import time and installed size of each library (its own files, not its
dependencies').

The alternatives are not kvblend dependencies; those not installed are left out of the table. To run it all:

    python -m venv /tmp/extract-env && /tmp/extract-env/bin/pip install -c constraints.txt \\
        pypdfium2 trafilatura lxml_html_clean python-docx python-pptx fpdf2 pypdf pdfminer.six mammoth html2text \\
        "markitdown[pptx]" ebooklib
    /tmp/extract-env/bin/python scripts/bench_extract.py [--out bench-out/extract.json] [--formats pptx]
    .venv/bin/python scripts/bench_extract.py --plain-text-vs HEAD   # plain-text reading, before vs after

(kvblend.conversion imports nothing of kvblend's heavy stack, so the repository on sys.path is enough.)
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.metadata as md
import io
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from make_fixtures import PAGE3_FACT, SLIDE3_FACT, WEB_PAGE  # noqa: E402

from kvblend import conversion  # noqa: E402

DOCS = ROOT / "fixtures" / "documents"
BOILERPLATE = ("cookies", "Careers", "Copyright", "Privacy policy", "Related stories", "gtag", "dataLayer")
REPS = 5
SMALL = {
    "manual.pdf (4 pages)",
    "article.html",
    "report.docx",
    "briefing.pptx (6 slides)",
    "handbook.epub (3 chapters)",
    "budget.xlsx (4 sheets)",
}  # the fixtures, whose content the checks know


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


# ─────────────────────────────── inputs ───────────────────────────────


def big_pdf(path: Path, pages: int = 50) -> None:
    """A 50-page report as fpdf2 writes it: an outline, a heading, six paragraphs and a ruled table per page."""
    from fpdf import FPDF

    pdf = FPDF(format="A4")
    body = (
        "The Orca series pumps move water and light slurries at the Tern Valley works; each unit is tested for "
        "flow, pressure and vibration before it leaves the factory, and its results are kept for ten years. "
    )
    for p in range(pages):
        pdf.add_page()
        pdf.start_section(f"Test report {p + 1}", level=0)
        pdf.set_font("Helvetica", "B", 16)
        pdf.multi_cell(0, 10, f"Test report {p + 1}", new_x="LMARGIN", new_y="NEXT")
        pdf.set_font("Helvetica", "", 11)
        for _ in range(6):
            pdf.multi_cell(0, 6, body * 2, new_x="LMARGIN", new_y="NEXT")
            pdf.ln(3)
        with pdf.table() as table:
            for r, row in enumerate((("Unit", "Flow", "Pressure"), *((f"U{p}-{k}", "180", "412") for k in range(4)))):
                cells = table.row()
                for value in row:
                    cells.cell(value if r else value)
    pdf.output(str(path))


def big_html(sections: int = 50) -> bytes:
    """The fixture web page with its article grown to 50 sections (same boilerplate around it)."""
    section = WEB_PAGE[WEB_PAGE.index("<h2>The heading fault</h2>") : WEB_PAGE.index("</article>")]
    article = "".join(section.replace("<h2>", f"<h2>{i}. ") for i in range(sections))
    return WEB_PAGE.replace(section, article).encode()


def big_docx(path: Path, sections: int = 50) -> None:
    import docx

    doc = docx.Document()
    body = (
        "The Orca series pumps move water and light slurries at the Tern Valley works; each unit is tested for "
        "flow, pressure and vibration before it leaves the factory. "
    ) * 3
    for s in range(sections):
        doc.add_heading(f"Section {s + 1}", 1)
        for _ in range(6):
            doc.add_paragraph(body)
        for k in range(3):
            doc.add_paragraph(f"Finding {k} of section {s + 1}.", style="List Bullet")
        table = doc.add_table(rows=5, cols=3)
        for r in range(5):
            for c in range(3):
                table.cell(r, c).text = f"r{r}c{c}"
    doc.save(str(path))


def big_xlsx(path: Path, rows: int = 5000) -> None:
    """A 5,000-row data sheet as XlsxWriter writes it: an item, a quarter, a cost, a date and a formula a row."""
    import datetime as dt

    import xlsxwriter

    book = xlsxwriter.Workbook(str(path))
    dates = book.add_format({"num_format": "yyyy-mm-dd"})
    sheet = book.add_worksheet("Ledger")
    sheet.write_row(0, 0, ["Item", "Quarter", "Cost (EUR)", "Ordered", "With VAT"])
    for i in range(1, rows + 1):
        cost = round(80 + 0.37 * i, 2)
        sheet.write_row(i, 0, [f"Part {i % 97}", f"Q{i % 4 + 1}", cost])
        sheet.write_datetime(i, 3, dt.datetime(2026, 1, 1) + dt.timedelta(days=i % 365), dates)
        sheet.write_formula(i, 4, f"=C{i + 1}*1.2", None, round(cost * 1.2, 4))
    book.close()


def big_pptx(path: Path, slides: int = 50) -> None:
    """A 50-slide deck on python-pptx's default template: a title, five bullets at two levels, a table and notes
    on each slide."""
    from pptx import Presentation
    from pptx.util import Inches

    deck = Presentation()
    for s in range(slides):
        slide = deck.slides.add_slide(deck.slide_layouts[1])
        slide.shapes.title.text = f"Site review {s + 1}"
        body = slide.placeholders[1].text_frame
        body.text = "The Orca pumps at this site were tested for flow, pressure and vibration."
        for k in range(4):
            para = body.add_paragraph()
            para.text, para.level = f"Unit {k}: flow 180 L/min, pressure 412 kPa, within limits.", k % 2
        table = slide.shapes.add_table(4, 3, Inches(1), Inches(5), Inches(8), Inches(1.5)).table
        for r in range(4):
            for c in range(3):
                table.cell(r, c).text = f"r{r}c{c}"
        slide.notes_slide.notes_text_frame.text = f"Speaker notes for site {s + 1}: mention the dock delay."
    deck.save(str(path))


def big_epub(path: Path, chapters: int = 50) -> None:
    """A 50-chapter book as EbookLib writes it: a heading, six paragraphs, a list and a table per chapter."""
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("bench-book")
    book.set_title("Orca pump test reports")
    book.set_language("en")
    body = (
        "<p>The Orca series pumps move water and light slurries at the Tern Valley works; each unit is tested for "
        "flow, pressure and vibration before it leaves the factory.</p>"
    ) * 6
    items = []
    for c in range(chapters):
        item = epub.EpubHtml(title=f"Report {c + 1}", file_name=f"c{c}.xhtml", lang="en")
        rows = "".join(f"<tr><td>U{c}-{k}</td><td>180</td><td>412</td></tr>" for k in range(4))
        item.content = (
            f"<h1>Report {c + 1}</h1>{body}<ul><li>Flow within limits.</li><li>Seals replaced.</li></ul>"
            f"<table><tr><th>Unit</th><th>Flow</th><th>Pressure</th></tr>{rows}</table>"
        )
        book.add_item(item)
        items.append(item)
    book.toc = tuple(items)
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = ["nav", *items]
    epub.write_epub(str(path), book)


# ─────────────────────────────── extractors ───────────────────────────────


def kvblend_convert(fmt: str) -> Callable[[bytes], str]:
    return lambda data: conversion.convert(fmt, data).text


def pdfium_plain(data: bytes) -> str:
    import pypdfium2 as pdfium

    pdf = pdfium.PdfDocument(data)
    pages = []
    try:
        for i in range(len(pdf)):  # pages closed as they are read, as kvblend does (else their finalizers run later)
            page = pdf[i]
            textpage = page.get_textpage()
            pages.append(textpage.get_text_bounded())
            textpage.close()
            page.close()
    finally:
        pdf.close()
    return "\n\n".join(pages)


def pypdf_text(data: bytes) -> str:
    import pypdf

    return "\n\n".join(page.extract_text() for page in pypdf.PdfReader(io.BytesIO(data)).pages)


def pdfminer_text(data: bytes) -> str:
    from pdfminer.high_level import extract_text

    return extract_text(io.BytesIO(data))


def html2text_text(data: bytes) -> str:
    import html2text

    h = html2text.HTML2Text()
    h.ignore_links = h.ignore_images = True
    h.body_width = 0
    return h.handle(data.decode("utf-8"))


def mammoth_html(data: bytes) -> str:
    import mammoth

    return mammoth.convert_to_html(io.BytesIO(data)).value


def trafilatura_epub(data: bytes) -> str:
    """The book's chapters (kvblend's spine reading) through kvblend's web-page converter instead of markdownify."""
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as book:
        parts = [conversion._convert_html(book.read(name), time.monotonic()).text for name in conversion._epub_spine(book)]
    return "\n\n".join(parts)


def markitdown_for(suffix: str) -> Callable[[bytes], str]:
    def run(data: bytes) -> str:
        from markitdown import MarkItDown, StreamInfo

        return MarkItDown().convert_stream(io.BytesIO(data), stream_info=StreamInfo(extension=suffix)).markdown

    return run


CANDIDATES: dict[str, list[tuple[str, str, Callable[[bytes], str]]]] = {
    # format -> (name shown, module that must import, extractor)
    "pdf": [
        ("kvblend (pypdfium2 + outline headings)", "pypdfium2", kvblend_convert("pdf")),
        ("pypdfium2 text only", "pypdfium2", pdfium_plain),
        ("pypdf", "pypdf", pypdf_text),
        ("pdfminer.six", "pdfminer", pdfminer_text),
        ("markitdown", "markitdown", markitdown_for(".pdf")),
    ],
    "html": [
        ("kvblend (trafilatura)", "trafilatura", kvblend_convert("html")),
        ("html2text", "html2text", html2text_text),
        ("markitdown", "markitdown", markitdown_for(".html")),
    ],
    "docx": [
        ("kvblend (python-docx)", "docx", kvblend_convert("docx")),
        ("mammoth (to HTML)", "mammoth", mammoth_html),
        ("markitdown", "markitdown", markitdown_for(".docx")),
    ],
    "pptx": [
        ("kvblend (python-pptx)", "pptx", kvblend_convert("pptx")),
        ("markitdown (python-pptx inside)", "markitdown", markitdown_for(".pptx")),
    ],
    "xlsx": [
        ("kvblend (openpyxl)", "openpyxl", kvblend_convert("xlsx")),
        ("markitdown (pandas + openpyxl)", "markitdown", markitdown_for(".xlsx")),
    ],
    "epub": [
        ("kvblend (spine + markdownify)", "markdownify", kvblend_convert("epub")),
        ("trafilatura per chapter", "trafilatura", trafilatura_epub),
        ("markitdown", "markitdown", markitdown_for(".epub")),
    ],
}


def quality(fmt: str, name: str, text: str) -> str:
    """Short notes: does the table survive as rows, are headings '#' lines, is the boilerplate gone."""
    flat = " ".join(text.split())
    notes = []
    if fmt == "pdf":
        notes.append("page-3 fact found" if PAGE3_FACT in flat else "page-3 fact MISSING")
        notes.append("table rows as lines" if "Orca-7 180 412 58" in text else "table rows broken")
        notes.append(
            "headings as #" if "\n## Specifications" in text or "# Specifications" in text else "no # headings"
        )
    elif fmt == "html":
        left = [b for b in BOILERPLATE if b in text]
        notes.append("boilerplate dropped" if not left else f"boilerplate kept ({', '.join(left)})")
        if "| 3.1 | 0.4 | 1.2 |" in text:
            notes.append("table as pipe rows")
        else:
            notes.append("table as rows without outer pipes" if "3.1| 0.4| 1.2" in text else "table not as rows")
        notes.append("headings as #" if "## Measured drift" in text else "no # headings")
    elif fmt == "pptx":
        notes.append("slide-3 fact found" if SLIDE3_FACT in flat else "slide-3 fact MISSING")
        notes.append("table as pipe rows" if "| Halifax | 1,450 | 6 |" in text else "table not as pipe rows")
        notes.append("titles as #" if "# Service costs" in text else "titles not marked")
        notes.append("bullets as '- '" if "- Nine run firmware" in text else "bullets not marked")
        notes.append("footer dropped" if "confidential" not in text else "footer kept")
        notes.append("notes kept" if "Halifax dock delay" in text else "notes lost")
        chart = "| 2026 | 4 | 3.5 |" in text or "| 2026 | 4.0 | 3.5 |" in text
        notes.append("chart data as rows" if chart else "chart data not as pipe rows")
    elif fmt == "xlsx":
        notes.append("formula's value kept" if "19093.75" in text else "formula's value lost")
        notes.append("dates as dates" if "2026-06-16" in text and "00:00:00" not in text else "dates with times")
        notes.append("hidden sheet left out" if "rate table" not in text else "hidden sheet kept")
        notes.append("empty cells as NaN" if "NaN" in text else "empty cells empty")
        repeated = text.count("| Item | Quarter |") >= 2
        notes.append("header over every block of rows" if repeated else "header once")
    elif fmt == "epub":
        in_order = 0 <= text.find("A red status light") < text.find("Clean the transducer window")
        notes.append("chapters in spine order" if in_order else "chapters out of order")
        notes.append("headings as #" if "# Maintenance" in text and "## Tools" in text else "headings lost")
        notes.append("list as '- '" if "- A soft brush." in text or "* A soft brush." in text else "list not marked")
        notes.append("table as pipe rows" if "| Window | 200 |" in text else "table not as pipe rows")
        notes.append("contents page left out" if text.count("Maintenance") == 1 else "contents page kept")
    else:
        pipe = "| 2 | 3.4 | 298 |" in text
        html_table = "<table>" in text
        notes.append("table as pipe rows" if pipe else "table as HTML" if html_table else "table lost")
        notes.append(
            "headings as #" if "## Findings" in text else "headings as <h2>" if "<h2>" in text else "no headings"
        )
        notes.append("list as '- '" if "- Pump 1 bearing" in text or "* Pump 1 bearing" in text else "list not marked")
    return "; ".join(notes)


def best_time(fn: Callable[[bytes], str], data: bytes) -> tuple[float, str]:
    """Best of REPS runs (of 2 for an extractor slower than a second: its rank is not in doubt)."""
    best, out = float("inf"), ""
    for rep in range(REPS):
        t = time.perf_counter()
        out = fn(data)
        best = min(best, time.perf_counter() - t)
        if rep >= 1 and best > 1.0:
            break
    return best, out


def import_seconds(module: str) -> float:
    """Cold import time in a fresh interpreter, minus the interpreter's own start."""

    def run(code: str) -> float:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        return time.perf_counter() - t

    base = min(run("pass") for _ in range(3))
    return max(0.0, min(run(f"import {module}") for _ in range(3)) - base)


DISTS = {
    "pypdfium2": ["pypdfium2", "pypdfium2_raw"],
    "pypdf": ["pypdf"],
    "pdfminer": ["pdfminer.six"],
    "trafilatura": ["trafilatura"],
    "html2text": ["html2text"],
    "docx": ["python-docx"],
    "pptx": ["python-pptx"],
    "openpyxl": ["openpyxl", "et_xmlfile"],
    "markdownify": ["markdownify", "beautifulsoup4", "soupsieve"],
    "mammoth": ["mammoth"],
    "markitdown": ["markitdown"],
}


def installed_mb(module: str) -> float | None:
    total = 0
    for dist in DISTS.get(module, []):
        try:
            files = md.distribution(dist).files or []
        except md.PackageNotFoundError:
            continue
        for f in files:
            p = Path(str(f.locate()))
            if p.is_file():
                total += p.stat().st_size
    return total / 1e6 if total else None


def plain_text_vs(rev: str, reps: int = 21) -> dict:
    """iter_documents on plain text: git REV's kvblend/documents.py against the work tree's, interleaved.

    Issue 32 bounds the cost of format detection on plain text at 5%. Two inputs: the bundled documents
    (12 small Markdown files) and 2,000 text files of ~10 KB made here (.txt and .md alike).
    """
    import importlib.util
    import random

    from kvblend import documents as after

    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:kvblend/documents.py"], capture_output=True, text=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "documents_before.py"
        old.write_text(source)
        spec = importlib.util.spec_from_file_location("documents_before", old)
        assert spec is not None and spec.loader is not None
        before = importlib.util.module_from_spec(spec)
        sys.modules["documents_before"] = before  # dataclasses look their module up
        spec.loader.exec_module(before)
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        rng = random.Random(0)
        words = (ROOT / "README.md").read_text(encoding="utf-8").split()
        for i in range(2000):
            (corpus / f"doc{i:04d}.{'md' if i % 2 else 'txt'}").write_text(" ".join(rng.choices(words, k=1500)))
        out = {}
        for label, root, n in (
            ("bundled docs (12)", ROOT / "kvblend" / "data" / "docs", reps * 10),
            ("2,000 text files", corpus, reps),
        ):
            times: dict[str, list[float]] = {"before": [], "after": []}
            for r in range(n):
                order = (("before", before), ("after", after)) if r % 2 else (("after", after), ("before", before))
                for name, module in order:
                    t = time.perf_counter()
                    docs, _ = module.iter_documents([root])
                    times[name].append(time.perf_counter() - t)
            mb = sum(len(d.text.encode()) for d in docs) / 1e6
            b, a = min(times["before"]), min(times["after"])  # the least disturbed run: this host is shared
            out[label] = {"mb": mb, "before_ms": b * 1000, "after_ms": a * 1000, "change_pct": 100 * (a / b - 1)}
            print(
                f"{label}: {mb:.1f} MB; before {b * 1000:.2f} ms ({mb / b:.0f} MB/s), after {a * 1000:.2f} ms "
                f"({mb / a:.0f} MB/s): {100 * (a / b - 1):+.1f}%"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "extract.json")
    ap.add_argument("--plain-text-vs", metavar="REV", help="only compare plain-text reading with git REV's")
    ap.add_argument("--formats", default=",".join(CANDIDATES), help="comma-separated formats to measure")
    args = ap.parse_args()
    if args.plain_text_vs:
        plain_text_vs(args.plain_text_vs)
        return
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "big.pdf"
        big_pdf(big)
        bigdoc = Path(tmp) / "big.docx"
        big_docx(bigdoc)
        bigdeck = Path(tmp) / "big.pptx"
        big_pptx(bigdeck)
        bigbook = Path(tmp) / "big.epub"
        big_epub(bigbook)
        bigsheet = Path(tmp) / "big.xlsx"
        big_xlsx(bigsheet)
        inputs = {
            "pdf": [
                ("manual.pdf (4 pages)", (DOCS / "manual.pdf").read_bytes(), 4),
                ("50-page PDF", big.read_bytes(), 50),
            ],
            "html": [
                ("article.html", (DOCS / "article.html").read_bytes(), 0),
                ("50-section page", big_html(), 0),
            ],
            "docx": [
                ("report.docx", (DOCS / "report.docx").read_bytes(), 0),
                ("50-section DOCX", bigdoc.read_bytes(), 0),
            ],
            "pptx": [
                ("briefing.pptx (6 slides)", (DOCS / "briefing.pptx").read_bytes(), 6),
                ("50-slide deck", bigdeck.read_bytes(), 50),
            ],
            "xlsx": [
                ("budget.xlsx (4 sheets)", (DOCS / "budget.xlsx").read_bytes(), 0),
                ("5,000-row sheet", bigsheet.read_bytes(), 0),
            ],
            "epub": [
                ("handbook.epub (3 chapters)", (DOCS / "handbook.epub").read_bytes(), 0),
                ("50-chapter book", bigbook.read_bytes(), 0),
            ],
        }
    rows = []
    for fmt, candidates in CANDIDATES.items():
        if fmt not in args.formats.split(","):
            continue
        for name, module, fn in candidates:
            try:
                importlib.import_module(module)
            except ImportError:
                print(f"[{fmt}] {name}: {module} not installed, left out", file=sys.stderr)
                continue
            imp = import_seconds(module)
            size = installed_mb(module)
            for label, data, pages in inputs[fmt]:
                seconds, text = best_time(fn, data)
                rows.append(
                    {
                        "format": fmt,
                        "extractor": name,
                        "input": label,
                        "input_mb": len(data) / 1e6,
                        "ms": seconds * 1000,
                        "ms_per_page": seconds * 1000 / pages if pages else None,
                        "mb_per_s": len(data) / 1e6 / seconds,
                        "quality": quality(fmt, name, text) if label in SMALL else "",
                        "import_s": imp,
                        "installed_mb": size,
                    }
                )
                r = rows[-1]
                print(
                    f"[{fmt}] {name:40s} {label:22s} {r['ms']:9.1f} ms  {r['mb_per_s']:7.2f} MB/s  {r['quality']}",
                    file=sys.stderr,
                )
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": cpu_model(),
        "date": dt.date.today().isoformat(),
        "python": platform.python_version(),
        "versions": {d: md.version(d) for ds in DISTS.values() for d in ds if _has(d)},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(markdown(result))


def _has(dist: str) -> bool:
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        return False
    return True


def markdown(result: dict) -> str:
    lines = [
        f"`{result['command']}` on {result['machine']}, {result['date']} (Python {result['python']}; best of {REPS})",
        "",
        "| format | extractor | input | ms | ms/page | MB/s | import s | installed MB | quality (small fixture) |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        per_page = f"{r['ms_per_page']:.2f}" if r["ms_per_page"] else ""
        size = f"{r['installed_mb']:.1f}" if r["installed_mb"] else ""
        lines.append(
            f"| {r['format']} | {r['extractor']} | {r['input']} | {r['ms']:.1f} | {per_page} | {r['mb_per_s']:.2f} "
            f"| {r['import_s']:.2f} | {size} | {r['quality']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
