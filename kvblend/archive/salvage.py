"""Whatever a damaged index still holds, read table by table before it is replaced.

The blobs carry what a segment needs (segments.py) and manifests what a
document lists (manifests.py), but archives written by older kvblends have
neither, and only the index holds usage counts, profiles and tuned settings.
So a rebuild first copies out every record the old index still yields: each
table is scanned until its first error; after one, the keys the caller can
guess (segment keys from blob names, document keys from manifests) are looked
up one by one, each in its own transaction, so only the records on the
damaged page itself are lost. A record that is not valid JSON is skipped. A
file that would crash the process when mapped (health.py) is not opened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from kvblend.archive.health import INDEX_DIR, index_problem
from kvblend.archive.index import DB_NAMES, lmdb_reason


@dataclass
class Salvage:
    """Raw rows per table (key -> value bytes) and what went wrong while reading them."""

    tables: dict[str, dict[bytes, bytes]] = field(default_factory=lambda: {name: {} for name in DB_NAMES})
    problems: list[str] = field(default_factory=list)

    def json_rows(self, table: str) -> dict[bytes, Any]:
        """The table's rows whose value is valid JSON, parsed."""
        out = {}
        for key, raw in self.tables[table].items():
            try:
                out[key] = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                self.problems.append(f"{table} record {key[:40]!r} is not valid JSON")
        return out

    def segments(self) -> dict[str, dict[str, Any]]:
        """Segment key -> record dict, for records that at least name a key and a blob."""
        rows = self.json_rows("segments")
        return {d["key"]: d for d in rows.values() if isinstance(d, dict) and d.get("key") and d.get("blob")}

    def documents(self) -> list[dict[str, Any]]:
        return [d for d in self.json_rows("documents").values() if isinstance(d, dict) and d.get("path")]


def salvage(root: Path, hints: dict[str, list[bytes]] | None = None) -> Salvage:
    """Read every table of ``root``'s index that can still be read (an empty Salvage if none can).

    ``hints``: table -> keys worth looking up one by one when its scan fails.
    """
    found = Salvage()
    problem = index_problem(root)
    if problem is not None:
        if problem not in ("is missing", "is empty"):
            found.problems.append(f"the old index {problem}: nothing could be read from it")
        return found
    try:
        # Read-only, without LMDB's reader table: the caller holds the writer lock, so no kvblend
        # writer runs, and the damaged directory may not even take a lock file.
        env = lmdb.open(str(root / INDEX_DIR), readonly=True, lock=False, max_dbs=len(DB_NAMES) + 2,
                        subdir=True, readahead=False)
    except lmdb.Error as e:
        found.problems.append(f"the old index cannot be opened ({lmdb_reason(e)})")
        return found
    try:
        for name in DB_NAMES:
            if not _read_table(env, name, found):
                _look_up(env, name, (hints or {}).get(name, []), found)
    finally:
        env.close()
    return found


def _read_table(env: lmdb.Environment, name: str, found: Salvage) -> bool:
    """Copy one table's rows into ``found`` until the first error; False if one stopped the scan."""
    rows = found.tables[name]
    try:
        db = env.open_db(name.encode(), create=False)
    except lmdb.NotFoundError:
        return True
    except lmdb.Error as e:
        found.problems.append(f"table {name} cannot be opened ({lmdb_reason(e)})")
        return False
    try:
        with env.begin(db=db, buffers=False) as txn:
            for key, value in txn.cursor():
                rows[bytes(key)] = bytes(value)
    except lmdb.Error as e:
        found.problems.append(f"table {name} is damaged after {len(rows)} records ({lmdb_reason(e)})")
        return False
    return True


def _look_up(env: lmdb.Environment, name: str, keys: list[bytes], found: Salvage) -> None:
    """Get each key on its own (a failed read poisons its transaction), skipping those already read."""
    rows = found.tables[name]
    try:
        db = env.open_db(name.encode(), create=False)
    except lmdb.Error:
        return
    for key in keys:
        if key in rows:
            continue
        try:
            with env.begin(db=db, buffers=False) as txn:
                value = txn.get(key)
        except lmdb.Error:
            continue
        if value is not None:
            rows[key] = bytes(value)
