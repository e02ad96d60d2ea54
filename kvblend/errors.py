"""Errors kvblend reports to users.

Every failure a user can cause (bad path, bad flag, wrong archive) raises a
subclass of :class:`KvblendError`. The CLI turns these into one line on
stderr and a non-zero exit, so no user ever sees a traceback for bad input.
Anything else escaping is a bug.
"""

from __future__ import annotations


class KvblendError(Exception):
    """Base class: a problem the user can act on; its message is one line."""

    exit_code = 1


class UsageError(KvblendError):
    """Bad argument value (ratio out of range, empty prompt, ...)."""

    exit_code = 2


class UnsupportedModelError(KvblendError):
    """The checkpoint's architecture has no layer-by-layer runner."""


class ModelNotFoundError(KvblendError):
    """No checkpoint at the given path, or the default model is not installed."""


class ArchiveError(KvblendError):
    """The archive cannot be opened or used as asked."""


class ArchiveVersionError(ArchiveError):
    """The archive was written by a newer format version."""


class ArchiveModelMismatchError(ArchiveError):
    """The archive was built with a different model than the one requested."""


class ArchiveBusyError(ArchiveError):
    """Another process holds the archive's writer lock."""


class CorruptBlobError(ArchiveError):
    """A blob is missing, truncated, or fails its checksum."""

    def __init__(self, message: str, segment_key: str = "", layer: int | None = None, reason: str = ""):
        super().__init__(message)
        self.segment_key = segment_key
        self.layer = layer
        self.reason = reason or message  # what is wrong, without naming the segment or where it lives


class BlobUnreadableError(CorruptBlobError):
    """A blob could not be read (permissions, an I/O error, too many open files): it cannot be used now, but
    nothing says its bytes are bad, so `verify --repair` leaves it alone."""


class ArchiveDamagedError(ArchiveError):
    """The archive's index is missing, truncated or corrupted: its message names the repair command."""


class NotFoundError(UsageError):
    """A document or segment the archive does not hold (a server answers 404)."""


class ArchiveUnavailableError(ArchiveError):
    """The archive's store cannot be reached (a Redis server down, unreachable, or refusing the credentials);
    a server answers 503."""


class NonFiniteLogitsError(KvblendError):
    """The model computed NaN or +inf logits (a dtype too narrow for its activations): no token can be chosen."""
