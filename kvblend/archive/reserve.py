"""A few MB of disk kept in reserve, so the commands that free space still run on a full disk.

``gc``, ``rm`` and ``verify --repair`` free space by deleting blobs, but only
*after* an index commit that stops referring to them (FORMAT.md 4.4), and an
LMDB commit writes new pages (copy-on-write) before it frees any. On a disk
at 100% that commit fails with ENOSPC, so the very command the disk-full
message recommends could not run. Writers therefore keep ``reserve``, a
preallocated file in the archive directory: the space-freeing commands delete
it first, do their work, and recreate it afterwards (when space allows).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvblend.archive.blobs import unlink_blob, unlink_quiet

RESERVE_FILE = "reserve"
RESERVE_BYTES = 4 << 20  # LMDB commits of a gc or rm touch far fewer pages than this


def ensure_reserve(root: Path, size: int = RESERVE_BYTES) -> bool:
    """Create the reserve file if it is missing; False when there is no room for it (never raises).

    Written as a temp file then renamed, so a crash or a full disk never
    leaves a short reserve that looks complete. Called under the writer lock,
    so any other temp reserve is a crashed writer's: it is removed.
    """
    final = root / RESERVE_FILE
    tmp = root / f".{RESERVE_FILE}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        for stale in root.glob(f".{RESERVE_FILE}.tmp-*"):
            unlink_quiet(stale)
        if final.is_file() and final.stat().st_size >= size:
            return True
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            os.posix_fallocate(fd, 0, size)  # real blocks, not a sparse hole
        finally:
            os.close(fd)
        os.rename(tmp, final)
        return True
    except OSError:
        unlink_quiet(tmp)
        return False


def release_reserve(root: Path) -> int:
    """Delete the reserve file; the bytes it freed (0 if there was none)."""
    return unlink_blob(root, RESERVE_FILE)


@contextmanager
def spending_reserve(root: Path) -> Iterator[None]:
    """Free the reserve for the block (which frees space), then take it back if there is room."""
    release_reserve(root)
    try:
        yield
    finally:
        ensure_reserve(root)
