"""Blob files: one file per segment, its per-layer payloads back to back; document manifests; the disk reserve.

A layer is one contiguous ``pread`` at the (offset, length) the index records,
so loading layer i of every segment in a prompt is one read per segment, and
no layer's bytes depend on another's (a loader can fetch layer i+1 while the
model computes layer i).

Durability protocol (the reason this module exists): a blob is written to a
temp file in its final directory, fsynced, renamed into place, and the
directory fsynced, all *before* the index transaction that references it
commits. A crash therefore leaves at most an unreferenced file (a finished
orphan or a ``.tmp`` file) that ``gc`` deletes, never an index record pointing
at a partial blob. Layer 0 of each blob also carries the record's own fields,
and every document record is also written as a manifest file, so a lost index
can be rebuilt from the files alone (repair.py).

The disk reserve: ``gc``, ``rm`` and ``verify --repair`` free space by deleting
blobs, but only *after* an index commit that stops referring to them, and an
LMDB commit writes new pages before it frees any. On a disk at 100% that commit
would fail, so writers keep a preallocated ``reserve`` file that the
space-freeing commands delete first and recreate afterwards.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from kvblend.archive.records import (
    DocumentRecord,
    LayerEntry,
    SegmentRecord,
    check_key,
    checksum,
)
from kvblend.errors import ArchiveError

BLOB_DIR = "blobs"
BLOB_SUFFIX = ".kvb"
TMP_MARKER = ".tmp-"  # temp files: ".<name>.tmp-<pid>-<random>" in the blob's own directory

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


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
        make_dirs_durably(final.parent)
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
            raise ArchiveError(
                f"disk full while writing {final}; free space or shrink the archive with `kvblend gc --max-size`"
            ) from None
        if isinstance(e, OSError):
            raise ArchiveError(f"cannot write {final}: {e.strerror or e}") from None
        raise
    if sync_dir:
        fsync_dir(final.parent)
    return entries


def make_dirs_durably(directory: Path) -> None:
    """``mkdir -p``, syncing the parent of each directory it creates: a new directory's entry survives a power
    loss only once its parent is synced (ext4's journal usually saves it; XFS and btrfs need the fsync), and a
    committed record must never point into a directory that is gone."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for new in reversed(missing):
        try:
            new.mkdir()
        except FileExistsError:  # another writer made it meanwhile (and syncs it)
            continue
        fsync_dir(new.parent)


def unlink_quiet(path: Path) -> None:
    """Delete a file that may already be gone."""
    with suppress(FileNotFoundError):
        os.unlink(path)


def unlink_blob(root: Path, relpath: str) -> int:
    """Delete a blob if present; return the bytes freed (0 if it was already gone). A blob this user may not
    delete (a folder another user made, say by one `sudo kvblend ingest`) is one line, not a traceback."""
    path = root / relpath
    try:
        size = path.stat().st_size
        os.unlink(path)
        return size
    except FileNotFoundError:
        return 0
    except OSError as e:
        raise ArchiveError(f"cannot delete {path}: {e.strerror} (check the archive's owner and permissions)") from None


#: `kvblend profile` measures a folder (the archive's own by default) through a scratch file it deletes when done:
#: ``.kvblend-profile-<pid>-<hex>.scratch``. A profile killed outright (SIGKILL, OOM, power loss) leaves it behind,
#: up to 64 MB each: the next profile of that folder and `gc` of that archive delete those whose process is gone.
PROFILE_SCRATCH_PREFIX = ".kvblend-profile-"
PROFILE_SCRATCH_SUFFIX = ".scratch"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def stale_profile_scratch(directory: Path) -> list[tuple[str, int]]:
    """Scratch files of profiles whose process is gone, in ``directory``: (file name, size)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    stale = []
    for entry in entries:
        name = entry.name
        if not (name.startswith(PROFILE_SCRATCH_PREFIX) and name.endswith(PROFILE_SCRATCH_SUFFIX)):
            continue
        pid_text = name[len(PROFILE_SCRATCH_PREFIX) :].split("-", 1)[0]
        if not pid_text.isascii() or not pid_text.isdigit() or _process_alive(int(pid_text)):
            continue
        try:
            if entry.is_file(follow_symlinks=False):
                stale.append((name, entry.stat(follow_symlinks=False).st_size))
        except FileNotFoundError:
            continue
    return stale


def scan_blob_dir(root: Path) -> Iterator[tuple[str, int, bool]]:
    """Every file under ``blobs/``: (relative path, size, is_temp)."""
    base = root / BLOB_DIR
    if not base.is_dir():
        return
    try:
        subs = sorted(base.iterdir())
    except OSError as e:
        raise ArchiveError(f"cannot list {base}: {e.strerror} (check the archive's owner and permissions)") from None
    for sub in subs:
        if not sub.is_dir():
            continue
        try:
            entries = list(os.scandir(sub))
        except OSError as e:
            raise ArchiveError(f"cannot list {sub}: {e.strerror} (check the archive's owner and permissions)") from None
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
                yield f"{BLOB_DIR}/{sub.name}/{entry.name}", size, is_temp_name(entry.name)


class _Descriptors:
    """One thread's open blob descriptors, least recently used first; closed when the thread ends.

    Each query streams on a thread of its own, so a cache that outlived its thread leaked its
    descriptors: a server gained ~6 per request, and blobs that gc evicted kept their disk
    space until the server stopped. CPython drops a thread's ``threading.local`` state when
    the thread ends, and with it this object.
    """

    def __init__(self) -> None:
        self.fds: OrderedDict[str, int] = OrderedDict()

    def close(self) -> None:
        while self.fds:
            _, fd = self.fds.popitem()
            with suppress(OSError):
                os.close(fd)

    def drop_unlinked(self) -> None:
        """Close descriptors of blobs deleted since (gc, eviction, rm): an open one keeps the disk space."""
        for relpath, fd in list(self.fds.items()):
            if _unlinked(fd):
                del self.fds[relpath]
                with suppress(OSError):
                    os.close(fd)

    def __del__(self) -> None:
        self.close()


def _unlinked(fd: int) -> bool:
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


class BlobReader:
    """``pread`` access to blobs with per-thread caches of open file descriptors.

    Loader threads read the same few blobs layer after layer; reopening each
    time would cost a path lookup per layer. Each thread keeps its own LRU of
    descriptors (no locking on the read path), closed when the thread ends or by
    :meth:`close`. A cached descriptor may point at a blob that was since
    replaced or deleted: one whose file is deleted is closed when next used and
    whenever its thread opens another, and :meth:`read_checked` retries once after
    :meth:`invalidate` when a read fails.
    """

    def __init__(self, root: Path, max_open: int = 64):
        self.root = root
        self.max_open = max_open
        self._tls = threading.local()
        self._all: weakref.WeakSet[_Descriptors] = weakref.WeakSet()
        self._lock = threading.Lock()

    def _cache(self) -> _Descriptors:
        cache = getattr(self._tls, "descriptors", None)
        if cache is None:
            cache = self._tls.descriptors = _Descriptors()
            with self._lock:
                self._all.add(cache)
        return cache

    def _fd(self, relpath: str) -> int:
        descriptors = self._cache()
        cache = descriptors.fds
        fd = cache.get(relpath)
        if fd is not None and not _unlinked(fd):
            cache.move_to_end(relpath)
            return fd
        descriptors.drop_unlinked()  # this path's own, if its blob was deleted, among them
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

    def read_checked(self, relpath: str, entry: LayerEntry) -> tuple[bytes | None, str, bool]:
        """One layer's payload checked against its entry: (data, "", False) or (None, reason, unreadable).

        `unreadable`: the read failed (permissions, I/O, descriptors), which says nothing of the bytes; else
        the blob is missing, short or fails its checksum. Retries once with a fresh descriptor: a cached one
        may point at a blob that was replaced since, which is not corruption.
        """
        reason, unreadable = "", False
        for _ in range(2):
            try:
                data = self.pread(relpath, entry.offset, entry.length)
            except FileNotFoundError:
                reason, unreadable = "blob file is missing", False
            except OSError as e:
                reason, unreadable = f"cannot read blob ({e.strerror or e})", True
            else:
                unreadable = False
                if len(data) < entry.length:
                    reason = f"blob is truncated (layer needs bytes {entry.offset}..{entry.offset + entry.length})"
                elif checksum(data) != entry.checksum:
                    reason = "checksum mismatch"
                else:
                    return data, "", False
            self.invalidate(relpath)
        return None, reason, unreadable

    def invalidate(self, relpath: str) -> None:
        """Drop this thread's cached descriptor for ``relpath``."""
        fd = self._cache().fds.pop(relpath, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close every thread's descriptors (call when no reads are in flight)."""
        with self._lock:
            for cache in list(self._all):
                cache.close()
            self._all.clear()
        self._tls = threading.local()


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


MANIFEST_DIR = "documents"
MANIFEST_SUFFIX = ".json"


def manifest_relpath(path: str) -> str:
    """``documents/<blake2b-128 of the absolute path>.json``: fixed-length names for any path."""
    digest = hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()
    return f"{MANIFEST_DIR}/{digest}{MANIFEST_SUFFIX}"


def write_manifest(root: Path, doc: DocumentRecord) -> None:
    """Durably write (or replace) a document's manifest; a full disk is one ArchiveError line."""
    write_blob(root, manifest_relpath(doc.path), [doc.to_json().encode()])  # rebuild-index's copy: durable too


def remove_manifest(root: Path, path: str) -> None:
    unlink_blob(root, manifest_relpath(path))


def iter_manifest_files(root: Path) -> list[tuple[str, bool]]:
    """(relative path, is_temp) of every file under ``documents/``."""
    try:
        entries = sorted(os.scandir(root / MANIFEST_DIR), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [
        (f"{MANIFEST_DIR}/{e.name}", is_temp_name(e.name))
        for e in entries
        if e.is_file(follow_symlinks=False) and (is_temp_name(e.name) or e.name.endswith(MANIFEST_SUFFIX))
    ]


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


def write_segment_blobs(
    root: Path,
    staged: Sequence[tuple[SegmentRecord, Iterable[bytes]]],
    committed: Callable[[str], SegmentRecord | None],
) -> None:
    """Write one blob per segment, filling in each record's ``blob`` and ``layers``; not yet committed.

    ``staged``: each record with its encoded layer payloads (core.py encodes
    them). ``committed(key)`` is the record the index holds now, if any (its
    blob must survive until the new record commits). On any failure the blobs
    already written are unlinked (no committed record names them yet) and the
    error propagates.
    """
    written: list[str] = []
    dirs: set[Path] = set()
    try:
        for rec, payloads in staged:
            rec.blob = new_blob_path(rec.key, committed(rec.key))
            rec.layers = write_blob(root, rec.blob, payloads, sync_dir=False)
            written.append(rec.blob)
            dirs.add((root / rec.blob).parent)
        for d in sorted(dirs):
            fsync_dir(d)
    except BaseException:
        for rel in written:
            with suppress(ArchiveError):  # the first failure is the one to tell
                unlink_blob(root, rel)
        raise


def new_blob_path(key: str, current: SegmentRecord | None) -> str:
    """The plain blob name, unless the committed record uses it (then a fresh generation name)."""
    plain = blob_relpath(key)
    if current is not None and current.blob == plain:
        return blob_relpath(key, secrets.token_hex(4))
    return plain
