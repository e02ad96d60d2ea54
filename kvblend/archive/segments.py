"""Segment KV <-> records: check KV against its record, write it to blobs, check it read back.

Blobs are written and fsynced (files, then each directory once) before the
caller commits the index records that name them (FORMAT.md, 4.1), so a crash
leaves at most unreferenced files for ``gc``. Layer 0 of each blob also
carries the record's own fields (token ids, text, model, embedding), so a
lost index can be rebuilt from the blobs (rebuild.py). Decoded KV is checked
against its record, so a payload that decodes but does not fit is treated as
corrupt (the caller recomputes) rather than fed to the model.
"""

from __future__ import annotations

import base64
import dataclasses
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvblend.archive.blobs import blob_relpath, check_key, fsync_dir, unlink_blob, write_blob
from kvblend.archive.codec import CODECS, decode_layer, dtype_name, encode_layer
from kvblend.archive.identity import Model
from kvblend.archive.records import LayerEntry, SegmentRecord
from kvblend.errors import CorruptBlobError
from kvblend.types import LayerKV


def write_segment_blobs(root: Path, items: Iterable[tuple[SegmentRecord, Sequence[LayerKV]]], codec: str,
                        level: int, committed: Callable[[str], SegmentRecord | None], model: Model = Model(),
                        embeddings: Mapping[str, Any] | None = None) -> list[SegmentRecord]:
    """Write one blob per new key (repeats: first wins); return the filled-in records, not yet committed.

    ``committed(key)`` is the record the index holds now, if any (its blob
    must survive until the new record commits). ``model`` and ``embeddings``
    (key -> vector) go into layer 0's metadata with the record. On any
    failure the blobs already written are unlinked (no committed record names
    them yet) and the error propagates.
    """
    records: list[SegmentRecord] = []
    seen: set[str] = set()
    written: list[str] = []
    dirs: set[Path] = set()
    try:
        for record, layers in items:
            if record.key in seen:
                continue
            seen.add(record.key)
            rec = describe(record, layers, codec)
            rec.blob = new_blob_path(rec.key, committed(rec.key))
            about = blob_metadata(rec, model, (embeddings or {}).get(rec.key))
            payloads = (encode_layer(k, v, codec, level, segment=about if i == 0 else None)
                        for i, (k, v) in enumerate(layers))
            rec.layers = write_blob(root, rec.blob, payloads, sync_dir=False)
            written.append(rec.blob)
            dirs.add((root / rec.blob).parent)
            records.append(rec)
        for d in sorted(dirs):
            fsync_dir(d)
    except BaseException:
        for rel in written:
            unlink_blob(root, rel)
        raise
    return records


def new_blob_path(key: str, current: SegmentRecord | None) -> str:
    """The plain blob name, unless the committed record uses it (then a fresh generation name)."""
    plain = blob_relpath(key)
    if current is not None and current.blob == plain:
        return blob_relpath(key, secrets.token_hex(4))
    return plain


def describe(record: SegmentRecord, layers: Sequence[LayerKV], codec: str) -> SegmentRecord:
    """Validate the tensors against the record and fill in shape, dtype, codec, times."""
    check_key(record.key)
    if not layers:
        raise ValueError(f"segment {record.key}: no layers to store")
    k0 = layers[0][0]
    if k0.dim() != 3:
        raise ValueError(f"segment {record.key}: K must be [kv_heads, n_tokens, head_dim], got {tuple(k0.shape)}")
    for i, (k, v) in enumerate(layers):
        if k.shape != k0.shape or v.shape != k0.shape or k.dtype != k0.dtype or v.dtype != k0.dtype:
            raise ValueError(f"segment {record.key} layer {i}: K/V shape or dtype differs from layer 0")
    kv_heads, n_tokens, head_dim = (int(s) for s in k0.shape)
    if record.n_tokens and record.n_tokens != n_tokens:
        raise ValueError(f"segment {record.key}: record says {record.n_tokens} tokens, KV has {n_tokens}")
    if record.token_ids and len(record.token_ids) != n_tokens:
        raise ValueError(f"segment {record.key}: {len(record.token_ids)} token ids for {n_tokens} KV tokens")
    now = time.time()
    return dataclasses.replace(
        record, n_tokens=n_tokens, token_ids=[int(t) for t in record.token_ids], dtype=dtype_name(k0.dtype),
        codec=codec, n_layers=len(layers), kv_heads=kv_heads, head_dim=head_dim, layers=[],
        created=record.created or now, last_access=record.last_access or now, extra=dict(record.extra))


def decode_checked(record: SegmentRecord, layer: int, data: bytes, lazy: bool = False) -> LayerKV:
    """Decode one layer's payload and check it matches the record's shape and dtype.

    ``lazy``: lossy codecs return :class:`~kvblend.archive.quant.Quantized`
    codes (same ``shape``/``dtype``) for the loader to dequantize in place.
    """
    if record.codec not in CODECS:  # written by a newer kvblend: unreadable here, so recompute
        raise CorruptBlobError(f"segment {record.key} uses codec {record.codec!r}, unknown to this kvblend",
                               record.key, layer)
    try:
        k, v = decode_layer(data, record.codec, lazy)
    except CorruptBlobError as e:
        raise CorruptBlobError(f"segment {record.key} layer {layer}: {e}", record.key, layer) from None
    want = (record.kv_heads, record.n_tokens, record.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want or dtype_name(k.dtype) != record.dtype:
        raise CorruptBlobError(f"segment {record.key} layer {layer}: payload is {tuple(k.shape)} {k.dtype}, "
                               f"record says {want} {record.dtype}", record.key, layer)
    return k, v


def blob_metadata(rec: SegmentRecord, model: Model, embedding: Any = None) -> dict[str, Any]:
    """What layer 0 of a blob says about its segment: every record field that is not about the tensors."""
    about: dict[str, Any] = {"key": rec.key, "token_ids": rec.token_ids, "text": rec.text,
                             "base_position": rec.base_position, "extra": rec.extra, "created": rec.created,
                             "model_name": model.name, "model_fingerprint": model.fingerprint}
    if embedding is not None:
        vector = np.ascontiguousarray(np.asarray(embedding, dtype="<f4").reshape(-1))
        about["embedding"] = base64.b64encode(vector.tobytes()).decode("ascii")
    return about


def record_from_blob(about: Mapping[str, Any], tensors: Mapping[str, Any], layers: list[LayerEntry],
                     blob: str) -> tuple[SegmentRecord, np.ndarray | None]:
    """Inverse of :func:`blob_metadata`: the record (and embedding) a rebuilt index gets for a blob.

    ``tensors``: codec, dtype and shape [kv_heads, n_tokens, head_dim] from
    the payload header (``codec.describe_payload``). Raises ValueError when
    the two disagree, e.g. token ids for another number of tokens.
    """
    kv_heads, n_tokens, head_dim = (int(x) for x in tensors["shape"])
    token_ids = [int(t) for t in about.get("token_ids") or []]
    if token_ids and len(token_ids) != n_tokens:
        raise ValueError(f"{len(token_ids)} token ids for {n_tokens} KV tokens")
    created = float(about.get("created") or 0.0)
    rec = SegmentRecord(key=str(about["key"]), n_tokens=n_tokens, token_ids=token_ids, text=str(about.get("text", "")),
                        dtype=str(tensors["dtype"]), codec=str(tensors["codec"]), n_layers=len(layers),
                        kv_heads=kv_heads, head_dim=head_dim, base_position=int(about.get("base_position") or 0),
                        layers=layers, blob=blob, created=created, last_access=created,
                        extra=dict(about.get("extra") or {}))
    vector = None
    if about.get("embedding"):
        vector = np.frombuffer(base64.b64decode(about["embedding"]), dtype="<f4").astype(np.float32)
    return rec, vector
