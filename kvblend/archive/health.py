"""Is the index file there and whole? Checked before LMDB maps it, by every open.

LMDB trusts its file. A ``data.mdb`` shorter than its own header says is
mapped anyway, and the first read past the end kills the process with SIGBUS
(no exception, no message). So the two meta pages are read here with plain
file I/O and the file size compared with the last page they claim.

A missing or empty index next to blob files is a *damaged* archive, not an
empty one: opening it as empty would let ``gc`` delete every blob as an
orphan. Every command refuses it with one line naming the repair command
(``verify --rebuild-index``, see rebuild.py), which restores the index from
the blobs.
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

from kvblend.archive.blobs import BLOB_DIR, BLOB_SUFFIX, is_temp_name
from kvblend.errors import ArchiveDamagedError

INDEX_DIR = "index"  # the LMDB environment
DATA_FILE = "data.mdb"

# LMDB 0.9 meta page on a 64-bit build (mdb.c: MDB_page header, then MDB_meta).
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_MAGIC_AT = 16  # mm_magic, mm_version: two uint32 right after the 16-byte page header
_PSIZE_AT = 40  # mm_dbs[FREE_DBI].md_pad holds the page size
_LAST_PG_AT = 136  # mm_last_pg, then mm_txnid: two uint64
_MIN_PAGE = 512


def repair_hint(root: Path) -> str:
    """The command that repairs a damaged index, for every message that reports one."""
    return f"run `kvblend verify --rebuild-index --archive {root}` to restore it from the blobs"


def data_file(root: Path) -> Path:
    return root / INDEX_DIR / DATA_FILE


def has_blobs(root: Path) -> bool:
    """Whether any finished segment blob exists (stops at the first one found)."""
    base = root / BLOB_DIR
    try:
        subdirs = [e for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return False
    for sub in subdirs:
        with os.scandir(sub.path) as entries:
            if any(e.name.endswith(BLOB_SUFFIX) and not is_temp_name(e.name) for e in entries):
                return True
    return False


def index_problem(root: Path) -> str | None:
    """Why ``index/data.mdb`` cannot be mapped safely, or None when it can (or LMDB itself will say).

    Only damage that would crash the process or hide data is reported here:
    a missing or empty file, a file too short for its meta pages, a file that
    is not LMDB, and a file shorter than its last used page.
    """
    path = data_file(root)
    try:
        with open(path, "rb") as f:
            head = f.read(_MIN_PAGE)
            size = os.fstat(f.fileno()).st_size
            if not head:
                return "is empty"
            last = _last_page_claimed(f, head)
            size = max(size, os.fstat(f.fileno()).st_size)  # a writer may have grown it meanwhile
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if isinstance(last, str):
        return last
    if last is not None and size < last:
        return f"is truncated ({size} bytes; its header needs {last})"
    return None


def _last_page_claimed(f, head: bytes) -> int | str | None:
    """Bytes the newest meta page says the file holds; a reason string if unreadable; None if unknown."""
    if sys.maxsize <= 2**32:
        return None  # 32-bit LMDB lays the meta page out differently: leave the check to LMDB
    if len(head) < _LAST_PG_AT + 16:
        return "is too short to be an LMDB file"
    magic, version = struct.unpack_from("<II", head, _MAGIC_AT)
    if magic != _MAGIC:
        return "is not an LMDB file"
    if version != _DATA_VERSION:
        return None  # another LMDB data version: LMDB will refuse it with its own message
    psize = struct.unpack_from("<I", head, _PSIZE_AT)[0]
    if psize < _MIN_PAGE or psize & (psize - 1):
        return "has a damaged header (bad page size)"
    best_pg, best_txn = struct.unpack_from("<QQ", head, _LAST_PG_AT)
    f.seek(psize)
    second = f.read(_LAST_PG_AT + 16)
    if len(second) == _LAST_PG_AT + 16 and struct.unpack_from("<I", second, _MAGIC_AT)[0] == _MAGIC:
        pg, txn = struct.unpack_from("<QQ", second, _LAST_PG_AT)
        if txn > best_txn:
            best_pg = pg
    elif len(second) < _LAST_PG_AT + 16:
        return "is truncated (its second meta page is missing)"
    return (best_pg + 1) * psize


def check_index_file(root: Path, *, fresh_ok: bool) -> bool:
    """Refuse (ArchiveDamagedError) an index that is damaged; True if ``data.mdb`` exists and looks whole.

    ``fresh_ok``: a missing or empty index with no blobs beside it is a
    new archive (LMDB creates the file); False is returned and the caller
    decides. With blobs beside it, it is always damage.
    """
    problem = index_problem(root)
    if problem is None:
        return True
    if problem in ("is missing", "is empty"):
        if has_blobs(root):
            raise damaged(root, f"its index {INDEX_DIR}/{DATA_FILE} {problem} but segment blobs remain")
        if fresh_ok:
            return False
        raise ArchiveDamagedError(f"{root} holds no archive index yet ({INDEX_DIR}/{DATA_FILE} {problem[3:]}); "
                                  "run `kvblend ingest PATH` to create one")
    raise damaged(root, f"its index {INDEX_DIR}/{DATA_FILE} {problem}")


def damaged(root: Path, what: str) -> ArchiveDamagedError:
    """The one-line error for a damaged archive: what is wrong and the command that repairs it."""
    return ArchiveDamagedError(f"archive at {root} is damaged: {what}; {repair_hint(root)}")
