"""Read the documents a user points kvblend at.

:func:`iter_documents` takes files and directories and returns the documents
found plus the files (or records) it had to skip, each with a short reason.

* Directories are walked recursively in sorted order; hidden entries (names
  starting with ``.``, e.g. ``.git``) are skipped, as are symlinked
  directories (no loops), the ``Page_files/`` folder a browser saves
  beside ``Page.html`` and a kvblend archive (one skip line for each folder).  A hidden file named
  explicitly is read.
* A gzip'd file (``.gz``) is read as the file it holds (``notes.md.gz`` as Markdown), under its own name.
* A ZIP or tar archive of documents (a zipped or tarred folder) is read member by member, each named
  ``bundle.zip/its/path``.
* PDF, HTML, DOCX, PPTX, ODT, ODS, ODP, EPUB, XLSX, XML, e-mail (.eml, .mbox), Jupyter notebook (.ipynb) and
  transcript (.vtt, .srt) files are converted to Markdown-flavoured text by
  :mod:`kvblend.conversion` (headings as ``#`` lines, tables as pipe rows; a
  web page without its navigation, banners and footer; a PDF's pages, or a
  deck's slides, apart by a blank line, where each begins in
  :attr:`Document.page_starts`).  What a file is comes from its first bytes
  and its extension together; a file that
  is not what its extension claims, an encrypted, scanned (no text layer),
  truncated or corrupt file, a ZIP bomb or an oversized web page is skipped
  with a one-line reason, and so is anything a converter raises.
* Any other file that is text is a document (``.txt``, ``.md``, ``.rst``
  and every other extension alike; ``.md``/``.markdown`` are recorded as
  format ``"markdown"``, their text unchanged but for a page's front matter
  (:func:`kvblend.conversion.markdown_body`) and tables too long for a segment
  (:func:`kvblend.conversion.block_tables`); ``.csv``/``.tsv`` as ``"csv"``/``"tsv"``, their rows as
  Markdown pipe rows under a repeated header: :func:`kvblend.conversion.delimited_table`).  Text is UTF-8, or UTF-16/32
  with a byte-order mark, or a legacy encoding that charset-normalizer
  detects (recorded as :attr:`Document.encoding`; see
  :func:`kvblend.conversion.decode_text`).  Skipped: files with NUL bytes
  and no byte-order mark (``"binary"``), bytes no encoding reads as text,
  RTF (its control words are not text), empty or whitespace-only
  (``"empty"``), unreadable (``"permission denied"``), larger than
  :data:`MAX_FILE_BYTES`.
* ``.jsonl``: one document per line, from the line's ``text`` field (else
  ``content``, else ``body``; the first of these holding a string).  Shown as
  ``file.jsonl#L12`` (1-based line).  Blank lines are ignored; bad lines are
  skipped with a reason.
* ``.json``: a single object with such a field is one document (shown as the
  file's path); a list of objects, at least one with such a field, is one
  document per element (shown as ``file.json#3``, 0-based index; elements
  without the field are skipped).  Any other JSON, or invalid JSON, is read
  as plain text.
* Text keeps its content exactly, except that a byte-order mark is
  dropped and ``\\r\\n`` / ``\\r`` line endings become ``\\n`` (so a checkout's
  line-ending style does not change cache keys).

Paths are shown as given plus the part below a directory argument, with
``/`` separators.  A file reached twice (same resolved path) is read once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvblend import conversion
from kvblend.errors import UsageError

__all__ = [
    "Document",
    "Reading",
    "Skipped",
    "SourceFile",
    "Unchanged",
    "TEXT_FIELDS",
    "MAX_FILE_BYTES",
    "content_hash",
    "iter_documents",
    "find_files",
    "read_documents",
    "read_file",
    "source_hash",
]

TEXT_FIELDS = ("text", "content", "body")
MAX_FILE_BYTES = 64 * 1024 * 1024


def content_hash(text: str) -> str:
    """blake2b (32-byte digest) of the UTF-8 text, as hex."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=32).hexdigest()


@dataclass(frozen=True)
class Document:
    path: str  # as the user named it (the archive makes it absolute)
    text: str
    content_hash: str
    name: str = ""  # relative to the directory it was found under (a file given alone: its file name)
    # What the file was read as: "text", "markdown", "json", or a converted format (kvblend.conversion's
    # CONVERTED_FORMATS: "pdf", "html", ...), which comes out as Markdown-flavoured text: headings are ATX lines
    # ("## Safety"), so segments can name their section.
    format: str = "text"
    # Offsets into `text` where pages 1, 2, ... begin (page_starts[0] == 0); empty for formats without pages.
    page_starts: tuple[int, ...] = ()
    # A sheet's data rows (XLSX, ODS, CSV, TSV): (offset where the row's line begins, its row number in the sheet
    # or file), in text order; empty for other formats (kvblend.conversion.Converted.row_marks).
    row_marks: tuple[tuple[int, int], ...] = ()
    # The encoding a plain-text file was decoded from when it was not UTF-8 ("utf-16", "cp1252", ...), so a
    # user can see what was guessed; "" for UTF-8 and for converted formats.
    encoding: str = ""

    # source_hash() of the converted file (PDF, HTML, ...) this document is; "" for text, which is as cheap to
    # read again as to hash. What lets the next ingest know the file unchanged without converting it again.
    source_hash: str = ""

    @classmethod
    def of(
        cls,
        path: str,
        text: str,
        format: str = "text",
        page_starts: tuple[int, ...] = (),
        encoding: str = "",
        row_marks: tuple[tuple[int, int], ...] = (),
    ) -> Document:
        return cls(
            path=path,
            text=text,
            content_hash=content_hash(text),
            format=format,
            page_starts=page_starts,
            row_marks=row_marks,
            encoding=encoding,
        )


def source_hash(data: bytes) -> str:
    """blake2b of a file's bytes and of what converts them (:func:`kvblend.conversion.converter_identity`): equal
    only when the same bytes would become the same text. Hashing is ~1 GB/s where converting a PDF is ~1 MB/s."""
    h = hashlib.blake2b(conversion.converter_identity().encode(), digest_size=32)
    h.update(b"\0")
    h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


@dataclass(frozen=True)
class Unchanged:
    """A file whose bytes the caller already holds, read as they are now (:func:`read_documents`): not converted."""

    path: str  # as shown, like Document.path
    name: str
    source_hash: str  # what the predicate was asked about: checked again under the archive's writer lock
    member: bytes | None = None  # a ZIP's or tar's member: its bytes, to read it again without the archive file


@dataclass
class Reading:
    """What :func:`read_documents` found: documents, files skipped with their reasons, and files left unread."""

    docs: list[Document] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    unchanged: list[Unchanged] = dataclasses.field(default_factory=list)


def iter_documents(paths: list[Path]) -> tuple[list[Document], list[Skipped]]:
    """Documents under ``paths`` (files or directories), and what was skipped and why.

    Raises :class:`UsageError` for a path that does not exist, or a directory
    holding no (non-hidden) files at all.
    """
    reading = read_documents(paths)
    return reading.docs, reading.skipped


@dataclass(frozen=True)
class SourceFile:
    """A file found under the paths given: where it is, its path as shown, and its name below its root."""

    path: Path
    shown: str
    name: str


def find_files(paths: list[Path]) -> tuple[list[SourceFile], list[Skipped]]:
    """The walk of :func:`iter_documents`: every file to read once (by resolved path), in order, and the
    folders skipped (unreadable, a saved web page's assets). Nothing is read yet, so a path that does not
    exist is an error before any work."""
    skipped: list[Skipped] = []
    seen: set[str] = set()
    found: list[SourceFile] = []
    for given in paths:
        given = Path(given)
        shown = given.as_posix()
        try:
            if not os.path.lexists(given) or (given.is_symlink() and not given.exists()):
                raise UsageError(f"no such file or directory: {shown}")
            is_dir = given.is_dir()
        except OSError as exc:  # under a folder this user may not search
            raise UsageError(f"cannot read {shown} ({(exc.strerror or type(exc).__name__).lower()})") from None
        if is_dir:
            if is_archive_dir(given):
                raise UsageError(f"{shown} is a kvblend archive, not a folder of documents")
            files, unreadable, assets, archives, links = _walk(given)
            skipped.extend(Skipped(_join(shown, rel), "permission denied") for rel in unreadable)
            skipped.extend(
                Skipped(_join(shown, rel), f"assets of the saved web page {_join(shown, page)} (read from the page)")
                for rel, page in assets
            )
            skipped.extend(
                Skipped(_join(shown, rel), "a kvblend archive (its files are no documents)") for rel in archives
            )
            skipped.extend(  # left out in silence, it read as "no documents found" where it was all there was
                Skipped(_join(shown, rel), "a symbolic link to a folder (not followed: give its path to ingest it)")
                for rel in links
            )
            if not files and not unreadable and not assets and not archives and not links:
                raise UsageError(f"no documents found under {shown}")
            targets = [SourceFile(f, _join(shown, rel), rel) for f, rel in files]
        else:
            targets = [SourceFile(given, shown, given.name)]
        for target in targets:
            key = os.path.realpath(target.path)
            if key not in seen:
                seen.add(key)
                found.append(target)
    return _distinct_names(found), skipped


def _distinct_names(files: list[SourceFile]) -> list[SourceFile]:
    """Files of one run that would share a name (``ingest ~/docs-2023 ~/docs-2024``, two README.md) named by their
    paths below the folder they share (``docs-2023/README.md``): under one name they were one document to `show`,
    `rm` and every citation. Never an absolute path: a name is what users and API clients are shown."""
    groups: dict[str, list[str]] = {}
    for f in files:
        groups.setdefault(f.name, []).append(os.path.abspath(f.shown))
    renamed: dict[str, str] = {}
    for paths in (p for p in groups.values() if len(p) > 1):
        common = os.path.commonpath([os.path.dirname(p) for p in paths])
        renamed.update((p, Path(os.path.relpath(p, common)).as_posix()) for p in paths)
    return [
        dataclasses.replace(f, name=renamed[os.path.abspath(f.shown)]) if os.path.abspath(f.shown) in renamed else f
        for f in files
    ]


def read_file(source: SourceFile, is_unchanged: Callable[[str, str], bool] | None = None) -> Reading:
    """One file's documents (a JSON(L) file holds several), or why it was skipped. A file to convert (PDF, HTML,
    DOCX, PPTX, EPUB, XLSX, e-mail) for which ``is_unchanged(path as shown, source_hash(bytes))`` holds is
    :class:`Unchanged` and not converted: re-ingesting 1,000 unchanged PDFs would otherwise convert them all
    again to find nothing new."""
    reading = Reading()
    unread = _read_file(source.path, source.shown, reading, is_unchanged)
    if unread is not None:
        reading.unchanged.append(Unchanged(source.shown, source.name, unread))
    return _named_below(reading, source.shown, source.name)


def read_unchanged(file: Unchanged) -> Reading:
    """A file (or an archive's member) left unread as unchanged, read after all: the archive no longer holds it
    as it is."""
    if file.member is None:
        return read_file(SourceFile(Path(file.path), file.path, file.name))
    reading = Reading()
    _read_bytes(file.path, file.path.rsplit("/", 1)[-1], file.member, reading, in_archive=True)
    return _named_below(reading, file.path, file.name)


def _named_below(reading: Reading, shown: str, name: str) -> Reading:
    """Names under a file's own: a JSON(L) file's records ("notes.jsonl#3") and an archive's members
    ("bundle.zip/docs/a.pdf") keep what follows the file's path."""
    reading.docs[:] = [dataclasses.replace(d, name=name + d.path[len(shown) :]) for d in reading.docs]
    reading.unchanged[:] = [dataclasses.replace(u, name=name + u.path[len(shown) :]) for u in reading.unchanged]
    return reading


def read_documents(paths: list[Path], is_unchanged: Callable[[str, str], bool] | None = None) -> Reading:
    """:func:`find_files`, then :func:`read_file` for each: everything at once (ingest reads file by file)."""
    files, skipped = find_files(paths)
    reading = Reading(skipped=skipped)
    for source in files:
        one = read_file(source, is_unchanged)
        reading.docs.extend(one.docs)
        reading.skipped.extend(one.skipped)
        reading.unchanged.extend(one.unchanged)
    return reading


# ─────────────────────────────── internals ───────────────────────────────


def _join(shown: str, rel: str) -> str:
    if rel == ".":
        return shown
    return rel if shown in ("", ".") else f"{shown.rstrip('/')}/{rel}"


def _walk(
    root: Path,
) -> tuple[list[tuple[Path, str]], list[str], list[tuple[str, str]], list[str], list[str]]:
    """Non-hidden files under root, sorted by relative path (deterministic), the relative paths of
    directories that could not be listed, the saved web pages' asset folders left out (with their page), the
    kvblend archives left out, and the symbolic links to folders left out (never followed: a link may loop, or
    lead anywhere)."""
    found: list[tuple[Path, str]] = []
    unreadable: list[str] = []
    assets: list[tuple[str, str]] = []
    archives: list[str] = []
    links: list[str] = []

    def onerror(err: OSError) -> None:
        if err.filename is not None:
            rel = Path(os.path.relpath(err.filename, root)).as_posix()
            unreadable.append(rel)

    for dirpath, dirnames, filenames in os.walk(root, onerror=onerror, followlinks=False):
        rel_dir = Path(os.path.relpath(dirpath, root))
        linked = {d for d in dirnames if not d.startswith(".") and os.path.islink(os.path.join(dirpath, d))}
        links.extend((rel_dir / d).as_posix().removeprefix("./") + "/" for d in linked)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in linked)
        for d in list(dirnames):
            page = _saved_page_of(d, filenames)
            if page is not None:
                dirnames.remove(d)
                assets.append(((rel_dir / d).as_posix().removeprefix("./") + "/", (rel_dir / page).as_posix()))
            elif is_archive_dir(Path(dirpath) / d):
                dirnames.remove(d)
                archives.append((rel_dir / d).as_posix().removeprefix("./") + "/")
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            rel = (rel_dir / name).as_posix()
            if rel.startswith("./"):
                rel = rel[2:]
            found.append((Path(dirpath) / name, rel))
    found.sort(key=lambda item: item[1].split("/"))
    return found, sorted(unreadable), sorted(assets), sorted(archives), sorted(links)


def is_archive_dir(path: Path) -> bool:
    """Whether a folder is a kvblend archive (kvblend/archive/FORMAT.md, section 1: an LMDB index and blob
    folders). Its files are no documents: a folder ingested with its archive inside it (``kvblend ingest .
    --archive ./kv``) once took the archive's manifests, lock and index stamp as text documents. A folder this
    user may not search is none (Python 3.11's is_file raises there; the walk then skips it as unreadable)."""
    try:
        return (path / "index" / "data.mdb").is_file() and (path / "blobs").is_dir()
    except OSError:
        return False


_PAGE_SUFFIXES = (".html", ".htm", ".xhtml", ".shtml")


def _saved_page_of(dirname: str, filenames: list[str]) -> str | None:
    """The web page a folder holds the assets of, if it is one: browsers save "Page.html" with "Page_files/"
    beside it (its scripts, style sheets, images and frames). Their text is not the page's, which is read from
    Page.html; ingested, a script or a style sheet would become KV as prose does."""
    if not dirname.endswith("_files"):
        return None
    stem = dirname.removesuffix("_files")
    return next((stem + suffix for suffix in _PAGE_SUFFIXES if stem + suffix in filenames), None)


def _read_file(
    file: Path,
    name: str,
    reading: Reading,
    is_unchanged: Callable[[str, str], bool] | None = None,
) -> str | None:
    """Read one file into ``reading``; when ``is_unchanged`` holds, its source hash (left unread)."""
    skipped = reading.skipped
    if (unnamable := _unnamable(name)) is not None:
        skipped.append(unnamable)
        return None
    try:
        if not file.is_file():  # FIFOs, devices, sockets: never block on them
            if not os.path.lexists(file):  # found by the walk, gone by its turn
                skipped.append(Skipped(name, "no such file (deleted during the ingest?)"))
                return None
            broken = file.is_symlink() and not file.exists()  # its target gone, or a loop of links
            skipped.append(Skipped(name, "a broken symbolic link" if broken else "not a regular file"))
            return None
        size = file.stat().st_size
        if size > MAX_FILE_BYTES:
            skipped.append(Skipped(name, f"too large ({size // (1024 * 1024)} MiB)"))
            return None
        data = file.read_bytes()
    except PermissionError:
        skipped.append(Skipped(name, "permission denied"))
        return None
    except IsADirectoryError:
        skipped.append(Skipped(name, "is a directory"))
        return None
    except OSError as e:
        skipped.append(Skipped(name, (e.strerror or type(e).__name__).lower()))
        return None
    return _read_bytes(name, file.name, data, reading, is_unchanged)


def _unnamable(name: str) -> Skipped | None:
    """Why a file (or an archive's member) cannot be a document by its name: bytes that are no UTF-8 in it, which
    no record, manifest or line can hold; None where it can."""
    if _is_text(name):
        return None
    return Skipped(
        name.encode("utf-8", "surrogateescape").decode("utf-8", "replace"), "file name is not valid UTF-8 (rename it)"
    )


def _read_archive(
    name: str,
    members: Callable[[bytes, int], Iterator[tuple[str, bytes | str]]],
    data: bytes,
    reading: Reading,
    is_unchanged: Callable[[str, str], bool] | None,
) -> None:
    """A zipped or tarred folder's documents (``members``: :func:`conversion.zip_members` or ``tar_members``),
    each named ``bundle.zip/its/path.pdf`` and read as that file would be. A member to convert that the archive
    already holds as it is (``is_unchanged``, as for a file) is :class:`Unchanged`, with its bytes, and not
    converted again. What a damaged archive yielded before its damage was found is kept."""
    try:
        for member, content in members(data, MAX_FILE_BYTES):
            shown = f"{name}/{member}"
            if (unnamable := _unnamable(shown)) is not None:  # a tar's name in another encoding
                reading.skipped.append(unnamable)
                continue
            if isinstance(content, str):
                reading.skipped.append(Skipped(shown, content))
                continue
            digest = _read_bytes(shown, member.rsplit("/", 1)[-1], content, reading, is_unchanged, in_archive=True)
            if digest is not None:
                reading.unchanged.append(Unchanged(shown, shown, digest, content))
    except conversion.ConversionError as e:
        reading.skipped.append(Skipped(name, str(e)))


def _read_bytes(
    name: str,
    filename: str,
    data: bytes,
    reading: Reading,
    is_unchanged: Callable[[str, str], bool] | None = None,
    in_archive: bool = False,
) -> str | None:
    """:func:`_read_file` once the bytes are read: a file's, or a zipped or tarred folder's member's
    (``in_archive``: an archive there, compressed or not, is not opened)."""
    docs, skipped = reading.docs, reading.skipped
    suffix = os.path.splitext(filename)[1].lower()  # (a PurePath per file cost 2% of reading plain text)
    members = None
    if conversion.is_document_tar(filename, data):  # docs.tar.gz, .tgz, .tar.xz: decompressed as a tar
        members = conversion.tar_members
    elif suffix == ".gz" and data.startswith(_GZIP_MAGIC):  # notes.md.gz, corpus.jsonl.gz: read what it holds
        try:
            data = _gunzip(data)
        except conversion.ConversionError as e:
            skipped.append(Skipped(name, str(e)))
            return None
        suffix = os.path.splitext(filename[: -len(".gz")])[1].lower()  # ".md" of notes.md.gz ("" for README.gz)
    if members is None and conversion.is_document_zip(suffix, data):  # a zipped folder (docs.zip, docs.zip.gz)
        members = conversion.zip_members
    if members is not None:
        if in_archive:
            skipped.append(Skipped(name, "an archive inside the archive (unpack it first)"))
        else:
            _read_archive(name, members, data, reading, is_unchanged)
        return None
    try:
        fmt = conversion.classify(suffix, data)
    except conversion.ConversionError as e:
        skipped.append(Skipped(name, str(e)))
        return None
    if fmt in conversion.CONVERTED_FORMATS:  # converting is the cost worth skipping (~1 MB/s for a PDF)
        digest = source_hash(data)
        if is_unchanged is not None and is_unchanged(name, digest):
            return digest
        before = len(docs)
        _add_converted(name, fmt, data, docs, skipped)
        if len(docs) == before + 1:
            docs[-1] = dataclasses.replace(docs[-1], source_hash=digest)
        return None
    _read_text(name, suffix, fmt, data, docs, skipped)
    return None


_GZIP_MAGIC = b"\x1f\x8b"


def _gunzip(data: bytes) -> bytes:
    """A gzip file's contents (every member, as `zcat` reads them), at most :data:`MAX_FILE_BYTES` of them: a
    few KiB of gzip can inflate to gigabytes (a gzip bomb), so inflating stops at the limit, never past it."""
    import gzip
    import zlib

    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
            out = f.read(MAX_FILE_BYTES + 1)
    except EOFError:
        raise conversion.ConversionError("truncated gzip (it ends before its last member does)") from None
    except (OSError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise conversion.ConversionError(f"corrupt gzip ({conversion.describe_error(e)})") from None
    if len(out) > MAX_FILE_BYTES:
        raise conversion.ConversionError(f"too large (over {MAX_FILE_BYTES // (1024 * 1024)} MiB decompressed)")
    return out


def _read_text(name: str, suffix: str, fmt: str, data: bytes, docs: list[Document], skipped: list[Skipped]) -> None:
    """A file that is text as it is (plain, Markdown, JSON): reading it again costs what hashing it would."""
    try:
        text, encoding = conversion.decode_text(data)
    except conversion.ConversionError as e:
        skipped.append(Skipped(name, str(e)))
        return
    text = _clean(text)

    if suffix == ".jsonl":
        _read_jsonl(text, name, docs, skipped)
        return
    if suffix == ".json" and _read_json(text, name, docs, skipped):
        return
    try:
        read = conversion.text_document(text, fmt)  # Markdown's front matter off, CSV's rows as a table
    except conversion.ConversionError as e:
        skipped.append(Skipped(name, str(e)))
        return
    _add_text(name, read.text, docs, skipped, fmt, encoding=encoding, row_marks=read.row_marks)


def _add_converted(name: str, fmt: str, data: bytes, docs: list[Document], skipped: list[Skipped]) -> None:
    """Convert a PDF, HTML or DOCX file; any failure, whatever a converter raised, is one skip line.

    Converters are third-party code fed untrusted bytes: they raise anything from
    their own error types to ``KeyError`` or ``RecursionError``. None of that may
    stop the run or print a traceback, so everything but an interrupt is caught
    here, per file.
    """
    label = fmt.upper()
    try:
        converted = conversion.convert(fmt, data)
    except conversion.ConversionError as e:
        skipped.append(Skipped(name, str(e)))
        return
    except MemoryError:
        skipped.append(Skipped(name, f"too large to convert as {label} (out of memory)"))
        return
    except RecursionError:
        skipped.append(Skipped(name, f"cannot be read as {label} (nested too deeply)"))
        return
    except Exception as e:  # see the docstring
        skipped.append(Skipped(name, f"cannot be read as {label} ({conversion.describe_error(e)})"))
        return
    _add_text(name, converted.text, docs, skipped, converted.format, converted.page_starts, "", converted.row_marks)


def _clean(text: str) -> str:
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _add_text(
    name: str,
    text: str,
    docs: list[Document],
    skipped: list[Skipped],
    format: str = "text",
    page_starts: tuple[int, ...] = (),
    encoding: str = "",
    row_marks: tuple[tuple[int, int], ...] = (),
) -> None:
    if not conversion.has_visible_text(text):
        skipped.append(Skipped(name, "empty"))
    elif not _is_text(text):  # a JSON string's lone "\ud800" escape
        skipped.append(Skipped(name, "holds a lone UTF-16 surrogate, which is no text"))
    else:
        docs.append(Document.of(name, text, format, page_starts, "" if encoding == "utf-8" else encoding, row_marks))


def _is_text(s: str) -> bool:
    """Encodable as UTF-8: no lone surrogates (undecodable file-name bytes, JSON's "\ud800" escapes)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text_field(record: object) -> str | None:
    if not isinstance(record, dict):
        return None
    for key in TEXT_FIELDS:
        value = record.get(key)
        if isinstance(value, str):
            return value
    return None


_NO_FIELD = "no text, content or body field"


def _add_record(name: str, record: object, docs, skipped) -> None:
    if not isinstance(record, dict):
        skipped.append(Skipped(name, "not a JSON object"))
        return
    text = _text_field(record)
    if text is None:
        skipped.append(Skipped(name, _NO_FIELD))
        return
    _add_text(name, _clean(text), docs, skipped, "json")


def _read_jsonl(text: str, name: str, docs, skipped) -> None:
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{name}#L{lineno}"
        try:
            record = json.loads(line)
        except ValueError:
            skipped.append(Skipped(where, "invalid JSON"))
            continue
        _add_record(where, record, docs, skipped)


def _read_json(text: str, name: str, docs, skipped) -> bool:
    """Read a .json file as records if it holds them; False means 'treat as text'."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return False
    if isinstance(value, dict):
        if _text_field(value) is None:
            return False
        _add_record(name, value, docs, skipped)
        return True
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, dict) for v in value)
        and any(_text_field(v) is not None for v in value)
    ):
        for i, record in enumerate(value):
            _add_record(f"{name}#{i}", record, docs, skipped)
        return True
    return False


def read_user_text(path: Path, what: str, convert: bool = False) -> str:
    """A file the user named on the command line, as text (:func:`kvblend.conversion.decode_text`); any failure
    is one UsageError line naming it. With `convert`, a document ingest would convert (a PDF, a web page, a DOCX,
    ...) is converted as ingest converts it: a query's --context-file read a web page's tags and a PDF's
    operators into the KV, and refused a compressed PDF as "binary".

    Only regular files are read: a FIFO (or a device, a socket) would block
    forever or never end. The file is opened non-blocking and checked on the
    open descriptor, so it cannot be swapped for a FIFO between check and read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UsageError(f"no such {what}: {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path} ({exc.strerror or type(exc).__name__})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UsageError(f"{what} {path} is a directory, not a file")
        if not stat.S_ISREG(mode):
            raise UsageError(f"{what} {path} is not a regular file (FIFOs, devices and sockets are not read)")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path} ({exc.strerror or type(exc).__name__})") from None
    finally:
        os.close(fd)
    if convert:
        try:
            fmt = conversion.classify(path.suffix.lower(), data)
        except conversion.ConversionError as exc:
            raise UsageError(f"cannot read {what} {path} ({exc})") from None
        if fmt in conversion.CONVERTED_FORMATS:
            try:
                return conversion.convert(fmt, data).text
            except conversion.ConversionError as exc:
                raise UsageError(f"cannot read {what} {path} ({exc})") from None
            except Exception as exc:  # a converter's own failure: one line, as ingest's skip line says it
                raise UsageError(f"cannot read {what} {path} as {fmt.upper()} ({type(exc).__name__})") from None
    try:
        text, _ = conversion.decode_text(data)  # what ingest reads as text, this reads too
    except conversion.ConversionError as exc:
        raise UsageError(f"cannot read {what} {path} as text ({exc})") from None
    return _clean(text)  # as text mode reads it (universal newlines), without a byte-order mark
