"""The archive's single-writer lock: ``flock`` across processes, a re-entrant mutex within one.

Every operation that creates or deletes blob files (put, remove, repair, gc)
runs under it, so ``gc`` can tell a crashed writer's leftovers from a live
writer's work in progress. Readers never take it.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvblend.errors import ArchiveBusyError


class _Flock:
    """Exclusive ``flock`` on the archive's ``lock`` file, holding the owner's pid for error messages.

    flock (not fcntl record locks) because it belongs to the open file, so the
    kernel drops it when a writer dies, even by SIGKILL.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self, wait: bool | float) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if wait is True:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                self._poll(fd, deadline=time.monotonic() + (0.0 if wait is False else float(wait)))
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _note_pid(fd)

    def _poll(self, fd: int, deadline: float) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ArchiveBusyError(
                        f"another kvblend process is writing to this archive (pid {_holder(fd)}); "
                        "retry when it is done, or pass --wait to wait for it") from None
                time.sleep(0.05)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)  # closing the last descriptor releases the flock


def _note_pid(fd: int) -> None:
    """Write our pid for the busy message of other writers; best effort.

    Only a courtesy for error messages: on a full disk (ENOSPC) the write
    fails, and the lock must still be usable, since `gc` and `rm`, which
    free space, need it most then.
    """
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass


def _holder(fd: int) -> str:
    """The pid the current holder wrote into the lock file, or "unknown"."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"


class WriterLock:
    """Re-entrant exclusive writer: a thread mutex in this process, the flock across processes.

    The flock is taken by the outermost :meth:`hold` and released with it, so
    nested writes (a batch inside ``with archive.writer()``) reuse it.
    """

    def __init__(self, path: Path):
        self._flock = _Flock(path)
        self._mutex = threading.RLock()
        self._depth = 0

    @property
    def held(self) -> bool:
        return self._depth > 0

    @property
    def depth(self) -> int:
        """Nesting of :meth:`hold` in this process (1 inside the outermost)."""
        return self._depth

    @contextmanager
    def hold(self, wait: bool | float = False) -> Iterator[None]:
        """Hold the lock for the block. ``wait``: False fails at once, True blocks, a number waits seconds."""
        if wait is True:
            got = self._mutex.acquire()
        elif wait is False or float(wait) <= 0:
            got = self._mutex.acquire(blocking=False)
        else:
            got = self._mutex.acquire(timeout=float(wait))
        if not got:
            raise ArchiveBusyError("another thread of this process is writing to this archive; "
                                   "retry when it is done")
        try:
            if self._depth == 0:
                self._flock.acquire(wait)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._flock.release()
        finally:
            self._mutex.release()

    def close(self) -> None:
        """Drop the flock whatever the nesting (the archive is closing)."""
        self._flock.release()
        self._depth = 0
