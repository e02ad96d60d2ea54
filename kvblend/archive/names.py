"""Names under which profiles and tuned settings are stored in the archive's side-stores (no torch).

No torch here: `kvblend query` looks its tuned ratio up by :func:`tuned_key`
before any model is loaded, and the CLI imports this module at start-up.
"""

from __future__ import annotations

import hashlib
import os


def normalize_path(path: str | os.PathLike[str]) -> str:
    """Absolute, symlink-free spelling of a location, so the same place always gets the same key."""
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


def _short_hash(text: str, size: int) -> str:
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def tuned_key(model_name: str, compute: str, archive_path: str | os.PathLike[str]) -> str:
    """Name of the tuned settings for a model on a compute device type with the archive at a location.

    The archive location is part of the key because loading speed (and so the
    ratio) depends on where the archive is: move it to another disk and the
    tuned ratio no longer applies. The path is hashed so the key stays short
    (LMDB keys are limited to 511 bytes).
    """
    return f"{model_name[:200]}|{compute}|{_short_hash(normalize_path(archive_path), 8)}"


def profile_name(hostname: str, model_name: str, compute: str, storage_label: str,
                 storage_path: str | None) -> str:
    """One stored profile per (machine, model, compute, storage): re-profiling replaces it."""
    where = storage_label
    if storage_path is not None:
        where += "@" + _short_hash(storage_path, 6)
    return f"{hostname[:100]}|{model_name[:200]}|{compute}|{where[:100]}"
