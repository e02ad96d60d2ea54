"""Write the document fixtures under fixtures/documents/ with real producers (issue 32).

Conversion is tested on files that real software wrote, not on hand-made
bytes: fpdf2 writes the PDFs (a 4-page manual with an outline, headings, a
table and a list; an image-only "scan"; one that needs a password),
python-docx the DOCX, python-pptx the slide decks (msoffcrypto-tool locks one with a password), EbookLib
the EPUB. The web
page and the Markdown file are text a site or a person writes, so they are
written as they are. The outputs are committed (a few KB each), so the tests
need none of these producers at run time; run this again only to change them:

    .venv/bin/python scripts/make_fixtures.py [OUT_DIR]

fpdf2 is in the ``dev`` extra; python-docx and python-pptx are runtime dependencies.
Every output is deterministic (fixed creation dates and ZIP dates), so
running it twice changes nothing in git.
"""

from __future__ import annotations

import datetime as dt
import io
import re
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "documents"
FIXED_DATE = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

# The fact on page 3 that tests look for (and its page), and the specification table on page 2.
PAGE3_FACT = "The Orca-7 pump's maximum pressure is 412 kPa."
SPEC_ROWS = [
    ("Model", "Flow (L/min)", "Pressure (kPa)", "Mass (kg)"),
    ("Orca-5", "120", "300", "41"),
    ("Orca-7", "180", "412", "58"),
    ("Orca-9", "240", "520", "77"),
]


def make_manual_pdf(path: Path) -> None:
    """A 4-page pump manual: an outline (bookmarks) of its sections, headings in a larger bold font, a table
    on page 2, PAGE3_FACT on page 3, a bullet list on page 4 — what a word processor's PDF export holds."""
    from fpdf import FPDF

    pdf = FPDF(format="A4")
    pdf.set_creation_date(FIXED_DATE)
    pdf.set_title("Orca pump series: service manual")
    pdf.set_author("Kestrel Pumps Ltd")

    def heading(text: str, level: int) -> None:
        pdf.start_section(text, level=level)
        pdf.set_font("Helvetica", "B", 18 if level == 0 else 14)
        pdf.multi_cell(0, 10, text, new_x="LMARGIN", new_y="NEXT")
        pdf.set_font("Helvetica", "", 11)

    def para(text: str) -> None:
        pdf.multi_cell(0, 6, text, new_x="LMARGIN", new_y="NEXT")
        pdf.ln(3)

    pdf.add_page()
    heading("Orca pump series: service manual", 0)
    heading("Introduction", 1)
    para(
        "This manual covers the Orca series of centrifugal pumps built by Kestrel Pumps Ltd at the Tern Valley "
        "works. It is meant for service engineers who install, inspect and repair the pumps on site."
    )
    para(
        "Read every section before the first start-up. The pumps move water and light slurries; they must "
        "not be used for fuel, solvents or any flammable liquid."
    )

    pdf.add_page()
    heading("Specifications", 1)
    para("The table below lists the rated values of each model at 20 degrees Celsius.")
    pdf.set_font("Helvetica", "", 10)
    with pdf.table(col_widths=(30, 30, 30, 30), text_align="LEFT") as table:
        for row in SPEC_ROWS:
            cells = table.row()
            for value in row:
                cells.cell(value)
    pdf.set_font("Helvetica", "", 11)
    pdf.ln(4)
    para("Rated values are measured with clean water; a slurry lowers the flow by up to a fifth.")

    pdf.add_page()
    heading("Operating limits", 1)
    para(
        "Each pump has a pressure relief valve that opens above its rated pressure. "
        + PAGE3_FACT
        + " Above that value the relief valve opens and the controller raises an alarm."
    )
    para("Never run a pump dry for more than thirty seconds: the shaft seal overheats and leaks.")

    pdf.add_page()
    heading("Safety checklist", 1)
    para("Before any service work:")
    for item in (
        "Isolate the motor and lock the breaker open.",
        "Close the suction and discharge valves.",
        "Drain the casing into a tray and check that the gauge reads zero.",
    ):
        pdf.multi_cell(0, 6, "- " + item, new_x="LMARGIN", new_y="NEXT")
    pdf.ln(3)
    para("Report every leak to the site supervisor on the same day.")
    pdf.output(str(path))


def make_scanned_pdf(path: Path) -> None:
    """A one-page PDF holding only a picture of text, as a scanner without OCR makes it: no text layer."""
    from fpdf import FPDF
    from PIL import Image, ImageDraw

    img = Image.new("1", (600, 200), 1)
    draw = ImageDraw.Draw(img)
    draw.text((20, 20), "SCANNED PAGE - Orca-7 inspection report", fill=0)
    draw.text((20, 60), "Seal replaced, pressure test passed.", fill=0)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    pdf = FPDF(format="A4")
    pdf.set_creation_date(FIXED_DATE)
    pdf.add_page()
    pdf.image(buf, x=10, y=10, w=190)
    pdf.output(str(path))


def make_encrypted_pdf(path: Path) -> None:
    """A PDF that opens only with a password (a user password, RC4 as fpdf2 writes it by default)."""
    from fpdf import FPDF

    pdf = FPDF(format="A4")
    pdf.set_creation_date(FIXED_DATE)
    pdf.set_encryption(owner_password="owner-secret", user_password="user-secret")
    pdf.add_page()
    pdf.set_font("Helvetica", "", 11)
    pdf.multi_cell(0, 6, "Confidential: the Orca-9 tender price.")
    pdf.output(str(path))


def make_docx(path: Path) -> None:
    """A DOCX with a title, headings, a bullet list and a table, written by python-docx (Word's own styles)."""
    import docx

    doc = docx.Document()
    doc.core_properties.created = FIXED_DATE.replace(tzinfo=None)
    doc.core_properties.modified = FIXED_DATE.replace(tzinfo=None)
    doc.core_properties.author = "Kestrel Pumps Ltd"
    doc.add_heading("Field service report: Skua-3 station", level=1)
    doc.add_paragraph("Engineer A. Morven visited the Skua-3 pumping station on 12 March to inspect two pumps.")
    doc.add_heading("Findings", level=2)
    for item in (
        "Pump 1 bearing noise within limits.",
        "Pump 2 shaft seal weeping; replaced.",
        "Control panel firmware updated to 4.2.",
    ):
        doc.add_paragraph(item, style="List Bullet")
    doc.add_heading("Measurements", level=2)
    table = doc.add_table(rows=3, cols=3)
    table.style = "Table Grid"
    for r, row in enumerate((("Pump", "Vibration (mm/s)", "Pressure (kPa)"), ("1", "2.1", "305"), ("2", "3.4", "298"))):
        for c, value in enumerate(row):
            table.cell(r, c).text = value
    doc.add_heading("Next visit", level=2)
    doc.add_paragraph("The next inspection of the Skua-3 station is due in September.")
    buf = io.BytesIO()
    doc.save(buf)
    path.write_bytes(_fixed_zip_dates(buf.getvalue()))


# The fact on slide 3 of the deck that tests look for.
SLIDE3_FACT = "The Skua-7 refit at Halifax costs 1,450 thousand euros."


def make_pptx(path: Path) -> None:
    """A 6-slide deck written by python-pptx on its default template: a title slide; bullets at two levels with
    speaker notes; a text box, a table and the layout's footer and slide-number placeholders (text that repeats
    on every slide); a group whose shapes sit out of z-order; a column chart; and a slide with no text at all."""
    from pptx import Presentation
    from pptx.chart.data import CategoryChartData
    from pptx.enum.chart import XL_CHART_TYPE
    from pptx.enum.shapes import PP_PLACEHOLDER
    from pptx.util import Inches

    deck = Presentation()
    deck.core_properties.created = FIXED_DATE.replace(tzinfo=None)
    deck.core_properties.modified = FIXED_DATE.replace(tzinfo=None)
    deck.core_properties.author = "Kestrel Marine Ltd"
    title_layout, bullets_layout, title_only, blank = (deck.slide_layouts[i] for i in (0, 1, 5, 6))

    slide = deck.slides.add_slide(title_layout)
    slide.shapes.title.text = "Skua-7 fleet briefing"
    slide.placeholders[1].text = "Operations review, March 2026"

    slide = deck.slides.add_slide(bullets_layout)
    slide.shapes.title.text = "Fleet status"
    body = slide.placeholders[1].text_frame
    body.text = "Twelve Skua-7 sonars are at sea."
    for text, level in (
        ("Nine run firmware 3.1.", 1),
        ("Three wait for a dock slot.", 1),
        ("No heading faults since May.", 0),
    ):
        para = body.add_paragraph()
        para.text, para.level = text, level
    slide.notes_slide.notes_text_frame.text = "Mention the Halifax dock delay."

    slide = deck.slides.add_slide(title_only)
    slide.shapes.title.text = "Service costs"
    box = slide.shapes.add_textbox(Inches(0.5), Inches(1.4), Inches(9), Inches(0.6))
    box.text_frame.text = SLIDE3_FACT
    rows = (("Site", "Refit (k EUR)", "Weeks"), ("Halifax", "1,450", "6"), ("Aberdeen", "980", "4"))
    table = slide.shapes.add_table(3, 3, Inches(0.5), Inches(2.2), Inches(9), Inches(1.2)).table
    for r, row in enumerate(rows):
        for c, value in enumerate(row):
            table.cell(r, c).text = value
    for placeholder in title_only.placeholders:  # as PowerPoint's "show footer" and "slide number" add them
        kind = placeholder.placeholder_format.type
        if kind in (PP_PLACEHOLDER.FOOTER, PP_PLACEHOLDER.SLIDE_NUMBER):
            slide.shapes.clone_placeholder(placeholder)
    for shape in slide.placeholders:
        if shape.placeholder_format.type == PP_PLACEHOLDER.FOOTER:
            shape.text = "Kestrel Marine confidential"
        elif shape.placeholder_format.type == PP_PLACEHOLDER.SLIDE_NUMBER:
            shape.text = "3"

    slide = deck.slides.add_slide(title_only)
    slide.shapes.title.text = "Next steps"
    group = slide.shapes.add_group_shape()
    later = group.shapes.add_textbox(Inches(0.5), Inches(3.0), Inches(9), Inches(0.6))  # drawn first, read second
    later.text_frame.text = "Then refit the three waiting sonars."
    first = group.shapes.add_textbox(Inches(0.5), Inches(1.5), Inches(9), Inches(0.6))
    first.text_frame.text = "First book the Halifax dock for June."

    slide = deck.slides.add_slide(title_only)
    slide.shapes.title.text = "Refits per year"
    data = CategoryChartData()
    data.categories = ["2024", "2025", "2026"]
    data.add_series("Halifax", (3, 5, 4))
    data.add_series("Aberdeen", (2, 2, 3.5))
    chart = slide.shapes.add_chart(
        XL_CHART_TYPE.COLUMN_CLUSTERED, Inches(1), Inches(1.5), Inches(8), Inches(5), data
    ).chart
    chart.has_title = True
    chart.chart_title.text_frame.text = "Refits by site"

    deck.slides.add_slide(blank)
    buf = io.BytesIO()
    deck.save(buf)
    path.write_bytes(_fixed_zip_dates(buf.getvalue()))


def make_locked_pptx(path: Path) -> None:
    """A one-slide deck that opens only with a password, as PowerPoint saves one: the package AES-encrypted inside
    an OLE compound file, by msoffcrypto-tool (Office's own "Agile" encryption). Its salt is random, so the file
    is written once and kept (running this again leaves it, and git, unchanged); msoffcrypto-tool is needed
    only to write it: ``pip install msoffcrypto-tool``."""
    if path.exists():
        return
    from msoffcrypto.format.ooxml import OOXMLFile
    from pptx import Presentation

    deck = Presentation()
    deck.core_properties.created = FIXED_DATE.replace(tzinfo=None)
    deck.core_properties.modified = FIXED_DATE.replace(tzinfo=None)
    slide = deck.slides.add_slide(deck.slide_layouts[5])
    slide.shapes.title.text = "Confidential: the Skua-9 tender price"
    plain = io.BytesIO()
    deck.save(plain)
    locked = io.BytesIO()
    OOXMLFile(io.BytesIO(_fixed_zip_dates(plain.getvalue()))).encrypt("deck-secret", locked)
    path.write_bytes(locked.getvalue())


def make_epub(path: Path) -> None:
    """A 3-chapter EPUB 3 book written by EbookLib: chapters with headings, a list and a table, a navigation
    document, and a spine whose order (intro, faults, maintenance) is not the manifest's. EbookLib stamps the
    time it wrote the book, so the file is written once and kept; EbookLib (AGPL-3.0) is needed only to write
    it, never by kvblend: ``pip install ebooklib``."""
    if path.exists():
        return
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("kestrel-tern4-handbook-2026")
    book.set_title("Tern-4 operator handbook")
    book.set_language("en")
    book.add_author("Kestrel Marine Ltd")
    intro = epub.EpubHtml(title="Introduction", file_name="intro.xhtml", lang="en")
    intro.content = (
        "<h1>Introduction</h1><p>The Tern-4 is a hull-mounted sonar built at the Tern Valley works.</p>"
        "<p>This handbook covers daily checks, maintenance and faults.</p>"
    )
    maintenance = epub.EpubHtml(title="Maintenance", file_name="maintenance.xhtml", lang="en")
    maintenance.content = (
        "<h1>Maintenance</h1><p>Clean the transducer window every 200 hours of operation.</p>"
        "<h2>Tools</h2><ul><li>A soft brush.</li><li>Fresh water, never solvent.</li></ul>"
        "<h2>Intervals</h2><table><tr><th>Part</th><th>Interval (h)</th></tr>"
        "<tr><td>Window</td><td>200</td></tr><tr><td>Shaft seals</td><td>1000</td></tr></table>"
    )
    faults = epub.EpubHtml(title="Faults", file_name="faults.xhtml", lang="en")
    faults.content = "<h1>Faults</h1><p>A red status light means the self-test failed: run it again.</p>"
    for chapter in (intro, maintenance, faults):
        book.add_item(chapter)
    book.toc = (intro, maintenance, faults)
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = ["nav", intro, faults, maintenance]
    epub.write_epub(str(path), book)


def make_xlsx(path: Path) -> None:
    """A workbook as Excel-compatible producers write it (XlsxWriter): a cost sheet of 30 rows with a header, a
    date column and a formula with its cached value, a hidden lookup sheet, a notes sheet and an empty one."""
    import xlsxwriter

    buffer = io.BytesIO()
    book = xlsxwriter.Workbook(buffer, {"in_memory": True})
    book.set_properties({"created": FIXED_DATE})
    dates = book.add_format({"num_format": "yyyy-mm-dd"})
    costs = book.add_worksheet("Service costs")
    costs.write_row(0, 0, ["Item", "Quarter", "Cost (EUR)", "Ordered"])
    items = ["Seal kit", "Impeller", "Bearing set", "Shaft sleeve", "Gasket pack", "Relief valve"]
    for i in range(30):
        item = items[i % len(items)]
        quarter = f"Q{i // 8 + 1}"
        cost = 1240.5 if (item, quarter) == ("Seal kit", "Q3") else round(80 + 37.25 * i, 2)
        costs.write_row(i + 1, 0, [item, quarter, cost])
        costs.write_datetime(i + 1, 3, dt.datetime(2026, 1, 5) + dt.timedelta(days=9 * i), dates)
    costs.write(31, 0, "Total")
    costs.write_formula(31, 2, "=SUM(C2:C31)", None, sum(
        1240.5 if (items[i % 6], f"Q{i // 8 + 1}") == ("Seal kit", "Q3") else round(80 + 37.25 * i, 2) for i in range(30)
    ))
    lookup = book.add_worksheet("Lookup")
    lookup.write_row(0, 0, ["internal", "rate table"])
    lookup.hide()
    notes = book.add_worksheet("Notes")
    notes.write(0, 0, "Costs exclude VAT. The seal kit price rose in Q3 after the supplier change.")
    book.add_worksheet("Empty")
    book.close()
    path.write_bytes(_fixed_zip_dates(buffer.getvalue()))


def _fixed_zip_dates(data: bytes) -> bytes:
    """The same zip with every member dated FIXED_DATE, so the file's bytes do not change from run to run (a
    chart's embedded workbook too: XlsxWriter stamps its creation time in it)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            fixed = zipfile.ZipInfo(info.filename, date_time=(2026, 1, 1, 0, 0, 0))
            fixed.compress_type = zipfile.ZIP_DEFLATED
            member = src.read(info.filename)
            if info.filename.endswith("/core.xml"):
                stamp = FIXED_DATE.strftime("%Y-%m-%dT%H:%M:%SZ")
                member = re.sub(rb"(<dcterms:(?:created|modified)[^>]*>)[^<]*", rb"\g<1>" + stamp.encode(), member)
            elif info.filename.endswith(".xlsx"):
                member = _fixed_zip_dates(member)
            dst.writestr(fixed, member)
    return out.getvalue()


WEB_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>How the Skua-7 sonar finds its heading | Kestrel Marine News</title>
  <meta name="description" content="Engineering notes on the Skua-7 sonar heading fault.">
  <link rel="stylesheet" href="/static/site.css">
  <script>window.dataLayer = window.dataLayer || []; function gtag(){dataLayer.push(arguments);}
  gtag('js', new Date()); gtag('config', 'G-TRACKER42');</script>
  <style>.cookie-banner { position: fixed; bottom: 0; } nav ul { display: flex; }</style>
</head>
<body>
  <div id="cookie-banner" class="cookie-banner" role="dialog">
    <p>We use cookies to improve your experience and for marketing. Accept all cookies?</p>
    <button>Accept all</button> <button>Manage preferences</button>
  </div>
  <header class="site-header">
    <a class="logo" href="/">Kestrel Marine News</a>
    <nav aria-label="Main">
      <ul>
        <li><a href="/">Home</a></li>
        <li><a href="/products">Products</a></li>
        <li><a href="/careers">Careers at Kestrel</a></li>
        <li><a href="/contact">Contact us</a></li>
      </ul>
    </nav>
  </header>
  <main>
    <article>
      <h1>How the Skua-7 sonar finds its heading</h1>
      <p class="byline">By R. Tallis, 3 February 2026</p>
      <p>The Skua-7 is a towed sonar that reports the heading of every contact it hears. Its heading comes from
      a fluxgate compass in the tow body, corrected for the magnetic field of the towing ship.</p>
      <h2>The heading fault</h2>
      <p>In 2025 a customer in Halifax reported headings that drifted by up to eight degrees during long turns.
      The cause was a compass calibration table that was written once at the factory and never updated at sea.</p>
      <h2>What the fix changes</h2>
      <p>Firmware 3.1 recalibrates the compass at sea. After an update the sonar does three things:</p>
      <ul>
        <li>It logs the compass deviation every ten minutes.</li>
        <li>It recomputes the calibration table after each full turn.</li>
        <li>It warns the operator when the deviation exceeds two degrees.</li>
      </ul>
      <h2>Measured drift</h2>
      <table>
        <thead><tr><th>Firmware</th><th>Mean drift (deg)</th><th>Worst drift (deg)</th></tr></thead>
        <tbody>
          <tr><td>3.0</td><td>4.6</td><td>8.1</td></tr>
          <tr><td>3.1</td><td>0.4</td><td>1.2</td></tr>
        </tbody>
      </table>
      <p>Owners can download firmware 3.1 from the service portal; the update takes about twenty minutes.</p>
    </article>
    <aside class="related">
      <h3>Related stories</h3>
      <ul><li><a href="/news/tern-4">Tern-4 enters service</a></li><li><a href="/news/awards">Awards night</a></li></ul>
    </aside>
  </main>
  <footer class="site-footer">
    <p>Copyright 2026 Kestrel Marine Ltd. All rights reserved.</p>
    <p><a href="/privacy">Privacy policy</a> | <a href="/terms">Terms of use</a> | Follow us on social media</p>
  </footer>
  <script src="/static/analytics.js"></script>
  <script>document.querySelector('#cookie-banner button').onclick = function () { this.parentNode.remove(); };</script>
</body>
</html>
"""

MARKDOWN = """# Tern-4 sonar: quick start

The Tern-4 is a hull-mounted sonar built at the Tern Valley works.

## Before the first dive

1. Check that the transducer window is clean.
2. Run the self-test from the operator console.

## Power

| Supply | Voltage | Current |
|---|---|---|
| Main | 24 V | 3 A |
| Backup | 12 V | 1 A |

The backup supply keeps the sonar listening for six hours.
"""


def main(out: Path = OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    make_manual_pdf(out / "manual.pdf")
    make_scanned_pdf(out / "scanned.pdf")
    make_encrypted_pdf(out / "encrypted.pdf")
    make_docx(out / "report.docx")
    make_pptx(out / "briefing.pptx")
    make_locked_pptx(out / "locked.pptx")
    make_epub(out / "handbook.epub")
    make_xlsx(out / "budget.xlsx")
    (out / "article.html").write_text(WEB_PAGE, encoding="utf-8")
    (out / "quickstart.md").write_text(MARKDOWN, encoding="utf-8")
    for p in sorted(out.iterdir()):
        print(f"{p.stat().st_size:>8,d}  {p}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
