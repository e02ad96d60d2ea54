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


def segment_key(fingerprint: str, token_ids: Sequence[int], settings: dict) -> str:
    """Key = hash(model fingerprint, token ids, KV-producing settings): no collisions across models."""
    h = hashlib.blake2b(digest_size=20)
    h.update(fingerprint.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()
