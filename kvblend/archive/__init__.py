"""kvblend's on-disk KV archive: an LMDB index plus one blob file per segment.

The format is specified in ``FORMAT.md`` next to this file. Typical use::

    with Archive.open(path, model_name=name, model_fingerprint=fp) as ar:
        with ar.writer():
            ar.put_segment(SegmentRecord(key=key, token_ids=ids, text=text), layers)
        k, v = ar.read_layer(key, 0)

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
from kvblend.archive.facade import Archive
from kvblend.archive.local import FORMAT_VERSION, resolve_archive_path
from kvblend.archive.maintenance import GcReport, VerifyProblem, VerifyReport
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
    "Archive",
    "DocumentRecord",
    "GcReport",
    "KeyScheme",
    "LayerEntry",
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
    "resolve_archive_path",
    "segment_key",
]
