"""Opening an archive: every check that must pass before anything is read, created or written.

In order: the directory (paths.py), the index file (health.py: missing,
empty, truncated), the LMDB environment, the format version, the tables, a
blank index beside blobs, and the model (identity.py). A read-only open
writes nothing at all; a writable open of a directory this user cannot write
falls back to read-only, so reading commands (``query``) still work there
and only an actual write is refused, naming the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvblend.archive import identity
from kvblend.archive.health import INDEX_DIR, check_index_file, damaged, has_blobs
from kvblend.archive.identity import Model
from kvblend.archive.index import Index, open_index
from kvblend.archive.paths import prepare_dir, writable


@dataclass
class Opened:
    """What :func:`open_parts` found: the index and how the archive may be used."""

    root: Path
    index: Index
    readonly: bool
    denied: str | None  # why a writable open fell back to read-only, if it did
    model: Model  # the model the archive records


def open_parts(path: str | os.PathLike[str], *, create: bool, readonly: bool, asked: Model,
               defer_binding: bool, map_size: int) -> Opened:
    """Check and open the archive at ``path``; raises a one-line ArchiveError for every refusal."""
    root = Path(path).expanduser().absolute()
    denied = None
    if not readonly and not create and root.is_dir() and not writable(root):
        readonly, denied = True, f"archive directory {root} is not writable"
    prepare_dir(root, create=create and not readonly, readonly=readonly)
    check_index_file(root, fresh_ok=create and not readonly)
    index = open_index(root / INDEX_DIR, readonly=readonly, map_size=map_size,
                       lock=not readonly or _reader_table_usable(root))
    try:
        identity.check_version(index.peek_meta("format_version"), root)
        _refuse_blank(index, root)
        index.open_dbs()
        model = _bind(index, root, asked, version=create and not readonly, model=not (readonly or defer_binding))
    except BaseException:
        index.close()
        raise
    return Opened(root, index, readonly, denied, model)


def _reader_table_usable(root: Path) -> bool:
    """Whether a read-only open may use LMDB's ``lock.mdb`` (it exists and this user can write it).

    LMDB registers every reader there; a read-only open must neither create
    that file nor fail because it cannot write it (see ``Index``).
    """
    lock = root / INDEX_DIR / "lock.mdb"
    return lock.is_file() and os.access(lock, os.R_OK | os.W_OK)


def _refuse_blank(index: Index, root: Path) -> None:
    """An index with no format version and no segments, beside blobs, is a lost index LMDB re-created."""
    if index.peek_meta("format_version") is None and index.peek_count("segments") == 0 and has_blobs(root):
        raise damaged(root, "its index is blank (no format version, no segments) but segment blobs remain")


def _bind(index: Index, root: Path, asked: Model, *, version: bool, model: bool) -> Model:
    """Check the asked model against the recorded one; record the format version and/or the model now.

    Only a creating writer stamps the version at open (so a fresh archive is
    never blank while its first blobs are written); others leave a missing
    one to the first segment commit. The model waits for that commit too
    when binding is deferred.
    """
    meta = index.dbs["meta"]
    if (version or model) and index.read(
            lambda txn: identity.needs_stamp(txn, meta, root, asked, version=version, model=model)):
        return index.write(lambda txn: identity.stamp(txn, meta, root, asked, version=version, model=model))
    return index.read(lambda txn: identity.recorded(txn, meta, root, asked))
