"""Typed records ⇄ the JSON-able dicts the archive's side-stores hold, with a format version.

Profiles and tuned settings outlive the code that wrote them (they sit in an
archive for months), so each dict carries a ``"version"``. Reading one written
by a *newer* kvblend is refused with a clear error rather than misread; an
older one (or one from before versions existed) is read as today's, because no
field has changed meaning yet. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from kvblend.errors import KvblendError

T = TypeVar("T")


def check_version(data: Mapping[str, Any], current: int, what: str) -> int:
    """The dict's version (0 when absent); a KvblendError when it is newer than `current`."""
    version = data.get("version", 0)
    if not isinstance(version, int) or version < 0:
        raise KvblendError(f"stored {what} has an invalid version {version!r}")
    if version > current:
        raise KvblendError(
            f"stored {what} is version {version}, newer than this kvblend reads ({current}): "
            "upgrade kvblend, or re-run the command that wrote it"
        )
    return version


def from_fields(cls: type[T], data: Mapping[str, Any]) -> T:
    """A flat dataclass from a dict: known keys only (unknown ones are extras a reader may ignore)."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError as exc:  # a required field is missing
        raise KvblendError(f"stored {cls.__name__} is incomplete: {exc}") from None
