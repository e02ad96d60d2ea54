"""kvblend's on-disk KV archive: an LMDB index plus one blob file per segment.

The format is specified in ``FORMAT.md`` next to this file. Typical use::

    with Archive.open(path, model_name=name, model_fingerprint=fp) as ar:
        with ar.writer():
            ar.put_segment(SegmentRecord(key=key, token_ids=ids, text=text), layers)
        k, v = ar.read_layer(key, 0)
"""

from kvblend.archive_format.archive import (
    FORMAT_VERSION,
    Archive,
    GcReport,
    VerifyProblem,
    VerifyReport,
    resolve_archive_path,
)
from kvblend.archive_format.codec import (
    CODECS,
    DEFAULT_CODEC,
    DEFAULT_LEVEL,
    decode_layer,
    decode_safetensors,
    decompress_layer,
    encode_layer,
)
from kvblend.archive_format.index import DocumentRecord, LayerEntry, SegmentRecord

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "DEFAULT_LEVEL",
    "FORMAT_VERSION",
    "Archive",
    "DocumentRecord",
    "GcReport",
    "LayerEntry",
    "SegmentRecord",
    "VerifyProblem",
    "VerifyReport",
    "decode_layer",
    "decode_safetensors",
    "decompress_layer",
    "encode_layer",
    "resolve_archive_path",
]
