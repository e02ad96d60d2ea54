"""Turn PDF, HTML, DOCX, PPTX, ODT, ODS, ODP, EPUB, XLSX, XML, e-mail, notebooks, transcripts and CSV into
Markdown-flavoured text, or say why.

Segments are retrieved and prefilled as text, so every format must become
text first, and text a segmenter can cut well: headings as ATX lines
(``## Safety``, which also names a segment's section), tables as pipe rows,
list items as ``- `` lines, paragraphs and pages apart by blank lines. Each
format goes to the converter that measured best for it (BENCHMARKS.md,
"Document extraction (issue 32)"); none of them is a parser of ours:

* **PDF** — pypdfium2 (Chrome's PDFium): text in reading order, 4x faster than
  pypdf and 35x faster than pdfminer.six on the same pages, and it repairs
  what damage it can. Headings come from the PDF's outline (bookmarks) where
  the producer wrote one. Running headers and footers are kept once and
  printed page numbers dropped (:func:`_drop_running_lines`). Pages are
  joined by a blank line and :attr:`Converted.page_starts` says where each
  begins.
* **HTML** — trafilatura: keeps the article and drops navigation, cookie
  banners, footers and scripts, with headings, lists and tables as Markdown.
  A page too short for it to find an article is read whole (its text only).
* **DOCX** — python-docx: Word's own heading, list and table structure, in
  body order; 1.5x faster than mammoth's HTML, with no second conversion.
* **PPTX** — python-pptx (the library markitdown itself reads decks with): a
  slide is a page (PowerPoint prints and exports a slide per page, so "p. 3"
  is slide 3), its title a ``##`` heading, then its shapes top to bottom and
  left to right: a body placeholder's paragraphs as list items by level,
  other text boxes as paragraphs, tables as pipe rows, a chart as its title
  and its data's pipe rows, groups opened, and the speaker notes last.
  Footers, dates and slide numbers are left out (they repeat on every
  slide, as a web page's navigation does). A deck or document saved with a
  password is an OLE file, not a ZIP: named as encrypted (olefile).
* **EPUB** — the book's chapters in its spine's reading order (the package
  file's own list, read with lxml), each chapter's XHTML body converted by
  markdownify: headings as ``#`` lines, lists, tables as pipe rows. Not
  trafilatura, which looks for a web page's article in each chapter and on
  short ones drops their headings and lists. The navigation document (the
  table of contents) is left out; a book under DRM is named as such. EPUBs
  are reflowable, so they have no page numbers: chapters and headings
  name the sections.

* **E-mail (.eml)** — Python's ``email`` package: subject, people, date and
  the body (plain part first), then its attachments, each read as a file of
  its name would be (or named with why it cannot be).
* **Mailboxes (.mbox, .mbx, or an extensionless mbox as Thunderbird keeps a
  folder)** — every message as an .eml is read, in the file's order, each
  under its subject. Read as text they were headers, quoted-printable and
  base64 attachments.
* **XLSX** — openpyxl (read-only, cached values): each visible sheet a
  ``##`` section, its cells pipe rows under their header, repeated over
  every block of rows that fits a default segment (:func:`_table_blocks`).
  12x markitdown's speed (pandas), which also keeps hidden sheets and writes
  empty cells as ``NaN``.
* **CSV / TSV** — Python's ``csv``, the delimiter sniffed: read as text (any
  encoding), then the same blocks of pipe rows (:func:`delimited_table`).
* **ODT / ODS / ODP** — odfdo (its own Markdown export for text): LibreOffice's
  headings, lists and tables, its Markdown escapes inside a line removed;
  a Calc sheet read as an XLSX sheet is, an Impress deck as a PPTX one.
* **XML** — lxml: a DocBook, TEI or JATS document's text without its tags,
  titles as headings, a record's short fields as ``name: value``.
* **Jupyter notebooks (.ipynb)** — Python's ``json``: Markdown cells as they
  are, code cells fenced in the kernel's language, their text outputs after
  them (cut at 40 lines); images, HTML and widgets left out.
* **Transcripts (.vtt, .srt)** — webvtt-py: what was said, by whom, under a
  heading of its time range every two minutes, so answers cite the minutes.

Every converter is imported inside the function that needs it, so
``kvblend --help`` and plain-text ingest never pay for them (trafilatura
alone takes 0.2 s to import).

Untrusted files: what a file *is* comes from its bytes as well as its name
(:func:`classify`), so ``report.pdf`` holding an HTML error page is named, not
fed to PDFium. A DOCX is a ZIP: its declared sizes are checked before
anything is inflated (a ZIP bomb). HTML has a size cap of its own, since
trafilatura's tree building grows with it. Every conversion has a time
budget checked between pages. Whatever a converter raises becomes a
:class:`ConversionError` in :mod:`kvblend.documents`, one line, and the run
goes on; converters' own logging and warnings are silenced.
"""

from __future__ import annotations

import datetime
import functools
import html
import io
import logging
import re
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import PurePath

from kvblend.defaults import DEFAULT_CHUNK_TOKENS

__all__ = [
    "CONVERTED_FORMATS",
    "MAX_CONVERT_SECONDS",
    "MAX_HTML_BYTES",
    "MAX_ZIP_RATIO",
    "MAX_ZIP_UNCOMPRESSED_BYTES",
    "ConversionError",
    "Converted",
    "classify",
    "convert",
    "converter_identity",
    "decode_text",
    "block_tables",
    "delimited_table",
    "markdown_body",
    "text_document",
    "describe_error",
]

MAX_HTML_BYTES = 20 * 1024 * 1024  # a real article page is < 2 MB; trafilatura's time and memory grow with the tree
MAX_ZIP_UNCOMPRESSED_BYTES = 200 * 1024 * 1024  # a DOCX's parts, inflated, all together
MAX_ZIP_RATIO = 100  # per part (over 1 MiB): Word's XML deflates 5-20x, a bomb's zeros 1000x
MAX_ARCHIVE_MEMBERS = 10_000  # files read from one ZIP or tar: past it, a line each would bury the ingest's report
MAX_CONVERT_SECONDS = 120.0  # per file, checked between pages: a pathological file is skipped, not waited on

CONVERTED_FORMATS = (
    "pdf",
    "html",
    "docx",
    "pptx",
    "epub",
    "xlsx",
    "eml",
    "mbox",
    "odt",
    "ods",
    "odp",
    "xml",
    "ipynb",
    "vtt",
    "srt",
)

_MIB = 1024 * 1024
_HTML_EXTENSIONS = {".html", ".htm", ".xhtml", ".shtml"}
_TEXT_EXTENSIONS = {
    ".md": "markdown",
    ".markdown": "markdown",
    ".json": "text",
    ".jsonl": "text",
    ".csv": "csv",
    ".tsv": "tsv",
}
# Office formats that are ZIPs too, so an .xlsx is named as one rather than called "binary"
_OTHER_ZIPS = {"content.xml": "OpenDocument"}  # those kvblend reads are named from _ZIP_FORMATS


# Bumped whenever kvblend's own treatment of a format changes what text comes out (tidying, headings, running
# lines, encodings), so a file archived before is converted again rather than recognised by its bytes.
CONVERSION_REVISION = 5
# The libraries whose output is the text: a new version of one may read the same bytes differently.
_CONVERTER_PACKAGES = (
    "pypdfium2",
    "trafilatura",
    "python-docx",
    "python-pptx",
    "markdownify",
    "charset-normalizer",
    "openpyxl",
    "odfdo",
    "webvtt-py",
)


@functools.cache
def converter_identity() -> str:
    """What turns a file's bytes into text here: this module's revision and its libraries' versions.

    kvblend.documents hashes it with a file's bytes, so an archive can tell a file it has already read from
    its bytes alone, without converting it again (ingest's unchanged check), and no longer can once the
    converter changes."""
    import sys
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"kvblend-conversion/{CONVERSION_REVISION}", "python/{}.{}".format(*sys.version_info[:2])]  # email
    for package in _CONVERTER_PACKAGES:
        try:
            parts.append(f"{package}/{version(package)}")
        except PackageNotFoundError:
            parts.append(f"{package}/-")
    return " ".join(parts)


class ConversionError(Exception):
    """Why a file cannot become a document: one line, shown as the skip reason."""


@dataclass(frozen=True)
class Converted:
    """A converted file's text and what kvblend.documents.Document records about it."""

    text: str
    format: str
    page_starts: tuple[int, ...] = ()  # offsets into text where pages 1, 2, ... begin; empty without pages
    # A sheet's (XLSX, ODS, CSV, TSV) rows: (offset into text where a data row's pipe line begins, its row number as
    # the spreadsheet shows it), in text order; empty for other formats. What lets an answer cite "rows 26-50".
    row_marks: tuple[tuple[int, int], ...] = ()


# ─────────────────────────────── what is it ───────────────────────────────


def classify(suffix: str, data: bytes) -> str:
    """The format to read ``data`` as: one of :data:`CONVERTED_FORMATS`, ``"markdown"`` or ``"text"``.

    The extension says what the user expects and the first bytes what the file
    is; both must agree for PDF, DOCX and HTML, or the file is skipped naming
    what it looks like (a ``.pdf`` that is an HTML error page is the classic).
    Any other extension is read by content: a PDF or DOCX without its
    extension is still converted. ``.md``/``.json``/``.jsonl`` are text as
    they are. RTF is refused whatever its extension: it is text, so it would
    otherwise be ingested with its control words. Only the first bytes are
    looked at, so plain text pays nothing.

    Raises :class:`ConversionError` for a mismatch or a format kvblend does not read.
    """
    suffix = suffix.lower()
    if suffix in _TEXT_EXTENSIONS:
        return _TEXT_EXTENSIONS[suffix]
    if _is_rtf(data):  # text, but its control words would become the KV
        raise ConversionError("unsupported format (RTF: save it as .docx or plain text)")
    if _is_svg(data):  # an image written as XML: its path data would become the KV
        raise ConversionError("unsupported format (SVG image)")
    if _is_postscript(data):  # a page description program: its drawing operators would become the KV
        raise ConversionError("unsupported format (PostScript: convert it to PDF, e.g. with ps2pdf)")
    if data.startswith(_OLE_MAGIC) and _ole_encrypted(data):
        what = suffix[1:].upper() if suffix in (".docx", ".pptx", ".xlsx") else "Office file"
        raise ConversionError(f"encrypted {what} (password protected)")
    if suffix == ".pdf":
        if b"%PDF-" not in data[:1024]:  # where Acrobat looks for the header
            raise ConversionError(f"not a PDF (content looks like {_describe(data)})")
        return "pdf"
    if suffix in _ZIP_FORMATS:
        fmt, named, _ = _ZIP_FORMATS[suffix]
        # a ZIP cut short (no central directory) is a damaged one of its kind, which conversion names as such
        if not _is_zip(data) or (_zip_names(data) is not None and _zip_format(data) != fmt):
            raise ConversionError(f"not {named} (content looks like {_describe(data)})")
        return fmt
    if suffix == ".eml":
        if not _EMAIL_HEADER.match(_eml_headers(data[:2048])):
            raise ConversionError(f"not an email (content looks like {_describe(data)})")
        return "eml"
    if suffix in _MBOX_EXTENSIONS:
        if not _MBOX_START.match(data[:2048].lstrip(b"\xef\xbb\xbf \t\r\n")):
            raise ConversionError(f"not a mailbox (content looks like {_describe(data)})")
        return "mbox"
    if suffix in (".vtt", ".srt"):  # a transcript's cue numbers and timings would become the KV
        fmt = suffix[1:]
        head = data[:512]
        if (wide := _wide_bom(head)) is not None:  # Windows tools write UTF-16 subtitles: matched as their text
            head = head.decode(wide, "ignore").encode("utf-8")
        if not _TRANSCRIPT_START[fmt].match(head.lstrip(b"\xef\xbb\xbf \t\r\n")):
            named = "WebVTT" if fmt == "vtt" else "SubRip"
            raise ConversionError(f"not {named} subtitles (content looks like {_describe(data)})")
        return fmt
    if suffix == ".ipynb":  # JSON: read as text, its escaped sources and base64 images would become the KV
        if data.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] not in (b"{", b"["):
            raise ConversionError(f"not a Jupyter notebook (content looks like {_describe(data)})")
        return "ipynb"
    if suffix in _HTML_EXTENSIONS:
        if _is_pdf(data) or _is_zip(data) or (b"\x00" in data[:4096] and _wide_bom(data) is None):
            raise ConversionError(f"not HTML (content looks like {_describe(data)})")
        return "html"
    if _is_pdf(data):
        return "pdf"
    if _is_zip(data):
        if (found := _zip_format(data)) is not None:
            return found
        raise ConversionError(f"unsupported format ({_describe(data)})")
    if data.startswith(_OLE_MAGIC):
        raise ConversionError("unsupported format (legacy Office file: .doc/.xls/.ppt; save it as .docx)")
    if _MBOX_START.match(data[:2048]):  # Thunderbird's folders (no extension), git format-patch's .patch
        return "mbox"
    if _looks_like_html(data):
        return "html"
    if suffix in _XML_EXTENSIONS or _is_xml(data):  # DocBook, JATS, TEI, a feed: its tags would become the KV
        return "xml"
    return "text"


_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"  # an OLE compound file: legacy Office, or OOXML under a password


def _ole_encrypted(data: bytes) -> bool:
    """Whether an OLE compound file is an Office document saved with a password: Word, PowerPoint and Excel
    then store the whole OOXML package AES-encrypted in an ``EncryptedPackage`` stream (MS-OFFCRYPTO), so a
    locked .docx or .pptx is no ZIP at all. olefile reads the compound file's directory; nothing is decrypted."""
    import olefile  # lazy: only OLE files need it

    try:
        with olefile.OleFileIO(data) as ole:
            return bool(ole.exists("EncryptedPackage"))
    except Exception:  # a damaged compound file: whatever it is, it is not read (the caller's reason stands)
        return False


def _is_postscript(data: bytes) -> bool:
    """PostScript or EPS: "%!PS" first (after a DOS EPS binary header's magic, or a ^D that old drivers sent)."""
    return data[:8].lstrip(b"\x04").startswith(b"%!PS") or data.startswith(b"\xc5\xd0\xd3\xc6")


def _is_rtf(data: bytes) -> bool:
    return data[:64].lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{\\rtf")


def _is_pdf(data: bytes) -> bool:
    return data.startswith(b"%PDF-")


def _is_zip(data: bytes) -> bool:
    return data.startswith((b"PK\x03\x04", b"PK\x05\x06"))


def _zip_names(data: bytes) -> set[str] | None:
    """The member names of a ZIP (from its central directory: nothing is inflated), or None if it is no ZIP."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return set(z.namelist())
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        return None


# The ZIP-based formats kvblend reads: extension → (format, how a skip reason names it, the member that marks it)
_ZIP_FORMATS = {
    ".docx": ("docx", "a DOCX", "word/document.xml"),
    ".pptx": ("pptx", "a PPTX", "ppt/presentation.xml"),
    ".xlsx": ("xlsx", "an XLSX", "xl/workbook.xml"),
    ".epub": ("epub", "an EPUB", "META-INF/container.xml"),
    ".odt": ("odt", "an ODT", "content.xml"),  # and its mimetype member says which (ODP holds content.xml too)
    ".ods": ("ods", "an ODS", "content.xml"),
    ".odp": ("odp", "an ODP", "content.xml"),
}
_ODF_MIMETYPES = {
    "odt": b"application/vnd.oasis.opendocument.text",
    "ods": b"application/vnd.oasis.opendocument.spreadsheet",
    "odp": b"application/vnd.oasis.opendocument.presentation",
}


def _zip_format(data: bytes) -> str | None:
    """Which of :data:`_ZIP_FORMATS` a ZIP is, from its member names (None: none of them, or no ZIP)."""
    names = _zip_names(data) if _is_zip(data) else None
    if names is None:
        return None
    for fmt, _, marker in _ZIP_FORMATS.values():
        if marker in names and (fmt not in _ODF_MIMETYPES or _odf_mimetype(data) == _ODF_MIMETYPES[fmt]):
            return fmt
    return None


def _odf_mimetype(data: bytes) -> bytes | None:
    """An OpenDocument package's `mimetype` member (text, spreadsheet, presentation ...; None: it has none)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return z.read("mimetype")[:200].strip() if "mimetype" in z.NameToInfo else None
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError):
        return None


# What may come before a markup document's first element: whitespace, an XML declaration, comments (browsers'
# "saved from url" one); and, where the caller does not look at it, a DOCTYPE.
_LEADING_MARKUP = re.compile(rb"\s*(?:<\?.*?\?>|<!--.*?-->)", re.S)
_LEADING_MARKUP_OR_DOCTYPE = re.compile(rb"\s*(?:<\?.*?\?>|<!--.*?-->|<!DOCTYPE[^>]*>)", re.S | re.I)


def _first_markup(data: bytes, leading: re.Pattern[bytes] = _LEADING_MARKUP) -> bytes | None:
    """The first 4 KiB of a markup document from its first element on (after a BOM and what ``leading``
    matches), lowercased; None for bytes that do not open with ``<``."""
    if not data[:256].lstrip(b"\xef\xbb\xbf \t\r\n\f").startswith(b"<"):  # plain text's fast way out
        return None
    head = data[:4096].removeprefix(b"\xef\xbb\xbf")
    pos = 0
    while (m := leading.match(head, pos)) is not None and m.end() > pos:
        pos = m.end()
    return head[pos:].lstrip().lower()


def _is_svg(data: bytes) -> bool:
    """An SVG image: ``<svg`` first, after a BOM, whitespace, an XML declaration, comments and a DOCTYPE."""
    rest = _first_markup(data, _LEADING_MARKUP_OR_DOCTYPE)
    return rest is not None and rest.startswith(b"<svg")


_XML_EXTENSIONS = {".xml", ".dbk", ".docbook", ".tei", ".jats", ".nxml"}


def _is_xml(data: bytes) -> bool:
    """An XML document by its declaration (``<?xml``, after a BOM and whitespace)."""
    return data[:64].removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"<?xml")


def _looks_like_html(data: bytes) -> bool:
    """A whole HTML document: ``<!DOCTYPE html`` or ``<html`` first, after a BOM, whitespace, an XML
    declaration or comments. A text that only mentions a tag is text."""
    rest = _first_markup(data)
    return rest is not None and rest.startswith((b"<!doctype html", b"<html"))


def _describe(data: bytes) -> str:
    """What some bytes look like, for a skip reason: 'HTML', 'a PDF', 'a ZIP archive', 'text', 'binary data'."""
    if not data.strip():
        return "an empty file"
    if _is_pdf(data):
        return "a PDF"
    if data.startswith(_OLE_MAGIC):
        return "a legacy Office file"
    if _is_rtf(data):
        return "RTF"
    if _is_svg(data):
        return "an SVG image"
    if _is_zip(data):
        if (fmt := _zip_format(data)) is not None:
            return next(named for f, named, _ in _ZIP_FORMATS.values() if f == fmt)
        names = _zip_names(data)
        if names is None:
            return "a damaged ZIP archive"
        kind = next((what for marker, what in _OTHER_ZIPS.items() if marker in names), None)
        return f"{kind} file" if kind else "a ZIP archive"
    if _looks_like_html(data) or re.search(rb"<(?:html|body|head|div|p)[\s>]", data[:4096], re.I):
        return "HTML"
    head = data[:4096]
    if b"\x00" in head:
        return "binary data"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the end of the sample
            return "binary data"
    return "text"


# ─────────────────────────────── plain text ───────────────────────────────


def _wide_bom(data: bytes) -> str | None:
    """The encoding a UTF-16 or UTF-32 byte-order mark names ("utf-16", "utf-32"; None: none of them)."""
    return next((enc for bom, enc in _BOMS if enc != "utf-8-sig" and data.startswith(bom)), None)


# Byte-order marks, longest first: UTF-32 LE's begins with UTF-16 LE's.
_BOMS = (
    (b"\xff\xfe\x00\x00", "utf-32"),
    (b"\x00\x00\xfe\xff", "utf-32"),
    (b"\xef\xbb\xbf", "utf-8-sig"),
    (b"\xff\xfe", "utf-16"),
    (b"\xfe\xff", "utf-16"),
)
# A legacy encoding charset-normalizer may rank level with others on a short Western text (chaos and coherence
# alike): cp1250 and cp1252 decode "Café" the same and "crème" differently. Windows-1252 is what browsers assume
# for unlabelled Western pages (WHATWG's encoding standard), and what Windows wrote for most of the world.
_PREFERRED_ON_A_TIE = ("cp1252",)


def decode_text(data: bytes) -> tuple[str, str]:
    """A plain-text file's text and the encoding it was read in ("utf-8", "utf-16", "cp1252", ...).

    Real corpora are not all UTF-8: Windows Notepad's "Unicode" and Windows PowerShell's ``>`` write UTF-16
    with a byte-order mark, and older files are in a legacy code page (Windows-1252, Shift-JIS, KOI8-R).
    A byte-order mark is believed; then NUL bytes mean binary; then UTF-8, which almost every file is
    (strict: one bad byte and it is not); then charset-normalizer (the detector requests and markitdown use)
    picks the legacy encoding whose decoding reads as language, or none: bytes no encoding makes sense of
    are skipped rather than ingested as mojibake. The text is exact otherwise (no normalisation here).

    Raises :class:`ConversionError` with the skip reason.
    """
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding), encoding.removesuffix("-sig")
            except UnicodeDecodeError:
                name = encoding.removesuffix("-sig").upper()
                raise ConversionError(f"not valid {name} (damaged text after a {name} byte-order mark)") from None
    if b"\x00" in data:
        raise ConversionError("binary")
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        pass
    detected = _detect_encoding(data)
    try:
        if detected is not None:  # the detector reads a sample of a large file: the rest must decode too
            return data.decode(detected), detected
    except UnicodeDecodeError:
        pass
    raise ConversionError("not UTF-8, and no other text encoding reads it as text")


def _detect_encoding(data: bytes) -> str | None:
    """charset-normalizer's pick for bytes that are not UTF-8, with :data:`_PREFERRED_ON_A_TIE` breaking ties."""
    import charset_normalizer  # lazy: only files that are not UTF-8 need it

    matches = list(charset_normalizer.from_bytes(data))
    if not matches:
        return None
    best = matches[0]  # ranked by chaos (mess), then coherence (language)
    tied = [m for m in matches if m.chaos == best.chaos and m.coherence == best.coherence]
    for preferred in _PREFERRED_ON_A_TIE:
        for match in tied:
            if preferred in (match.encoding, *match.could_be_from_charset):
                return preferred
    return best.encoding


# ─────────────────────────────── Markdown ───────────────────────────────

_FRONT_MATTER = re.compile(r"\A(---|\+\+\+)[ \t]*\n(.*?)\n(---|\.\.\.|\+\+\+)[ \t]*(?:\n|\Z)", re.S)
_MAX_FRONT_MATTER = 64 * 1024
_FRONT_MATTER_TEXT = ("description", "summary", "abstract")  # keys whose value is prose worth keeping


def markdown_body(text: str) -> str:
    """A Markdown file's text without its front matter, its title and description kept as text.

    Static-site and notes tools (Jekyll, Hugo, Docusaurus, MkDocs, Obsidian) start a page with a YAML block
    between ``---`` lines (TOML between ``+++`` for Hugo): ``title``, ``layout``, ``tags``, ``date``,
    ``draft``. Read as text, that block becomes KV and the first segment's text, and the title names no
    section (sections come from ``#`` headings). The block is parsed (PyYAML's safe loader,
    or tomllib: data only, never objects) and replaced by the page's title as a ``#`` heading, unless the
    body has one, and its description as a paragraph; the other keys are page settings, not content. Text
    that does not open with a block that parses as a mapping is returned as it is.
    """
    m = _FRONT_MATTER.match(text[: _MAX_FRONT_MATTER + 8])
    if m is None or (m.group(1) == "+++") != (m.group(3) == "+++"):
        return text
    meta = _parse_front_matter(m.group(2), toml=m.group(1) == "+++")
    if meta is None:
        return text
    body = text[m.end() :].lstrip("\n")
    kept = []
    title = _scalar_text(meta.get("title"))
    if title and not body.startswith("# "):
        kept.append("# " + " ".join(title.split()))
    for key in _FRONT_MATTER_TEXT:
        value = _scalar_text(meta.get(key))
        if value:
            kept.append(value)
            break
    return "\n\n".join([*kept, body]) if kept else body


def _scalar_text(value: object) -> str:
    """A front-matter value as the text its author wrote, for the scalars YAML and TOML read as something else
    (`title: 1984` is an int, `title: 2024-01-01` a date); "" for a list, a mapping, a boolean or nothing."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float, datetime.date, datetime.time)):
        return ""
    return str(value.isoformat() if isinstance(value, (datetime.date, datetime.time)) else value).strip()


def _parse_front_matter(block: str, toml: bool) -> dict | None:
    """The block as a mapping, or None if it is not one (then the text is left as it is)."""
    try:
        if toml:
            import tomllib

            return tomllib.loads(block)
        import yaml  # PyYAML, already installed with transformers

        value = yaml.safe_load(block)
    except Exception:  # not front matter after all: a thematic break, a table, prose between rules
        return None
    return value if isinstance(value, dict) else None


# ─────────────────────────────── conversion ───────────────────────────────


def convert(fmt: str, data: bytes) -> Converted:
    """The Markdown-flavoured text of a file of format ``fmt`` (one of :data:`CONVERTED_FORMATS`).

    Raises :class:`ConversionError` with the reason to skip it; other exceptions
    from a converter are the caller's to catch (kvblend.documents turns them into
    one line too).
    """
    converter = _converter(fmt)
    with _quiet():
        return converter(data, time.monotonic())  # the start, for the time budget checked between pages


def _converter(fmt: str) -> Callable[[bytes, float], Converted]:
    """Each format's converter is the function ``_convert_<format>``, looked up when called (a test replaces
    one); it takes the bytes and the time its budget started."""
    converter = globals().get(f"_convert_{fmt}") if fmt in CONVERTED_FORMATS else None
    if converter is None:
        raise ValueError(f"no converter for {fmt!r}")
    return converter


_NOISY_LOGGERS = (
    "trafilatura",
    "htmldate",
    "courlan",
    "justext",
    "readability",
    "charset_normalizer",
    "docx",
    "pptx",
    "openpyxl",
)


@contextmanager
def _quiet() -> Iterator[None]:
    """No converter may print: their warnings and log records about odd input would garble the progress bar
    and the one line per skipped file (their failures reach the user as that line)."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def describe_error(e: BaseException) -> str:
    """An exception as a few words for a skip reason: its type and the first 100 characters of its message."""
    detail = " ".join(str(e).split())[:100]
    return f"{type(e).__name__}: {detail}" if detail else type(e).__name__


@contextmanager
def _damage_named(what: str) -> Iterator[None]:
    """What a converter raises while reading a ZIP-based file's parts (BadZipFile for a bad CRC, zlib.error,
    lxml's XMLSyntaxError, KeyError for a missing part) becomes ``corrupt WHAT (...)``; our own reasons pass."""
    try:
        yield
    except ConversionError:
        raise
    except Exception as e:
        raise ConversionError(f"corrupt {what} ({describe_error(e)})") from None


def _check_time(started: float) -> None:
    if time.monotonic() - started > MAX_CONVERT_SECONDS:
        raise ConversionError(f"took longer than {MAX_CONVERT_SECONDS:.0f} s to convert")


# Control characters are no text, and each would reach the KV and split the word it sits in. PDFium puts them
# in a page's text: U+0002 where it joined a word hyphenated over a line end ("back\x02ground": the hyphen and the
# line break already gone), other C0 codes for glyphs a font maps to no character (a math font's symbols), and
# U+FFFE, older PDFium's hyphen mark. Justified PDFs hyphenate: 9-80 per manual in /usr/share/doc's.
# U+00AD, a soft hyphen, is a break hint that splits its word.
_CONTROLS = re.compile("[\x00-\x08\x0e-\x1f\u00ad\ufffe\uffff]")


def _tidy(text: str) -> str:
    """Trailing spaces off every line, at most one blank line in a row, no control characters (:data:`_CONTROLS`)
    or lone surrogates, ends stripped."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\v", "\n").replace("\f", "\n\n")
    text = _CONTROLS.sub("", text)  # a vertical tab (Office's line break) and a form feed were breaks: kept as such
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text.encode("utf-8", "replace").decode("utf-8")  # PDFs can hold lone UTF-16 surrogates


# PDF ────────────────────────────────────────────────────────────────────────


def _convert_pdf(data: bytes, started: float) -> Converted:
    import pypdfium2 as pdfium  # lazy: a 0.06 s import that plain text never needs

    if b"%%EOF" not in data[-1024:]:  # where Acrobat looks for the end marker
        raise ConversionError("truncated PDF (no %%EOF end marker: the file was cut short)")
    try:
        pdf = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as e:
        code = getattr(e, "err_code", None)
        if code == pdfium.raw.FPDF_ERR_PASSWORD:
            raise ConversionError("encrypted PDF (password protected)") from None
        if code == pdfium.raw.FPDF_ERR_SECURITY:
            raise ConversionError("encrypted PDF (unsupported security handler)") from None
        raise ConversionError("corrupt PDF (PDFium cannot read it)") from None
    try:
        headings = _pdf_headings(pdf)
        pages: list[str] = []
        for index in range(len(pdf)):
            _check_time(started)
            page = pdf[index]
            try:
                textpage = page.get_textpage()
                try:
                    raw = textpage.get_text_bounded()
                finally:
                    textpage.close()
            finally:
                page.close()
            pages.append(_tidy(raw))
    finally:
        pdf.close()
    if not pages:
        raise ConversionError("PDF has no pages")
    if not any(p.strip() for p in pages):
        raise ConversionError("no text layer (a scanned or image-only PDF; run OCR on it first)")
    titles = [{" ".join(t.split()).casefold() for t, _ in headings.get(i, [])} for i in range(len(pages))]
    pages, running = _drop_running_lines(pages, titles)
    pages = [_escape_markup(text) for text in pages]  # a PDF's headings are its outline's, never its '#' lines
    return _paged([_mark_headings(text, headings.get(i, []), running) for i, text in enumerate(pages)], "pdf")


#: What starts a rule that underlines a title in Markdown (= -) or reStructuredText (~ ^ * +): the segmenter's
#: underlined headings, and what a PDF's text must not be read as.
UNDERLINE_RULE = r"(?:={3}|-{3}|~{3}|\^{3}|\*{3}|\+{3})"
_MARKUP_LINE = re.compile(r"^( {0,3})(#{1,6}(?:[ \t]|$)|" + UNDERLINE_RULE + ")", re.MULTILINE)


def _escape_markup(text: str) -> str:
    """A PDF page's text with what Markdown would read as a heading escaped: a line that starts with '#' (a
    shell comment in a listing, "# of cycles") and a rule of '=', '-', '~', ... (which underlines the line above
    it). The segmenter reads section headings from Markdown; a PDF's are marked from its outline alone."""
    return _MARKUP_LINE.sub(lambda m: m.group(1) + "\\" + m.group(2), text)


_EDGE_LINES = 2  # a page's first and last lines: where running headers, footers and page numbers sit
_RUNNING_MIN_PAGES = 3
_RUNNING_MIN_SHARE = 0.25  # of the pages: a book's title on every other page counts, a chapter's name may not
_PAGE_NUMBER_MAX_WORDS = 8  # "Page 3 of 40", "- 3 -", "Orca manual | 3": short
_RUNNING_MAX_WORDS = 12  # a header or footer is a title, a name, a notice; a full-width line of body text is longer
_NUMBER = re.compile(r"\d+")


def _drop_running_lines(pages: list[str], keep: list[set[str]] | None = None) -> tuple[list[str], set[str]]:
    """The pages without their running headers and footers, and without printed page numbers.

    Every page of a real PDF repeats its header and footer ("Kestrel Pumps Ltd - Orca service manual",
    "Page 3 of 40"), which would become KV on every page, split a sentence running over a page break, and
    pull retrieval to any segment holding them. Like trafilatura on a web page's navigation, this drops them,
    from their place only: a page's first and last :data:`_EDGE_LINES` lines.

    - A short line (:data:`_RUNNING_MAX_WORDS`) that recurs at an edge on at least :data:`_RUNNING_MIN_PAGES`
      pages and :data:`_RUNNING_MIN_SHARE` of them is a running header or footer. Its first occurrence is kept (nothing
      is lost: a table header repeated over pages keeps one copy), the rest dropped.
    - A short edge line whose digits differ from page to page is a page number when it is written as one
      (:func:`_page_number_form`) and, over the pages it is on, one of its numbers is the page's index plus
      one constant (printed numbering may start anywhere). Every occurrence is dropped: kvblend records pages
      itself.

    A PDF of fewer pages has nothing to tell a running line from content by, and is returned as it is.
    ``keep``: per page, the outline's titles there (whitespace collapsed, case folded), never dropped: a
    catalogue's "Specifications" atop every page is each page's heading. Returns the pages and the running
    lines' texts (as compared), where a title that is also a running header must not be taken for the heading.
    """
    if len(pages) < _RUNNING_MIN_PAGES:
        return pages, set()
    lines = [page.split("\n") for page in pages]
    # each page's edge lines, by index, as compared: whitespace collapsed, case folded
    edges = [{i: " ".join(page_lines[i].split()).casefold() for i in _edge_indices(page_lines)} for page_lines in lines]
    enough = max(_RUNNING_MIN_PAGES, _RUNNING_MIN_SHARE * len(pages))

    pages_with: dict[str, set[int]] = {}  # an edge line's text -> the pages it is on
    numbered: dict[str, list[tuple[int, list[int]]]] = {}  # its shape, digits as '#' -> (page, its numbers)
    for index, edge in enumerate(edges):
        for text in edge.values():
            pages_with.setdefault(text, set()).add(index)
            numbers = [int(n) for n in _NUMBER.findall(text)]
            if numbers and len(text.split()) <= _PAGE_NUMBER_MAX_WORDS:
                numbered.setdefault(_NUMBER.sub("#", text), []).append((index, numbers))
    running = {text for text, on in pages_with.items() if len(on) >= enough and len(text.split()) <= _RUNNING_MAX_WORDS}
    page_numbers = {
        shape: found
        for shape, seen in numbered.items()
        if _page_number_form(shape) and (found := _counts_pages(seen, enough)) is not None
    }

    out: list[str] = []
    seen_running: set[str] = set()
    for index, (page_lines, edge) in enumerate(zip(lines, edges)):
        drop = set()
        titles = keep[index] if keep is not None else set()
        for i, text in edge.items():
            found = page_numbers.get(_NUMBER.sub("#", text))
            numbers = [int(n) for n in _NUMBER.findall(text)]
            if found is not None and len(numbers) > found[0] and numbers[found[0]] - index == found[1]:
                drop.add(i)  # this page's own number: "42" at the foot of page 7 is a value, not one
            elif text in running and text not in titles:
                if text in seen_running:
                    drop.add(i)
                seen_running.add(text)
        kept = [line for i, line in enumerate(page_lines) if i not in drop]
        out.append("\n".join(kept).strip())
    return out, running


def _edge_indices(page_lines: list[str]) -> list[int]:
    """Indices of a page's first and last :data:`_EDGE_LINES` non-blank lines (each once)."""
    filled = [i for i, line in enumerate(page_lines) if line.strip()]
    return sorted(set(filled[:_EDGE_LINES] + filled[-_EDGE_LINES:]))


_DECORATION = " -\u2013\u2014_|\u00b7\u2022.,:;()[]{}<>*"
_PAGE_WORD_NUMBER = re.compile(
    r"(?:page|pg\.?|p\.|pp\.|seite|s\.|p\u00e1gina|pagina|pag\.?) ?#(?: ?(?:of|/|von|de|di) ?#)?"
)
_NUMBER_OF_NUMBER = re.compile(r"# ?(?:of|/) ?#")
_TITLE_AND_NUMBER = re.compile(r".+ [|\u00b7\u2022\u2013\u2014-] ?#|# ?[|\u00b7\u2022\u2013\u2014-] .+")


def _page_number_form(shape: str) -> bool:
    """Whether an edge line's shape (digits as '#') is written as a page number: the number alone ("#", "- # -",
    "[#]"), after a page word ("Page # of #", "p. #"), as "# of #" or "# / #", or beside a title across a
    separator ("Orca manual | #"). Rising numbers alone do not make one: a quiz's "Question 3" and a diary's
    "Day 3" atop each page, or a paragraph's wrapped last line, climb with the pages too, and are content."""
    core = shape.strip(_DECORATION)
    return (
        core == "#"
        or _PAGE_WORD_NUMBER.fullmatch(core) is not None
        or _NUMBER_OF_NUMBER.fullmatch(core) is not None
        or _TITLE_AND_NUMBER.fullmatch(core) is not None
    )


def _counts_pages(seen: list[tuple[int, list[int]]], enough: float) -> tuple[int, int] | None:
    """Whether lines of one shape, seen on these (page index, numbers in the line), number the pages, and how:
    the (number's position in the line, offset from the page index) that enough pages, and 80% of the pages
    the shape is on, agree on. Counted by page, not by line: a value line of the same shape ("42" under a
    table) on some pages neither dilutes the pages' own numbers nor is taken for one."""
    pages = {index for index, _ in seen}
    if len(pages) < enough:
        return None
    agreeing: dict[tuple[int, int], set[int]] = {}
    for index, numbers in seen:
        for position, n in enumerate(numbers):
            agreeing.setdefault((position, n - index), set()).add(index)
    best, on = max(agreeing.items(), key=lambda item: len(item[1]))
    return best if len(on) >= max(enough, 0.8 * len(pages)) else None


def _paged(pages: list[str], fmt: str) -> Converted:
    """Pages joined by a blank line (no paragraph spans a page join), with the offset where each begins."""
    starts: list[int] = []
    offset = 0
    for page_text in pages:
        starts.append(offset)
        offset += len(page_text) + 2
    return Converted("\n\n".join(pages), fmt, tuple(starts))


def _pdf_headings(pdf) -> dict[int, list[tuple[str, int]]]:
    """The outline's entries per page index: (title, level from 1). A PDF without an outline has none."""
    out: dict[int, list[tuple[str, int]]] = {}
    try:
        for item in pdf.get_toc(max_depth=6):
            dest = item.get_dest()
            index = dest.get_index() if dest is not None else None
            title = " ".join((item.get_title() or "").split())
            if index is not None and title:
                out.setdefault(index, []).append((title, min(item.level + 1, 6)))
    except Exception:  # a damaged outline costs the headings, not the document
        return {}
    return out


def _mark_headings(text: str, headings: list[tuple[str, int]], running: set[str] | frozenset[str] = frozenset()) -> str:
    """Turn the lines of a page that are its outline entries' titles into ATX headings, each its own paragraph.
    A title wrapped over two lines is matched too; a title not found on its page is left out, and the others
    are still looked for (one unmatched title hid every later one). Titles are found in outline order where
    the text allows it. A title that is also a running header (`running`: "Safety" atop each page of its
    section) is the line that is not at the page's edge, where there is one: the header is no heading."""
    if not headings:
        return text
    lines = text.split("\n")
    flat = [" ".join(line.split()).casefold() for line in lines]
    edges = set(_edge_indices(lines))
    marked: dict[int, tuple[int, int]] = {}  # first line -> (level, lines it spans)
    used: set[int] = set()
    after = -1
    for title, level in headings:
        wanted = " ".join(title.split()).casefold()
        found = [
            (i, span)
            for i in range(len(lines))
            for span in (1, 2)
            if i + span <= len(lines) and not used & set(range(i, i + span)) and " ".join(flat[i : i + span]) == wanted
        ]
        if not found:
            continue
        if wanted in running and len(found) > 1:
            inner = [f for f in found if f[0] not in edges]
            pick = inner[0] if inner else found[-1]
        else:
            pick = next((f for f in found if f[0] > after), found[0])
        marked[pick[0]] = (level, pick[1])
        used.update(range(pick[0], pick[0] + pick[1]))
        after = pick[0]
    out: list[str] = []
    i = 0
    while i < len(lines):
        if i in marked:
            level, span = marked[i]
            if out and out[-1] != "":
                out.append("")
            out.extend(("#" * level + " " + " ".join(" ".join(lines[i + k].split()) for k in range(span)), ""))
            i += span
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out).strip()


# HTML ───────────────────────────────────────────────────────────────────────


def _convert_html(data: bytes, started: float) -> Converted:
    if len(data) > MAX_HTML_BYTES:
        raise ConversionError(
            f"too large for HTML ({len(data) // _MIB} MiB; at most {MAX_HTML_BYTES // _MIB} MiB of a web page is read)"
        )
    import trafilatura  # lazy: 0.2 s to import

    data = _html_as_utf8(data)
    if b"<html" not in data[:4096].lower():  # a fragment ("<p>...</p>"): trafilatura reads only whole pages
        data = b"<html><body>" + data + b"</body></html>"
    text = trafilatura.extract(
        data,  # UTF-8, declared nowhere: trafilatura detects UTF-8
        output_format="markdown",
        include_tables=True,
        include_formatting=True,  # headings as '#' lines (and bold/italic), lists as '- '
        include_links=False,
        include_images=False,
        include_comments=False,
        deduplicate=False,
        with_metadata=False,
    )
    if not text or not text.strip():
        # too little text for an article (a short page, a fragment): all of its text, with no boilerplate filter
        text = trafilatura.html2txt(data)
    text = block_tables(_tidy(text or ""))
    if not text:
        raise ConversionError("no text in the HTML page")
    return Converted(text, "html")


_CHARSET_DECLARATION = re.compile(
    rb"(?i)<meta[^>]*charset\s*=\s*[\"']?\s*([\w.:-]+)[^>]*>|<\?xml[^>]*encoding\s*=\s*[\"']([\w.:-]+)[^>]*\?>"
)
# WHATWG's Encoding Standard: browsers read these labels as Windows-1252, a superset (curly quotes, dashes, €)
_READ_AS_CP1252 = {"iso8859-1", "ascii"}


def _html_as_utf8(data: bytes) -> bytes:
    """The page's bytes as UTF-8, its charset declarations removed, decoded as a browser would: a byte-order
    mark, else the charset the page declares if its bytes are that, else as a plain-text file
    (:func:`decode_text`: UTF-8, else the detected legacy code page, Windows-1252 on a tie).

    trafilatura, handed the bytes, guessed the code page itself and read an unlabelled Latin-1 page as
    Central European ("grand-mčre"), and believed a `<meta charset="utf-8">` its bytes were not. Bytes that
    no encoding reads (binary named .html) go to trafilatura as they are."""
    marked = _wide_bom(data) is not None or data.startswith(b"\xef\xbb\xbf")
    text = None
    if not marked:
        for match in _CHARSET_DECLARATION.finditer(data[:4096]):
            text = _decoded_as(data, (match.group(1) or match.group(2)).decode("ascii", "replace"))
            break
    if text is None:
        try:
            text = decode_text(data)[0]
        except ConversionError:
            if marked:  # damaged text after its byte-order mark: named as such
                raise
            return data
    encoded = text.encode("utf-8", "surrogatepass")
    return _CHARSET_DECLARATION.sub(b"", encoded)  # anywhere: lxml believes a late <meta> too


def _decoded_as(data: bytes, label: str) -> str | None:
    """`data` in the encoding a page declares, or None where the label is unknown, names a 16/32-bit encoding
    (a page without a byte-order mark is none), or the bytes are not in it."""
    import codecs

    try:
        name = codecs.lookup(label).name
    except LookupError:
        return None
    if name.startswith(("utf-16", "utf-32")):
        return None
    for candidate in ["cp1252", name] if name in _READ_AS_CP1252 else [name]:
        try:
            return data.decode(candidate)
        except UnicodeDecodeError:
            continue
    return None


# DOCX ───────────────────────────────────────────────────────────────────────


def _check_zip(data: bytes, what: str) -> None:
    """Refuse a ZIP whose parts would inflate past the caps, from the sizes its central directory declares,
    before anything is inflated (Python's zipfile stops a part at its declared size, so they bound it)."""
    total = 0
    for info in _zip_infos(data, what):
        total += info.file_size
        if total > MAX_ZIP_UNCOMPRESSED_BYTES:
            raise ConversionError(
                f"{what} would inflate to over {MAX_ZIP_UNCOMPRESSED_BYTES // _MIB} MiB (a ZIP bomb?); not opened"
            )
        if (ratio := _bomb_ratio(info)) is not None:
            raise ConversionError(
                f"{what} part {info.filename} is compressed {ratio}:1 (over {MAX_ZIP_RATIO}:1, a ZIP bomb?); not opened"
            )


def _zip_infos(data: bytes, what: str) -> list[zipfile.ZipInfo]:
    """A ZIP's central directory (nothing inflated); a damaged one is ``corrupt {what}``."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return z.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        raise ConversionError(f"corrupt {what} (not a complete ZIP archive)") from None


def _bomb_ratio(info: zipfile.ZipInfo) -> int | None:
    """A part's declared compression ratio where it is over :data:`MAX_ZIP_RATIO`:1 and the part over 1 MiB (a
    bomb's zeros); None otherwise."""
    if info.file_size > _MIB and info.file_size > MAX_ZIP_RATIO * max(info.compress_size, 1):
        return info.file_size // max(info.compress_size, 1)
    return None


def is_document_zip(suffix: str, data: bytes) -> bool:
    """Whether a file is a ZIP of documents (a folder someone zipped, a download of a manual's files), to read
    member by member: a ``.zip`` that is no DOCX, XLSX, EPUB or other format kvblend reads as one document."""
    return suffix.lower() == ".zip" and _is_zip(data) and _zip_format(data) is None


# Members of a zipped folder that hold no document: macOS's resource forks, and the ones a file manager hides
_ZIP_NOISE = ("__MACOSX", ".DS_Store", "Thumbs.db", "desktop.ini")


def zip_members(data: bytes, max_member_bytes: int) -> Iterator[tuple[str, bytes | str]]:
    """A ZIP's files in their stored order, as (member path, bytes) or, for one that cannot be read, (member
    path, why), each read as a file in a folder would be, nothing extracted to disk.

    The whole ZIP is refused (:class:`ConversionError`) where it is damaged, or where the members it would read
    declare over :data:`MAX_ZIP_UNCOMPRESSED_BYTES` in all; each member is checked from the central directory
    before it is inflated (Python's zipfile stops a member at its declared size, and its CRC then fails). Left
    out, as the folder walk leaves them: folders, hidden files and folders (``.git/``), macOS's ``__MACOSX``
    forks and a file manager's litter. Named with why: a name that is empty or leaves the ZIP (``../a.md``,
    ``/etc/x``, which would map onto another document's name), a name seen before, a symbolic link, an encrypted
    member, one over ``max_member_bytes`` or compressed over :data:`MAX_ZIP_RATIO`:1 (a bomb), and one that
    cannot be inflated. (An archive among the members is the reader's to refuse: kvblend.documents opens no
    archive inside an archive.) Names a Windows tool stored in UTF-8 without saying so are read as UTF-8, where
    Python's zipfile would read them as cp437."""
    total, seen, wanted = 0, set[str](), list[tuple[zipfile.ZipInfo, str, str | None]]()
    for info in _zip_infos(data, "ZIP"):
        path = _zip_name(info)
        if _left_out(path):
            continue
        if len(wanted) == MAX_ARCHIVE_MEMBERS:
            raise ConversionError(
                f"ZIP holds over {MAX_ARCHIVE_MEMBERS:,} files; not opened (unzip it and ingest the folder)"
            )
        why = _member_name_problem(path, seen, "ZIP") or _zip_member_problem(info, max_member_bytes)
        if why is None:
            total += info.file_size
        seen.add(path)
        wanted.append((info, path or "(no name)", why))
    if total > MAX_ZIP_UNCOMPRESSED_BYTES:
        raise ConversionError(f"ZIP would inflate to over {MAX_ZIP_UNCOMPRESSED_BYTES // _MIB} MiB; not opened")
    if not wanted:
        raise ConversionError("empty ZIP (no documents in it)")
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info, path, why in wanted:
            if why is not None:
                yield path, why
                continue
            try:
                member = z.read(info)
            except Exception as e:  # zlib's, lzma's, a bad CRC, an unknown method: this member's damage alone
                yield path, f"cannot be read from the ZIP ({describe_error(e)})"
                continue
            yield path, member


def _zip_member_problem(info: zipfile.ZipInfo, max_member_bytes: int) -> str | None:
    """Why a ZIP member is not read, from its central directory entry alone (None: it is read)."""
    if (info.external_attr >> 16) & 0o170000 == 0o120000:
        return "a symbolic link (not followed)"
    if info.flag_bits & 0x1:
        return "encrypted (password protected)"
    if info.file_size > max_member_bytes:  # as a file that large is skipped, before it is inflated
        return f"too large ({info.file_size // _MIB} MiB)"
    if (ratio := _bomb_ratio(info)) is not None:
        return f"compressed {ratio}:1 (over {MAX_ZIP_RATIO}:1, a ZIP bomb?); not opened"
    return None


def _left_out(path: str) -> bool:
    """Whether a member is one the folder walk would leave out too: a folder, a hidden file or one in a hidden
    folder (``.git/``, macOS's ``._x`` forks), ``__MACOSX`` and a file manager's litter."""
    parts = path.split("/")
    return path.endswith("/") or any(p.startswith(".") or p in _ZIP_NOISE for p in parts if p not in ("", ".."))


def _member_name_problem(path: str, seen: set[str], kind: str) -> str | None:
    """Why a member cannot be a document of its own name (None: it can): a name that is empty or leaves the
    archive (``../a.md``, ``/etc/x``: it would map onto another document), or one seen before."""
    parts = path.split("/")
    if not path or path.startswith("/") or ".." in parts or "" in parts:
        return f"its name is empty or leaves the {kind} (not read)"
    if path in seen:
        return "a second member of the same name (the first is read)"
    return None


_TAR_SUFFIXES = (".tar", ".tgz", ".tar.gz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst", ".tzst")
_TAR_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")  # gzip, bzip2, xz, zstandard


def is_document_tar(filename: str, data: bytes) -> bool:
    """Whether a file is a tar archive of documents (``docs.tar.gz``, ``.tgz``, ``.tar.xz``, ``.tar.bz2``,
    ``.tar.zst``, ``.tar``), by its name and its first bytes (a compressor's magic, or a plain tar's header)."""
    name = filename.lower()
    if not name.endswith(_TAR_SUFFIXES):
        return False
    return data.startswith(_TAR_COMPRESSED) or data[257:262] == b"ustar" or _plain_tar_header(data)


def tar_members(data: bytes, max_member_bytes: int) -> Iterator[tuple[str, bytes | str]]:
    """A tar archive's files in their order, as :func:`zip_members` gives a ZIP's, with its rules: the same
    members left out, the same names refused, each member over ``max_member_bytes`` named as too large, a link
    or device named as no regular file.

    The tar is decompressed first (gzip with its CRC checked, bzip2, xz), and refused past
    :data:`MAX_ZIP_UNCOMPRESSED_BYTES` (a bomb stops there: a GNU long-name or pax header that claims gigabytes
    has only what is there to claim). Python's tarfile ends an archive quietly at a damaged header; here the
    bytes after where it stopped must be the end-of-archive zeros, or the tar is corrupt: what was yielded
    before stands, and the skip line says the rest was not read."""
    import tarfile

    raw = _decompressed_tar(data)
    if not (raw[257:262] == b"ustar" or _plain_tar_header(raw)):
        raise ConversionError(f"not a tar archive (content looks like {_describe(raw)})")
    seen: set[str] = set()
    found = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            for info in tar:
                path = _member_path(info.name)
                if info.isdir() or path in ("", ".") or _left_out(path):
                    continue
                if found == MAX_ARCHIVE_MEMBERS:
                    raise ConversionError(
                        f"tar archive holds over {MAX_ARCHIVE_MEMBERS:,} files; the rest not read "
                        "(unpack it and ingest the folder)"
                    )
                found += 1
                why = _member_name_problem(path, seen, "tar archive")
                seen.add(path)
                if why is None and info.islnk():
                    why = f"a hard link to {info.linkname} (read there)"
                elif why is None and not info.isreg():
                    why = "a symbolic link (not followed)" if info.issym() else "not a regular file"
                elif why is None and info.size > max_member_bytes:
                    why = f"too large ({info.size // _MIB} MiB)"
                if why is not None:
                    yield path, why
                    continue
                member = tar.extractfile(info)
                yield path, member.read() if member is not None else b""
            stopped = tar.offset
    except ConversionError:
        raise
    except Exception as e:  # tarfile's own errors, and what its header parsing raises on crafted bytes
        raise ConversionError(f"corrupt tar archive ({describe_error(e)})") from None
    if raw[stopped:].strip(b"\x00"):  # tarfile stopped at a header it could not read, not at the end
        raise ConversionError(f"corrupt tar archive (a damaged header at byte {stopped}; the rest not read)")
    if not found:
        raise ConversionError("empty tar archive (no documents in it)")


def _plain_tar_header(raw: bytes) -> bool:
    """Whether the first 512 bytes are a pre-POSIX (V7) tar header: its checksum field sums the block."""
    if len(raw) < 512:
        return False
    try:
        declared = int(raw[148:156].replace(b"\x00", b" ").strip() or b"-1", 8)
    except ValueError:
        return False
    return declared == sum(raw[:148]) + 8 * 32 + sum(raw[156:512])


def _decompressed_tar(data: bytes) -> bytes:
    """A tar archive's bytes, decompressed (gzip, bzip2, xz, zstandard) at most up to the cap, else refused."""
    import bz2
    import lzma

    cap = MAX_ZIP_UNCOMPRESSED_BYTES
    too_big = ConversionError(f"tar archive would inflate to over {cap // _MIB} MiB; not read")
    try:
        if data.startswith(b"\x1f\x8b"):
            import gzip

            with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:  # every member, the CRC checked at each end
                out = f.read(cap + 1)
        elif data.startswith((b"BZh", b"\xfd7zXZ\x00")):
            new = bz2.BZ2Decompressor if data.startswith(b"BZh") else lzma.LZMADecompressor
            out, rest = b"", data
            while rest and len(out) <= cap:  # every stream (pbzip2 and pixz write several)
                decompressor = new()
                out += decompressor.decompress(rest, max_length=cap + 1 - len(out))
                if not decompressor.eof:
                    if len(out) <= cap:
                        raise EOFError("compressed data ends before its stream does")
                    break
                rest = decompressor.unused_data.lstrip(b"\x00")
        elif data.startswith(b"\x28\xb5\x2f\xfd"):  # zstandard (the archive's own codec library): every frame
            import zstandard

            chunks, size = [], 0
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as reader:
                while size <= cap and (chunk := reader.read(min(cap + 1 - size, 1 << 24))):
                    chunks.append(chunk)
                    size += len(chunk)
            out = b"".join(chunks)
        else:
            out = data
    except Exception as e:  # zlib's, lzma's, zstandard's own error types, OSError, EOFError: damage all
        raise ConversionError(f"corrupt tar archive ({describe_error(e)})") from None
    if len(out) > cap:
        raise too_big
    return out


def _zip_name(info: zipfile.ZipInfo) -> str:
    """A ZIP member's path (:func:`_member_path`) with ``/`` separators, in UTF-8 where its bytes are."""
    name = info.orig_filename
    if not info.flag_bits & 0x800:  # no UTF-8 flag: zipfile read the bytes as cp437
        with suppress(UnicodeError):
            name = name.encode("cp437").decode("utf-8")
    return _member_path(name.replace("\\", "/"))


def _member_path(name: str) -> str:
    """An archive member's stored name as a path: cut at a NUL, its ``./`` steps taken out (``a/././b.md``)."""
    path = name.split("\x00", 1)[0]
    while path.startswith("./"):
        path = path[2:]
    while "/./" in path:
        path = path.replace("/./", "/")
    return path


def _convert_docx(data: bytes, started: float) -> Converted:
    _check_zip(data, "DOCX")
    import docx  # lazy: python-docx and lxml, 0.09 s
    from docx.table import Table

    with _damage_named("DOCX"):
        document = docx.Document(io.BytesIO(data))  # reads and parses every part: damage shows here
    blocks: list[str] = []
    list_run: list[str] = []  # consecutive list items stay one paragraph
    style_names: dict[object, str] = {}

    def flush_list() -> None:
        if list_run:
            blocks.append("\n".join(list_run))
            list_run.clear()

    for block in _docx_blocks(document.element.body, document._body):
        if isinstance(block, Table):
            flush_list()
            blocks.append(_docx_table(block))
            continue
        text = " ".join(block.text.split())
        if not text:
            continue
        style_id = block._p.style  # the style's id; its name is looked up once (a lookup walks styles.xml)
        if style_id not in style_names:
            style = block.style
            style_names[style_id] = (style.name or "") if style is not None else ""
        name = style_names[style_id]
        level = _heading_level(name)
        is_list = name.startswith("List") or block._p.pPr is not None and block._p.pPr.numPr is not None
        if level:
            flush_list()
            blocks.append("#" * level + " " + text)
        elif is_list:
            list_run.append(("1. " if "Number" in name else "- ") + text)
        else:
            flush_list()
            blocks.append(text)
    flush_list()
    text = _tidy("\n\n".join(blocks))
    if not text:
        raise ConversionError("empty (the DOCX holds no text)")
    return Converted(text, "docx")


def _heading_level(style_name: str) -> int:
    """1-6 for Word's 'Title' and 'Heading N' styles, else 0."""
    if style_name == "Title":
        return 1
    m = re.fullmatch(r"Heading (\d)", style_name)
    return min(int(m.group(1)), 6) if m else 0


def _docx_blocks(element, parent) -> Iterator:
    """The paragraphs and tables under a body-like element, in reading order, where Word keeps text that
    python-docx's `iter_inner_content` (direct `w:p` and `w:tbl` children only) does not reach: inside a
    content control (`w:sdt`: cover pages, templates, forms) and in a paragraph's text boxes (`w:txbxContent`,
    each after its paragraph; a text box's VML fallback copy, `mc:Fallback`, is the same text and skipped)."""
    from docx.oxml.ns import qn
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    for child in element.iterchildren():
        if child.tag == qn("w:p"):
            yield Paragraph(child, parent)
            for box in child.iter(qn("w:txbxContent")):
                if not any(a.tag == _MC_FALLBACK for a in box.iterancestors()):
                    yield from _docx_blocks(box, parent)
        elif child.tag == qn("w:tbl"):
            yield Table(child, parent)
        elif child.tag == qn("w:sdt"):
            for content in child.iterchildren(qn("w:sdtContent")):
                yield from _docx_blocks(content, parent)


# Office's markup compatibility (mc:AlternateContent, mc:Choice, mc:Fallback), in DOCX and PPTX alike
_MC = "{http://schemas.openxmlformats.org/markup-compatibility/2006}"
_MC_FALLBACK = _MC + "Fallback"


def _docx_table(table) -> str:
    """A Word table as Markdown pipe rows in blocks under its header row (:func:`_table_blocks`: a long
    table's later segments still name its columns); a merged cell's text appears once per grid column it
    spans, as python-docx reports it."""
    return _table_text([[_docx_cell_text(cell) for cell in row.cells] for row in table.rows])


def _docx_cell_text(cell) -> str:
    """A cell's text, a table nested in it included (python-docx's `cell.text` leaves it out): a nested
    table's rows inline, cells joined by "; ", as a pipe row cannot hold a table."""
    from docx.table import Table

    parts: list[str] = []
    for block in _docx_blocks(cell._tc, cell):
        if isinstance(block, Table):
            parts.extend("; ".join(_docx_cell_text(c) for c in row.cells) for row in block.rows)
        else:
            parts.append(block.text)
    return "\n".join(parts)


def _table_text(rows: list[list[str]]) -> str:
    """A document's table (Word, PowerPoint, a chart's data, ODF) as :func:`_table_blocks` writes a sheet: pipe
    rows under the first row as header (those formats have no other header notion), repeated over every
    block that fits a segment, empty rows and columns dropped."""
    return "\n\n".join(_table_blocks(rows))


def _pipe_line(cells: list[str]) -> str:
    """One table row as a Markdown pipe row: each cell's whitespace collapsed and its pipes escaped."""
    return "| " + " | ".join(" ".join(c.split()).replace("|", "\\|") for c in cells) + " |"


# OpenDocument text ──────────────────────────────────────────────────────────

# The Markdown escapes odfdo writes inside a line (`well\-known`, `item\_name`, `\#1`): read as text they are
# noise in the KV, so they go; at a line's start they stay, where they keep a "- " or "# " from becoming a list
# item or a heading, and `\|` stays everywhere (it is a cell's own pipe inside a table row).
_ODT_ESCAPE = re.compile(r"(?m)^([ \t]*\\[-#*+])|\\([-_*#.!+()\[\]{}`])")


def _unescape_odt(markdown: str) -> str:
    """odfdo's Markdown read as text: its escapes gone (:data:`_ODT_ESCAPE`), and a soft line break's
    Markdown form (a backslash before the newline) a plain newline."""
    return _ODT_ESCAPE.sub(lambda m: m.group(1) or m.group(2), markdown).replace("\\\n", "\n")


def _open_odf(data: bytes, what: str):
    """An OpenDocument package opened by odfdo, after the ZIP's declared sizes are checked (a bomb) and its
    manifest is read for ``encryption-data`` (LibreOffice encrypts a password-protected file's parts)."""
    _check_zip(data, what)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        if "META-INF/manifest.xml" in z.NameToInfo and b"encryption-data" in z.read("META-INF/manifest.xml"):
            raise ConversionError(f"encrypted {what} (password protected)")
    import odfdo  # lazy: 0.05 s, lxml underneath

    with _damage_named(what):
        return odfdo.Document(io.BytesIO(data))


def _odf_table_size(table, what: str, before: int, started: float) -> int:
    """The cells read so far with this table's, once its trailing empty rows and columns are stripped (ODF
    writes them as one row repeated up to a million times; a crafted file repeats a full one): counted
    against :data:`MAX_TABLE_CELLS` before any value is read."""
    _check_time(started)
    table.rstrip(aggressive=True)
    return _spend_cells(before, table.height * table.width, what)


def _odf_rows(table) -> list[list[str]]:
    """An ODF table's values as cells (:func:`_cell`), from A1: row i is the sheet's row i + 1."""
    return [[_cell(v) for v in row] for row in table.get_values()]


def _convert_odp(data: bytes, started: float) -> Converted:
    """LibreOffice Impress's format, read as a PPTX deck is: a page per slide (so "p. 3" is slide 3), its title
    frame a ``##`` heading, then its other shapes in document order (text boxes, drawn shapes with text,
    groups opened): text as odfdo formats it (lists as ``- `` items), tables as pipe rows in blocks under their
    header, then the speaker notes as ``Notes: ...``. Headers, footers, dates, page numbers and images' place
    holders are left out, as in a deck. Every table, the notes' too, is counted against the cell cap before any
    is read. Charts' data is not read (odfdo does not read ODF charts)."""
    document = _open_odf(data, "ODP")
    pages: list[str] = []
    cells = 0
    with _damage_named("ODP"):
        for slide in document.body.get_draw_pages():
            _check_time(started)
            for table in slide.get_elements(".//table:table"):  # a crafted notes table is as big as any
                cells = _odf_table_size(table, "ODP", cells, started)
            title, blocks, notes = "", [], []  # type: str, list[str], list[str]
            for child in slide.children:
                if child.tag == "presentation:notes":
                    notes.extend(text for shape in _odp_shapes(child) if (text := _odp_shape_text(shape)))
                    continue
                for shape in _odp_shapes(child):
                    kind = shape.get_attribute("presentation:class")
                    if kind in ("header", "footer", "date-time", "page-number"):
                        continue
                    text = _odp_shape_text(shape)
                    if kind == "title" and not title:
                        title = " ".join(text.split())
                    elif text:
                        blocks.append(text)
            prose = [n for n in notes if not n.startswith("|")]
            note = " ".join(" ".join(n.split()) for n in prose)
            page = [f"## {title}" if title else "", *blocks, f"Notes: {note}" if note else ""]
            page += [n for n in notes if n.startswith("|")]  # a table in the notes stays a table
            pages.append(_tidy("\n\n".join(b for b in page if b)))  # a slide without text is a page all the same
    if not any(pages):
        raise ConversionError("empty (the ODP holds no text)")
    return _paged(pages, "odp")


# Shapes on an Impress page that hold text: frames (text boxes, tables, images) and drawn shapes.
_ODP_SHAPES = {
    "draw:frame",
    "draw:custom-shape",
    "draw:rect",
    "draw:ellipse",
    "draw:circle",
    "draw:polygon",
    "draw:polyline",
    "draw:path",
    "draw:regular-polygon",
    "draw:caption",
    "draw:measure",
}
_IMAGE_PLACE = re.compile(r"^\[Image [^\]]*\]$")  # what odfdo writes for a picture or a chart's replacement


def _odp_shapes(element) -> Iterator:
    """The text-holding shapes in ``element`` in document order, groups (``draw:g``) opened."""
    if element.tag in _ODP_SHAPES:
        yield element
    elif element.tag == "draw:g" or element.tag == "presentation:notes":
        for child in element.children:
            yield from _odp_shapes(child)


def _odp_shape_text(shape) -> str:
    """A shape's text: its tables as pipe rows (:func:`_table_text`), else its paragraphs as odfdo formats them,
    each line stripped (odfdo indents them), empty lines and image place holders dropped."""
    tables = shape.get_elements(".//table:table")
    if tables:
        return "\n\n".join(_table_text(_odf_rows(t)) for t in tables)
    if shape.tag == "draw:frame":
        formatted = shape.get_formatted_text()
    else:  # a drawn shape: its paragraphs (odfdo formats frames only)
        formatted = "\n".join(str(p.text_recursive) for p in shape.get_elements(".//text:p | .//text:h"))
    lines = (line.strip() for line in formatted.split("\n"))
    return "\n".join(line for line in lines if line and not _IMAGE_PLACE.match(line))


def _convert_ods(data: bytes, started: float) -> Converted:
    """LibreOffice Calc's format, as an XLSX workbook is read: each visible sheet a ``##`` section and its
    cells pipe rows under their header (:func:`_table_blocks`); hidden sheets left out. A sheet's trailing
    empty rows and columns, which Calc writes as one row repeated a million times, are stripped before any
    value is read."""
    document = _open_odf(data, "ODS")
    blocks: list[str] = []
    numbers: list[int] = []
    cells = 0
    with _damage_named("ODS"):
        for table in document.body.get_tables():
            style = document.get_style("table", table.style) if table.style else None
            if style is not None and style.get_properties(area="table").get("table:display") == "false":
                continue  # a hidden sheet: helper data, as in XLSX
            cells = _odf_table_size(table, "ODS", cells, started)
            # get_values() starts at A1, so row i of it is the sheet's row i + 1
            if rows := _table_blocks(_odf_rows(table), numbers):
                blocks.append(f"## {' '.join(str(table.name).split())}")
                blocks.extend(rows)
    if not blocks:
        raise ConversionError("empty (the ODS holds no values)")
    return _sheet_text(blocks, "ods", numbers)


def _convert_odt(data: bytes, started: float) -> Converted:
    """LibreOffice's own format (ODF text), by odfdo: headings as ``#`` lines, lists, tables as pipe rows in
    blocks under their header (:func:`_table_blocks`), in document order. No pages: ODF text reflows (as DOCX
    does), so headings name the sections. A document saved with a password has its parts encrypted, which
    its manifest says (``encryption-data``): named as such, never parsed."""
    document = _open_odf(data, "ODT")
    import odfdo

    with _damage_named("ODT"):
        # Tables as a sheet's rows are read (_table_blocks): odfdo's Markdown export of a table deep-copies its
        # formatting state per table, 33 ms each (a 50-table report took 1.55 s, 64 ms this way; BENCHMARKS.md)
        tables: dict[str, str] = {}
        cells = 0
        for i, table in enumerate(document.body.get_tables()):
            if table.parent is None:  # inside a table already taken out: its text is in that table's cells
                continue
            cells = _odf_table_size(table, "ODT", cells, started)
            marker = f"kvblend-odt-table-{i}"
            tables[marker] = _table_text(_odt_rows(table))
            table.parent.replace_element(table, odfdo.Paragraph(marker))
        markdown = str(document.to_markdown())  # str for a text document (a list only for a spreadsheet's tables)
    text = _tidy(_ODT_TABLE_MARKER.sub(lambda m: _odt_table_in_place(m, tables), _unescape_odt(markdown)))
    if not text:
        raise ConversionError("empty (the ODT holds no text)")
    return Converted(text, "odt")


_ODT_TABLE_MARKER = re.compile(r"^(.*?)kvblend-odt-table-\d+(.*)$", re.M)


def _odt_table_in_place(match: re.Match, tables: dict[str, str]) -> str:
    """A table's marker line as the table, a paragraph of its own: odfdo writes a table inside a list item as
    `- marker` and one in a frame as `Frame: marker`, where a lookup of the whole line missed it and the marker
    itself reached the text (the table lost)."""
    line = match.group(0)
    marker = line[len(match.group(1)) : len(line) - len(match.group(2))]
    before = match.group(1).strip()
    kept = before if before.strip("-*+#: ") else ""  # a list bullet alone says nothing
    return (
        "\n\n" + "\n\n".join(part for part in (kept, tables.get(marker, ""), match.group(2).strip()) if part) + "\n\n"
    )


def _odt_rows(table) -> list[list[str]]:
    """An ODT table's cells as text: a typed cell's value (:func:`_cell`), an untyped one's text (writers other
    than LibreOffice leave `office:value-type` out, and odfdo's values are then None: the table vanished), and
    a table nested in a cell inline, its rows' cells joined by "; "."""
    rows = []
    for row in table.traverse():
        cells = []
        for cell in row.traverse():
            nested = cell.get_elements("table:table")
            if nested:
                cells.append(" ".join("; ".join(r) for t in nested for r in _odt_rows(t)))
            elif cell.get_attribute("office:value-type") and cell.value not in (None, ""):
                cells.append(_cell(cell.value))
            else:
                cells.append(" ".join(str(cell.text_recursive or "").split()))
        rows.append(cells)
    return rows


# XML documents ───────────────────────────────────────────────────────────────

# Elements whose text titles what follows them: DocBook's title, TEI's head, JATS's article-title, HTML's h1-h6.
_XML_TITLES = {"title", "subtitle", "head", "heading", "article-title", "h1", "h2", "h3", "h4", "h5", "h6"}
_XML_RECORD_FIELD_CHARS = 60  # a record's field (<price>12</price>) is short; a paragraph is not
_XML_SKIPPED = ("{*}indexterm", "indexterm")  # DocBook's index entries repeat a word of the text inline


def _convert_xml(data: bytes, started: float) -> Converted:
    """A document written as XML (DocBook, TEI, JATS, a feed) as its text, parsed with lxml: an element with text
    of its own (its text or a child's tail) is a paragraph, its inline children read with it; a title-like
    element (:data:`_XML_TITLES`) a ``#`` heading, one level deeper per titled ancestor; an element of a few
    short leaf fields (a record: ``<part><name>Seal kit</name><cost>11.75</cost></part>``) one line of
    ``name: value`` pairs, so the fields keep their names. Only the file's own entities are expanded, and
    nothing is fetched (no DTD, no network); libxml2's limits refuse a "billion laughs" file. DocBook's
    index entries are left out and its citations bracketed. Read as text, DocBook's tags took 60% more tokens
    than the same manual's PDF; read so, as many (BENCHMARKS.md)."""
    if len(data) > MAX_HTML_BYTES:
        raise ConversionError(f"too large for XML ({len(data) // _MIB} MiB; at most {MAX_HTML_BYTES // _MIB} MiB)")
    from html.entities import name2codepoint

    from lxml import etree  # lazy: lxml is trafilatura's and python-docx's parser already

    # Only entities the file itself declares are expanded (DocBook's "&version;"), within libxml2's default
    # limits on expansion; an external one is never fetched, and a file that uses one (a chapter included by
    # `<!ENTITY ch1 SYSTEM "ch1.xml">`) is read with no entity expanded.
    root = None
    for entities in ("internal", False):
        parser = etree.XMLParser(
            resolve_entities=entities, no_network=True, load_dtd=False, remove_comments=True, remove_pis=True
        )
        try:
            root = etree.fromstring(data, parser)
            break
        except etree.XMLSyntaxError as e:
            if entities is False or "not defined" not in str(e):
                raise ConversionError(f"corrupt XML ({describe_error(e)})") from None
    assert root is not None
    for entity in root.iter(etree.Entity):  # left unexpanded: an HTML name (&mdash;, from an unread DTD) as its
        code = name2codepoint.get(entity.name)  # character, any other ("&ch1;", an included file) as a space
        entity.tail = (chr(code) if code is not None else " ") + (entity.tail or "")
    etree.strip_elements(root, etree.Entity, *_XML_SKIPPED, with_tail=False)  # entities, index entries
    for citation in root.iter("{*}citation", "citation"):  # DocBook's "system<citation>MIME</citation>"
        citation.text, citation.tail = f" [{citation.text or ''}", f"]{citation.tail or ''}"
    blocks: list[str] = []
    _xml_blocks(root, 1, blocks, started)
    text = _tidy("\n\n".join(blocks))
    if not text:
        raise ConversionError("empty (the XML holds no text)")
    return Converted(text, "xml")


# HTML carried as text (escaped or in CDATA): what a feed's <description> and <content:encoded> hold
_ESCAPED_HTML = re.compile(r"<(?:p|a|b|i|em|strong|br|img|div|span|ul|ol|li|h[1-6]|table|tr|td)\b[^>]*>", re.I)


def _xml_text(element) -> str:
    """An element's text with its inline children's, whitespace collapsed; HTML it carries as text (a feed's
    description) read as HTML, so its tags do not reach the KV."""
    text = "".join(element.itertext())
    if _ESCAPED_HTML.search(text):
        from lxml import etree
        from lxml import html as lxml_html

        with suppress(etree.ParserError, ValueError):
            text = lxml_html.fragment_fromstring(text, create_parent="div").text_content()
    return " ".join(text.split())


def _xml_blocks(element, level: int, blocks: list[str], started: float) -> None:
    from lxml import etree

    name = etree.QName(element).localname.lower()
    children = list(element)  # elements only: the parser drops comments and PIs, and entities are stripped
    own = (element.text or "").strip() or any((c.tail or "").strip() for c in element)
    if own or not children:
        text = _xml_text(element)
        if text:
            blocks.append(f"{'#' * min(level, 6)} {text}" if name in _XML_TITLES else text)
        return
    names = [etree.QName(c).localname.lower() for c in children]
    # a record's fields have names of their own (<name>, <cost>); siblings of one name are paragraphs or cells
    distinct = len(set(names)) == len(names) > 1
    leaves = distinct and all(len(c) == 0 for c in children) and not set(names) & _XML_TITLES
    if leaves and all(len(_xml_text(c)) <= _XML_RECORD_FIELD_CHARS for c in children):
        fields = [f"{n}: {t}" for n, c in zip(names, children) if (t := _xml_text(c))]
        if fields:
            blocks.append("; ".join(fields))
        return
    if len(blocks) % 200 == 0:
        _check_time(started)
    deeper = level + 1 if set(names) & _XML_TITLES else level  # a titled element: its sections sit under it
    for child, child_name in zip(children, names):
        _xml_blocks(child, level if child_name in _XML_TITLES else deeper, blocks, started)


# E-mail ─────────────────────────────────────────────────────────────────────

_EMAIL_HEADER = re.compile(rb"^[A-Za-z][A-Za-z0-9-]*:[ \t]")  # "From: ...", "Received: ...", "X-Mailer: ..."
_EMAIL_FIELDS = ("From", "To", "Cc", "Date")


def _convert_eml(data: bytes, started: float) -> Converted:
    """A message saved as ``.eml`` (RFC 5322, what mail clients export) with Python's own ``email`` package:
    the subject as a ``#`` heading, From/To/Cc/Date, then the body, the plain-text part where the message has
    one (as a reader's client shows it), else its HTML part through markdownify (an e-mail's HTML is layout
    tables and inline styles, not a page with navigation for trafilatura to drop), then the names of its
    attachments, then each attachment kvblend reads (a PDF, a DOCX, a sheet, text: :func:`_attachment_text`)
    under a ``## Attachment: name`` heading, since in a mailbox the attachment often holds what the message
    only points to. An attachment that cannot be read is named with its reason; the message is kept. Headers
    in other charsets (RFC 2047) are decoded."""
    msg = _parse_message(_eml_headers(data))
    if msg is None:
        raise ConversionError("not an email (no From, Subject or Date header)")
    return Converted(_message_text(msg, started), "eml")


def _eml_headers(data: bytes) -> bytes:
    """A saved message from its first header on: without a byte-order mark, leading blank lines, or the
    mbox envelope line (`From - Wed Mar 30 10:27:45 2016`) Thunderbird writes atop the messages it saves."""
    data = data.lstrip(b"\xef\xbb\xbf \t\r\n")
    if data.startswith(b"From ") and b"\n" in data[:1024]:
        data = data[data.index(b"\n") + 1 :]
    return data


def _parse_message(data: bytes):
    """``data`` as an ``EmailMessage`` (the ``email`` package's modern policy), or None where it has no From,
    Subject or Date header, which every message a mail client writes has."""
    from email import message_from_bytes, policy

    msg = message_from_bytes(data, policy=policy.default)
    return msg if any(msg[k] for k in ("From", "Subject", "Date")) else None


def _message_text(msg, started: float) -> str:
    """One message as :func:`_convert_eml` describes it: subject heading, people and date, body, attachments."""
    subject = _header(msg, "Subject") or "(no subject)"
    blocks = ["# " + subject, "\n".join(f"{k}: {v}" for k in _EMAIL_FIELDS if (v := _header(msg, k)))]
    content_part = msg
    while content_part.get_content_type() == "multipart/signed":  # S/MIME, PGP/MIME: read the part signed
        signed = next(content_part.iter_parts(), None) if content_part.is_multipart() else None
        if signed is None:  # a signed container with nothing in it: read as it is
            break
        content_part = signed
    single_file = not content_part.is_multipart() and bool(content_part.get_filename())  # a scanner's mail
    part = None if single_file else content_part.get_body(preferencelist=("plain", "html"))
    if part is not None:
        blocks.append(_body_text(part))
    if single_file:
        others = [content_part]
    elif content_part.is_multipart():
        others = list(content_part.iter_attachments())
    else:
        others = []
    listed, read = [], []
    for attachment in others:
        if not attachment.get_filename():
            # more of the body: Apple Mail splits a message's text around an inline file (text, file, text)
            if attachment.get_content_type() in ("text/plain", "text/html"):
                blocks.append(_body_text(attachment))
            elif attachment.is_multipart() and (inner := attachment.get_body(preferencelist=("plain", "html"))):
                blocks.append(_body_text(inner))
            continue
        name = " ".join(str(attachment.get_filename()).split())
        if time.monotonic() - started > MAX_CONVERT_SECONDS:  # the message's budget, its attachments' too
            listed.append(f"{name} (not read: out of time)")
            continue
        content, why_not = _attachment_text(attachment, name, started)
        if content:
            read.extend([f"## Attachment: {name}", _close_fence(content)])
        listed.append(f"{name} (not read: {why_not})" if why_not else name)
    if listed:
        blocks.append("Attachments: " + ", ".join(listed))
    return _tidy("\n\n".join(b for b in [*blocks, *read] if b.strip()))


def _body_text(part) -> str:
    """A message's text part as text: HTML as Markdown, a fence left open closed (it hides no later heading)."""
    try:
        content = part.get_content()
    except LookupError:  # a charset Python does not know: its bytes as any file's are read
        content = decode_text(part.get_payload(decode=True) or b"")[0]
    if part.get_content_type() == "text/html":
        content = _xhtml_markdown(content.encode("utf-8") if isinstance(content, str) else content, layout_tables=True)
    return _close_fence(content) if isinstance(content, str) else ""


def _header(msg, name: str) -> str:
    """A header's value on one line, RFC 2047 words decoded; as written where the ``email`` package cannot parse
    it (``Cc: <`` raises inside it), so one malformed field costs neither the message nor the mailbox."""
    try:
        value = str(msg[name] or "")
    except Exception:  # the structured header's parser, on untrusted bytes
        value = next((str(v) for k, v in msg.raw_items() if k.lower() == name.lower()), "")
    return " ".join(value.split())


# An mbox file (RFC 4155): messages one after another, each opened by a "From " line with the sender and the
# time it arrived, then the message's own headers. What Thunderbird keeps a folder in, Google Takeout and
# Apple Mail export, and Mailman archives a list as.
_MBOX_EXTENSIONS = {".mbox", ".mbx"}
# The "From " line as mail stores write it: a sender without spaces, then the time as ctime() writes it ("Tue Nov
# 3 09:30:00 2026"; git format-patch's "Mon Sep 17 00:00:00 2001" too), then the message's first header line. A
# sentence that begins "From 10:00 to 12:00" is text, and git leaves a body's "From the docs" unescaped.
_MBOX_ENVELOPE = (
    rb"From \S+ +(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) +(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +\d{1,2} "
    rb"+\d{1,2}:\d\d(?::\d\d)?[^\r\n]*\r?\n(?=[A-Za-z][A-Za-z0-9-]*:[ \t])"
)
_MBOX_START = re.compile(_MBOX_ENVELOPE)
_MBOX_FROM_LINE = re.compile(rb"^" + _MBOX_ENVELOPE, re.MULTILINE)
_MBOX_ESCAPED = re.compile(rb"^>(>*From )", re.MULTILINE)  # a body's "From " line as writers escape it


def _convert_mbox(data: bytes, started: float) -> Converted:
    """A mailbox: each message as :func:`_convert_eml` reads one (its subject a ``#`` heading that names its
    section, people, date, body, attachments), in the file's order.

    A message starts at a ``From `` line of the form mail stores write (:data:`_MBOX_ENVELOPE`: sender, time,
    then a header), so a body's own "From my point of view" line, which mboxo writers and git leave unescaped,
    stays in its message; a body's ``>From`` has one ``>`` taken off, as mboxrd readers do. A message
    Thunderbird marks deleted (it keeps them until the folder is compacted) is left out; one the ``email``
    package cannot read is left out alone, not the mailbox; a fence one leaves open is closed at its end, so it
    hides no later subject. A mailbox with no message in it is refused. The file's time budget covers every
    message and attachment."""
    data = data.lstrip(b"\xef\xbb\xbf \t\r\n")
    starts = [m.start() for m in _MBOX_FROM_LINE.finditer(data)]
    texts = []
    for begin, end in zip(starts, [*starts[1:], len(data)]):
        _check_time(started)
        message = data[begin:end]
        try:
            msg = _parse_message(_MBOX_ESCAPED.sub(rb"\1", message[message.index(b"\n") + 1 :]))
            if msg is not None and not _deleted(msg):
                texts.append(_message_text(msg, started))
        except Exception:  # one message's damage (a body no charset reads, third-party code on untrusted bytes)
            continue
    if not texts:
        raise ConversionError("not a mailbox (no message in it)")
    return Converted("\n\n".join(texts), "mbox")


def _deleted(msg) -> bool:
    """Whether Thunderbird marked the message deleted (bit 0x0008 of its X-Mozilla-Status, a hex field)."""
    try:
        return bool(int(str(msg["X-Mozilla-Status"] or "0").strip(), 16) & 0x0008)
    except ValueError:
        return False


def _attachment_text(part, name: str, started: float) -> tuple[str, str | None]:
    """An e-mail attachment's text as kvblend reads a file of that name and content, and why not where it
    cannot (an encrypted PDF, a ZIP bomb: each converter's own checks apply; a part the ``email`` package
    cannot decode); an image says nothing, as no reason to show. Its bytes are read as sent and decoded as any
    file's are (:func:`decode_text`), not by a charset the part may misname. It converts within the message's
    time budget (``started``). An e-mail inside the e-mail is named, not opened (no recursion)."""
    try:
        if part.get_content_maintype() in ("image", "audio", "video"):
            return "", None
        payload = part.get_payload(decode=True)
        if not isinstance(payload, bytes):  # message/rfc822 (a forwarded message), multipart
            return "", "a message inside the message"
        fmt = classify(PurePath(name).suffix, payload)
        if fmt == "eml" or (fmt == "mbox" and PurePath(name).suffix.lower() in _MBOX_EXTENSIONS):
            return "", "a message inside the message"
        if fmt == "mbox":  # a patch from git format-patch, attached to a list's mail: read as the text it is
            fmt = "text"
        if fmt in CONVERTED_FORMATS:
            return _converter(fmt)(payload, started).text, None
        text = _tidy(text_document(decode_text(payload)[0], fmt).text)
        return text, None if text else "empty"
    except ConversionError as e:
        return "", str(e)
    except Exception as e:  # third-party code on untrusted bytes (kvblend.documents says why)
        return "", describe_error(e)


# Jupyter notebooks ───────────────────────────────────────────────────────────

NOTEBOOK_OUTPUT_LINES = 40  # of one cell output: a printed table says what it holds in its first lines ...
NOTEBOOK_OUTPUT_CHARS = 4000  # ... and a training loop's log or a 10,000-row print would crowd out the prose
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")  # colours and cursor moves in a terminal's output
# A character that shows: not whitespace, a control code, a zero-width or direction mark, a BOM
_VISIBLE = re.compile(r"[^\s\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def has_visible_text(text: str) -> bool:
    """Whether `text` shows anything once terminal escape codes are left out: a file of zero-width spaces or of
    colour codes alone is empty to a reader, and would be KV of nothing."""
    if _VISIBLE.search(text) is None:
        return False
    return "\x1b" not in text or _VISIBLE.search(_ANSI.sub("", text)) is not None  # no rewrite of a plain text


def _convert_ipynb(data: bytes, started: float) -> Converted:
    """A Jupyter notebook (nbformat 4, and 3's worksheets) with Python's ``json``: its cells in order, Markdown
    cells as they are (their ``#`` headings name sections), code cells fenced with the kernel's language (so a
    ``# comment`` is no heading), each followed by its text output (a stream, a result's ``text/plain``, an
    error's name and message), fenced and cut at :data:`NOTEBOOK_OUTPUT_LINES` lines. Images, HTML and widget
    outputs are left out: read as text, a notebook's JSON escapes and base64 PNGs would become the KV."""
    import json

    text, _ = decode_text(data)
    try:
        notebook = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConversionError(f"corrupt notebook (not JSON: {e.msg} at line {e.lineno})") from None
    if not isinstance(notebook, dict):
        raise ConversionError("not a Jupyter notebook (no cells)")
    cells = notebook.get("cells")
    if cells is None and isinstance(notebook.get("worksheets"), list):  # nbformat 3
        cells = [c for sheet in notebook["worksheets"] if isinstance(sheet, dict) for c in sheet.get("cells") or []]
    if not isinstance(cells, list):
        raise ConversionError("not a Jupyter notebook (no cells)")
    meta = _mapping(notebook.get("metadata"))
    language = _notebook_language(meta)
    blocks = [f"# {' '.join(title.split())}"] if isinstance(title := meta.get("title"), str) and title.strip() else []
    for i, cell in enumerate(cells):
        if i % 200 == 0:
            _check_time(started)
        if not isinstance(cell, dict):
            continue
        kind = cell.get("cell_type")
        source = _notebook_text(cell.get("source", cell.get("input")))
        if not source.strip():
            continue
        if kind == "code":  # nbformat 3 names each cell's language
            own = cell.get("language")
            blocks.append(_fenced(source, own.lower() if isinstance(own, str) and own.isidentifier() else language))
            blocks.extend(_fenced(out) for out in _notebook_outputs(cell.get("outputs")))
        elif kind == "heading":  # nbformat 3's heading cells
            level = cell.get("level")
            depth = min(max(level, 1), 6) if isinstance(level, int) else 1
            blocks.append("#" * depth + " " + " ".join(source.split()))
        else:  # markdown and raw cells, each rendered alone: a fence one leaves open closes with it
            blocks.append(_close_fence(_DATA_URI_IMAGE.sub(lambda m: m.group(1) or "", source)))
    text = _tidy("\n\n".join(blocks))
    if not text:
        raise ConversionError("empty (the notebook has no cells with text)")
    return Converted(block_tables(text), "ipynb")


# An image pasted into a Markdown cell (Colab, VS Code write it inline as base64): its alt text, not its bytes
_DATA_URI_IMAGE = re.compile(
    r"!\[([^\]]*)\]\(\s*<?data:[^)]*\)|<img\b[^>]*\bsrc\s*=\s*[\"']data:[^\"']*[\"'][^>]*>", re.I
)


def _notebook_language(meta: dict) -> str:
    """The notebook kernel's language (``python``, ``r``, ``julia``), for its code fences; "" when unsaid."""
    for key, field in (("kernelspec", "language"), ("language_info", "name")):
        section = meta.get(key)
        if isinstance(section, dict) and isinstance(value := section.get(field), str) and value.isidentifier():
            return value.lower()
    return ""


def _mapping(value: object) -> dict:
    """``value`` if a JSON object, else an empty one: a damaged notebook's field reads as absent."""
    return value if isinstance(value, dict) else {}


def _notebook_text(value: object) -> str:
    """A notebook's multi-line string: one string, or a list of lines (as Jupyter writes them)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(v for v in value if isinstance(v, str))
    return ""


def _notebook_outputs(outputs: object) -> list[str]:
    """A code cell's outputs as text: streams, results and displays by their ``text/plain`` (nbformat 3:
    ``text``) unless they are images, errors as ``name: message``; terminal colours removed, and a progress
    bar's carriage-return updates read as a terminal shows them (the last one). Each cut at
    :data:`NOTEBOOK_OUTPUT_LINES` lines."""
    found: list[str] = []
    for out in outputs if isinstance(outputs, list) else []:
        if not isinstance(out, dict):
            continue
        kind = out.get("output_type")
        if kind in ("error", "pyerr"):
            name, message = out.get("ename") or "Error", out.get("evalue") or ""
            text = f"{name}: {message}" if message else str(name)
        elif kind == "stream":
            text = _notebook_text(out.get("text"))
        else:  # execute_result, display_data (nbformat 3: pyout, display_data)
            bundle = _mapping(out.get("data")) or out
            if any(key.startswith("image/") or key in ("png", "jpeg", "svg") for key in bundle):
                continue  # a plot: its text is the figure object's repr ("<Figure size 640x480 with 1 Axes>")
            # IPython's Markdown display: its text/plain is the object's repr, its Markdown the content
            text = _notebook_text(bundle.get("text/markdown", bundle.get("text/plain", bundle.get("text"))))
        text = _ANSI.sub("", text).replace("\r\n", "\n")  # Windows' line ends are not a progress bar's updates
        text = "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n")).strip("\n")
        if not text.strip():
            continue
        lines = text.split("\n")
        if len(lines) > NOTEBOOK_OUTPUT_LINES or len(text) > NOTEBOOK_OUTPUT_CHARS:
            kept = "\n".join(lines[:NOTEBOOK_OUTPUT_LINES])[:NOTEBOOK_OUTPUT_CHARS]
            text = f"{kept}\n... (output cut: {len(lines):,} lines in all)"
        found.append(text)
    return found


def _close_fence(text: str) -> str:
    """``text`` with a closing line for a ``` or ~~~ fence it opens and leaves open: Jupyter renders each cell
    alone, but joined, an open fence would make every later cell code (and hide its headings)."""
    fence: str | None = None
    for line in text.split("\n"):
        fence = fence_after(line, fence)
    return text if fence is None else f"{text.rstrip()}\n{fence}"


def _fenced(text: str, info: str = "") -> str:
    """``text`` as a fenced block whose fence no line of it closes (a longer run of backticks than any inside)."""
    longest = max((len(run) for run in re.findall(r"`{3,}", text)), default=2)
    fence = "`" * (longest + 1)
    return f"{fence}{info}\n{text.strip(chr(10))}\n{fence}"


# Transcripts and subtitles ─────────────────────────────────────────────────────

TRANSCRIPT_SECTION_SECONDS = 120  # a transcript's text under a "## 00:12:30-00:14:28" heading per ~2 minutes
_CUE_NUMBER_SPACES = re.compile(r"(?m)^(\d+)[ \t]+$")  # "1 " as a cue number: webvtt-py wants "1"
_SUBTITLE_OVERRIDES = re.compile(r"\{\\[^}]*\}")  # SubRip's {\an8} positioning, ASS-style
_TRANSCRIPT_START = {
    "vtt": re.compile(rb"WEBVTT(?:[ \t\r\n]|$)"),
    "srt": re.compile(rb"\d+[ \t]*\r?\n[ \t]*\d{1,2}:\d\d:\d\d[,.]\d{1,3}[ \t]*-->"),
}


def _convert_vtt(data: bytes, started: float) -> Converted:
    """A WebVTT transcript or subtitle file (a meeting's recording, a video's captions) with webvtt-py."""
    return _transcript(data, "vtt", started)


def _convert_srt(data: bytes, started: float) -> Converted:
    """A SubRip (.srt) subtitle file with webvtt-py, as :func:`_convert_vtt`."""
    return _transcript(data, "srt", started)


def _transcript(data: bytes, fmt: str, started: float) -> Converted:
    """A transcript as what was said, cited by when: its captions joined into paragraphs, a new one where the
    speaker changes (WebVTT's ``<v Name>``, written ``Name: ...``), under a heading of the time range every
    :data:`TRANSCRIPT_SECTION_SECONDS` (``## 00:12:30-00:14:28``), so a segment starts at a section and an
    answer cites the minutes it came from. Cue numbers, timings, settings and styling tags are left out, and
    a line repeated by the next caption (live captions roll up a line at a time) is kept once."""
    import webvtt
    from webvtt.errors import MalformedFileError

    text, _ = decode_text(data)
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff \t\n")  # as classify() allowed it
    text = _CUE_NUMBER_SPACES.sub(r"\1", text)
    label = "WebVTT" if fmt == "vtt" else "SubRip"
    try:
        captions = webvtt.from_buffer(io.StringIO(text), format=fmt).captions
    except MalformedFileError as e:
        raise ConversionError(f"corrupt {label} ({describe_error(e)})") from None
    captions = sorted(captions, key=lambda c: c.start_in_seconds)  # cues out of order: by when they were said
    blocks: list[str] = []
    section: list[str] = []  # this section's paragraphs
    paragraph: list[str] = []
    speaker: str | None = None
    section_start = section_end = 0.0
    last_line = ""  # the caption before's last line

    def close_section() -> None:
        if paragraph:
            section.append(" ".join(paragraph))
            paragraph.clear()
        if section:
            blocks.append(f"## {_clock(section_start)}-{_clock(section_end)}")
            blocks.extend(section)
            section.clear()

    for i, caption in enumerate(captions):
        if i % 1000 == 0:
            _check_time(started)
        raw = _SUBTITLE_OVERRIDES.sub("", html.unescape(caption.text))  # &amp;, SubRip's {\an8}
        said = [line for line in (" ".join(line.split()) for line in raw.split("\n")) if line]
        voice = getattr(caption, "voice", None) or None
        lines = said
        # Live captions roll up: two lines, the first repeated from the caption before by the same speaker, with
        # a flash of the old line alone between (YouTube's 10 ms cues). A one-line caption that stays repeating
        # the last one was said again ("Okay." "Okay.").
        flash = _milliseconds(caption.end_time) - _milliseconds(caption.start_time) < 200
        if said and said[0] == last_line and voice == speaker and (len(said) > 1 or flash):
            lines = said[1:]
        last_line = said[-1] if said else last_line
        if not lines:
            continue
        start, end = float(caption.start_in_seconds), float(caption.end_in_seconds)
        if (section or paragraph) and start - section_start >= TRANSCRIPT_SECTION_SECONDS:
            close_section()
        if not section and not paragraph:
            section_start = section_end = start
        if voice != speaker and paragraph:
            section.append(" ".join(paragraph))
            paragraph.clear()
        if voice is not None and (voice != speaker or not paragraph):
            lines[0] = f"{' '.join(voice.split())}: {lines[0]}"
        speaker = voice
        paragraph.extend(lines)
        section_end = max(section_end, end)
    close_section()
    if not blocks:
        raise ConversionError(f"empty (the {label} file has no captions with text)")
    return Converted(_tidy("\n\n".join(blocks)), fmt)


def _milliseconds(timestamp) -> int:
    """A webvtt-py timestamp's milliseconds (a property in 0.6, a method before)."""
    value = timestamp.in_milliseconds
    return int(value() if callable(value) else value)


def _clock(seconds: float) -> str:
    """``00:12:30``: hours, minutes and seconds, as players show a position."""
    whole = int(seconds)
    return f"{whole // 3600:02d}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


# XLSX ───────────────────────────────────────────────────────────────────────

MAX_TABLE_CELLS = 1_000_000  # a workbook of data, not of prose; openpyxl reads ~1M cells a minute at worst
TABLE_ROWS_PER_BLOCK = 25  # a table's header is repeated at least every this many rows ...
# ... and before a block's pipe rows pass this many UTF-8 bytes: a byte-level BPE or byte-fallback tokenizer makes
# at most a token of a byte, so a block fits a segment of the default size whole and every segment of a long
# table begins under its header. (Blocks of 25 rows alone came to ~970 tokens for a 5-column ledger, so the
# second segment of each had no header.) A table of digits is ~0.8 tokens a byte with SmolLM2's tokenizer.
TABLE_BLOCK_BYTES = DEFAULT_CHUNK_TOKENS - 32


def _convert_xlsx(data: bytes, started: float) -> Converted:
    """Each visible sheet as a ``## sheet name`` heading and its used cells as pipe rows, the first row the header.

    Values are what Excel shows as cached in the file (``data_only``: a formula gives its last result, not its
    text); dates in ISO form; empty columns (a sheet begun at column B, a spacer) and rows dropped. A long
    table is cut into blocks of :data:`TABLE_ROWS_PER_BLOCK` rows, each under the header again and a paragraph
    of its own, so a segment of row 500 still names its columns. Hidden sheets (helper data) and charts are
    left out. No pages: a sheet is a section, not a printed page.
    """
    _check_zip(data, "XLSX")
    import openpyxl  # lazy: 0.1 s

    with _damage_named("XLSX"):
        book = openpyxl.load_workbook(io.BytesIO(data), read_only=True, data_only=True)
    blocks: list[str] = []
    numbers: list[int] = []
    cells = 0
    try:
        for sheet in book.worksheets:
            if sheet.sheet_state != "visible":
                continue
            rows: list[list[str]] = []
            # The sheet's rows as they are in the file, not as its stored <dimension> claims: a wrong one ("A1",
            # which some writers leave) cut the sheet to one cell, and one cell far out (Z60000) padded every row
            # to its width, past the cell bound.
            sheet.reset_dimensions()
            for values in sheet.iter_rows(values_only=True):  # from row 1, empty rows included
                cells = _spend_cells(cells, len(values), "XLSX")
                rows.append([_cell(v) for v in values])
                if len(rows) % 1000 == 0:
                    _check_time(started)
            if table := _table_blocks(rows, numbers):
                blocks.append(f"## {' '.join(str(sheet.title).split())}")
                blocks.extend(table)
    finally:
        book.close()
    if not blocks:
        raise ConversionError("empty (the XLSX holds no values)")
    return _sheet_text(blocks, "xlsx", numbers)


def text_document(text: str, fmt: str) -> Converted:
    """A text file's text (decoded: :func:`decode_text`) as kvblend reads its format (:func:`classify`): Markdown
    without its front matter and with long tables in blocks (:func:`markdown_body`, :func:`block_tables`), CSV
    and TSV as tables with their rows marked (:func:`delimited_table`), any other text as it is. A file and an
    e-mail's attachment are read alike."""
    if fmt == "markdown":
        return Converted(block_tables(markdown_body(text)), fmt)
    if fmt in ("csv", "tsv"):
        return delimited_table(text, fmt)
    return Converted(text, fmt)


_CSV_SEP_LINE = re.compile(r"sep=([^\r\n])\r?\n")  # Excel's first line naming the delimiter
#: Delimiters a CSV export uses: Excel writes ";" where the decimal mark is a comma (most of Europe).
_CSV_DELIMITERS = ",;\t|"


def delimited_table(text: str, fmt: str) -> Converted:
    """A CSV or TSV file's text as Markdown pipe rows, as an XLSX sheet becomes (:func:`_table_blocks`), with the
    row number of each (a record's, as a spreadsheet opening the file numbers it: the header is row 1, a quoted
    field's line breaks do not start a row).

    The raw text would reach the KV as rows of commas whose columns no segment past the first names; as pipe
    rows under a header repeated every :data:`TABLE_ROWS_PER_BLOCK` rows, every segment says what its numbers
    are. The delimiter of a ``.csv`` is sniffed from its first 8 KiB (Python's ``csv.Sniffer``: ``,`` ``;``
    tab or ``|``; a comma where it cannot tell); a ``.tsv`` is tab-separated. Quoted fields keep their commas
    and line breaks. The first row is the header, as in a spreadsheet.
    """
    import csv

    delimiter = "\t"
    if fmt == "csv" and (declared := _CSV_SEP_LINE.match(text)):  # Excel's "sep=;" line: a setting, no row
        delimiter, text = declared.group(1), text[declared.end() :]
    elif fmt == "csv":
        try:
            # 8 KiB: the sniffer's time grows with the square of its sample (64 KiB of odd quoting took 7.7 s)
            delimiter = csv.Sniffer().sniff(text[: 8 * 1024], delimiters=_CSV_DELIMITERS).delimiter
        except csv.Error:  # one column, or too irregular to tell: a comma, as RFC 4180 has it
            delimiter = ","
    rows: list[list[str]] = []
    cells = 0
    label = fmt.upper()
    try:
        for values in csv.reader(io.StringIO(text, newline=""), delimiter=delimiter):
            cells = _spend_cells(cells, len(values), label)
            rows.append([" ".join(v.split()) for v in values])
    except csv.Error as e:  # a field over csv's 128 KiB limit, a NUL byte
        raise ConversionError(f"corrupt {label} ({describe_error(e)})") from None
    numbers: list[int] = []
    return _sheet_text(_table_blocks(rows, numbers), fmt, numbers)


def _spend_cells(before: int, cells: int, what: str) -> int:
    """The cells read so far, these included; past :data:`MAX_TABLE_CELLS` the file is refused (every table
    reader, XLSX, ODS, ODT, CSV, counts against the one bound)."""
    if before + cells > MAX_TABLE_CELLS:
        raise ConversionError(f"too large for {what} (over {MAX_TABLE_CELLS:,} cells)")
    return before + cells


def _table_blocks(rows: list[list[str]], numbers: list[int] | None = None) -> list[str]:
    """A sheet's rows as text blocks: empty rows and columns dropped; a one-column sheet as lines
    (notes, not a table); otherwise pipe rows in blocks of at most :data:`TABLE_ROWS_PER_BLOCK` rows and
    :data:`TABLE_BLOCK_BYTES` bytes, each under the header row again and a paragraph of its own, so a segment of
    row 500 still names its columns (a row longer than that is a block alone, which the segmenter then cuts).

    ``numbers``, when given, gets the row number (1-based: ``rows[i]`` is row ``i + 1``) of each data row the
    blocks hold, in order: what :func:`_sheet_text` marks them with. A one-column sheet's lines are not rows."""
    kept: list[tuple[int, list[str]]] = []
    for number, row in enumerate(rows, 1):
        row = list(row)
        while row and not row[-1].strip():
            row.pop()
        if row:
            kept.append((number, row))
    if not kept:
        return []
    # Columns empty in every row go (a sheet begun at column B, a Word table's spacer column): each would cost
    # a "|  |" in every row's KV and say nothing.
    used = sorted({j for _, r in kept for j, value in enumerate(r) if value.strip()})
    kept = [(number, [r[j] if j < len(r) else "" for j in used]) for number, r in kept]
    width = len(used)
    if width == 1:
        return ["\n".join(r[0] for _, r in kept)]
    if numbers is not None:
        numbers.extend(number for number, _ in kept[1:])
    lines = [_pipe_line(r) for _, r in kept]
    return _row_blocks([lines[0], "|" + "---|" * width], lines[1:])


def _sheet_text(blocks: list[str], fmt: str, numbers: list[int]) -> Converted:
    """A sheet format's blocks (:func:`_table_blocks`) as one text, each data row marked with its row number.

    The rows are found again in the tidied text rather than counted while joining, since tidying moves
    offsets: a table block is a paragraph whose second line is the delimiter row, and its lines after that
    are data rows, one per number in order. Should the count ever differ (a cell that tidying empties of
    everything, say), no row is marked: citing no rows is better than citing wrong ones."""
    text = _tidy("\n\n".join(blocks))
    marks: list[tuple[int, int]] = []
    offset = 0
    for paragraph in text.split("\n\n"):
        lines = paragraph.split("\n")
        at = offset
        for i, line in enumerate(lines):
            if i >= 2 and lines[0].startswith("|") and _TABLE_DELIMITER.match(lines[1]) and line.startswith("|"):
                marks.append((at, 0))
            at += len(line) + 1
        offset += len(paragraph) + 2
    if len(marks) != len(numbers):
        return Converted(text, fmt)
    return Converted(text, fmt, row_marks=tuple((at, number) for (at, _), number in zip(marks, numbers)))


def _row_blocks(head: list[str], rows: list[str]) -> list[str]:
    """A table's pipe-row lines in blocks of at most :data:`TABLE_ROWS_PER_BLOCK` rows and
    :data:`TABLE_BLOCK_BYTES` bytes, each block the header lines (`head`) then its rows."""
    budget = TABLE_BLOCK_BYTES - sum(len(line.encode()) + 1 for line in head)
    if budget < TABLE_BLOCK_BYTES // 4:  # a header too wide to leave room: no block fits a segment anyway, so
        budget = 1 << 62  # blocks of 25 rows rather than the header over every row
    blocks: list[list[str]] = [[]]
    used = 0
    for line in rows:
        cost = len(line.encode()) + 1
        if blocks[-1] and (len(blocks[-1]) == TABLE_ROWS_PER_BLOCK or used + cost > budget):
            blocks.append([])
            used = 0
        blocks[-1].append(line)
        used += cost
    return ["\n".join([*head, *block]) for block in blocks]


# A Markdown table's delimiter row: |---|:---:|, or | --- | --- | as markdownify writes it.
_TABLE_DELIMITER = re.compile(r"^\|(?:\s*:?-{3,}:?\s*\|)+\s*$")
FENCE_LINE = re.compile(r"^ {0,3}(`{3,}|~{3,})", re.MULTILINE)  # a fenced code block's opening or closing line


def fence_after(line: str, fence: str | None) -> str | None:
    """The open fence's marker after ``line`` (None: outside any), given the one open before it. A closing
    fence is of the opening's character, at least as long, with no info string: "```python" inside a fence is
    code. The one fence rule: converters close what a cell leaves open, the segmenter hides headings inside."""
    if (m := FENCE_LINE.match(line)) is None:
        return fence
    marker = m.group(1)
    if fence is None:
        return marker
    return None if marker[0] == fence[0] and len(marker) >= len(fence) and not line[m.end() :].strip() else fence


def block_tables(markdown: str) -> str:
    """Every pipe table a converter wrote (trafilatura's web tables, markdownify's EPUB ones) or a Markdown file
    holds cut into blocks under its header, as :func:`_table_blocks` cuts a sheet: a long table's later segments
    name its columns. A table that fits one block, and anything inside a ``` or ~~~ fence (a code sample), is
    left as it is."""
    if "|" not in markdown:
        return markdown
    lines = markdown.split("\n")
    out: list[str] = []
    fence: str | None = None  # the open fence's marker while inside one
    i = 0
    while i < len(lines):
        fence = fence_after(lines[i], fence)
        if fence is None and lines[i].startswith("|") and i + 1 < len(lines) and _TABLE_DELIMITER.match(lines[i + 1]):
            end = i + 2
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            out.append("\n\n".join(_row_blocks(lines[i : i + 2], lines[i + 2 : end])))
            i = end
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out)


def _cell(value: object) -> str:
    """A cell (or a chart's data point) as Excel shows its value: 412 not 412.0, 1234567.89 in full (not
    1.23457e+06, which a chart's values were written as until 2026-11-27), ISO dates, nothing for no value."""
    import datetime as dt

    if value is None:
        return ""
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if type(value).__name__ == "Decimal":  # odfdo's numbers (ODS, ODT tables)
        value = float(value)  # type: ignore[arg-type]
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.15g}"  # Excel's digits
    if isinstance(value, dt.datetime):
        return value.date().isoformat() if value.time() == dt.time(0) else value.isoformat(sep=" ")
    if isinstance(value, (dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):  # a duration cell ([h]:mm): 26:00, as the sheet shows it, not "1 day, 2:00:00"
        seconds = round(value.total_seconds())
        sign, seconds = ("-" if seconds < 0 else ""), abs(seconds)
        hours, rest = divmod(seconds, 3600)
        minutes, secs = divmod(rest, 60)
        return f"{sign}{hours}:{minutes:02d}" + (f":{secs:02d}" if secs else "")
    return " ".join(str(value).split())


# PPTX ───────────────────────────────────────────────────────────────────────


def _convert_pptx(data: bytes, started: float) -> Converted:
    _check_zip(data, "PPTX")
    import pptx  # lazy: python-pptx and lxml

    with _damage_named("PPTX"):
        deck = pptx.Presentation(io.BytesIO(data))  # reads the package: damage shows here or at a slide's parts
        pages = []
        for slide in deck.slides:
            _check_time(started)
            pages.append(_tidy(_pptx_slide(slide)))
    if not pages:
        raise ConversionError("empty (the PPTX has no slides)")
    if not any(pages):
        raise ConversionError("no text in the PPTX (its slides hold only pictures or drawings)")
    return _paged(pages, "pptx")


def _pptx_slide(slide) -> str:
    """One slide as text: its title as a ``##`` heading, then its shapes in reading order, then its notes."""
    from pptx.enum.shapes import PP_PLACEHOLDER

    title_shape = slide.shapes.title
    blocks: list[str] = []
    if title_shape is not None and (title := " ".join(title_shape.text_frame.text.split())):
        blocks.append("## " + title)
    for shape in _reading_order(slide.shapes):
        if title_shape is not None and shape.shape_id == title_shape.shape_id:
            continue
        kind = shape.placeholder_format.type if shape.is_placeholder else None
        if kind in (PP_PLACEHOLDER.FOOTER, PP_PLACEHOLDER.DATE, PP_PLACEHOLDER.SLIDE_NUMBER, PP_PLACEHOLDER.HEADER):
            continue
        if shape.has_table:
            blocks.append(_table_text([[cell.text for cell in row.cells] for row in shape.table.rows]))
        elif shape.has_chart:
            with suppress(Exception):  # a chart python-pptx cannot read costs its data, not the deck (as an outline)
                blocks.append(_pptx_chart(shape.chart))
        elif shape.has_text_frame:
            bullets = kind in (PP_PLACEHOLDER.BODY, PP_PLACEHOLDER.OBJECT)
            blocks.append(_pptx_text(shape.text_frame, bullets))
    frame = slide.notes_slide.notes_text_frame if slide.has_notes_slide else None
    if frame is not None and (notes := _pptx_text(frame, bullets=False)):
        blocks.append("Notes: " + notes)
    return "\n\n".join(b for b in blocks if b)


def _pptx_chart(chart) -> str:
    """A chart as what it says: its title, then its data as pipe rows (a row per category, a column per series),
    from the numbers the deck stores with it. Text a picture of the chart would not give a retriever."""
    title = " ".join(chart.chart_title.text_frame.text.split()) if chart.has_title else ""
    tables: list[str] = []
    for plot in chart.plots:
        series = list(plot.series)
        categories = [str(c) for c in plot.categories]
        if series and not categories:  # an XY (scatter) or bubble chart: each series its own x and y
            tables.extend(t for i, s in enumerate(series, 1) if (t := _pptx_xy_table(s, i)))
            continue
        if not series:
            continue
        values = [list(s.values) for s in series]
        rows = [["", *[s.name or f"Series {i}" for i, s in enumerate(series, 1)]]]  # as PowerPoint names them
        for i, category in enumerate(categories):
            rows.append([category, *[_cell(v[i]) if i < len(v) else "" for v in values]])
        tables.append(_table_text(rows))
    return "\n\n".join(t for t in [f"Chart: {title}" if title else "", *tables] if t)


def _pptx_xy_table(series, index: int) -> str:
    """An XY series as `| x | name |` rows, from the x and y values the deck stores (python-pptx reads only y)."""
    xs = [str(v.text) for v in series._element.xpath("./c:xVal//c:pt/c:v")]
    ys = list(series.values)
    if not xs or not ys:
        return ""
    return _table_text([["x", series.name or f"Series {index}"], *([x, _cell(y)] for x, y in zip(xs, ys))])


_MC_ALTERNATE = _MC + "AlternateContent"


def _alternate_shapes(shapes) -> list:
    """The shapes PowerPoint wraps in `mc:AlternateContent` (a text box holding an equation, newer shape kinds),
    which python-pptx's shape tree does not list: the first choice's shapes, else the fallback's."""
    from pptx.shapes.shapetree import SlideShapeFactory

    found: list = []
    for alternate in shapes._spTree.iterchildren(_MC_ALTERNATE):
        options = [option for option in alternate if len(option)]
        if options:  # mc:Choice first, mc:Fallback last, as the schema orders them
            found.extend(SlideShapeFactory(element, shapes) for element in options[0])
    return found


def _reading_order(shapes) -> list:
    """The shapes top to bottom, then left to right (a group's shapes in their place), not in z-order."""
    return [shape for _, _, shape in sorted(_placed(shapes), key=lambda placed: placed[:2])]


def _placed(shapes, to_slide=lambda y, x: (y, x)) -> list:
    """Each shape (groups opened) as (top, left, shape) on the slide. A group's shapes are placed in its own
    child coordinates, which PowerPoint maps onto the slide by the group's offset and scale (a group dragged
    up moves its `off`, not its shapes): mapped so, a moved group sorts where it is shown."""
    from pptx.enum.shapes import MSO_SHAPE_TYPE

    placed = []
    for shape in [*shapes, *_alternate_shapes(shapes)]:
        if shape.shape_type == MSO_SHAPE_TYPE.GROUP:
            placed.extend(_placed(shape.shapes, _group_mapping(shape, to_slide)))
        else:
            placed.append((*to_slide(shape.top or 0, shape.left or 0), shape))
    return placed


def _group_mapping(group, outer):
    """A group's child coordinates (y, x) to the slide's, through the group's `a:xfrm` and the mapping above it."""
    xfrm = group._element.grpSpPr.find("{http://schemas.openxmlformats.org/drawingml/2006/main}xfrm")
    if xfrm is None or xfrm.off is None or xfrm.chOff is None:
        return outer
    scale_y = (xfrm.ext.cy / xfrm.chExt.cy) if xfrm.ext is not None and xfrm.chExt is not None and xfrm.chExt.cy else 1
    scale_x = (xfrm.ext.cx / xfrm.chExt.cx) if xfrm.ext is not None and xfrm.chExt is not None and xfrm.chExt.cx else 1
    off, child = xfrm.off, xfrm.chOff
    return lambda y, x: outer(off.y + (y - child.y) * scale_y, off.x + (x - child.x) * scale_x)


def _pptx_text(frame, bullets: bool) -> str:
    """A text frame's paragraphs: list items indented by level in a body placeholder (or wherever a
    paragraph is indented), else paragraphs; a soft line break within one becomes a space."""
    lines = []
    for para in frame.paragraphs:
        text = " ".join(para.text.replace("\v", " ").split())
        if text:
            lines.append("  " * para.level + "- " + text if bullets or para.level else text)
    items = all(line.lstrip().startswith("- ") for line in lines)
    return "\n".join(lines) if items else "\n\n".join(lines)


# EPUB ───────────────────────────────────────────────────────────────────────

_CONTAINER_NS = {"c": "urn:oasis:names:tc:opendocument:xmlns:container"}
_OPF_NS = {"opf": "http://www.idpf.org/2007/opf"}
_XHTML_TYPES = {"application/xhtml+xml", "text/html"}
# Font obfuscation (IDPF and Adobe's) scrambles embedded fonts only; any other encryption of a book's parts is DRM.
_FONT_OBFUSCATION = {"http://www.idpf.org/2008/embedding", "http://ns.adobe.com/pdf/enc#RC"}


def _convert_epub(data: bytes, started: float) -> Converted:
    _check_zip(data, "EPUB")
    with _damage_named("EPUB"), zipfile.ZipFile(io.BytesIO(data)) as book:
        _check_epub_drm(book)
        chapters = []
        present = set(book.namelist())
        for name in _epub_spine(book):
            _check_time(started)
            if name not in present:  # a chapter the spine lists but the ZIP lacks: the rest of the book is read
                continue
            if book.getinfo(name).file_size > MAX_HTML_BYTES:  # as for a web page: the parse grows with it
                raise ConversionError(
                    f"EPUB chapter {name} is too large ({book.getinfo(name).file_size // _MIB} MiB; "
                    f"at most {MAX_HTML_BYTES // _MIB} MiB)"
                )
            chapters.append(_xhtml_markdown(book.read(name)))
    text = block_tables(_tidy("\n\n".join(chapters)))
    if not text:
        raise ConversionError("no text in the EPUB (its chapters hold only pictures?)")
    return Converted(text, "epub")


def _check_epub_drm(book: zipfile.ZipFile) -> None:
    """Refuse a book whose chapters are encrypted (DRM: Adobe ADEPT, Apple FairPlay, ...), named as such; fonts
    obfuscated as the EPUB standard allows are no reason to."""
    from lxml import etree

    names = set(book.namelist())
    if "META-INF/rights.xml" in names:  # Adobe ADEPT's licence
        raise ConversionError("encrypted EPUB (DRM-protected)")
    if "META-INF/encryption.xml" not in names:
        return
    root = etree.fromstring(book.read("META-INF/encryption.xml"))
    methods = {m.get("Algorithm", "") for m in root.iter("{*}EncryptionMethod")}
    if methods - _FONT_OBFUSCATION:
        raise ConversionError("encrypted EPUB (DRM-protected)")


def _epub_spine(book: zipfile.ZipFile) -> list[str]:
    """The ZIP names of the book's XHTML chapters in reading order: container.xml names the package file, whose
    spine lists manifest ids. The navigation document (EPUB 3's table of contents) is left out."""
    import posixpath
    from urllib.parse import unquote

    from lxml import etree

    container = etree.fromstring(book.read("META-INF/container.xml"))
    rootfiles = container.xpath("//c:rootfile/@full-path", namespaces=_CONTAINER_NS)
    if not rootfiles:
        raise ConversionError("corrupt EPUB (META-INF/container.xml names no package file)")
    opf_name = unquote(str(rootfiles[0]))  # a URL path: "OEBPS%20files/content.opf" names a space
    package = etree.fromstring(book.read(opf_name))
    base = posixpath.dirname(opf_name)
    items = {item.get("id"): item for item in package.xpath("/opf:package/opf:manifest/opf:item", namespaces=_OPF_NS)}
    names = []
    for ref in package.xpath("/opf:package/opf:spine/opf:itemref/@idref", namespaces=_OPF_NS):
        item = items.get(ref)
        if item is None or item.get("media-type") not in _XHTML_TYPES:
            continue
        if "nav" in (item.get("properties") or "").split():
            continue
        href = unquote(item.get("href", "").split("#", 1)[0])
        names.append(posixpath.normpath(posixpath.join(base, href)))
    if not names:
        raise ConversionError("corrupt EPUB (its spine lists no chapters)")
    return names


def _is_layout_table(table) -> bool:
    """Whether an HTML table lays a message out rather than holding data: newsletters and notification mail
    are built of nested tables whose cells hold headings and paragraphs (as pipe rows they were `|  |  |`
    noise and lost their headings). A data table has header cells or plain text in its cells."""
    if table.get("role") == "presentation" or table.find("table") is not None or table.find_parent("table"):
        return True
    if table.find("th") is not None:
        return False
    if max((len(row.find_all(["td", "th"], recursive=False)) for row in table.find_all("tr")), default=0) <= 1:
        return True  # one column: a frame around the text
    return table.find(["p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "img"]) is not None


def _xhtml_markdown(data: bytes, layout_tables: bool = False) -> str:
    """A chapter's body as Markdown: ATX headings, '-' list items, tables as pipe rows; links and images as
    their text only. `layout_tables` (an e-mail's HTML): tables used for layout (:func:`_is_layout_table`)
    are read as the blocks they hold, not as pipe rows."""
    from bs4 import BeautifulSoup  # lazy: markdownify's parser
    from markdownify import MarkdownConverter

    soup = BeautifulSoup(data, "lxml")
    body = soup.body or soup
    if layout_tables:
        layout = [t for t in body.find_all("table") if _is_layout_table(t)]
        own = [
            p
            for t in layout
            for p in t.find_all(["thead", "tbody", "tfoot", "tr", "td", "th"])
            if p.find_parent("table") is t
        ]
        for part in [*layout, *own]:
            part.name = "div"
    converter = MarkdownConverter(heading_style="ATX", bullets="-", strip=["a", "img"], escape_misc=False)
    return converter.convert_soup(body)
