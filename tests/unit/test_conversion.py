"""PDF, HTML, DOCX, PPTX, EPUB and Markdown documents (issue 32): the text each becomes, and each bad file skipped
in one line.

The good files are fixtures/documents/, written by real producers (fpdf2, python-docx, python-pptx, EbookLib;
scripts/make_fixtures.py).
The bad ones are made here from them: cut short, bytes flipped, a ZIP bomb, a 50 MB page, a wrong extension.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from document_helpers import DOCS, ENCRYPTED_CHAPTER, encryption_xml, make_bad_documents, with_member

from kvblend import conversion
from kvblend.documents import Document, Skipped, iter_documents
from kvblend.segmenter import find_headings
from support import REPO


def read_one(path: Path) -> Document:
    docs, skipped = iter_documents([path])
    assert skipped == [] and len(docs) == 1, skipped
    return docs[0]


def flat(text: str) -> str:
    """Whitespace runs as one space: a PDF wraps its lines where the page ends them."""
    return " ".join(text.split())


def marked_rows(doc: Document) -> dict[int, str]:
    """Each row number a sheet's document marks, with the pipe line it marks."""
    return {number: doc.text[at:].split("\n", 1)[0] for at, number in doc.row_marks}


def in_order(text: str, *parts: str) -> None:
    at = 0
    for part in parts:
        found = text.find(part, at)
        assert found >= 0, f"{part!r} missing after offset {at} in:\n{text}"
        at = found + len(part)


# ─────────────────────────────── good documents ───────────────────────────────


def test_pdf_has_headings_table_rows_list_and_its_pages():
    doc = read_one(DOCS / "manual.pdf")
    assert doc.format == "pdf"
    text = doc.text
    in_order(
        text,
        "# Orca pump series: service manual\n\n## Introduction\n\nThis manual covers",
        "\n\n## Specifications\n\nThe table below",
        "\nModel Flow (L/min) Pressure (kPa) Mass (kg)\nOrca-5 120 300 41\nOrca-7 180 412 58\nOrca-9 240 520 77\n",
        "\n\n## Operating limits\n\nEach pump",
        "\n\n## Safety checklist\n\nBefore any",
        "\n- Isolate the motor and lock the breaker open.\n- Close the suction and discharge valves.\n",
    )
    starts = doc.page_starts
    assert len(starts) == 4 and starts[0] == 0 and list(starts) == sorted(set(starts))
    for start in starts[1:]:
        assert text[start - 2 : start] == "\n\n" and not text[start].isspace()  # pages are paragraphs apart
    fact = "The Orca-7 pump's maximum pressure is 412 kPa."
    page3 = text[starts[2] : starts[3]]
    assert fact in flat(page3) and fact not in flat(text[: starts[2]] + text[starts[3] :])
    assert text[starts[1] :].startswith("## Specifications") and text[starts[3] :].startswith("## Safety checklist")


BODIES = [  # a page each: different text, as a real manual's pages are
    "Install the pump on a level base and bolt it down before connecting any pipe.",
    "Prime the casing with clean water; a dry start damages the shaft seal within seconds.",
    "Check the rotation: the arrow on the casing shows the direction the impeller must turn.",
    "Open the discharge valve slowly while watching the gauge, and stop at the rated pressure.",
    "Record the flow, the pressure and the motor current in the commissioning sheet.",
    "Inspect the seal every 500 hours and replace it at the first sign of a leak.",
]


RATINGS = [412, 300, 520, 180, 240, 96]


def running_pdf(path: Path, pages: int, numbering_from: int = 1) -> Path:
    """A PDF as real producers write them: a running header, a footer with the page number, one body per page."""
    from fpdf import FPDF

    class Manual(FPDF):
        def header(self):
            self.set_font("helvetica", size=9)
            self.cell(0, 8, "Kestrel Pumps Ltd - Orca service manual", align="C")
            self.ln(12)

        def footer(self):
            self.set_y(-15)
            self.set_font("helvetica", size=9)
            self.cell(0, 10, f"Page {self.page_no() + numbering_from - 1} of {{nb}}", align="C")

    pdf = Manual()
    pdf.alias_nb_pages()
    for body in BODIES[:pages]:
        pdf.add_page()
        pdf.set_font("helvetica", size=11)
        pdf.multi_cell(0, 6, body, new_x="LMARGIN", new_y="NEXT")
        # a last line that is numbered like the footer, but not by page: content, kept
        pdf.multi_cell(0, 6, f"Rated at {RATINGS[pdf.page_no() - 1]} kPa.", new_x="LMARGIN", new_y="NEXT")  # a body line that looks like a number
    pdf.output(str(path))
    return path


@pytest.mark.parametrize("numbering_from", [1, 7], ids=["numbered-from-1", "numbered-from-7"])
def test_running_headers_footers_and_page_numbers_leave_a_pdf(tmp_path, numbering_from):
    doc = read_one(running_pdf(tmp_path / "manual.pdf", 6, numbering_from))
    text, starts = doc.text, doc.page_starts
    assert text.count("Kestrel Pumps Ltd - Orca service manual") == 1  # the header kept once, on page 1
    assert text.startswith("Kestrel Pumps Ltd - Orca service manual\n")
    assert not re.search(r"^Page \d+ of \d+$", text, re.M), text  # every printed page number gone
    assert [int(n) for n in re.findall(r"^Rated at (\d+) kPa\.$", text, re.M)] == RATINGS
    assert len(starts) == 6
    for page, body in enumerate(BODIES):  # the pages still begin where their text begins
        end = starts[page + 1] if page + 1 < len(starts) else len(text)
        assert body in flat(text[starts[page] : end])
    assert all(text[start:].startswith("Install" if i == 0 else BODIES[i][:10]) for i, start in enumerate(starts) if i)


def test_numbered_headings_that_climb_with_the_pages_are_content_not_page_numbers(tmp_path):
    """A quiz with "Question N" atop page N, and a body line numbered by its page at each page's foot: their
    numbers follow the page index as a page number's do, but they are not written as one, and are kept."""
    from fpdf import FPDF

    pdf = FPDF()
    for n in range(1, 7):
        pdf.add_page()
        pdf.set_font("helvetica", size=11)
        pdf.multi_cell(0, 6, f"Question {n}", new_x="LMARGIN", new_y="NEXT")
        pdf.multi_cell(0, 6, f"Which city did expedition {n} reach first?", new_x="LMARGIN", new_y="NEXT")
        pdf.multi_cell(0, 6, f"{n + 10} teams took part in it.", new_x="LMARGIN", new_y="NEXT")
        pdf.multi_cell(0, 6, f"- {n} -", new_x="LMARGIN", new_y="NEXT")  # the printed page number: dropped
    pdf.output(str(tmp_path / "quiz.pdf"))
    doc = read_one(tmp_path / "quiz.pdf")
    assert [int(n) for n in re.findall(r"^Question (\d+)$", doc.text, re.M)] == [1, 2, 3, 4, 5, 6]
    assert [int(n) for n in re.findall(r"^(\d+) teams took part in it\.$", doc.text, re.M)] == [11, 12, 13, 14, 15, 16]
    assert not re.search(r"^- \d+ -$", doc.text, re.M), doc.text
    assert all(doc.text[start:].startswith(f"Question {i + 1}\n") for i, start in enumerate(doc.page_starts))


def _placed_pdf(path: Path, pages: list[list[tuple[str, str | None]]]) -> Path:
    """A PDF whose pages hold these lines top to bottom, each with the outline entry (bookmark) it starts, if any,
    and its page number at the foot."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_auto_page_break(False)
    for number, lines in enumerate(pages, 1):
        pdf.add_page()
        pdf.set_font("helvetica", size=11)
        for row, (text, bookmark) in enumerate(lines):
            if bookmark is not None:
                pdf.start_section(bookmark)
            pdf.set_xy(15, 20 + 8 * row)
            pdf.cell(0, 6, text)
        pdf.set_xy(15, 280)
        pdf.cell(0, 6, str(number))
    pdf.output(str(path))
    return path


def test_pdf_sections_come_from_the_outline_only_and_a_pages_values_stay(tmp_path):
    """A review's cases, each of which made answers cite the wrong section or lose a value: a bookmark whose
    title the page does not print ("Introduction" printed "1 Introduction") hid the next one ("Safety"); a
    heading every page repeats ("Specifications") was dropped as a running line; a listing's "# then install"
    became a section; and once bare numbers were known to be page numbers, a value ("42") at a page's foot
    went too."""
    from kvblend.segmenter import find_headings

    pages = [
        [("1 Introduction", "Introduction"), ("Intro body text.", None), ("Safety", "Safety"),
         ("Never open it under pressure.", None)],
        *([(f"Pump {n}", None), ("Specifications", "Specifications"), (f"Max pressure {n} bar.", None),
           ("# then install", None), ("apt-get install orca", None), ("Torque", None), (str(40 + n), None)]
          for n in range(2, 6)),
    ]
    doc = read_one(_placed_pdf(tmp_path / "catalogue.pdf", pages))
    titles = [h.title for h in find_headings(doc.text)]
    assert titles == ["Safety", *["Specifications"] * 4]
    assert [int(n) for n in re.findall(r"^(\d+)$", doc.text, re.M)] == [42, 43, 44, 45]  # values; no page number
    assert doc.text.count("then install") == 4


def test_a_short_pdf_keeps_every_line():
    """Two pages are too few to tell a running line from content: nothing is dropped."""
    pages = ["Orca manual\nFirst page text.\nPage 1", "Orca manual\nSecond page text.\nPage 2"]
    assert conversion._drop_running_lines(pages) == (pages, set())


def test_web_page_keeps_the_article_and_drops_the_boilerplate():
    doc = read_one(DOCS / "article.html")
    assert doc.format == "html" and doc.page_starts == ()
    text = doc.text
    in_order(
        text,
        "# How the Skua-7 sonar finds its heading\n\n",
        "The Skua-7 is a towed sonar",
        "\n\n## The heading fault\n\n",
        "\n\n## What the fix changes\n\n",
        "\n- It logs the compass deviation every ten minutes.\n- It recomputes",
        "\n\n## Measured drift\n\n",
        "| Firmware | Mean drift (deg) | Worst drift (deg) |\n|---|---|---|\n| 3.0 | 4.6 | 8.1 |\n| 3.1 | 0.4 | 1.2 |",
        "takes about twenty minutes.",
    )
    for boilerplate in (
        "cookies",
        "Accept all",
        "Careers",
        "Contact us",
        "Copyright",
        "Privacy policy",
        "Related stories",
        "Awards night",
        "gtag",
        "dataLayer",
        "querySelector",
        "cookie-banner",
    ):
        assert boilerplate not in text, boilerplate


def test_docx_has_headings_list_and_table_in_body_order():
    doc = read_one(DOCS / "report.docx")
    assert doc.format == "docx" and doc.page_starts == ()
    in_order(
        doc.text,
        "# Field service report: Skua-3 station\n\n",
        "Engineer A. Morven visited",
        "\n\n## Findings\n\n",
        "- Pump 1 bearing noise within limits.\n- Pump 2 shaft seal weeping; replaced.\n- Control panel",
        "\n\n## Measurements\n\n",
        "| Pump | Vibration (mm/s) | Pressure (kPa) |\n|---|---|---|\n| 1 | 2.1 | 305 |\n| 2 | 3.4 | 298 |",
        "\n\n## Next visit\n\n",
        "due in September.",
    )


W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def test_docx_text_in_content_controls_nested_tables_and_text_boxes_is_read(tmp_path):
    """Where Word keeps text that python-docx's top-level walk misses: a cover page's content control (w:sdt),
    a table nested in a cell, and a text box, here as Word writes one (DrawingML with a VML fallback copy of
    the same text, which must not come out twice)."""
    import docx
    from docx.oxml import parse_xml

    document = docx.Document()
    document.add_paragraph("Body text before.")
    body = document.element.body
    body.insert(len(body) - 1, parse_xml(
        f"<w:sdt {W}><w:sdtPr/><w:sdtContent><w:p><w:r><w:t>Warranty: seven years on the Skua-7.</w:t></w:r>"
        "</w:p></w:sdtContent></w:sdt>"))
    table = document.add_table(rows=2, cols=2)
    table.cell(0, 0).text, table.cell(0, 1).text, table.cell(1, 1).text = "Part", "Note", "outer"
    inner = table.cell(1, 0).add_table(rows=1, cols=2)
    inner.cell(0, 0).text, inner.cell(0, 1).text = "Seal kit", "code SK-42"
    anchor = document.add_paragraph("Callout: ")
    box = "<w:txbxContent><w:p><w:r><w:t>Torque the bolts to 40 Nm.</w:t></w:r></w:p></w:txbxContent>"
    anchor._p.append(parse_xml(
        f'<w:r {W} xmlns:mc="http://schemas.openxmlformats.org/markup-compatibility/2006" '
        'xmlns:wps="http://schemas.microsoft.com/office/word/2010/wordprocessingShape" xmlns:v="urn:schemas-microsoft-com:vml">'
        f'<mc:AlternateContent><mc:Choice Requires="wps"><w:drawing><wps:txbx>{box}</wps:txbx></w:drawing></mc:Choice>'
        f"<mc:Fallback><w:pict><v:shape><v:textbox>{box}</v:textbox></v:shape></w:pict></mc:Fallback>"
        "</mc:AlternateContent></w:r>"))
    document.add_paragraph("Body text after.")
    document.save(str(tmp_path / "cover.docx"))
    text = read_one(tmp_path / "cover.docx").text
    in_order(text, "Body text before.", "Warranty: seven years on the Skua-7.", "| Part | Note |",
             "| Seal kit; code SK-42 | outer |", "Callout:", "Torque the bolts to 40 Nm.", "Body text after.")
    assert text.count("Torque the bolts") == 1


def test_an_epub_missing_a_chapter_keeps_the_rest_and_a_percent_encoded_package_path_is_read(tmp_path):
    import zipfile

    book = (DOCS / "handbook.epub").read_bytes()
    whole = read_one(DOCS / "handbook.epub").text
    with zipfile.ZipFile(io.BytesIO(book)) as src:
        names = src.namelist()
        members = {n: src.read(n) for n in names}
    gap = io.BytesIO()  # the spine names EPUB/maintenance.xhtml; the ZIP lost it
    with zipfile.ZipFile(gap, "w") as dst:
        for n in names:
            if n != "EPUB/maintenance.xhtml":
                dst.writestr(n, members[n])
    (tmp_path / "gap.epub").write_bytes(gap.getvalue())
    text = read_one(tmp_path / "gap.epub").text  # the whole book was "corrupt EPUB (KeyError ...)"
    assert text == whole[: whole.index("# Maintenance")].strip()
    spaced = io.BytesIO()  # EPUB 3.3: full-path is a URL path, so a space in it is "%20"
    with zipfile.ZipFile(spaced, "w") as dst:
        for n in names:
            data = members[n].replace(b'full-path="EPUB/content.opf"', b'full-path="EPUB%20files/content.opf"')
            dst.writestr(n.replace("EPUB/", "EPUB files/"), data)
    (tmp_path / "spaced.epub").write_bytes(spaced.getvalue())
    assert read_one(tmp_path / "spaced.epub").text == whole


def test_a_duration_cell_reads_as_the_sheet_shows_it():
    import datetime as dt

    assert [conversion._cell(dt.timedelta(hours=h, minutes=m, seconds=s)) for h, m, s in
            [(26, 0, 0), (1, 30, 5), (0, -90, 0)]] == ["26:00", "1:30:05", "-1:30"]


def test_pptx_alternate_content_xy_charts_and_moved_groups_are_read_in_place(tmp_path):
    """A text box PowerPoint wraps in mc:AlternateContent (one holding an equation) was dropped, an XY chart's
    data too (python-pptx gives it no categories), and a group dragged up sorted where its shapes were drawn."""
    import copy

    from lxml import etree
    from pptx import Presentation
    from pptx.chart.data import XyChartData
    from pptx.enum.chart import XL_CHART_TYPE
    from pptx.util import Inches

    deck = Presentation()
    slide = deck.slides.add_slide(deck.slide_layouts[6])
    slide.shapes.add_textbox(Inches(1), Inches(2), Inches(4), Inches(1)).text_frame.text = "Second on the slide"
    group = slide.shapes.add_group_shape()
    group.shapes.add_textbox(Inches(1), Inches(5), Inches(4), Inches(1)).text_frame.text = "First on the slide"
    xfrm = group._element.grpSpPr.find("{http://schemas.openxmlformats.org/drawingml/2006/main}xfrm")
    xfrm.find("{http://schemas.openxmlformats.org/drawingml/2006/main}off").set("y", str(Inches(0.5)))
    box = slide.shapes.add_textbox(Inches(1), Inches(6), Inches(4), Inches(1))
    box.text_frame.text = "Flow rate Q equals v times A"
    mc = "http://schemas.openxmlformats.org/markup-compatibility/2006"
    tree, element = box._element.getparent(), box._element
    alternate = etree.SubElement(tree, f"{{{mc}}}AlternateContent", nsmap={"mc": mc})
    choice = etree.SubElement(alternate, f"{{{mc}}}Choice", Requires="a14")
    tree.remove(element)
    choice.append(element)
    etree.SubElement(alternate, f"{{{mc}}}Fallback").append(copy.deepcopy(element))
    data = XyChartData()
    series = data.add_series("Pressure")
    series.add_data_point(1, 10.5)
    series.add_data_point(2, 20.25)
    chart = deck.slides.add_slide(deck.slide_layouts[6]).shapes.add_chart(
        XL_CHART_TYPE.XY_SCATTER, Inches(1), Inches(1), Inches(6), Inches(4), data).chart
    chart.has_title = True
    chart.chart_title.text_frame.text = "Seal pressure"
    deck.save(str(tmp_path / "deck.pptx"))
    text = read_one(tmp_path / "deck.pptx").text
    in_order(text, "First on the slide", "Second on the slide", "Flow rate Q equals v times A",
             "Chart: Seal pressure", "| x | Pressure |\n|---|---|\n| 1 | 10.5 |\n| 2 | 20.25 |")
    assert text.count("Flow rate Q") == 1  # the choice, not its fallback copy too


def test_pptx_is_a_page_per_slide_with_titles_bullets_tables_charts_and_notes_in_reading_order():
    doc = read_one(DOCS / "briefing.pptx")
    assert doc.format == "pptx"
    text, starts = doc.text, doc.page_starts
    assert len(starts) == 6  # six slides, the last one without text
    slides = [text[a:b].strip() for a, b in zip(starts, [*starts[1:], len(text)])]
    assert slides[0] == "## Skua-7 fleet briefing\n\nOperations review, March 2026"
    assert slides[1] == (
        "## Fleet status\n\n- Twelve Skua-7 sonars are at sea.\n  - Nine run firmware 3.1.\n"
        "  - Three wait for a dock slot.\n- No heading faults since May.\n\nNotes: Mention the Halifax dock delay."
    )
    assert slides[2] == (
        "## Service costs\n\nThe Skua-7 refit at Halifax costs 1,450 thousand euros.\n\n"
        "| Site | Refit (k EUR) | Weeks |\n|---|---|---|\n| Halifax | 1,450 | 6 |\n| Aberdeen | 980 | 4 |"
    )  # the footer and the slide number on it are left out
    assert "confidential" not in text
    # the group's boxes by their place on the slide, not by the order they were drawn in
    assert slides[3] == "## Next steps\n\nFirst book the Halifax dock for June.\n\nThen refit the three waiting sonars."
    # a chart is its title and the numbers stored with it, a row per category and a column per series
    assert slides[4] == (
        "## Refits per year\n\nChart: Refits by site\n\n|  | Halifax | Aberdeen |\n|---|---|---|\n"
        "| 2024 | 3 | 2 |\n| 2025 | 5 | 2 |\n| 2026 | 4 | 3.5 |"
    )
    assert slides[5] == ""


def test_a_long_slide_table_repeats_its_header_over_every_block_and_drops_empty_columns(tmp_path):
    from pptx import Presentation
    from pptx.util import Inches

    deck = Presentation()
    slide = deck.slides.add_slide(deck.slide_layouts[5])
    slide.shapes.title.text = "Depths"
    table = slide.shapes.add_table(41, 4, Inches(0.5), Inches(1.5), Inches(9), Inches(5)).table
    for i in range(41):  # column 2 is a spacer, empty in every row
        for j, text in enumerate(["Pump", "Site", "", "Depth (m)"] if i == 0 else [f"P{i}", "Halifax", "", str(i)]):
            table.cell(i, j).text = text
    deck.save(tmp_path / "depths.pptx")
    text = read_one(tmp_path / "depths.pptx").text
    blocks = [b for b in text.split("\n\n") if b.startswith("|")]
    assert len(blocks) >= 2 and all(b.startswith("| Pump | Site | Depth (m) |\n|---|---|---|\n| P") for b in blocks)
    assert sum(b.count("\n") - 1 for b in blocks) == 40 and "|  |" not in text


def test_a_chart_that_cannot_be_read_costs_its_data_not_the_deck(monkeypatch):
    def unreadable(chart):
        raise NotImplementedError("a chart type python-pptx does not parse")

    monkeypatch.setattr(conversion, "_pptx_chart", unreadable)
    text = conversion.convert("pptx", (DOCS / "briefing.pptx").read_bytes()).text
    assert "## Refits per year" in text and "| 2026 |" not in text and "1,450 thousand euros" in text


def test_epub_is_its_chapters_in_spine_order_with_headings_lists_and_tables():
    doc = read_one(DOCS / "handbook.epub")
    assert doc.format == "epub" and doc.page_starts == ()  # reflowable: no pages, chapters name the sections
    assert doc.text == (
        "# Introduction\n\nThe Tern-4 is a hull-mounted sonar built at the Tern Valley works.\n\n"
        "This handbook covers daily checks, maintenance and faults.\n\n"
        "# Faults\n\nA red status light means the self-test failed: run it again.\n\n"  # the spine's order
        "# Maintenance\n\nClean the transducer window every 200 hours of operation.\n\n"
        "## Tools\n\n- A soft brush.\n- Fresh water, never solvent.\n\n"
        "## Intervals\n\n| Part | Interval (h) |\n| --- | --- |\n| Window | 200 |\n| Shaft seals | 1000 |"
    )  # the navigation document (the table of contents) is not read as a chapter


def test_epub_with_obfuscated_fonts_is_read_and_with_encrypted_chapters_is_refused():
    book = (DOCS / "handbook.epub").read_bytes()
    fonts = encryption_xml("http://www.idpf.org/2008/embedding", "EPUB/fonts/serif.otf")  # the standard allows it
    assert conversion.convert("epub", with_member(book, "META-INF/encryption.xml", fonts)).text.startswith("# Intro")
    for name, data in (("META-INF/encryption.xml", ENCRYPTED_CHAPTER), ("META-INF/rights.xml", b"<rights/>")):
        with pytest.raises(conversion.ConversionError, match=r"^encrypted EPUB \(DRM-protected\)$"):
            conversion.convert("epub", with_member(book, name, data))


def _odt_cell(text: str, typed: bool = True) -> str:
    kind = ' office:value-type="string"' if typed else ""
    return f"<table:table-cell{kind}><text:p>{text}</text:p></table:table-cell>"


def _odt_table(name: str, rows: list[list[str]], typed: bool = True) -> str:
    body = "".join("<table:table-row>" + "".join(_odt_cell(c, typed) if not c.startswith("<") else
                                                 f'<table:table-cell office:value-type="string">{c}</table:table-cell>'
                                                 for c in row) + "</table:table-row>" for row in rows)
    return f'<table:table table:name="{name}"><table:table-column table:number-columns-repeated="2"/>{body}</table:table>'


def test_odt_tables_in_list_items_untyped_or_nested_are_read(tmp_path):
    """A table in a list item (as pandoc writes) came out as its internal marker `- kvblend-odt-table-0`, its
    cells lost; one whose cells carry no value type (writers other than LibreOffice) vanished; one nested in a
    cell was an empty cell; a soft line break left a backslash."""
    import odfdo
    from odfdo import Element

    document = odfdo.Document("text")
    document.body.clear()
    for fragment in [
        "<text:p>Before.</text:p>",
        "<text:list><text:list-item><text:p>list item one</text:p>"
        + _odt_table("InList", [["colA", "colB"], ["LISTTABLE a", "b"]]) + "</text:list-item></text:list>",
        _odt_table("NoType", [["name", "value"], ["untyped cell", "42"]], typed=False),
        _odt_table("Outer", [["outer1", _odt_table("Inner", [["i1", "NESTED"]])], ["o3", "o4"]]),
        "<text:p>Soft<text:line-break/>break.</text:p>",
    ]:
        document.body.append(Element.from_tag(fragment))
    document.save(str(tmp_path / "t.odt"))
    text = read_one(tmp_path / "t.odt").text
    assert "kvblend-odt-table" not in text and "\\" not in text
    in_order(text, "Before.", "list item one", "| colA | colB |\n|---|---|\n| LISTTABLE a | b |",
             "| name | value |\n|---|---|\n| untyped cell | 42 |", "| outer1 | i1; NESTED |", "| o3 | o4 |",
             "Soft\nbreak.")


def test_xlsx_rows_are_read_as_the_file_holds_them_not_as_its_dimension_claims(tmp_path):
    """A writer's wrong <dimension ref="A1"/> cut the sheet to one cell; one cell far out (Z60000) padded each of
    its 60,000 rows to 26 columns, and the sheet was refused as too large."""
    import zipfile

    import openpyxl

    book = openpyxl.Workbook()
    book.active.title = "Parts"
    for row in [["part", "cost"], *([f"seal {i}", 10 + i] for i in range(5))]:
        book.active.append(row)
    book.save(tmp_path / "right.xlsx")
    with zipfile.ZipFile(tmp_path / "right.xlsx") as src, zipfile.ZipFile(tmp_path / "dim.xlsx", "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "xl/worksheets/sheet1.xml":
                data = re.sub(rb'<dimension ref="[^"]*"/>', b'<dimension ref="A1"/>', data)
            dst.writestr(item, data)
    assert read_one(tmp_path / "dim.xlsx").text == read_one(tmp_path / "right.xlsx").text
    assert "| seal 4 | 14 |" in read_one(tmp_path / "dim.xlsx").text
    sparse = openpyxl.Workbook()
    for cell, value in {"A1": "item", "B1": "qty", "A2": "bolt", "B2": 4, "Z60000": "end note"}.items():
        sparse.active[cell] = value
    sparse.save(tmp_path / "sparse.xlsx")
    doc = read_one(tmp_path / "sparse.xlsx")
    assert doc.text.endswith("| bolt | 4 |  |\n|  |  | end note |")
    assert [row for _, row in doc.row_marks] == [2, 60000]


def test_xlsx_is_its_visible_sheets_as_sections_with_the_header_over_every_block_of_rows():
    doc = read_one(DOCS / "budget.xlsx")
    assert doc.format == "xlsx" and doc.page_starts == ()
    text = doc.text
    in_order(
        text,
        "## Service costs\n\n| Item | Quarter | Cost (EUR) | Ordered |\n|---|---|---|---|\n| Seal kit | Q1 | 80 | 2026-01-05 |",
        "| Seal kit | Q3 | 1240.5 | 2026-06-16 |",  # a float as written, a date as a date
        "| Total |  | 19093.75 |  |",  # a formula's cached value
        "\n\n## Notes\n\nCosts exclude VAT.",  # one column: lines, not a table
    )
    # 31 rows under the header: blocks of at most 25 rows and TABLE_BLOCK_BYTES bytes, each under the header
    table = text.split("## Service costs\n\n")[1].split("\n\n## ")[0].split("\n\n")
    assert len(table) == 4 and all(len(b.encode()) <= conversion.TABLE_BLOCK_BYTES for b in table)
    assert all(b.startswith("| Item | Quarter | Cost (EUR) | Ordered |\n|---|---|---|---|\n| ") for b in table)
    assert sum(b.count("\n") - 1 for b in table) == 31
    assert "Lookup" not in text and "rate table" not in text and "Empty" not in text  # hidden, empty: left out
    # each data row marked with its row number in the sheet, so a segment cites "rows 2-26"; the notes are no rows
    rows = marked_rows(doc)
    assert list(rows) == list(range(2, 33)) and rows[2] == "| Seal kit | Q1 | 80 | 2026-01-05 |"
    assert rows[32] == "| Total |  | 19093.75 |  |"  # =SUM(C2:C31) is on row 32 of the sheet


def test_a_sheet_begun_at_b3_with_a_spacer_column_has_no_empty_columns_and_keeps_its_row_numbers(tmp_path):
    import openpyxl

    book = openpyxl.Workbook()
    sheet = book.active
    sheet.title = "Pumps"
    sheet["B3"], sheet["C3"], sheet["E3"] = "Pump", "Site", "Depth (m)"  # column D: a spacer, A: the margin
    for row in range(4, 10):
        sheet[f"B{row}"], sheet[f"C{row}"], sheet[f"E{row}"] = f"Orca-{row}", "Halifax", row * 10
    sheet["D12"] = "   "  # a cell of spaces is no value
    book.save(tmp_path / "pumps.xlsx")
    doc = read_one(tmp_path / "pumps.xlsx")
    assert doc.text.startswith("## Pumps\n\n| Pump | Site | Depth (m) |\n|---|---|---|\n| Orca-4 | Halifax | 40 |\n")
    assert "|  |" not in doc.text and doc.text.endswith("| Orca-9 | Halifax | 90 |")
    assert marked_rows(doc) == {row: f"| Orca-{row} | Halifax | {row * 10} |" for row in range(4, 10)}


def test_a_long_word_table_repeats_its_header_over_every_block(tmp_path):
    import docx

    document = docx.Document()
    table = document.add_table(rows=61, cols=3)
    for i, row in enumerate(table.rows):
        for j, cell in enumerate(row.cells):
            cell.text = ["Part", "Site", "Depth (m)"][j] if i == 0 else f"{['P', 'Halifax', ''][j]}{i}"
    document.save(tmp_path / "depths.docx")
    blocks = read_one(tmp_path / "depths.docx").text.split("\n\n")
    assert len(blocks) > 2 and all(b.startswith("| Part | Site | Depth (m) |\n|---|---|---|\n| P") for b in blocks)
    assert sum(b.count("\n") - 1 for b in blocks) == 60 and blocks[-1].endswith("| P60 | Halifax60 | 60 |")


def test_a_long_web_or_book_table_repeats_its_header_over_every_block():
    rows = "".join(f"<tr><td>Part {i}</td><td>{i * 3.5}</td><td>Halifax</td></tr>" for i in range(60))
    page = (
        "<!DOCTYPE html><html><body><nav>Home | About</nav><article><h1>Parts list</h1><p>All parts we stock, "
        "with prices, are listed below for the whole fleet.</p><table><tr><th>Part</th><th>Price</th><th>Site</th>"
        f"</tr>{rows}</table><p>Prices exclude VAT and shipping to any of the harbours.</p></article></body></html>"
    )
    text = conversion.convert("html", page.encode()).text
    tables = [b for b in text.split("\n\n") if b.startswith("|")]
    assert len(tables) > 2 and all(b.startswith("| Part | Price | Site |\n|---|---|---|\n| Part ") for b in tables)
    assert all(len(b.encode()) <= conversion.TABLE_BLOCK_BYTES for b in tables)
    assert sum(b.count("\n") - 1 for b in tables) == 60 and text.endswith("shipping to any of the harbours.")
    # markdownify's delimiter row (an EPUB chapter's tables) is a table too; a short table is left as it is
    book = "| a | b |\n| --- | --- |\n" + "".join(f"| {i} | {'x' * 40} |\n" for i in range(30)) + "\nAfter."
    assert conversion.block_tables(book).count("| a | b |\n| --- | --- |\n") > 2
    assert conversion.block_tables("| a | b |\n|---|---|\n| 1 | 2 |\n\nText.") == "| a | b |\n|---|---|\n| 1 | 2 |\n\nText."


def write_odt(path: Path) -> None:
    """An OpenDocument text as odfdo writes it (LibreOffice's format): headings, a list, a table."""
    from odfdo import Document, Header, List, Paragraph, Table

    document = Document("text")
    document.body.append(Header(1, "Orca-7 service notes"))
    document.body.append(Paragraph("The well-known pump_head holds 412 kPa; see item #3 (spares) * twice."))
    document.body.append(Header(2, "Spare parts"))
    document.body.append(List(["Seal kit", "Impeller"]))
    table = Table("Costs", width=2, height=3)
    table.set_values([["Part", "Cost"], ["Seal kit", "11.75"], ["Impeller", "1011.25"]])
    document.body.append(table)
    document.save(path)


def test_odt_has_headings_list_and_table_in_order_without_markdown_escapes(tmp_path):
    write_odt(tmp_path / "notes.odt")
    doc = read_one(tmp_path / "notes.odt")
    assert doc.format == "odt" and doc.page_starts == ()
    in_order(
        doc.text,
        "# Orca-7 service notes",
        "The well-known pump_head holds 412 kPa; see item #3 (spares) * twice.",  # odfdo wrote \- \_ \# \*
        "## Spare parts",
        "Seal kit",
        "Impeller",
        "| Part",
        "| Seal kit | 11.75",
    )
    assert "\\" not in doc.text
    (tmp_path / "notes.dat").write_bytes((tmp_path / "notes.odt").read_bytes())  # no extension: read by content
    assert read_one(tmp_path / "notes.dat").format == "odt"


def test_an_encrypted_odt_and_a_spreadsheet_named_odt_are_named(tmp_path):
    write_odt(tmp_path / "plain.odt")
    data = (tmp_path / "plain.odt").read_bytes()
    manifest = (
        b'<manifest:manifest xmlns:manifest="urn:oasis:names:tc:opendocument:xmlns:manifest:1.0">'
        b'<manifest:file-entry manifest:full-path="content.xml" manifest:media-type="text/xml">'
        b'<manifest:encryption-data manifest:checksum-type="SHA1/1K"/></manifest:file-entry></manifest:manifest>'
    )
    (tmp_path / "locked.odt").write_bytes(with_member(data, "META-INF/manifest.xml", manifest))
    sheet = with_member(data, "mimetype", b"application/vnd.oasis.opendocument.spreadsheet")
    (tmp_path / "sheet.ods").write_bytes(sheet)
    (tmp_path / "sheet.odt").write_bytes(sheet)
    docs, skipped = iter_documents([tmp_path / n for n in ("locked.odt", "sheet.ods", "sheet.odt")])
    assert [(d.name, d.format) for d in docs] == [("sheet.ods", "ods")]  # what its mimetype says: its table read
    assert [(Path(s.path).name, s.reason) for s in skipped] == [
        ("locked.odt", "encrypted ODT (password protected)"),
        ("sheet.odt", "not an ODT (content looks like an ODS)"),
    ]


def test_ods_is_its_visible_sheets_as_sections_with_the_header_over_every_block(tmp_path):
    import datetime as dt
    from decimal import Decimal

    from odfdo import Cell, Document, Row, Style, Table

    document = Document("spreadsheet")
    document.body.clear()
    hidden = Style("table", name="hidden")
    hidden.set_properties({"table:display": "false"}, area="table")
    document.insert_style(hidden, automatic=True)
    costs = Table("Service costs")
    costs.set_values(
        [["Item", "Cost (EUR)", "Ordered"]]
        + [[f"Part {i}", Decimal("80") + Decimal("37.25") * i, dt.date(2026, 1, 1 + i)] for i in range(30)]
    )
    empty_rows = Row(repeated=1_048_000)  # as Calc writes a sheet's unused rows: one row repeated
    empty_rows.set_cells([Cell()])
    costs.append(empty_rows)
    lookup = Table("Lookup", style="hidden")
    lookup.set_values([["rate table"], ["0.2"]])
    document.body.extend([costs, lookup])
    document.save(tmp_path / "budget.ods")
    doc = read_one(tmp_path / "budget.ods")
    assert doc.format == "ods" and doc.page_starts == ()
    blocks = doc.text.split("\n\n")
    assert blocks[0] == "## Service costs" and "rate table" not in doc.text  # the hidden sheet left out
    assert all(b.startswith("| Item | Cost (EUR) | Ordered |\n|---|---|---|\n| Part ") for b in blocks[1:])
    assert "| Part 0 | 80 | 2026-01-01 |" in doc.text and "| Part 29 | 1160.25 | 2026-01-30 |" in doc.text
    assert sum(b.count("\n") - 1 for b in blocks[1:]) == 30
    rows = marked_rows(doc)  # rows as Calc numbers them: the header is row 1
    assert list(rows) == list(range(2, 32)) and rows[31] == "| Part 29 | 1160.25 | 2026-01-30 |"


def test_a_markdown_table_too_long_for_a_segment_is_cut_under_its_header_but_not_in_a_code_sample(tmp_path):
    table = "| Option | Default |\n|---|---|\n" + "".join(f"| --option-{i} | {'x' * 30} |\n" for i in range(40))
    page = f"# Options\n\n{table}\nSee above.\n\n```text\n{table}```\n"
    (tmp_path / "options.md").write_text(page)
    text = read_one(tmp_path / "options.md").text
    body, sample = text.split("```text\n")
    assert sample == table + "```\n"  # a code sample is left as written
    blocks = [b for b in body.split("\n\n") if b.startswith("|")]
    assert len(blocks) > 2 and all(b.startswith("| Option | Default |\n|---|---|\n| --option-") for b in blocks)
    assert sum(b.count("\n") - 1 for b in blocks) == 40 and body.endswith("See above.\n\n")


def test_a_word_hyphenated_over_a_pdf_line_end_is_one_word_again(tmp_path):
    from fpdf import FPDF

    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("Helvetica", size=12)
    for line in ("The seal needs regular mainte-", "nance every six months, as the", "manual says."):
        pdf.cell(0, 8, line, new_x="LMARGIN", new_y="NEXT")
    pdf.output(str(tmp_path / "seal.pdf"))  # PDFium reads the first line's end as "mainte\x02nance"
    text = read_one(tmp_path / "seal.pdf").text
    assert "regular maintenance every six months" in text
    assert not any(ord(c) < 32 and c not in "\n\t" for c in text)


def test_an_archive_inside_the_folder_is_left_out_in_one_line(tmp_path):
    """`kvblend ingest . --archive ./kv` a second time: the archive's manifests, lock and index are no documents."""
    from kvblend.archive import Archive
    from kvblend.errors import UsageError

    (tmp_path / "notes.md").write_text("# Notes\n\nThe Tern-4 sonar left Halifax.\n")
    archive = Archive.open(tmp_path / "kv", create=True, model_name="m", model_fingerprint="f")
    archive.close()
    (tmp_path / "kv" / "documents").mkdir(exist_ok=True)
    (tmp_path / "kv" / "documents" / "abc.json").write_text('{"text": "a manifest"}')
    docs, skipped = iter_documents([tmp_path])
    assert [d.name for d in docs] == ["notes.md"]
    assert [(s.path, s.reason) for s in skipped] == [
        (f"{tmp_path.as_posix()}/kv/", "a kvblend archive (its files are no documents)")
    ]
    with pytest.raises(UsageError, match=r"kv is a kvblend archive, not a folder of documents$"):
        iter_documents([tmp_path / "kv"])


DOCBOOK = b"""<?xml version="1.0"?>
<!DOCTYPE article PUBLIC "-//OASIS//DTD DocBook XML V4.1.2//EN" "http://www.oasis-open.org/docbook/xml/4.1.2/docbookx.dtd" [
  <!ENTITY version "0.21">
]>
<article><articleinfo><title>Orca-7 service manual</title></articleinfo>
<sect1><title>Limits</title>
  <para>This is version &version; of the manual. The pump<indexterm><primary>pump</primary></indexterm> holds
  <emphasis>412 kPa</emphasis> as the standard<citation>ISO</citation> says.</para>
  <sect2><title>Spares</title><para>Order seal kits in pairs.</para></sect2>
</sect1>
<parts><part><name>Seal kit</name><cost>11.75</cost></part><part><name>Impeller</name><cost>1011.25</cost></part></parts>
</article>"""


def test_an_xml_document_is_its_text_with_headings_and_named_fields_not_its_tags(tmp_path):
    (tmp_path / "manual.xml").write_bytes(DOCBOOK)
    external = DOCBOOK.replace(b"]>", b'<!ENTITY host SYSTEM "file:///etc/hostname">]>').replace(b"pairs.", b"pairs.&host;")
    (tmp_path / "external.dbk").write_bytes(external)  # an external entity is never read: the rest of the text is
    (tmp_path / "feed.txt").write_bytes(b'<?xml version="1.0"?><rss><channel><title>Dock news</title></channel></rss>')
    (tmp_path / "page.xml").write_bytes(b'<?xml version="1.0"?>\n<!DOCTYPE html><html><body><p>An XHTML page.</p></body></html>')
    docs, skipped = iter_documents([tmp_path])
    assert skipped == []
    got = {d.name: d for d in docs}
    assert got["manual.xml"].format == "xml" and "<" not in got["manual.xml"].text
    in_order(
        got["manual.xml"].text,
        "# Orca-7 service manual",
        "# Limits",
        "This is version 0.21 of the manual. The pump holds 412 kPa as the standard [ISO] says.",  # entity, inline
        "## Spares\n\nOrder seal kits in pairs.",  # a section inside a titled one: one level down
        "name: Seal kit; cost: 11.75\n\nname: Impeller; cost: 1011.25",  # a record's fields keep their names
    )
    host = Path("/etc/hostname").read_text().strip() if Path("/etc/hostname").is_file() else "no-such-host"
    assert got["external.dbk"].format == "xml" and "Order seal kits in pairs." in got["external.dbk"].text
    assert host not in got["external.dbk"].text and "&" not in got["external.dbk"].text
    assert (got["feed.txt"].format, got["feed.txt"].text) == ("xml", "# Dock news")  # by its declaration
    assert got["page.xml"].format == "html"  # XHTML is a web page


def test_a_utf16_web_page_is_read_and_a_damaged_one_named(tmp_path):
    """Old Internet Explorer's and Word's "Save as: Unicode" pages: UTF-16 with a byte-order mark, and a
    <meta charset="utf-16"> that no longer holds once kvblend has decoded it."""
    page = (
        '<!DOCTYPE html><html><head><meta charset="utf-16"><title>Dock</title></head><body><nav>Home | About</nav>'
        "<article><h1>Dock log</h1><p>The Tern-4 sonar left Halifax on the 3rd, with the crème brûlée crew aboard "
        "and all gear checked twice.</p></article></body></html>"
    )
    (tmp_path / "le.html").write_bytes(b"\xff\xfe" + page.encode("utf-16-le"))
    (tmp_path / "be.htm").write_bytes(b"\xfe\xff" + page.encode("utf-16-be"))
    (tmp_path / "damaged.html").write_bytes(b"\xff\xfe" + page.encode("utf-16-le")[:-3] + b"\x00\xd8")
    docs, skipped = iter_documents([tmp_path])
    assert sorted(d.name for d in docs) == ["be.htm", "le.html"]
    assert all(d.format == "html" and "crème brûlée crew" in d.text and "Home" not in d.text for d in docs)
    assert [Path(s.path).name for s in skipped] == ["damaged.html"]
    assert skipped[0].reason == "not valid UTF-16 (damaged text after a UTF-16 byte-order mark)"


@pytest.mark.parametrize("head,encoding", [
    ("", "latin-1"),  # unlabelled Western page: Windows-1252, as browsers assume (trafilatura guessed cp1250)
    ('<meta charset="utf-8">', "latin-1"),  # a label its bytes are not: read as if unlabelled
    ('<meta http-equiv="Content-Type" content="text/html; charset=iso-8859-1">', "cp1252"),  # WHATWG: cp1252
    ('<meta charset="koi8-r">', "koi8-r"),  # a label its bytes are: believed
    ("<!-- x -->" * 500 + '<meta charset="windows-1252">', "cp1252"),  # a label past 4 KiB: lxml read it too
], ids=["unlabelled", "mislabelled-utf8", "latin1-label", "koi8r-label", "late-label"])
def test_a_web_page_is_decoded_as_a_browser_decodes_it(tmp_path, head, encoding):
    body = "Le café naïve de ma grand-mère était très célèbre à Paris, “disait-on” – et ses crêpes aussi."
    if encoding == "koi8-r":
        body = "Бабушкино кафе было очень известно в Париже, и её блины тоже были известны всем."
    elif encoding == "latin-1":
        body = body.replace("“", '"').replace("”", '"').replace("–", "-")
    page = f"<!DOCTYPE html><html><head>{head}<title>Souvenirs</title></head><body><article><h1>Souvenirs</h1>" \
           f"<p>{body}</p></article></body></html>"
    (tmp_path / "page.html").write_bytes(page.encode(encoding))
    assert body in flat(read_one(tmp_path / "page.html").text)


@pytest.mark.parametrize("meta", ["", '<meta charset="utf-8">'])
def test_a_short_unlabelled_latin1_page_is_not_read_as_central_european(tmp_path, meta):
    """The review's page: trafilatura's own guess read it as cp1250 ("grand-mčre", "ŕ Paris")."""
    text = "Le café naïve de ma grand-mère était très célèbre à Paris. Les crêpes étaient délicieuses."
    (tmp_path / "p.html").write_bytes(f"<html><head>{meta}</head><body><p>{text}</p></body></html>".encode("latin-1"))
    assert read_one(tmp_path / "p.html").text == text


def test_a_feeds_html_descriptions_are_read_as_html_not_as_tags(tmp_path):
    """RSS carries each item's HTML as text (escaped, or in CDATA): its tags came out in the text."""
    feed = (
        '<?xml version="1.0" encoding="UTF-8"?><rss version="2.0" xmlns:content="http://purl.org/rss/1.0/modules/'
        'content/"><channel><title>Orca blog</title><item><title>Seal kits</title><description>&lt;p&gt;Seal kits '
        'now ship &lt;b&gt;boxed&lt;/b&gt;.&lt;/p&gt;&lt;img src="a.png"/&gt;</description><content:encoded>'
        '<![CDATA[<p>Full article: <a href="https://x">kits</a> are <em>here</em>.</p>]]></content:encoded>'
        "</item></channel></rss>"
    )
    (tmp_path / "feed.xml").write_text(feed)
    text = read_one(tmp_path / "feed.xml").text
    in_order(text, "# Orca blog", "## Seal kits", "Seal kits now ship boxed.", "Full article: kits are here.")
    assert "<" not in text and "&lt;" not in text


def test_review_cases_wide_tables_xml_siblings_and_entities_an_odt_bomb_and_fences(tmp_path):
    # a header too wide for a block's budget: blocks of 25 rows, not the header over every row
    header = ",".join(f"column name number {i}" for i in range(30))
    wide = conversion.delimited_table(header + "\n" + "".join(",".join("x" * 30) + "\n" for _ in range(30)), "csv").text
    assert len(wide.split("\n\n")) == 2
    # paragraphs of one name are paragraphs, not a record's fields; an HTML entity from an unread DTD is its char
    xml = (
        b'<?xml version="1.0"?><!DOCTYPE a PUBLIC "-//OASIS//DTD DocBook XML V4.5//EN" "docbookx.dtd">'
        b"<a><sect><para>Yes, it works.</para><para>Run it twice.</para></sect><p>A&mdash;B</p></a>"
    )
    assert conversion.convert("xml", xml).text == "Yes, it works.\n\nRun it twice.\n\nA\u2014B"
    # an ODT table row repeated 100,000 times x 20 columns: refused before any value is read
    from odfdo import Cell, Document, Row, Table

    document = Document("text")
    table = Table("T", width=20, height=1)
    table.set_values([[f"v{i}" for i in range(20)]])
    row = Row(repeated=100_000)
    row.set_cells([Cell(value="full") for _ in range(20)])
    table.append(row)
    document.body.append(table)
    document.save(tmp_path / "bomb.odt")
    with pytest.raises(conversion.ConversionError, match=r"^too large for ODT \(over 1,000,000 cells\)$"):
        conversion.convert("odt", (tmp_path / "bomb.odt").read_bytes())
    # "```python" inside an open fence is code, not its end: the table after the real end is still cut
    rows = "".join(f"| {i} | {'x' * 40} |\n" for i in range(30))
    page = "```\n```python\n```\n\n| a | b |\n|---|---|\n" + rows
    assert conversion.block_tables(page).count("| a | b |\n|---|---|\n") > 2


def test_gzip_files_are_read_as_what_they_hold(tmp_path):
    """Debian's docs, datasets' corpus.jsonl.gz, a manual.pdf.gz: the inner name's extension says what it is."""
    import gzip

    (tmp_path / "quickstart.md.gz").write_bytes(gzip.compress((DOCS / "quickstart.md").read_bytes()))
    (tmp_path / "corpus.jsonl.gz").write_bytes(gzip.compress(b'{"text": "first record"}\n{"text": "second"}\n'))
    (tmp_path / "manual.pdf.gz").write_bytes(gzip.compress((DOCS / "manual.pdf").read_bytes()))
    two = gzip.compress("Changes in 1.1.\n".encode()) + gzip.compress("Changes in 1.0.\n".encode())
    (tmp_path / "changelog.gz").write_bytes(two)  # two members, as `gzip -c a >> f` leaves: zcat reads both
    docs, skipped = iter_documents([tmp_path])
    assert skipped == []
    got = {d.name: d for d in docs}
    assert got["quickstart.md.gz"].format == "markdown"
    assert got["quickstart.md.gz"].text == read_one(DOCS / "quickstart.md").text
    assert [d.text for d in docs if d.name.startswith("corpus.jsonl.gz")] == ["first record", "second"]
    assert got["manual.pdf.gz"].format == "pdf" and len(got["manual.pdf.gz"].page_starts) == 4
    assert got["changelog.gz"].text == "Changes in 1.1.\nChanges in 1.0.\n"


def test_csv_is_pipe_rows_under_its_header_repeated_every_block_of_rows(tmp_path):
    import csv

    with open(tmp_path / "parts.csv", "w", newline="", encoding="utf-8") as f:  # Python's csv: RFC 4180 quoting
        writer = csv.writer(f)
        writer.writerow(["Part", "Note", "Cost"])
        writer.writerow(["Seal kit", "fits Orca-7, Orca-9", "11.75"])  # a quoted comma
        writer.writerow(["Pump", "rated 412 kPa\nat full flow", "412"])  # a quoted line break
        writer.writerow([])  # an empty row: dropped
        writer.writerows([[f"Spare {i}", "", str(i)] for i in range(28)])
    doc = read_one(tmp_path / "parts.csv")
    assert doc.format == "csv" and doc.page_starts == ()
    in_order(
        doc.text,
        "| Part | Note | Cost |\n|---|---|---|\n| Seal kit | fits Orca-7, Orca-9 | 11.75 |",
        "| Pump | rated 412 kPa at full flow | 412 |",
        "| Spare 27 |  | 27 |",
    )
    blocks = doc.text.split("\n\n")  # 30 rows: more than one block, each under the header
    assert len(blocks) >= 2 and all(b.startswith("| Part | Note | Cost |\n|---|---|---|\n| ") for b in blocks)
    assert "," not in doc.text.replace("Orca-7, Orca-9", "")
    # rows numbered as a spreadsheet opening the file numbers them: a record's quoted line break starts no row,
    # the empty row 4 keeps its number, and a repeated header is no row
    rows = marked_rows(doc)
    assert list(rows) == [2, 3, *range(5, 33)] and rows[3] == "| Pump | rated 412 kPa at full flow | 412 |"
    assert rows[5] == "| Spare 0 |  | 0 |" and rows[32] == "| Spare 27 |  | 27 |"
    # wide rows: blocks close at TABLE_BLOCK_BYTES, before 25 rows, each under the header again
    wide = conversion.delimited_table("a,b\n" + "".join(f"{i},{'x' * 60}\n" for i in range(30)), "csv").text
    blocks = wide.split("\n\n")
    assert len(blocks) > 4 and all(b.startswith("| a | b |\n|---|---|\n| ") for b in blocks)
    assert all(len(b.encode()) <= conversion.TABLE_BLOCK_BYTES for b in blocks)


def test_a_european_excel_csv_and_a_tsv_are_tables_too(tmp_path):
    # Excel where the decimal mark is a comma: ";" between fields, Windows-1252 without a byte-order mark
    (tmp_path / "kosten.csv").write_bytes("Teil;Preis (€);Größe\r\nDichtung;11,75;klein\r\nPumpe;412,00;groß\r\n".encode("cp1252"))
    (tmp_path / "depths.tsv").write_text("site\tdepth m\nHalifax\t210\n")
    (tmp_path / "names.csv").write_text("Ada Lovelace\nGrace Hopper\n")  # one column: lines, not a table
    docs, skipped = iter_documents([tmp_path])
    assert skipped == []
    by_name = {d.name: d for d in docs}
    kosten = by_name["kosten.csv"]
    assert (kosten.format, kosten.encoding) == ("csv", "cp1252")
    assert kosten.text == "| Teil | Preis (€) | Größe |\n|---|---|---|\n| Dichtung | 11,75 | klein |\n| Pumpe | 412,00 | groß |"
    assert by_name["depths.tsv"].format == "tsv"
    assert by_name["depths.tsv"].text == "| site | depth m |\n|---|---|\n| Halifax | 210 |"
    assert by_name["names.csv"].text == "Ada Lovelace\nGrace Hopper"


def test_an_excel_csv_that_names_its_delimiter_on_a_sep_line_is_read_by_it(tmp_path):
    """Excel's first line `sep=;` is a setting, not the header (it became `| sep= |  |` over the real one)."""
    (tmp_path / "k.csv").write_bytes(b"sep=;\r\nPart;Price\r\nSeal;11,75\r\nPump;412,00\r\n")
    doc = read_one(tmp_path / "k.csv")
    assert doc.text == "| Part | Price |\n|---|---|\n| Seal | 11,75 |\n| Pump | 412,00 |"
    assert [row for _, row in doc.row_marks] == [2, 3]  # as Excel numbers them, the sep line not shown


def test_a_csv_too_large_or_with_a_field_csv_cannot_hold_is_skipped_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "huge_field.csv").write_text('a,b\n1,"' + "x" * 200_000 + '"\n')
    (tmp_path / "many.csv").write_text("a,b\n" + "1,2\n" * 60)
    monkeypatch.setattr(conversion, "MAX_TABLE_CELLS", 100)
    docs, skipped = iter_documents([tmp_path])
    assert docs == []
    assert sorted((Path(s.path).name, s.reason) for s in skipped) == [
        ("huge_field.csv", "corrupt CSV (Error: field larger than field limit (131072))"),
        ("many.csv", "too large for CSV (over 100 cells)"),
    ]


def test_markdown_and_text_are_read_unchanged(tmp_path):
    md = read_one(DOCS / "quickstart.md")
    assert md.format == "markdown" and md.text == (DOCS / "quickstart.md").read_text(encoding="utf-8")
    assert md.page_starts == ()
    (tmp_path / "notes.txt").write_text("A <p> tag in a note is only text.\n")
    (tmp_path / "notes.markdown").write_text("<!DOCTYPE html> in Markdown stays Markdown\n")
    (tmp_path / "rec.jsonl").write_text(json.dumps({"text": "a record"}) + "\n")
    docs, _ = iter_documents([tmp_path])
    assert [(d.name, d.format, d.text) for d in docs] == [
        ("notes.markdown", "markdown", "<!DOCTYPE html> in Markdown stays Markdown\n"),
        ("notes.txt", "text", "A <p> tag in a note is only text.\n"),
        ("rec.jsonl#L1", "json", "a record"),
    ]


def test_format_comes_from_content_when_the_extension_says_nothing(tmp_path):
    (tmp_path / "manual").write_bytes((DOCS / "manual.pdf").read_bytes())
    (tmp_path / "report.dat").write_bytes((DOCS / "report.docx").read_bytes())
    (tmp_path / "deck").write_bytes((DOCS / "briefing.pptx").read_bytes())
    (tmp_path / "book.zip").write_bytes((DOCS / "handbook.epub").read_bytes())
    saved = "<!-- saved from url=(0022)https://example.com/ -->\n" + (DOCS / "article.html").read_text()
    (tmp_path / "page.txt").write_text(saved)
    docs, skipped = iter_documents([tmp_path])
    assert skipped == []
    assert {d.name: d.format for d in docs} == {
        "book.zip": "epub",
        "deck": "pptx",
        "manual": "pdf",
        "page.txt": "html",
        "report.dat": "docx",
    }
    assert "## Measured drift" in next(d for d in docs if d.name == "page.txt").text


def test_html_in_another_charset_and_a_short_page(tmp_path):
    page = (
        '<html><head><meta charset="iso-8859-1"></head><body><p>Caf\xe9 cr\xe8me at the Tern works.</p></body></html>'
    )
    (tmp_path / "latin.html").write_bytes(page.encode("latin-1"))
    (tmp_path / "short.htm").write_text("<p>Just one line.</p>")
    docs, skipped = iter_documents([tmp_path])
    assert skipped == []
    assert [(d.name, d.text) for d in docs] == [
        ("latin.html", "Café crème at the Tern works."),
        ("short.htm", "Just one line."),
    ]


def test_heavy_converters_are_imported_only_when_needed():
    """Plain-text ingest and `kvblend --help` never import a converter (trafilatura alone is 0.2 s)."""
    code = (
        "import sys; from pathlib import Path; from kvblend.documents import iter_documents;"
        "docs, _ = iter_documents([Path(sys.argv[1])]); assert len(docs) == 12;"
        "heavy = ('pypdfium2', 'trafilatura', 'docx', 'pptx', 'olefile', 'bs4', 'markdownify', 'lxml', 'openpyxl',"
        " 'charset_normalizer');"
        "print([m for m in heavy if m in sys.modules])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "kvblend" / "data" / "docs")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.strip() == "[]"


# ─────────────────────────────── bad documents ───────────────────────────────


def test_each_bad_document_is_skipped_with_its_reason_and_the_rest_is_read(tmp_path, capfd):
    expected = make_bad_documents(tmp_path / "in")
    (tmp_path / "in" / "good.md").write_text("A good document.")
    docs, skipped = iter_documents([tmp_path / "in"])
    assert [d.name for d in docs] == ["good.md"]
    reasons = {Path(s.path).name: s.reason for s in skipped}
    assert sorted(reasons) == sorted(expected)
    for name, pattern in expected.items():
        assert re.search(pattern, reasons[name]), (name, reasons[name])
        assert "\n" not in reasons[name]
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # no converter printed a word of its own


@pytest.mark.parametrize("fmt,fixture", [("docx", "report.docx"), ("pptx", "briefing.pptx"), ("xlsx", "budget.xlsx")])
def test_zip_bomb_is_refused_by_its_declared_total_too(monkeypatch, fmt, fixture):
    """Parts that are each plausible but add up past the cap: refused before anything is inflated."""
    monkeypatch.setattr(conversion, "MAX_ZIP_UNCOMPRESSED_BYTES", 15_000)
    data = (DOCS / fixture).read_bytes()
    what = fmt.upper()
    with pytest.raises(conversion.ConversionError, match=rf"^{what} would inflate to over 0 MiB \(a ZIP bomb\?\)"):
        conversion.convert(fmt, data)


def test_a_converter_that_raises_or_runs_long_costs_one_line_not_the_run(tmp_path, monkeypatch):
    (tmp_path / "a.html").write_text("<html><body><p>A page.</p></body></html>")
    (tmp_path / "b.pdf").write_bytes((DOCS / "manual.pdf").read_bytes())
    (tmp_path / "c.md").write_text("still read")

    def explode(data: bytes, started: float) -> conversion.Converted:
        raise KeyError("[Content_Types].xml")

    monkeypatch.setattr(conversion, "_convert_html", explode)
    monkeypatch.setattr(conversion, "MAX_CONVERT_SECONDS", -1.0)
    docs, skipped = iter_documents([tmp_path])
    assert [d.text for d in docs] == ["still read"]
    p = tmp_path.as_posix()
    assert skipped == [
        Skipped(f"{p}/a.html", "cannot be read as HTML (KeyError: '[Content_Types].xml')"),
        Skipped(f"{p}/b.pdf", "took longer than -1 s to convert"),
    ]


@pytest.mark.parametrize(
    "value, shown",
    [(4.0, "4"), (3.5, "3.5"), (1234567.89, "1234567.89"), (0.1 + 0.2, "0.3"), (None, ""), (True, "TRUE"),
     (7, "7"), ("  two\nlines ", "two lines")],
)
def test_a_cell_or_chart_value_is_shown_as_excel_shows_it(value, shown):
    """15 significant digits, as Excel: a chart's 1234567.89 was written 1.23457e+06 (`%g`) before."""
    assert conversion._cell(value) == shown


def test_a_date_cell_is_a_date_and_a_timestamp_keeps_its_time():
    import datetime as dt

    assert conversion._cell(dt.datetime(2026, 6, 16)) == "2026-06-16"
    assert conversion._cell(dt.datetime(2026, 6, 16, 9, 30)) == "2026-06-16 09:30:00"
    assert conversion._cell(dt.time(9, 30)) == "09:30:00"


@pytest.mark.parametrize(
    "page, text",
    [
        (  # Jekyll/Docusaurus: YAML; the title becomes the heading, the description a paragraph, the rest goes
            "---\ntitle: Installing the pump\nlayout: post\ntags: [pump, install]\ndraft: false\n"
            "description: Bolt it down, then prime it.\n---\n\nLevel the base first.\n",
            "# Installing the pump\n\nBolt it down, then prime it.\n\nLevel the base first.\n",
        ),
        (  # the body has its own title: only the description is added
            "---\ntitle: Pump\nsummary: Service notes.\n---\n# Orca pump\n\nText.\n",
            "Service notes.\n\n# Orca pump\n\nText.\n",
        ),
        (  # Hugo: TOML between +++
            '+++\ntitle = "Faults"\ndate = 2024-01-02\n+++\nA red light means the self-test failed.\n',
            "# Faults\n\nA red light means the self-test failed.\n",
        ),
        ("---\ntags: [a]\n---\nBody only.\n", "Body only.\n"),  # nothing to keep but the body
        # titles YAML reads as a number or a date: the text the author wrote (they were dropped)
        ("---\ntitle: 1984\ndescription: 2024-01-01\n---\nA novel.\n", "# 1984\n\n2024-01-01\n\nA novel.\n"),
        ("---\ntitle: true\n---\nA flag is no title.\n", "A flag is no title.\n"),
    ],
    ids=["yaml", "own-heading", "toml", "settings-only", "number-and-date", "boolean"],
)
def test_markdown_front_matter_becomes_its_title_and_description(tmp_path, page, text):
    f = tmp_path / "page.md"
    f.write_text(page, encoding="utf-8")
    assert read_one(f).text == text


@pytest.mark.parametrize(
    "page",
    [
        "---\nJust a rule above a paragraph.\n---\nAnd text.\n",  # thematic breaks, not a mapping
        "---\n!!python/object/apply:os.system ['echo unsafe']\n---\nText.\n",  # never constructed: left as text
        "Intro\n---\ntitle: not front matter\n---\n",  # not at the start
        "---\ntitle: [unclosed\n---\nText.\n",  # not YAML
    ],
    ids=["rules", "python-tag", "not-first", "bad-yaml"],
)
def test_text_that_only_looks_like_front_matter_is_kept_as_it_is(page):
    assert conversion.markdown_body(page) == page


def email_bytes(html_only: bool = False) -> bytes:
    """A message as a mail client exports it (Python's email package writes it): an RFC 2047 subject, a plain
    and an HTML alternative (or HTML only), and a PDF attachment."""
    from email.message import EmailMessage

    msg = EmailMessage()
    msg["From"] = "Ada Lovelace <ada@kestrel.example>"
    msg["To"] = "service@kestrel.example"
    msg["Subject"] = "Réparation: Orca-7 seal leaks"  # non-ASCII: encoded as RFC 2047 words
    msg["Date"] = "Tue, 03 Nov 2026 09:30:00 +0000"
    html = "<html><body><h2>Leak report</h2><table><tr><td>Pump</td><td>Orca-7</td></tr></table></body></html>"
    if html_only:
        msg.set_content(html, subtype="html")
    else:
        msg.set_content("The Orca-7 seal leaks after 400 hours.\nPlease send a seal kit.\n")
        msg.add_alternative(html, subtype="html")
    msg.add_attachment(b"%PDF-1.7 ...", maintype="application", subtype="pdf", filename="photos.pdf")
    return bytes(msg)


def test_an_email_is_its_subject_its_people_and_its_body(tmp_path):
    (tmp_path / "leak.eml").write_bytes(email_bytes())
    doc = read_one(tmp_path / "leak.eml")
    assert doc.format == "eml"
    assert doc.text == (
        "# Réparation: Orca-7 seal leaks\n\n"
        "From: Ada Lovelace <ada@kestrel.example>\nTo: service@kestrel.example\nDate: Tue, 03 Nov 2026 09:30:00 +0000\n\n"
        "The Orca-7 seal leaks after 400 hours.\nPlease send a seal kit.\n\n"
        "Attachments: photos.pdf (not read: truncated PDF (no %%EOF end marker: the file was cut short))"
    )  # the plain part, as a reader's client shows it; an attachment it cannot read named with its reason


def test_an_emails_attachments_are_read_under_their_names_and_those_it_cannot_read_say_why(tmp_path):
    from email import message_from_bytes, policy

    msg = message_from_bytes(email_bytes(), policy=policy.default)
    msg.add_attachment((DOCS / "manual.pdf").read_bytes(), maintype="application", subtype="pdf",
                       filename="manual.pdf")
    msg.add_attachment("Part;Cost (EUR)\nSeal kit;11,75\n".encode("cp1252"), maintype="text", subtype="csv",
                       filename="parts.csv")
    msg.add_attachment((DOCS / "encrypted.pdf").read_bytes(), maintype="application", subtype="pdf",
                       filename="locked.pdf")
    msg.add_attachment(b"\x89PNG\r\n\x1a\n" + bytes(64), maintype="image", subtype="png", filename="leak.png")
    msg.add_attachment(email_bytes(), maintype="application", subtype="octet-stream", filename="earlier.eml")
    (tmp_path / "leak.eml").write_bytes(bytes(msg))
    doc = read_one(tmp_path / "leak.eml")
    in_order(
        doc.text,
        "Attachments: photos.pdf (not read: truncated PDF",
        ", manual.pdf, parts.csv, locked.pdf (not read: encrypted PDF (password protected)), leak.png, "
        "earlier.eml (not read: a message inside the message)",
        "## Attachment: manual.pdf\n\n",
        "412 kPa",  # the manual's page 3, as the PDF alone reads
        "## Attachment: parts.csv\n\n| Part | Cost (EUR) |\n|---|---|\n| Seal kit | 11,75 |",
    )
    assert "PNG" not in doc.text and doc.text.count("## Attachment:") == 2


def mailbox_file(path: Path, messages: list) -> Path:
    """An mbox as Python's `mailbox` writes one (the From_ lines, a body's "From " escaped as ">From ")."""
    import mailbox

    box = mailbox.mbox(path)
    box.lock()
    try:
        for msg in messages:
            box.add(msg)
        box.flush()
    finally:
        box.unlock()
        box.close()
    return path


def plain_message(subject: str, body: str, attachment: tuple[str, bytes] | None = None):
    from email.message import EmailMessage

    msg = EmailMessage()
    msg["From"], msg["To"], msg["Subject"] = "Ada <ada@kestrel.example>", "list@kestrel.example", subject
    msg["Date"] = "Tue, 03 Nov 2026 09:30:00 +0000"
    msg.set_content(body)
    if attachment:
        msg.add_attachment(attachment[1], maintype="text", subtype="csv", filename=attachment[0])
    return msg


def test_signed_single_part_and_split_messages_keep_their_text_and_attachments(tmp_path):
    """Three shapes mail clients send that lost text: an S/MIME-signed message (its attachment sat one level
    down, inside the part signed), a scanner's message that is one attached file, and Apple Mail's body split
    around an inline file (the text after the file was dropped)."""
    from email.message import EmailMessage
    from email.mime.application import MIMEApplication
    from email.mime.multipart import MIMEMultipart
    from email.mime.text import MIMEText

    def headed(msg, subject):
        msg["Subject"], msg["From"], msg["To"] = subject, "a@example.com", "b@example.com"
        return msg

    signed_part = MIMEMultipart("mixed")
    signed_part.attach(MIMEText("See the attached parts list.", "plain"))
    parts = MIMEText("Seal kit part number 4711 costs 11.75 EUR.", "plain")
    parts.add_header("Content-Disposition", "attachment", filename="parts.txt")
    signed_part.attach(parts)
    signed = headed(MIMEMultipart("signed", protocol="application/pkcs7-signature"), "Signed")
    signed.attach(signed_part)
    signature = MIMEApplication(b"\x30\x80signature", "pkcs7-signature")
    signature.add_header("Content-Disposition", "attachment", filename="smime.p7s")
    signed.attach(signature)
    single = headed(EmailMessage(), "Scan")
    single.set_content("Pump 7 inspection: passed.", disposition="attachment", filename="scan.txt")
    split = headed(MIMEMultipart("mixed"), "Split")
    split.attach(MIMEText("First part before the file.", "plain"))
    notes = MIMEText("Torque 40 Nm.", "plain")
    notes.add_header("Content-Disposition", "inline", filename="notes.txt")
    split.attach(notes)
    split.attach(MIMEText("Second part after the file: replace the seal yearly.", "plain"))
    for name, msg in (("signed", signed), ("single", single), ("split", split)):
        (tmp_path / f"{name}.eml").write_bytes(msg.as_bytes())
    text = read_one(tmp_path / "signed.eml").text
    in_order(text, "# Signed", "See the attached parts list.", "Attachments: parts.txt",
             "## Attachment: parts.txt", "Seal kit part number 4711")
    assert "smime.p7s" not in text  # the signature is no content
    in_order(read_one(tmp_path / "single.eml").text, "# Scan", "Attachments: scan.txt", "Pump 7 inspection: passed.")
    in_order(read_one(tmp_path / "split.eml").text, "First part before the file.",
             "Second part after the file: replace the seal yearly.", "Attachments: notes.txt", "Torque 40 Nm.")


@pytest.mark.parametrize("lead", [b"From - Wed Mar 30 10:27:45 2016\r\n", b"\xef\xbb\xbf"], ids=["thunderbird", "bom"])
def test_a_saved_message_with_an_envelope_line_or_a_bom_is_read(tmp_path, lead):
    """Thunderbird writes the mbox envelope line atop a saved .eml; some tools a byte-order mark. Both were
    refused as "not an email (content looks like text)"."""
    message = b"From: a@example.com\r\nSubject: Saved\r\nDate: Wed, 30 Mar 2016 10:27:45 +0000\r\n\r\nThe body.\r\n"
    (tmp_path / "m.eml").write_bytes(lead + message)
    assert read_one(tmp_path / "m.eml").text.startswith("# Saved\n\nFrom: a@example.com")


def test_an_html_only_messages_layout_tables_are_its_blocks_and_a_data_table_stays_a_table(tmp_path):
    """Newsletters and notification mail are laid out in nested tables: as pipe rows they were `|  |  |` noise
    and lost their headings. A table with header cells in the same message is data and stays pipe rows."""
    html = (
        '<html><body><table width="100%"><tr><td><table><tr><td><h1>Quarterly news</h1></td></tr><tr><td>'
        "<p>Pump seals now ship in kits.</p><p>Second paragraph.</p></td><td><img src='x.png'></td></tr></table>"
        "</td></tr></table><table><tr><th>Part</th><th>Price</th></tr><tr><td>Seal</td><td>11.75</td></tr></table>"
        "</body></html>"
    )
    (tmp_path / "news.eml").write_text(
        "From: news@example.com\nSubject: News\nMIME-Version: 1.0\nContent-Type: text/html; charset=utf-8\n\n" + html
    )
    text = read_one(tmp_path / "news.eml").text
    in_order(text, "# News", "# Quarterly news\n\nPump seals now ship in kits.\n\nSecond paragraph.",
             "| Part | Price |", "| Seal | 11.75 |")
    assert "|  |" not in text


def test_a_mailbox_is_each_message_under_its_subject_with_attachments_read(tmp_path):
    """An mbox (Thunderbird's folders, Google Takeout, Mailman's archives) was ingested as text: its headers, the
    encoded parts and base64 attachments became KV. Now each message is read as an .eml is, under its subject."""
    readings = b"pump,hours\nOrca-7,412\nSkua-3,90\n"
    path = mailbox_file(tmp_path / "service.mbox", [
        plain_message("Orca-7 seal leaks", "The Orca-7 seal leaks after 400 hours.\nFrom now on, check it weekly.\n"),
        plain_message("Re: Orca-7 seal leaks", "Readings attached.\n", ("readings.csv", readings)),
        bytes(email_bytes(html_only=True)),  # a message as bytes, its subject RFC 2047-encoded
    ])
    assert b"\n>From now on" in path.read_bytes()  # the writer escaped the body's From line
    doc = read_one(path)
    assert doc.format == "mbox"
    titles = [h.title for h in find_headings(doc.text)]
    assert titles == ["Orca-7 seal leaks", "Re: Orca-7 seal leaks", "Attachment: readings.csv",
                      "Réparation: Orca-7 seal leaks", "Leak report"]
    assert "The Orca-7 seal leaks after 400 hours.\nFrom now on, check it weekly." in doc.text  # unescaped
    assert "| Orca-7 | 412 |" in doc.text
    assert "Content-Transfer-Encoding" not in doc.text and "=?utf-8?" not in doc.text and "base64" not in doc.text
    # Thunderbird keeps a folder as an mbox named like "Inbox", with no extension: read by its content
    (tmp_path / "Inbox").write_bytes(path.read_bytes())
    assert read_one(tmp_path / "Inbox").text == doc.text
    # a mailbox attached to a message is named, not opened (no recursion)
    outer = plain_message("Archive", "The old folder.\n")
    outer.add_attachment(path.read_bytes(), maintype="application", subtype="mbox", filename="old.mbox")
    (tmp_path / "outer.eml").write_bytes(bytes(outer))
    assert "old.mbox (not read: a message inside the message)" in read_one(tmp_path / "outer.eml").text


def test_a_mailbox_keeps_what_mboxo_writers_and_git_leave_and_skips_only_what_is_broken_or_deleted(tmp_path):
    """Messages start only at a From line of the envelope's form (sender, time, then a header): a body's own
    "From my point of view", which mboxo writers and git leave unescaped, stays in its message. A malformed
    header or an unknown charset costs neither the message nor the mailbox; Thunderbird's deleted messages
    (kept until the folder is compacted) are left out; a fence one message leaves open hides no later subject."""
    box = (b"From a@x Tue Nov  3 09:30:00 2026\nFrom: a@x\nSubject: First\n\nTry this:\n```\npip install foo\n\n"
           b"From b@x Tue Nov  3 09:31:00 2026\nFrom: b@x\nSubject: Second\nCc: <\n"
           b"Content-Type: text/plain; charset=x-bogus\n\nbody two\nFrom my point of view, fine.\nLast paragraph.\n\n"
           b"From c@x Tue Nov  3 09:32:00 2026\nFrom: c@x\nSubject: Third\nX-Mozilla-Status: 0009\n\ndeleted one\n\n"
           b"From d@x Tue Nov  3 09:33:00 2026\nFrom: d@x\nSubject: Fourth\n\nbody four\n")
    (tmp_path / "Inbox").write_bytes(box)
    text = read_one(tmp_path / "Inbox").text
    assert [h.title for h in find_headings(text)] == ["First", "Second", "Fourth"]
    assert "From my point of view, fine.\nLast paragraph." in text and "Cc: <" in text
    assert "deleted one" not in text
    # a body that is binary under an unknown charset costs its message, not the mailbox (it cost the mailbox)
    noise = __import__("base64").encodebytes(bytes((i * 7919 + 13) % 256 for i in range(4096)))
    bad = (b"From e@x Tue Nov  3 09:34:00 2026\nFrom: e@x\nSubject: Noise\nContent-Type: text/plain; charset=x-bogus\n"
           b"Content-Transfer-Encoding: base64\n\n" + noise + b"\n")
    (tmp_path / "Noisy").write_bytes(box + bad)
    assert [h.title for h in find_headings(read_one(tmp_path / "Noisy").text)] == ["First", "Second", "Fourth"]
    # a sentence that begins "From 10:00" is text, not a mailbox, with or without an extension
    notice = b"From 10:00 to 12:00 the office is closed.\nNote: bring your badge.\n"
    (tmp_path / "notice.txt").write_bytes(notice)
    assert read_one(tmp_path / "notice.txt").text.strip() == notice.decode().strip()
    # git format-patch writes an mbox: read as a message under its subject, its diff kept, "From the docs" too
    patch = (b"From 1a2b3c Mon Sep 17 00:00:00 2001\nFrom: Ada <ada@x>\nDate: Tue, 3 Nov 2026 09:30:00 +0000\n"
             b"Subject: [PATCH] Fix the parser\n\nFrom the docs: empty input is valid.\n---\n"
             b" parse.py | 2 +-\n\ndiff --git a/parse.py b/parse.py\n-    fail()\n+    return []\n")
    (tmp_path / "0001-fix.patch").write_bytes(patch)
    doc = read_one(tmp_path / "0001-fix.patch")
    assert doc.format == "mbox" and doc.text.startswith("# [PATCH] Fix the parser")
    assert "From the docs: empty input is valid." in doc.text and "+    return []" in doc.text
    # attached to a list's mail, a patch is read as the text it is; only a mailbox file is not opened
    mail = plain_message("Patch for review", "See attached.\n")
    mail.add_attachment(patch, maintype="text", subtype="x-patch", filename="0001-fix.patch")
    (tmp_path / "review.eml").write_bytes(bytes(mail))
    assert "## Attachment: 0001-fix.patch\n\nFrom 1a2b3c" in read_one(tmp_path / "review.eml").text


def test_a_zipped_folder_is_its_documents_each_named_by_its_path_inside(tmp_path):
    """A folder someone zipped (a manual's files, a download): each member read as that file would be, named
    `bundle.zip/docs/manual.pdf`. Left out as the folder walk leaves them: hidden files and folders, macOS's
    forks. Each member that cannot be read is one line naming it, and costs nothing else: a damaged deflate
    stream, a name that leaves the ZIP (it would map onto another document), a second member of one name, a
    symbolic link, an encrypted or bomb-like member, a ZIP inside the ZIP (gzip'd or not)."""
    import gzip
    import zipfile

    with zipfile.ZipFile(tmp_path / "bundle.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.write(DOCS / "manual.pdf", "docs/manual.pdf")
        z.write(DOCS / "report.docx", "docs/report.docx")
        z.writestr("docs/notes.md.gz", gzip.compress(b"# Notes\n\nThe Orca-7 is painted blue.\n"))
        z.writestr("__MACOSX/docs/._manual.pdf", b"\x00\x05\x16\x07 resource fork")
        z.writestr("docs/.DS_Store", b"\x00\x00\x00\x01Bud1")
        z.writestr(".git/config", "[core]\n")
        z.write(DOCS / "encrypted.pdf", "docs/encrypted.pdf")
        z.writestr("old/archive.zip", zipfile_bytes({"a.md": b"# A\n"}))
        z.writestr("old/archive.zip.gz", gzip.compress(zipfile_bytes({"a.md": b"# A\n"})))
        z.writestr("../escape.md", "# Elsewhere\n")
        with pytest.warns(UserWarning, match="Duplicate name"):
            z.writestr("docs/notes.md.gz", gzip.compress(b"# Another\n"))  # the same name again
        link = zipfile.ZipInfo("docs/link.md")
        link.external_attr = (0o120777 << 16)
        z.writestr(link, "../../etc/passwd")
        z.writestr("logs/zeros.txt", bytes(20 << 20))  # 20 MiB that deflate to ~20 KB
        z.writestr("docs/damaged.md", "# Damaged\n\n" + "Some text to deflate. " * 200)
    raw = bytearray((tmp_path / "bundle.zip").read_bytes())
    with zipfile.ZipFile(tmp_path / "bundle.zip") as z:
        info = z.getinfo("docs/damaged.md")
    at = info.header_offset + 30 + len(info.filename) + len(info.extra) + 2
    raw[at : at + 4] = b"\xff\xff\xff\xff"  # the deflate stream damaged: zlib.error, not a traceback
    (tmp_path / "bundle.zip").write_bytes(bytes(raw))

    docs, skipped = iter_documents([tmp_path / "bundle.zip"])
    assert [(Path(d.path).relative_to(tmp_path).as_posix(), d.format) for d in docs] == [
        ("bundle.zip/docs/manual.pdf", "pdf"), ("bundle.zip/docs/report.docx", "docx"), ("bundle.zip/docs/notes.md.gz", "markdown")]
    assert docs[0].page_starts and "412 kPa" in docs[0].text  # a member keeps its pages
    assert docs[2].text.startswith("# Notes")  # a gzip'd member is read as the file it holds; the first of its name
    reasons = {Path(s.path).relative_to(tmp_path).as_posix(): s.reason for s in skipped}
    assert set(reasons) == {f"bundle.zip/{m}" for m in ("docs/encrypted.pdf", "old/archive.zip", "old/archive.zip.gz",
                            "../escape.md", "docs/notes.md.gz", "docs/link.md", "logs/zeros.txt", "docs/damaged.md")}
    assert reasons["bundle.zip/docs/encrypted.pdf"] == "encrypted PDF (password protected)"
    assert reasons["bundle.zip/old/archive.zip"] == reasons["bundle.zip/old/archive.zip.gz"] == "an archive inside the archive (unpack it first)"
    assert reasons["bundle.zip/../escape.md"] == "its name is empty or leaves the ZIP (not read)"
    assert reasons["bundle.zip/docs/notes.md.gz"] == "a second member of the same name (the first is read)"
    assert reasons["bundle.zip/docs/link.md"] == "a symbolic link (not followed)"
    assert re.fullmatch(r"compressed \d+:1 \(over 100:1, a ZIP bomb\?\); not opened", reasons["bundle.zip/logs/zeros.txt"])
    assert reasons["bundle.zip/docs/damaged.md"].startswith("cannot be read from the ZIP (")
    # a DOCX is a ZIP too, but one document: never opened as a folder; an empty ZIP says so
    assert [d.format for d in iter_documents([DOCS / "report.docx"])[0]] == ["docx"]
    (tmp_path / "empty.zip").write_bytes(zipfile_bytes({"__MACOSX/._x": b"fork"}))
    assert iter_documents([tmp_path / "empty.zip"])[1][0].reason == "empty ZIP (no documents in it)"
    # a name a Windows tool wrote in UTF-8 without the flag that says so is read as UTF-8, not cp437
    buf = bytearray(zipfile_bytes({"Прив.md": b"# Hi\n"}))
    for at in (i for i in range(len(buf) - 1) if buf[i : i + 4] in (b"PK\x03\x04", b"PK\x01\x02")):
        flag_at = at + (7 if buf[at + 2] == 3 else 9)  # the flags' high byte
        buf[flag_at] &= ~0x08 & 0xFF  # clear bit 11 (0x800: "the name is UTF-8")
    (tmp_path / "win.zip").write_bytes(bytes(buf))
    assert [Path(d.path).name for d in iter_documents([tmp_path / "win.zip"])[0]] == ["Прив.md"]
    # `./` steps taken out as in a tar (a single pass of the ZIP's own left `a/./b.md`, a hidden folder, unread)
    (tmp_path / "dots.zip").write_bytes(zipfile_bytes({"docs/././a.md": b"# A\n\nalpha\n"}))
    assert [d.path.split("dots.zip/")[-1] for d in iter_documents([tmp_path / "dots.zip"])[0]] == ["docs/a.md"]


@pytest.mark.parametrize("mode,suffix", [("w:gz", ".tar.gz"), ("w:xz", ".tar.xz"), ("w:bz2", ".tbz2"), ("w", ".tar"),
                                         ("w", ".tar.zst")])
def test_a_tarred_folder_is_read_as_a_zipped_one(tmp_path, mode, suffix):
    """`docs.tar.gz` as `tar czf` writes it: each regular file read as that file would be, named by its path inside;
    ZIP's rules for what is left out and what is named (links, names that leave the archive, nested archives)."""
    import io
    import tarfile

    path = tmp_path / f"docs{suffix}"
    with tarfile.open(path, mode) as tar:
        tar.add(DOCS / "manual.pdf", "./docs/manual.pdf")
        tar.add(DOCS / "quickstart.md", "docs/quickstart.md")
        for name, data in (("docs/._quickstart.md", b"\x00\x05\x16\x07"), ("../escape.md", b"# Out\n"),
                           ("docs/inner.tar.gz", b"\x1f\x8b\x08\x00")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("docs/link.md")
        link.type, link.linkname = tarfile.SYMTYPE, "../../etc/passwd"
        tar.addfile(link)
    if suffix == ".tar.zst":  # as `tar --zstd` writes it: zstandard over the plain tar, in two frames here
        import zstandard

        raw = path.read_bytes()
        compressor = zstandard.ZstdCompressor()
        path.write_bytes(compressor.compress(raw[:4096]) + compressor.compress(raw[4096:]))
    docs, skipped = iter_documents([path])
    assert [Path(d.path).relative_to(tmp_path).as_posix() for d in docs] == [
        f"docs{suffix}/docs/manual.pdf", f"docs{suffix}/docs/quickstart.md"]
    assert docs[0].page_starts and "412 kPa" in docs[0].text
    assert {Path(s.path).relative_to(tmp_path).as_posix(): s.reason for s in skipped} == {
        f"docs{suffix}/../escape.md": "its name is empty or leaves the tar archive (not read)",
        f"docs{suffix}/docs/inner.tar.gz": "an archive inside the archive (unpack it first)",
        f"docs{suffix}/docs/link.md": "a symbolic link (not followed)",
    }


@pytest.mark.skipif(shutil.which("tar") is None, reason="no tar command on this machine")
def test_a_folder_tarred_by_the_tar_command_is_read(tmp_path):
    folder = tmp_path / "manuals"
    shutil.copytree(DOCS, folder, ignore=shutil.ignore_patterns("*.pptx", "*.xlsx", "*.epub", "encrypted.pdf"))
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x.md").write_text("# hidden\n")
    subprocess.run(["tar", "czf", str(tmp_path / "manuals.tgz"), "-C", str(tmp_path), "manuals"], check=True)
    docs, skipped = iter_documents([tmp_path / "manuals.tgz"])
    assert sorted(Path(d.path).name for d in docs) == ["article.html", "manual.pdf", "quickstart.md", "report.docx"]
    assert all(d.path.endswith(f"manuals.tgz/manuals/{Path(d.path).name}") for d in docs)
    assert [Path(s.path).name for s in skipped] == ["scanned.pdf"]  # no text layer; .cache/ left out


def test_an_archive_of_more_files_than_the_cap_is_one_line(tmp_path, monkeypatch):
    """A ZIP of 100,000 empty files printed 100,000 lines; past the cap an archive is refused (ZIP: its central
    directory is read first) or read no further (tar: a stream), in one line that says what to do."""
    import io
    import tarfile

    monkeypatch.setattr(conversion, "MAX_ARCHIVE_MEMBERS", 3)
    members = {f"notes/{i}.md": f"# Note {i}\n\ntext {i}\n".encode() for i in range(4)}
    (tmp_path / "many.zip").write_bytes(zipfile_bytes(members))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "many.tar.gz").write_bytes(buf.getvalue())
    docs, skipped = iter_documents([tmp_path / "many.tar.gz", tmp_path / "many.zip"])
    assert [Path(d.path).name for d in docs] == ["0.md", "1.md", "2.md"]  # the tar's first three stand
    assert [s.reason for s in skipped] == [
        "tar archive holds over 3 files; the rest not read (unpack it and ingest the folder)",
        "ZIP holds over 3 files; not opened (unzip it and ingest the folder)",
    ]


def test_a_damaged_or_oversized_tar_is_one_line(tmp_path, monkeypatch):
    """Each of these cost the whole ingest a traceback, hid documents, or took gigabytes, before review."""
    import bz2
    import gzip
    import io
    import tarfile

    def tar_of(members: list[tuple[str, bytes]], **kw) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", **kw) as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    md = [("a.md", b"# A\n\nalpha\n"), ("b.md", b"# B\n\nbeta\n"), ("c.md", b"# C\n\ngamma\n")]
    # a damaged header after the first member: tarfile would end the archive there without a word
    raw = bytearray(tar_of(md))
    raw[1024 : 1024 + 100] = b"\xff" * 100  # b.md's header
    (tmp_path / "damaged.tar").write_bytes(bytes(raw))
    docs, skipped = iter_documents([tmp_path / "damaged.tar"])
    assert [Path(d.path).name for d in docs] == ["a.md"]  # what came before the damage stands
    assert skipped[0].reason == "corrupt tar archive (a damaged header at byte 1024; the rest not read)"
    # a name in Latin-1 is one line for that member, not a traceback for the run
    latin = tar_of([("café.md", b"# Caf\n\ntext\n"), *md[:1]], format=tarfile.GNU_FORMAT, encoding="latin-1")
    (tmp_path / "latin.tar").write_bytes(latin)
    docs, skipped = iter_documents([tmp_path / "latin.tar"])
    assert [Path(d.path).name for d in docs] == ["a.md"]
    assert [s.reason for s in skipped] == ["file name is not valid UTF-8 (rename it)"]
    # a GNU long-name header that claims 8 MiB (512 MiB took 1.5 GB of memory in tarfile), in bzip2's few
    # hundred bytes: refused at the cap (1 MiB here) before tarfile reads a byte of it
    head = tarfile.TarInfo("././@LongLink")
    head.type, head.size = tarfile.GNUTYPE_LONGNAME, 8 << 20
    bomb = head.tobuf(format=tarfile.GNU_FORMAT)[:512] + bytes(8 << 20)
    (tmp_path / "long.tar.bz2").write_bytes(bz2.compress(bomb, 1))
    assert (tmp_path / "long.tar.bz2").stat().st_size < 1000
    with monkeypatch.context() as patched:
        patched.setattr(conversion, "MAX_ZIP_UNCOMPRESSED_BYTES", 1 << 20)
        assert iter_documents([tmp_path / "long.tar.bz2"])[1][0].reason == "tar archive would inflate to over 1 MiB; not read"
    # a gzip header cut short; gzip'd text named .tar.gz; a hard link; a name with ./ steps
    (tmp_path / "cut.tar.gz").write_bytes(b"\x1f\x8b\x08")
    (tmp_path / "notes.tar.gz").write_bytes(gzip.compress(b"Just notes, no tar.\n" * 40))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("docs/./././a.md")
        info.size = len(md[0][1])
        tar.addfile(info, io.BytesIO(md[0][1]))
        link = tarfile.TarInfo("docs/copy.md")
        link.type, link.linkname = tarfile.LNKTYPE, "docs/a.md"
        tar.addfile(link)
    (tmp_path / "linked.tar").write_bytes(buf.getvalue())
    docs, skipped = iter_documents([tmp_path / "cut.tar.gz", tmp_path / "notes.tar.gz", tmp_path / "linked.tar"])
    assert [d.path.split("linked.tar/")[-1] for d in docs] == ["docs/a.md"]
    reasons = [s.reason for s in skipped]
    assert reasons[0].startswith("corrupt tar archive (")
    assert reasons[1:] == ["not a tar archive (content looks like text)", "a hard link to docs/a.md (read there)"]


    whole = tmp_path / "whole.tar.gz"
    with tarfile.open(whole, "w:gz") as tar:
        tar.add(DOCS / "manual.pdf", "manual.pdf")
    (tmp_path / "cut.tar.gz").write_bytes(whole.read_bytes()[:-200])
    (tmp_path / "notes.tar.gz").write_bytes(b"\x1f\x8b not really gzip")
    docs, skipped = iter_documents([tmp_path / "cut.tar.gz", tmp_path / "notes.tar.gz"])
    assert docs == [] and [s.reason.split(" (")[0] for s in skipped] == ["corrupt tar archive"] * 2
    monkeypatch.setattr(conversion, "MAX_ZIP_UNCOMPRESSED_BYTES", 1000)  # the manual is 4 KB
    (_, skipped) = iter_documents([whole])
    assert skipped[0].reason == "tar archive would inflate to over 0 MiB; not read"


def zipfile_bytes(members: dict[str, bytes]) -> bytes:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def test_a_file_named_mbox_that_holds_no_mail_is_skipped_in_one_line(tmp_path):
    (tmp_path / "notes.mbox").write_text("Just some notes.\n")
    (tmp_path / "empty.mbox").write_bytes(b"From someone Tue Nov  3 09:30:00 2026\nX-Junk: 1\n\nno headers of a message\n")
    docs, skipped = iter_documents([tmp_path / "notes.mbox", tmp_path / "empty.mbox"])
    assert docs == []
    assert sorted((Path(s.path).name, s.reason) for s in skipped) == [
        ("empty.mbox", "not a mailbox (no message in it)"),
        ("notes.mbox", "not a mailbox (content looks like text)"),
    ]


def test_an_html_only_email_keeps_its_headings_and_tables_and_a_text_file_named_eml_is_refused(tmp_path):
    (tmp_path / "report.eml").write_bytes(email_bytes(html_only=True))
    text = read_one(tmp_path / "report.eml").text
    assert "## Leak report" in text and "| Pump | Orca-7 |" in text and "<td>" not in text
    (tmp_path / "notes.eml").write_text("Just some notes.\n")
    docs, skipped = iter_documents([tmp_path / "notes.eml"])
    assert docs == [] and skipped == [Skipped((tmp_path / "notes.eml").as_posix(), "not an email (content looks like text)")]


def test_every_converted_format_has_its_converter_and_nothing_else_converts():
    for fmt in conversion.CONVERTED_FORMATS:
        assert callable(getattr(conversion, f"_convert_{fmt}", None)), fmt
    with pytest.raises(ValueError, match="no converter for 'text'"):
        conversion.convert("text", b"plain")


def _notebook(cells: list[dict], **metadata) -> bytes:
    """A notebook as Jupyter saves one (nbformat 4.5: JSON, one-space indent, sources as lists of lines)."""
    import json

    meta = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"}, **metadata}
    return json.dumps({"cells": cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5}, indent=1).encode()


def _cell(kind: str, text: str, outputs: list | None = None) -> dict:
    cell = {"cell_type": kind, "id": f"c{len(text)}", "metadata": {}, "source": text.splitlines(keepends=True)}
    if kind == "code":
        cell.update(execution_count=1, outputs=outputs or [])
    return cell


def test_a_notebook_is_its_cells_with_code_fenced_and_text_outputs_without_images(tmp_path):
    png = "iVBORw0KGgo" + "A" * 5000  # a plot, base64
    progress = "\r  0%|          | 0/3\r 33%|###       | 1/3\r100%|##########| 3/3\n"
    cells = [
        _cell("markdown", "# Pump survey\n\nDepths measured at **Halifax** in 2026."),
        _cell("code", "# load the depths\nimport pandas as pd\ndf = pd.read_csv('depths.csv')\ndf.head(2)", [
            {"output_type": "execute_result", "execution_count": 1, "metadata": {},
             "data": {"text/plain": ["   pump  depth\n", "0  Orca-7  412\n", "1  Skua-3  97"],
                      "text/html": ["<table><tr><td>Orca-7</td></tr></table>"]}},
        ]),
        _cell("code", "for step in tqdm(range(3)):\n    fit(step)\nplot(df)", [
            {"output_type": "stream", "name": "stderr", "text": [progress]},
            {"output_type": "display_data", "metadata": {}, "data": {"image/png": png, "text/plain": ["<Figure>"]}},
            {"output_type": "stream", "name": "stdout", "text": ["\x1b[32mdone\x1b[0m\n"]},
        ]),
        _cell("code", "print(*range(500), sep=chr(10))", [
            {"output_type": "stream", "name": "stdout", "text": "".join(f"{i}\n" for i in range(500))},
        ]),
        _cell("code", "1 / 0", [{"output_type": "error", "ename": "ZeroDivisionError", "evalue": "division by zero",
                                 "traceback": ["\x1b[0;31m---------------------------------------------------------"]}]),
        _cell("markdown", "## Findings\n\n| pump | depth |\n|---|---|\n| Orca-7 | 412 |"),
        _cell("raw", "   "),  # empty: left out
    ]
    (tmp_path / "survey.ipynb").write_bytes(_notebook(cells))
    doc = read_one(tmp_path / "survey.ipynb")
    assert doc.format == "ipynb" and doc.source_hash
    in_order(
        doc.text,
        "# Pump survey\n\nDepths measured at **Halifax** in 2026.",
        "```python\n# load the depths\nimport pandas as pd",  # fenced: the comment is code, no heading
        "df.head(2)\n```\n\n```\n   pump  depth\n0  Orca-7  412\n1  Skua-3  97\n```",  # text/plain, not the HTML
        "```\n100%|##########| 3/3\n```\n\n```\ndone\n```",  # the bar as a terminal ends it; the plot left out
        "```\n0\n1\n",
        "39\n... (output cut: 500 lines in all)\n```",
        "```\nZeroDivisionError: division by zero\n```",
        "## Findings\n\n| pump | depth |",
    )
    assert "iVBOR" not in doc.text and "<Figure>" not in doc.text and "<table>" not in doc.text and "\x1b" not in doc.text and "\\n" not in doc.text
    assert "\n40\n" not in doc.text and '"cell_type"' not in doc.text
    assert [h.title for h in find_headings(doc.text)] == ["Pump survey", "Findings"]
    # nbformat 3 (worksheets, "input", heading cells), as notebooks saved before 2015 are
    old = {"nbformat": 3, "metadata": {"name": "legacy"}, "worksheets": [{"cells": [
        {"cell_type": "heading", "level": 2, "source": ["Old results"]},
        {"cell_type": "code", "language": "python", "input": ["x = 3\n", "x"],
         "outputs": [{"output_type": "pyout", "text": ["3"], "prompt_number": 1}]},
    ]}]}
    (tmp_path / "old.ipynb").write_text(json.dumps(old))
    assert read_one(tmp_path / "old.ipynb").text == "## Old results\n\n```python\nx = 3\nx\n```\n\n```\n3\n```"
    # a Markdown cell's unclosed fence closes with its cell (Jupyter renders cells alone); Windows line ends in
    # an output are line ends, not a progress bar's updates; an error without a message is its name
    cells = [_cell("markdown", "# Intro\n\nExample:\n```\nfoo"), _cell("code", "# Load the data\nimport pandas", [
        {"output_type": "stream", "name": "stdout", "text": ["Collecting x\r\n", "Successfully installed x\r\n"]},
        {"output_type": "error", "ename": "KeyboardInterrupt", "evalue": None, "traceback": []}]),
        _cell("markdown", "## Results\n\nText.")]
    (tmp_path / "fences.ipynb").write_bytes(_notebook(cells))
    text = read_one(tmp_path / "fences.ipynb").text
    assert [h.title for h in find_headings(text)] == ["Intro", "Results"], text
    in_order(text, "```\nfoo\n```", "```\nCollecting x\nSuccessfully installed x\n```", "```\nKeyboardInterrupt\n```")


def test_a_notebook_keeps_a_pasted_images_alt_text_not_its_base64_and_a_markdown_displays_text(tmp_path):
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
    notebook = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": [f"Pump diagram: ![the seal housing](data:image/png;base64,{png})\n",
                                                             f'<img src="data:image/png;base64,{png}" width=40>']},
        {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": "Markdown('**Seal**: ok')", "outputs": [
            {"output_type": "execute_result", "execution_count": 1, "metadata": {},
             "data": {"text/plain": ["<IPython.core.display.Markdown object>"], "text/markdown": ["**Seal**: ok"]}}]},
    ]}
    (tmp_path / "n.ipynb").write_text(json.dumps(notebook))
    text = read_one(tmp_path / "n.ipynb").text
    assert "Pump diagram: the seal housing" in text and "base64" not in text and "iVBOR" not in text
    assert "**Seal**: ok" in text and "IPython.core.display.Markdown object" not in text


def test_a_bad_notebook_is_skipped_in_one_line(tmp_path):
    (tmp_path / "cut.ipynb").write_bytes(_notebook([_cell("markdown", "# Cut")])[:-40])
    (tmp_path / "list.ipynb").write_text("[1, 2]")
    (tmp_path / "page.ipynb").write_text("<html><body>404 Not Found</body></html>")
    (tmp_path / "blank.ipynb").write_bytes(_notebook([_cell("code", "  \n")]))
    docs, skipped = iter_documents([tmp_path])
    assert docs == []
    assert {Path(s.path).name: s.reason for s in skipped} == {
        "blank.ipynb": "empty (the notebook has no cells with text)",
        "cut.ipynb": "corrupt notebook (not JSON: Expecting ',' delimiter at line 21)",
        "list.ipynb": "not a Jupyter notebook (no cells)",
        "page.ipynb": "not a Jupyter notebook (content looks like HTML)",
    }


def test_a_transcript_is_what_was_said_by_whom_under_the_minutes_it_was_said(tmp_path):
    # a meeting's WebVTT as Teams and Zoom export one: voices, cue ids, settings, styling, a NOTE
    cues = [f"{i}\n00:{i // 60:02d}:{i % 60:02d}.000 --> 00:{(i + 3) // 60:02d}:{(i + 3) % 60:02d}.000 align:start\n"
            f"<v {'Ana Ruiz' if (i // 60) % 2 else 'Ben Ode'}><b>Point</b> {i}: the Tern-4 sonar.\n\n"
            for i in range(0, 300, 6)]
    (tmp_path / "meeting.vtt").write_text("WEBVTT\n\nNOTE exported 2026-11-27\n\n" + "".join(cues))
    doc = read_one(tmp_path / "meeting.vtt")
    assert doc.format == "vtt" and "-->" not in doc.text and "<v" not in doc.text and "align" not in doc.text
    # two minutes a section, named by when its first caption starts and its last one ends
    assert [h.title for h in find_headings(doc.text)] == ["00:00:00-00:01:57", "00:02:00-00:03:57",
                                                          "00:04:00-00:04:57"]
    in_order(doc.text, "## 00:00:00-00:01:57\n\nBen Ode: Point 0: the Tern-4 sonar. Point 6: the Tern-4 sonar.",
             "Point 54: the Tern-4 sonar.\n\nAna Ruiz: Point 60:", "## 00:02:00-00:03:57\n\nBen Ode: Point 120:")
    # SubRip in Windows-1252, with live captions' rolled-up lines: each line once
    srt = ("1\r\n00:00:01,000 --> 00:00:03,000\r\nThe café opens at nine.\r\n\r\n"
           "2\r\n00:00:03,000 --> 00:00:05,000\r\nThe café opens at nine.\r\n<i>Bring</i> the charts.\r\n\r\n")
    (tmp_path / "talk.srt").write_bytes(srt.encode("cp1252"))
    talk = read_one(tmp_path / "talk.srt")
    assert talk.format == "srt" and talk.text == "## 00:00:01-00:00:05\n\nThe café opens at nine. Bring the charts."


def test_a_bad_transcript_is_skipped_in_one_line(tmp_path):
    (tmp_path / "notes.vtt").write_text("Meeting notes, not captions.\n")
    (tmp_path / "cut.vtt").write_text("WEBVTT\n\n00:00:01.000 --> \nHello\n")  # cut inside its first cue
    (tmp_path / "empty.srt").write_text("1\n00:00:01,000 --> 00:00:02,000\n\n")
    docs, skipped = iter_documents([tmp_path])
    assert docs == []
    reasons = {Path(s.path).name: s.reason for s in skipped}
    assert reasons["notes.vtt"] == "not WebVTT subtitles (content looks like text)"
    assert reasons["cut.vtt"] == "empty (the WebVTT file has no captions with text)", reasons
    assert reasons["empty.srt"] == "empty (the SubRip file has no captions with text)", reasons


def test_odp_is_a_page_per_slide_with_its_title_text_tables_and_notes(tmp_path):
    from odfdo import Document, DrawPage, Frame, List, PresentationNotes, Table

    deck = Document("presentation")
    deck.body.clear()
    for n, title in enumerate(["Fleet status", "Blank", "Service costs"], 1):
        page = DrawPage(f"p{n}", name=f"Slide {n}")
        page.append(Frame.text_frame(title, size=("20cm", "2cm"), position=("1cm", "1cm"), presentation_class="title"))
        page.append(Frame.text_frame("Kestrel Pumps, confidential", size=("9cm", "1cm"), position=("1cm", "19cm"),
                                     presentation_class="footer"))
        if n == 1:
            page.append(Frame.text_frame(List(["Skua-7: 12 in service", "Orca-9: 3 in refit"]), size=("20cm", "8cm"),
                                         position=("1cm", "4cm"), presentation_class="outline"))
            notes = PresentationNotes()
            notes.append(Frame.text_frame("Mention the   refit dates.", size=("9cm", "1cm"), position=("1cm", "1cm"),
                                          presentation_class="notes"))
            page.append(notes)
        if n == 3:
            table = Table("Costs", width=3, height=3)
            table.set_values([["Part", "", "Cost (EUR)"], ["Seal kit", "", 11.75], ["Impeller", "", 1011.25]])
            frame = Frame(size=("10cm", "5cm"), position=("1cm", "5cm"))
            frame.append(table)
            page.append(frame)
        deck.body.append(page)
    deck.save(tmp_path / "deck.odp")
    doc = read_one(tmp_path / "deck.odp")
    assert doc.format == "odp" and len(doc.page_starts) == 3  # a slide a page, the text-less one too
    first, second, third = (doc.text[a:b].strip() for a, b in zip(doc.page_starts, [*doc.page_starts[1:], None]))
    assert first == ("## Fleet status\n\n- Skua-7: 12 in service\n- Orca-9: 3 in refit\n\n"
                     "Notes: Mention the refit dates.")
    assert second == "## Blank"
    assert third == "## Service costs\n\n| Part | Cost (EUR) |\n|---|---|\n| Seal kit | 11.75 |\n| Impeller | 1011.25 |"
    assert "confidential" not in doc.text  # footers repeat on every slide, as a deck's do
    (tmp_path / "deck.odt").write_bytes((tmp_path / "deck.odp").read_bytes())
    _, skipped = iter_documents([tmp_path / "deck.odt"])
    assert [s.reason for s in skipped] == ["not an ODT (content looks like an ODP)"]


def test_review_cases_of_transcripts_attachments_and_impress_shapes(tmp_path):
    # two speakers saying the same word, and a SubRip "No." "No.": said twice, kept twice; YouTube's roll-up
    # (two lines, the first repeated, and a 10 ms flash of it alone) kept once; cues out of order sorted
    vtt = ("WEBVTT\n\n00:00:05.000 --> 00:00:06.000\n<v Ana>Okay.\n\n00:00:06.000 --> 00:00:07.000\n<v Bob>Okay.\n\n"
           "00:00:01.000 --> 00:00:02.000\n<v Ana>First &amp; foremost.\n\n"
           "00:00:10.000 --> 00:00:12.000\n<v Cy>hello world\n\n00:00:12.000 --> 00:00:12.010\n<v Cy>hello world\n\n"
           "00:00:12.010 --> 00:00:14.000\n<v Cy>hello world\nthis is live\n")
    (tmp_path / "call.vtt").write_text(vtt)
    assert read_one(tmp_path / "call.vtt").text == (
        "## 00:00:01-00:00:14\n\nAna: First & foremost. Okay.\n\nBob: Okay.\n\nCy: hello world this is live")
    srt = "\n1 \r\n00:00:01,000 --> 00:00:02,000\r\n{\\an8}No.\r\n\r\n2\r\n00:00:02,000 --> 00:00:03,000\r\nNo!\r\n"
    (tmp_path / "no.srt").write_bytes(srt.replace("No!", "No.").encode("utf-16"))  # UTF-16, a blank line first
    assert read_one(tmp_path / "no.srt").text == "## 00:00:01-00:00:03\n\nNo. No."
    # an attachment whose charset Python does not know is read from its bytes; the message is kept either way
    from email.message import EmailMessage

    msg = EmailMessage()
    msg["From"], msg["Subject"] = "a@x.example", "Readings"
    msg.set_content("Body text.")
    msg.add_attachment(b"Depth 412 m", maintype="text", subtype="plain", filename="depths.txt")
    msg.get_payload()[1].set_param("charset", "x-unknown-cs")
    (tmp_path / "readings.eml").write_bytes(bytes(msg))
    assert read_one(tmp_path / "readings.eml").text.endswith(
        "Body text.\n\nAttachments: depths.txt\n\n## Attachment: depths.txt\n\nDepth 412 m")


def test_impress_shapes_are_read_and_every_table_counts_against_the_cell_cap(tmp_path):
    from odfdo import Document, DrawGroup, DrawPage, Element, Frame, Paragraph, PresentationNotes, RectangleShape

    deck = Document("presentation")
    deck.body.clear()
    page = DrawPage("p1", name="Slide 1")
    page.append(Frame.text_frame("Flow", size=("20cm", "2cm"), position=("1cm", "1cm"), presentation_class="title"))
    box = RectangleShape(size=("4cm", "2cm"), position=("1cm", "5cm"))
    box.append(Paragraph("Pump A feeds the tank"))
    group = DrawGroup()
    inner = RectangleShape(size=("4cm", "2cm"), position=("6cm", "5cm"))
    inner.append(Paragraph("Valve B in a group"))
    group.append(inner)
    page.extend([box, group])
    deck.body.append(page)
    deck.save(tmp_path / "flow.odp")
    assert read_one(tmp_path / "flow.odp").text == "## Flow\n\nPump A feeds the tank\n\nValve B in a group"
    # a crafted table of 3,000,000 cells in the speaker notes is refused as one on the slide is, at once
    huge = ('<table:table table:name="T"><table:table-column table:number-columns-repeated="1000"/>'
            '<table:table-row table:number-rows-repeated="3000"><table:table-cell office:value-type="string" '
            'table:number-columns-repeated="1000"><text:p>x</text:p></table:table-cell></table:table-row></table:table>')
    frame = Frame(size=("9cm", "1cm"), position=("1cm", "1cm"), presentation_class="notes")
    frame.append(Element.from_tag(huge))
    notes = PresentationNotes()
    notes.append(frame)
    page.append(notes)
    deck.save(tmp_path / "crafted.odp")
    _, skipped = iter_documents([tmp_path / "crafted.odp"])
    assert [s.reason for s in skipped] == ["too large for ODP (over 1,000,000 cells)"]


def test_a_title_that_is_also_the_running_header_marks_the_heading_not_the_header():
    page = "Safety\nThe overview ends here.\nSafety\nAlways depressurise first.\nOrca manual"
    marked = conversion._mark_headings(page, [("Safety", 1)], running={"safety"})
    assert marked == "Safety\nThe overview ends here.\n\n# Safety\n\nAlways depressurise first.\nOrca manual"
    # not a running line: the first line of the title is the heading, as before
    assert conversion._mark_headings(page, [("Safety", 1)]).startswith("# Safety\n\nThe overview ends here.")


def test_a_soft_hyphen_inside_a_word_is_dropped():
    """U+00AD is a hint where a word may break; left in, it split the word in the KV ("Hy\u00adphen\u00adated")."""
    assert conversion._tidy("Hy\u00adphen\u00adated word") == "Hyphenated word"
