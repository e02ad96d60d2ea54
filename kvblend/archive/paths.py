"""Where an archive lives and what its directory must hold before the index opens.

Every OS error met while preparing the directory becomes a one-line
:class:`ArchiveError`, so a bad ``--archive`` never shows a traceback.
Read-only opens create nothing: not the directory, not ``index/``, not
``blobs/``.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from kvblend.archive.blobs import BLOB_DIR
from kvblend.archive.health import INDEX_DIR, damaged, has_blobs
from kvblend.errors import ArchiveError

LOCK_FILE = "lock"  # the writer's flock (see lock.py)
INDEX_FILES = ("data.mdb", "lock.mdb")


def resolve_archive_path(cli_value: str | os.PathLike[str] | None) -> Path:
    """Where the archive lives: ``--archive``, else ``$KVBLEND_ARCHIVE``, else the XDG cache dir."""
    if cli_value:
        return Path(cli_value).expanduser()
    env = os.environ.get("KVBLEND_ARCHIVE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvblend"


def archive_exists(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds an archive (its index directory), without opening or creating it."""
    return (Path(path) / INDEX_DIR).is_dir()


def writable(root: Path) -> bool:
    """Whether this process may create and delete files in the archive directory and its index."""
    dirs = [root] + [root / d for d in (INDEX_DIR, BLOB_DIR) if (root / d).is_dir()]
    return all(os.access(d, os.W_OK | os.X_OK) for d in dirs)


def prepare_dir(root: Path, *, create: bool, readonly: bool) -> None:
    """Check (and, when creating, make) the archive directory and its ``index/`` and ``blobs/``."""
    if root.exists() and not root.is_dir():
        raise ArchiveError(f"archive path {root} is a file, not a directory")
    if not root.exists():
        if not create:
            raise ArchiveError(f"no archive at {root} (ingest documents first, or check --archive)")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArchiveError(f"cannot create archive directory {root}: {e.strerror or e}") from None
    if not archive_exists(root):
        if has_blobs(root):  # the index directory itself was lost: never start a fresh one over the blobs
            raise damaged(root, f"its {INDEX_DIR}/ directory is missing but segment blobs remain")
        if not create:
            raise ArchiveError(f"{root} is not a kvblend archive (it has no {INDEX_DIR}/ directory)")
    if readonly:
        return
    if not writable(root):
        raise ArchiveError(f"archive directory {root} is not writable; use another --archive")
    try:
        (root / INDEX_DIR).mkdir(exist_ok=True)
        (root / BLOB_DIR).mkdir(exist_ok=True)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ArchiveError(f"disk full while creating archive {root}") from None
        raise ArchiveError(f"cannot create archive directory {root}: {e.strerror or e}") from None


def index_bytes(root: Path) -> int:
    """Bytes of the LMDB files (the map is sparse, so this is what the index really takes)."""
    total = 0
    for name in INDEX_FILES:
        try:
            total += (root / INDEX_DIR / name).stat().st_size
        except FileNotFoundError:
            pass
    return total
