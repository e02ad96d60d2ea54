"""The archive: an :class:`~kvblend.archive.core.ArchiveCore` opened at a location, with its upkeep.

Every command, the pipeline and the feeds use an :class:`Archive`. What holds
the bytes is its :class:`~kvblend.archive.store.Store`, a local directory
(LMDB + blob files, local.py) or Redis (redis_store.py), chosen by the
location's form when the archive is opened; what the bytes mean (segments,
documents, the format version and the model binding, lookups) is the core's,
the same whatever the store. This module adds only opening (and refusing),
the location, and the entry points of upkeep (maintenance.py: verify, gc,
stats).

torch is imported only by the calls that encode or decode tensors, so
listing, verifying and collecting an archive never load it.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvblend.archive import maintenance
from kvblend.archive.core import SEGMENT_PREFIX_MIN, ArchiveCore, DocumentSummary, bind
from kvblend.archive.index import DEFAULT_MAP_SIZE
from kvblend.archive.local import LocalStore, archive_exists, check_creatable
from kvblend.archive.location import Location, resolve_location
from kvblend.archive.records import Model
from kvblend.archive.store import Store
from kvblend.errors import ArchiveError

__all__ = ["SEGMENT_PREFIX_MIN", "Archive", "DocumentSummary"]


class Archive(ArchiveCore):
    """A KV archive. Open with :meth:`Archive.open`; close (or use ``with``) when done."""

    def __init__(self, store: Store, location: Location, asked: Model = Model(), model: Model = Model()):
        """Internal: use :meth:`open`."""
        super().__init__(store, asked, model)
        self.location = location

    @staticmethod
    def exists(location: str | os.PathLike[str] | Location) -> bool:
        """Whether an archive is there, without opening or creating it (a Redis archive is assumed to be:
        only connecting could tell)."""
        where = resolve_location(location)
        return where.is_redis or archive_exists(where.path or Path())

    @staticmethod
    def check_creatable(location: str | os.PathLike[str] | Location) -> None:
        """Raise ArchiveError where a local archive could not be created (a file there, no permission)."""
        where = resolve_location(location)
        if where.path is not None:
            check_creatable(where.path)

    @classmethod
    def open(
        cls,
        location: str | os.PathLike[str] | Location,
        *,
        create: bool = True,
        model_name: str | None = None,
        model_fingerprint: str | None = None,
        readonly: bool = False,
        defer_binding: bool = False,
        initial_map_size: int = DEFAULT_MAP_SIZE,
    ) -> Archive:
        """Open (or create) the archive at ``location``: a directory, or a ``redis://`` URL.

        Refuses, with one actionable line, an archive written by a newer format
        (ArchiveVersionError), one built with another model
        (ArchiveModelMismatchError, when ``model_fingerprint`` is given), a
        damaged one (ArchiveDamagedError, naming the repair command), and a
        missing archive when ``create`` is False. ``readonly`` writes nothing
        at all. The first writable open with a model records it; with
        ``defer_binding`` it is checked now but recorded with the first
        committed segment.
        """
        where = resolve_location(location)
        asked = Model(model_name, model_fingerprint)
        store: Store
        if where.redis is not None:
            from kvblend.archive.redis_store import RedisStore

            store = RedisStore.open(where.redis, create=create, readonly=readonly)
        else:
            store = LocalStore.open(where.path or Path(), create=create, readonly=readonly, map_size=initial_map_size)
        try:
            writing = not store.readonly  # a local open of a directory this user cannot write falls back to reading
            model = bind(store, asked, version=create and writing, model=writing and not defer_binding)
        except BaseException:
            store.close()
            raise
        return cls(store, where, asked, model)

    def close(self) -> None:
        """Release the writer lock if held, descriptors, connections. Idempotent."""
        self.store.close()

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Archive({self.location.display!r}, model={self.model_name!r})"

    @property
    def path(self) -> Path:
        """The archive directory (a local archive only: a Redis archive has none)."""
        if self.location.path is None:
            raise ArchiveError(f"{self.location} is a Redis archive: it has no directory")
        return Path(self.store.location)

    # ------------------------------------------------------------ upkeep (maintenance.py)

    def verify(self, repair: bool = False, deep: bool = False) -> maintenance.VerifyReport:
        return maintenance.verify(self, repair=repair, deep=deep)

    def gc(self, max_size_bytes: int | None = None, dry_run: bool = False) -> maintenance.GcReport:
        return maintenance.gc(self, max_size_bytes=max_size_bytes, dry_run=dry_run)

    def stats(self) -> maintenance.ArchiveStats:
        return maintenance.stats(self, self.location.display)
