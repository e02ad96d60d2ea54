"""One blob back into one segment record, for rebuilding a lost index (rebuild.py).

The layer entries (offset, length, CRC) are found again by walking the blob's
zstd frames, and every frame is decompressed in full, so a blob is listed
only if all its layers read back (frame checksums, where present, prove the
bytes). The rest of the record comes from the old index's record when that
still matches the blob byte for byte, else from what layer 0 says about its
segment. A blob with neither cannot be restored: its KV is useless without
the token ids it was computed from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvblend.archive.blobs import check_key
from kvblend.archive.codec import describe_payload, split_frames
from kvblend.archive.records import LayerEntry, SegmentRecord, checksum
from kvblend.archive.segments import record_from_blob
from kvblend.errors import CorruptBlobError


@dataclass
class Restored:
    """A segment record rebuilt from a blob, and what the blob said beyond the record."""

    record: SegmentRecord
    embedding: np.ndarray | None
    model_name: str | None
    model_fingerprint: str | None
    mtime: float
    from_old_index: bool


def restore_blob(root: Path, rel: str, known: dict[str, dict[str, Any]]) -> Restored:
    """The record of blob ``rel``; ``known``: segment key -> record dict salvaged from the old index.

    Raises CorruptBlobError (damaged) or ValueError (cannot be described) with a one-line reason.
    """
    path = root / rel
    key = check_key(Path(rel).name.split(".", 1)[0])
    data = path.read_bytes()
    mtime = os.stat(path).st_mtime
    frames = split_frames(data)
    if not frames:
        raise CorruptBlobError("blob is empty")
    layers = [LayerEntry(offset, length, checksum(data[offset : offset + length])) for offset, length, _ in frames]
    described = [describe_payload(raw) for _, _, raw in frames]
    first = described[0]
    for i, d in enumerate(described[1:], start=1):
        if (d["codec"], d["dtype"], d["shape"]) != (first["codec"], first["dtype"], first["shape"]):
            raise CorruptBlobError(f"layer {i} differs from layer 0 in codec, dtype or shape")
    about = first["segment"] if isinstance(first["segment"], dict) else {}
    model = (about.get("model_name"), about.get("model_fingerprint"))
    old = known.get(key)
    if old is not None and old.get("blob") == rel and _same_layers(old, layers):
        return Restored(SegmentRecord.from_dict(old), None, *model, mtime, from_old_index=True)
    if not about:
        why = "its bytes no longer match the old index record" if old else "the old index is lost"
        raise ValueError(f"written by an older kvblend, the blob does not describe its segment, and {why}")
    if about.get("key") != key:
        raise ValueError(f"the blob describes segment {about.get('key')!r} but is named for {key!r}")
    record, embedding = record_from_blob(about, first, layers, rel)
    return Restored(record, embedding, *model, mtime, from_old_index=False)


def _same_layers(old: dict[str, Any], layers: list[LayerEntry]) -> bool:
    """Whether the old record's layer entries are exactly the blob's (same offsets, lengths, CRCs)."""
    try:
        entries = [(int(x["offset"]), int(x["length"]), str(x["checksum"])) for x in old.get("layers", [])]
    except (KeyError, TypeError, ValueError):
        return False
    return entries == [(e.offset, e.length, e.checksum) for e in layers]
