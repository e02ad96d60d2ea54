"""What the document-format tests share (issue 32): the fixtures folder and every kind of bad document.

The bad documents are made from the good fixtures (fixtures/documents/, written by real producers), so no
producer is needed at test time: cut short, bytes flipped, a ZIP bomb, a 50 MB page, a wrong extension.
"""

from __future__ import annotations

import gzip
import io
import json
import zipfile
from pathlib import Path

from support import FIXTURES

DOCS = FIXTURES / "documents"


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def encryption_xml(algorithm: str, part: str) -> bytes:
    """An EPUB's META-INF/encryption.xml saying `part` is encrypted with `algorithm` (XML Encryption, as OCF has it)."""
    return (
        '<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container" '
        'xmlns:enc="http://www.w3.org/2001/04/xmlenc#"><enc:EncryptedData>'
        f'<enc:EncryptionMethod Algorithm="{algorithm}"/><enc:CipherData>'
        f'<enc:CipherReference URI="{part}"/></enc:CipherData></enc:EncryptedData></encryption>'
    ).encode()


ENCRYPTED_CHAPTER = encryption_xml("http://www.w3.org/2001/04/xmlenc#aes128-cbc", "EPUB/intro.xhtml")  # as DRM does


def with_member(zip_data: bytes, name: str, data: bytes) -> bytes:
    """The ZIP with one more member, or with `name`'s contents replaced where it has one (in its place)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(zip_data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, data if info.filename == name else src.read(info.filename))
        if name not in src.NameToInfo:
            dst.writestr(name, data)
    return out.getvalue()


def odt_bytes(scratch: Path) -> bytes:
    """A small OpenDocument text as odfdo (LibreOffice's format library) writes it; `scratch` is removed."""
    from odfdo import Document, Header, Paragraph

    document = Document("text")
    document.body.extend([Header(1, "Dock log"), Paragraph("The Tern-4 sonar left Halifax on the 3rd.")])
    document.save(scratch)
    data = scratch.read_bytes()
    scratch.unlink()
    return data


def make_bad_documents(root: Path) -> dict[str, str]:
    """Every kind of bad document in ``root``; returns file name -> a regex its skip reason must match."""
    root.mkdir(parents=True, exist_ok=True)
    pdf = (DOCS / "manual.pdf").read_bytes()
    docx = (DOCS / "report.docx").read_bytes()
    pptx = (DOCS / "briefing.pptx").read_bytes()
    (root / "encrypted.pdf").write_bytes((DOCS / "encrypted.pdf").read_bytes())
    (root / "scanned.pdf").write_bytes((DOCS / "scanned.pdf").read_bytes())
    (root / "truncated.pdf").write_bytes(pdf[: len(pdf) // 2])
    (root / "corrupt.pdf").write_bytes(b"%PDF-1.7\n" + bytes(range(256)) * 8 + b"\n%%EOF\n")
    (root / "truncated.docx").write_bytes(docx[: len(docx) // 2])
    with zipfile.ZipFile(io.BytesIO(docx)) as z:
        info = z.getinfo("word/document.xml")
    flipped = bytearray(docx)
    at = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size // 2
    flipped[at : at + 8] = bytes(b ^ 0xFF for b in flipped[at : at + 8])
    (root / "flipped.docx").write_bytes(bytes(flipped))
    (root / "bomb.docx").write_bytes(
        zip_bytes({"[Content_Types].xml": b"<Types/>", "word/document.xml": bytes(20 << 20)})
    )
    # 201 members of 1 MiB of zeros each (a member of 1 MiB or less is not held to the 100:1 ratio): 201 MiB in all
    (root / "bomb.zip").write_bytes(zip_bytes({f"logs/{i:03d}.txt": bytes(1 << 20) for i in range(201)}))
    (root / "truncated.zip").write_bytes(zip_bytes({"notes.md": b"# Notes\n" * 500})[:-30])
    (root / "huge.html").write_bytes(
        b"<!DOCTYPE html><html><body>" + b"<p>filler text</p>\n" * (50 * 1024 * 1024 // 19)
    )
    (root / "error-page.pdf").write_text("<!DOCTYPE html><html><body><h1>404 Not Found</h1></body></html>")
    (root / "noise.pdf").write_bytes(bytes((i * 7919 + 13) % 256 for i in range(4096)))
    (root / "notes.docx").write_text("Only text, saved under the wrong name.")
    (root / "locked.pptx").write_bytes((DOCS / "locked.pptx").read_bytes())
    (root / "locked.docx").write_bytes((DOCS / "locked.pptx").read_bytes())  # Word locks a DOCX the same way
    (root / "truncated.pptx").write_bytes(pptx[: len(pptx) // 2])
    (root / "hollow.pptx").write_bytes(zip_bytes({"ppt/presentation.xml": b"<p/>"}))  # no package parts
    (root / "memo.pptx").write_bytes(docx)
    (root / "sheet.xlsx").write_bytes(zip_bytes({"xl/workbook.xml": b"<workbook/>"}))  # no package parts
    xlsx = (DOCS / "budget.xlsx").read_bytes()
    (root / "truncated.xlsx").write_bytes(xlsx[: len(xlsx) // 2])
    (root / "locked.xlsx").write_bytes((DOCS / "locked.pptx").read_bytes())  # Excel locks a workbook the same way
    epub = (DOCS / "handbook.epub").read_bytes()
    (root / "truncated.epub").write_bytes(epub[: len(epub) // 2])
    hollow = {"mimetype": b"application/epub+zip", "META-INF/container.xml": b"<x/>"}  # no package file named
    (root / "hollow.epub").write_bytes(zip_bytes(hollow))
    (root / "slides.epub").write_bytes(pptx)
    (root / "drm.epub").write_bytes(with_member(epub, "META-INF/encryption.xml", ENCRYPTED_CHAPTER))
    (root / "letter.rtf").write_text(r"{\rtf1\ansi\deff0{\fonttbl{\f0 Times;}}\f0 Dear reader,\par {\b Hello}.\par}")
    # high bytes without a NUL: no BOM, not UTF-8, and no legacy code page reads them as language
    (root / "noise.txt").write_bytes(bytes(128 + (i * 7919 + 13) % 128 for i in range(4096)))
    (root / "damaged-utf16.txt").write_bytes(b"\xff\xfe" + "Half a ".encode("utf-16-le") + b"\x00\xd8")
    (root / "notes.eml").write_text("Only notes, saved under a mail client's extension.\n")
    (root / "logo.svg").write_text('<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"><path d="M0 0h9"/></svg>')
    (root / "poster.ps").write_text("%!PS-Adobe-3.0\n/Times-Roman findfont 12 scalefont setfont\n72 720 moveto (Hi) show\n")
    odt = odt_bytes(root / "odt.tmp")
    manifest = b'<manifest:manifest><manifest:encryption-data manifest:checksum-type="SHA1/1K"/></manifest:manifest>'
    (root / "locked.odt").write_bytes(with_member(odt, "META-INF/manifest.xml", manifest))
    (root / "truncated.odt").write_bytes(odt[: len(odt) // 2])
    (root / "sheet.odt").write_bytes(with_member(odt, "mimetype", b"application/vnd.oasis.opendocument.spreadsheet"))
    laughs = "".join(f'<!ENTITY lol{i} "{f"&lol{i - 1};" * 10}">' for i in range(1, 10))
    (root / "laughs.xml").write_text(f'<?xml version="1.0"?><!DOCTYPE l [<!ENTITY lol0 "lol">{laughs}]><l>&lol9;</l>')
    (root / "broken.xml").write_text('<?xml version="1.0"?><manual><para>An unclosed element</manual>')
    notes = gzip.compress((DOCS / "quickstart.md").read_bytes() * 40)
    (root / "truncated.md.gz").write_bytes(notes[: len(notes) // 2])
    (root / "bomb.txt.gz").write_bytes(gzip.compress(b"a" * (65 << 20), compresslevel=1))  # 65 MiB inflated
    notebook = json.dumps({"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# Survey"]}],
                           "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1)
    (root / "truncated.ipynb").write_text(notebook[: len(notebook) // 2])
    (root / "page.ipynb").write_text("<!DOCTYPE html><html><body><h1>404 Not Found</h1></body></html>")
    (root / "notes.vtt").write_text("Meeting notes, saved under a subtitle extension.\n")
    (root / "captions.srt").write_text("WEBVTT\n\n00:00:01.000 --> 00:00:02.000\nA WebVTT file named .srt\n")
    return {
        "encrypted.pdf": r"^encrypted PDF \(password protected\)$",
        "scanned.pdf": r"^no text layer \(",
        "truncated.pdf": r"^truncated PDF \(",
        "corrupt.pdf": r"^corrupt PDF \(",
        "truncated.docx": r"^corrupt DOCX \(not a complete ZIP archive\)$",
        "flipped.docx": r"^corrupt DOCX \(",
        "bomb.docx": r"^DOCX part word/document.xml is compressed \d+:1 \(over 100:1, a ZIP bomb\?\); not opened$",
        "bomb.zip": r"^ZIP would inflate to over 200 MiB; not opened$",
        "truncated.zip": r"^corrupt ZIP \(not a complete ZIP archive\)$",
        "huge.html": r"^too large for HTML \(50 MiB; at most 20 MiB",
        "error-page.pdf": r"^not a PDF \(content looks like HTML\)$",
        "noise.pdf": r"^not a PDF \(content looks like binary data\)$",
        "notes.docx": r"^not a DOCX \(content looks like text\)$",
        "locked.pptx": r"^encrypted PPTX \(password protected\)$",
        "locked.docx": r"^encrypted DOCX \(password protected\)$",
        "truncated.pptx": r"^corrupt PPTX \(not a complete ZIP archive\)$",
        "hollow.pptx": r"^corrupt PPTX \(",
        "memo.pptx": r"^not a PPTX \(content looks like a DOCX\)$",
        "sheet.xlsx": r"^corrupt XLSX \(",
        "truncated.xlsx": r"^corrupt XLSX \(not a complete ZIP archive\)$",
        "locked.xlsx": r"^encrypted XLSX \(password protected\)$",
        "truncated.epub": r"^corrupt EPUB \(not a complete ZIP archive\)$",
        "hollow.epub": r"^corrupt EPUB \(META-INF/container.xml names no package file\)$",
        "slides.epub": r"^not an EPUB \(content looks like a PPTX\)$",
        "drm.epub": r"^encrypted EPUB \(DRM-protected\)$",
        "notes.eml": r"^not an email \(content looks like text\)$",
        "logo.svg": r"^unsupported format \(SVG image\)$",
        "locked.odt": r"^encrypted ODT \(password protected\)$",
        "truncated.odt": r"^corrupt ODT \(not a complete ZIP archive\)$",
        "sheet.odt": r"^not an ODT \(content looks like an ODS\)$",
        "laughs.xml": r"^corrupt XML \(XMLSyntaxError: Maximum entity amplification factor exceeded",
        "broken.xml": r"^corrupt XML \(XMLSyntaxError: ",
        "poster.ps": r"^unsupported format \(PostScript: convert it to PDF, e.g. with ps2pdf\)$",
        "truncated.md.gz": r"^truncated gzip \(it ends before its last member does\)$",
        "bomb.txt.gz": r"^too large \(over 64 MiB decompressed\)$",
        "letter.rtf": r"^unsupported format \(RTF: save it as .docx or plain text\)$",
        "noise.txt": r"^not UTF-8, and no other text encoding reads it as text$",
        "damaged-utf16.txt": r"^not valid UTF-16 \(damaged text after a UTF-16 byte-order mark\)$",
        "truncated.ipynb": r"^corrupt notebook \(not JSON: ",
        "page.ipynb": r"^not a Jupyter notebook \(content looks like HTML\)$",
        "notes.vtt": r"^not WebVTT subtitles \(content looks like text\)$",
        "captions.srt": r"^not SubRip subtitles \(content looks like text\)$",
    }
