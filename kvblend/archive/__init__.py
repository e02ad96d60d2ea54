"""kvblend's KV archive: segments' per-layer KV and their records, on a local directory or on Redis.

The format is specified in ``FORMAT.md`` next to this file. Typical use::

    with Archive.open(path_or_redis_url, model_name=name, model_fingerprint=fp) as ar:
        with ar.writer():
            ar.put_segment(SegmentRecord(key=key, token_ids=ids, text=text), layers)
        k, v = ar.read_layer(key, 0)

    records.py      segment / document records, keys, names of stored settings
    codec.py        per-layer payloads: safetensors + zstd (lossless), quant.py (int8 / int4)
    core.py         every rule above the store, once: format version, model binding, segments, documents, lookups
    store.py        the narrow store interface: records in a transaction, payloads, scans, the writer lock
    local.py        the local store: a directory with an LMDB index (index.py, indexcheck.py) and blob files (blobs.py)
    redis_store.py  the Redis store: one key per segment layer, records written last
    facade.py       Archive: the core opened at a location, with its upkeep; what every command uses
    maintenance.py  verify, gc, stats
    repair.py       a lost local index rebuilt from its blob files
    location.py     --archive: a directory or a redis:// URL

Importing this package does not import torch (only encoding and decoding KV do).
"""

from kvblend.archive.codec import (
    CODECS,
    check_codec,
    decode_layer,
    decode_safetensors,
    decompress_layer,
    encode_layer,
    is_lossless,
)
from kvblend.archive.core import FORMAT_VERSION, SEGMENT_PREFIX_MIN, DocumentSummary
from kvblend.archive.facade import Archive
from kvblend.archive.location import Location, resolve_location
from kvblend.archive.maintenance import (
    ArchiveStats,
    GcReport,
    VerifyProblem,
    VerifyReport,
)
from kvblend.archive.records import (
    DocumentRecord,
    KeyScheme,
    LayerEntry,
    SegmentRecord,
    codec_settings,
    segment_key,
)
from kvblend.archive.repair import RebuildReport, rebuild_index
from kvblend.defaults import DEFAULT_CODEC, DEFAULT_LEVEL

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "DEFAULT_LEVEL",
    "FORMAT_VERSION",
    "SEGMENT_PREFIX_MIN",
    "Archive",
    "ArchiveStats",
    "DocumentRecord",
    "DocumentSummary",
    "GcReport",
    "KeyScheme",
    "LayerEntry",
    "Location",
    "RebuildReport",
    "SegmentRecord",
    "VerifyProblem",
    "VerifyReport",
    "check_codec",
    "codec_settings",
    "decode_layer",
    "decode_safetensors",
    "decompress_layer",
    "encode_layer",
    "is_lossless",
    "rebuild_index",
    "resolve_location",
    "segment_key",
]
