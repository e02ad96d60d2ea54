"""What an archive is: its format version and the model it was built with, checked at every open.

Both live in the ``meta`` table. The version is checked before anything else
is opened or created (a newer archive is refused untouched); the model is
recorded by the first writer that names one, and every later open naming
another model is refused, because KV from one model is garbage to another.

A writer may *defer* recording (``Archive.open(..., defer_binding=True)``):
the model is then checked at open but recorded with the first committed
segment, so a run that fails before storing anything (a model that does not
load) leaves the archive bound to nothing. Every segment commit re-checks in
its own transaction, so two writers naming different models cannot both bind.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from kvblend.archive.health import damaged
from kvblend.archive.stores import dump_json, load_json
from kvblend.errors import ArchiveModelMismatchError, ArchiveVersionError

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Model:
    """A model identity: the name shown to users and the fingerprint that is compared."""

    name: str | None = None
    fingerprint: str | None = None


def check_version(raw: bytes | None, root: Path) -> int | None:
    """The stored ``format_version`` (None when absent); refuse a newer or a malformed one.

    Only positive integers are versions: 1.5, 0, -1 or "1" were never written
    by kvblend, so the index is damaged rather than of some other format.
    """
    if raw is None:
        return None
    try:
        version: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        version = raw[:20]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise damaged(root, f"its format version {version!r} is not a positive integer")
    if version > FORMAT_VERSION:
        raise ArchiveVersionError(f"archive format v{version} is newer than this kvblend supports "
                                  f"(v{FORMAT_VERSION}); upgrade kvblend")
    return version


def recorded(txn: lmdb.Transaction, meta: Any, root: Path, asked: Model) -> Model:
    """The model the archive records (checked against ``asked``); refuses a mismatch."""
    if meta is None:  # a read-only open of an index without tables: nothing recorded
        return Model()
    check_version(txn.get(b"format_version", db=meta), root)
    have = Model(load_json(txn.get(b"model_name", db=meta)), load_json(txn.get(b"model_fingerprint", db=meta)))
    if asked.fingerprint and have.fingerprint and asked.fingerprint != have.fingerprint:
        raise ArchiveModelMismatchError(_mismatch_message(root, have, asked))
    return have


def stamp(txn: lmdb.Transaction, meta: Any, root: Path, asked: Model, *, version: bool = True,
          model: bool = True) -> Model:
    """Check, then record what is missing: the format version (with ``created``) and/or the model.

    A fingerprint is recorded when none is; a name when it comes with a new
    fingerprint or when nothing identifies the model yet. Returns the model
    now recorded. Runs inside the caller's write transaction.
    """
    have = recorded(txn, meta, root, asked)
    if version and txn.get(b"format_version", db=meta) is None:
        txn.put(b"format_version", dump_json(FORMAT_VERSION), db=meta)
        txn.put(b"created", dump_json(time.time()), db=meta)
    if not model:
        return have
    name, fp = have.name, have.fingerprint
    new_fp = bool(asked.fingerprint and not fp)
    if new_fp:
        fp = asked.fingerprint
        txn.put(b"model_fingerprint", dump_json(fp), db=meta)
    if asked.name and (new_fp or not (name or fp)):  # a new fingerprint brings its name
        name = asked.name
        txn.put(b"model_name", dump_json(name), db=meta)
    return Model(name, fp)


def needs_stamp(txn: lmdb.Transaction, meta: Any, root: Path, asked: Model, *, version: bool = True,
                model: bool = True) -> bool:
    """Whether :func:`stamp` would write anything (so opening an up-to-date archive needs no write)."""
    have = recorded(txn, meta, root, asked)
    if version and txn.get(b"format_version", db=meta) is None:
        return True
    return model and (bool(asked.fingerprint and not have.fingerprint)
                      or bool(asked.name and not (have.name or have.fingerprint)))


def _mismatch_message(root: Path, have: Model, asked: Model) -> str:
    old_fp, new_fp = have.fingerprint or "", asked.fingerprint or ""
    a = have.name or f"fingerprint {old_fp[:12]}"
    b = asked.name or f"fingerprint {new_fp[:12]}"
    if a == b:  # same name, other weights (e.g. a re-quantized checkpoint)
        a, b = f"{a} (fingerprint {old_fp[:12]})", f"{b} (fingerprint {new_fp[:12]})"
    hint = f"pass --model {have.name} or use another --archive" if have.name else "use another --archive"
    return f"archive at {root} was built with model {a}; you asked for model {b} ({hint})"
