"""Document manifests: a copy of each document record beside the blobs, for rebuilding a lost index.

A blob knows its own segment (codec.py writes the record's fields into layer
0), but not which documents list it: segments are shared between documents
and committed before them. So every document record is also written as
``documents/<hash of path>.json`` (atomically, fsynced) before the index
commit that stores it, and deleted after the commit that removes it. The
index stays the authority; ``verify --rebuild-index`` reads these only when
the index is gone. A manifest that is stale (a crash between commit and
unlink) or missing (written by an older kvblend) at worst restores a document
as incomplete or not at all, and the rebuild reports it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kvblend.archive.blobs import is_temp_name, unlink_blob, write_blob
from kvblend.archive.records import DocumentRecord
from kvblend.errors import ArchiveError

MANIFEST_DIR = "documents"
MANIFEST_SUFFIX = ".json"


def manifest_relpath(path: str) -> str:
    """``documents/<blake2b-128 of the absolute path>.json``: fixed-length names for any path."""
    digest = hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()
    return f"{MANIFEST_DIR}/{digest}{MANIFEST_SUFFIX}"


def write_manifest(root: Path, doc: DocumentRecord) -> None:
    """Durably write (or replace) a document's manifest; a full disk is one ArchiveError line."""
    write_blob(root, manifest_relpath(doc.path), [doc.to_json().encode()], sync_dir=False)


def remove_manifest(root: Path, path: str) -> None:
    unlink_blob(root, manifest_relpath(path))


def iter_manifest_files(root: Path) -> list[tuple[str, bool]]:
    """(relative path, is_temp) of every file under ``documents/``."""
    try:
        entries = sorted(os.scandir(root / MANIFEST_DIR), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [(f"{MANIFEST_DIR}/{e.name}", is_temp_name(e.name)) for e in entries
            if e.is_file(follow_symlinks=False) and (is_temp_name(e.name) or e.name.endswith(MANIFEST_SUFFIX))]


def read_manifests(root: Path) -> tuple[list[DocumentRecord], list[str]]:
    """Every readable manifest's record, and the relative paths of those that could not be read."""
    docs, unreadable = [], []
    for rel, is_temp in iter_manifest_files(root):
        if is_temp:
            continue
        try:
            doc = DocumentRecord.from_json((root / rel).read_bytes())
        except (OSError, ArchiveError, TypeError, AttributeError):
            unreadable.append(rel)
            continue
        if not doc.path or manifest_relpath(doc.path) != rel:
            unreadable.append(rel)
            continue
        docs.append(doc)
    return docs, unreadable
