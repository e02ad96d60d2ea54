"""Blob files: one file per segment, its per-layer payloads back to back.

A layer is one contiguous ``pread`` at the (offset, length) the index records,
so loading layer i of every segment in a prompt is one read per segment, and
no layer's bytes depend on another's (a loader can fetch layer i+1 while the
model computes layer i).

Durability protocol (the reason this module exists): a blob is written to a
temp file in its final directory, fsynced, renamed into place, and the
directory fsynced, all *before* the index transaction that references it
commits. A crash therefore leaves at most an unreferenced file (a finished
orphan or a ``.tmp`` file) that ``gc`` deletes, never an index record pointing
at a partial blob.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

from kvblend.archive.records import LayerEntry, checksum
from kvblend.errors import ArchiveError

BLOB_DIR = "blobs"
BLOB_SUFFIX = ".kvb"
TMP_MARKER = ".tmp-"  # temp files: ".<name>.tmp-<pid>-<random>" in the blob's own directory

_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{2,128}$")
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


def check_key(key: str) -> str:
    """Segment keys become file names, so only hash-like keys are accepted."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ArchiveError(f"invalid segment key {key!r}: use 2-128 characters from [A-Za-z0-9_-]")
    return key


def blob_relpath(key: str, generation: str = "") -> str:
    """Relative path of a segment's blob: ``blobs/<first 2 chars>/<key>[.<gen>].kvb``.

    Two-character fan-out keeps directories small. ``generation`` is used only
    when replacing a segment whose current blob has the plain name, so the old
    blob stays intact until the new record commits.
    """
    check_key(key)
    name = f"{key}.{generation}{BLOB_SUFFIX}" if generation else f"{key}{BLOB_SUFFIX}"
    return f"{BLOB_DIR}/{key[:2]}/{name}"


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TMP_MARKER in name


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (the rename), not just the file's data."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_blob(root: Path, relpath: str, payloads: Iterable[bytes], *, sync_dir: bool = True) -> list[LayerEntry]:
    """Write payloads back to back into ``root/relpath`` atomically; return their index entries.

    ``payloads`` may be a generator, so encoding layer i+1 and writing layer i
    interleave and only one layer is held in memory. With ``sync_dir=False``
    the caller must :func:`fsync_dir` the parent before committing the index
    (batch writes sync each directory once).

    On a full disk the temp file is removed and :class:`ArchiveError` says so;
    on any error nothing is left at ``relpath`` that was not there before.
    """
    final = root / relpath
    tmp = final.parent / f".{final.name}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}"
    entries: list[LayerEntry] = []
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            offset = 0
            for data in payloads:
                _write_all(fd, data)
                entries.append(LayerEntry(offset=offset, length=len(data), checksum=checksum(data)))
                offset += len(data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
    except BaseException as e:
        unlink_quiet(tmp)
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            raise ArchiveError(f"disk full while writing {final}; free space or shrink the archive "
                               "with `kvblend gc --max-size`") from None
        if isinstance(e, OSError):
            raise ArchiveError(f"cannot write {final}: {e.strerror or e}") from None
        raise
    if sync_dir:
        fsync_dir(final.parent)
    return entries


def unlink_quiet(path: Path) -> None:
    """Delete a file that may already be gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unlink_blob(root: Path, relpath: str) -> int:
    """Delete a blob if present; return the bytes freed (0 if it was already gone)."""
    path = root / relpath
    try:
        size = path.stat().st_size
        os.unlink(path)
        return size
    except FileNotFoundError:
        return 0


def scan_blob_dir(root: Path) -> Iterator[tuple[str, int, bool]]:
    """Every file under ``blobs/``: (relative path, size, is_temp)."""
    base = root / BLOB_DIR
    if not base.is_dir():
        return
    for sub in sorted(base.iterdir()):
        if not sub.is_dir():
            continue
        for entry in os.scandir(sub):
            if entry.is_file(follow_symlinks=False):
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
                yield f"{BLOB_DIR}/{sub.name}/{entry.name}", size, is_temp_name(entry.name)


class BlobReader:
    """``pread`` access to blobs with per-thread caches of open file descriptors.

    Loader threads read the same few blobs layer after layer; reopening each
    time would cost a path lookup per layer. Each thread keeps its own LRU of
    descriptors (no locking on the read path); all are closed by :meth:`close`.
    A cached descriptor may point at a blob that was since replaced or
    deleted, so :meth:`read_checked` retries once after :meth:`invalidate`
    when a read fails.
    """

    def __init__(self, root: Path, max_open: int = 64):
        self.root = root
        self.max_open = max_open
        self._tls = threading.local()
        self._all: list[OrderedDict[str, int]] = []
        self._lock = threading.Lock()

    def _cache(self) -> OrderedDict[str, int]:
        cache = getattr(self._tls, "fds", None)
        if cache is None:
            cache = self._tls.fds = OrderedDict()
            with self._lock:
                self._all.append(cache)
        return cache

    def _fd(self, relpath: str) -> int:
        cache = self._cache()
        fd = cache.get(relpath)
        if fd is not None:
            cache.move_to_end(relpath)
            return fd
        fd = os.open(self.root / relpath, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        cache[relpath] = fd
        while len(cache) > self.max_open:
            _, old = cache.popitem(last=False)
            os.close(old)
        return fd

    def pread(self, relpath: str, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset``; fewer if the file is shorter. FileNotFoundError if absent."""
        fd = self._fd(relpath)
        chunks = []
        got = 0
        while got < length:
            data = os.pread(fd, length - got, offset + got)
            if not data:
                break
            chunks.append(data)
            got += len(data)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def read_checked(self, relpath: str, entry: LayerEntry) -> tuple[bytes | None, str]:
        """One layer's payload checked against its entry: (data, "") or (None, reason).

        Retries once with a fresh descriptor: a cached one may point at a blob
        that was replaced since, which is not corruption.
        """
        reason = ""
        for _ in range(2):
            try:
                data = self.pread(relpath, entry.offset, entry.length)
            except FileNotFoundError:
                reason = "blob file is missing"
            except OSError as e:
                reason = f"cannot read blob ({e.strerror or e})"
            else:
                if len(data) < entry.length:
                    reason = f"blob is truncated (layer needs bytes {entry.offset}..{entry.offset + entry.length})"
                elif checksum(data) != entry.checksum:
                    reason = "checksum mismatch"
                else:
                    return data, ""
            self.invalidate(relpath)
        return None, reason

    def invalidate(self, relpath: str) -> None:
        """Drop this thread's cached descriptor for ``relpath``."""
        fd = self._cache().pop(relpath, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close every thread's descriptors (call when no reads are in flight)."""
        with self._lock:
            for cache in self._all:
                while cache:
                    _, fd = cache.popitem()
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._all.clear()
        self._tls = threading.local()
