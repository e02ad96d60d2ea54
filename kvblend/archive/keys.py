"""Segment keys: what makes two cached KVs interchangeable.

A key names a segment's KV in the archive (and its blob file), so it must
change whenever anything that produced the KV changes: the model weights, the
exact token ids, and the settings that shape the KV (dtype, position, ...).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

from kvblend.archive.codec import check_codec, is_lossless


def segment_key(fingerprint: str, token_ids: Sequence[int], settings: dict) -> str:
    """Key = hash(model fingerprint, token ids, KV-producing settings): no collisions across models."""
    h = hashlib.blake2b(digest_size=20)
    h.update(fingerprint.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def codec_settings(codec: str) -> dict:
    """What a codec adds to a segment key's KV-producing settings.

    A lossy codec changes the KV a query reads back (int4 KV is not the KV it
    was made from), so its segments get keys of their own and live beside the
    lossless ones. Lossless codecs give back the same bits and add nothing, so
    keys written before lossy codecs existed still match.
    """
    name = check_codec(codec)
    return {} if is_lossless(name) else {"codec": name}
