"""Segment keys: what makes two cached KVs interchangeable.

A key names a segment's KV in the archive (and its blob file), so it must
change whenever anything that produced the KV changes: the model weights, the
exact token ids, and the settings that shape the KV (dtype, position, ...).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvblend.archive.codec import check_codec, is_lossless
from kvblend.defaults import DEFAULT_CODEC


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


@dataclass(frozen=True)
class KeyScheme:
    """Everything besides the tokens that shapes a segment's KV, so everything its key must cover.

    Ingest, a stored context passage, a served client chunk and the instruction prefix
    all key their KV through one scheme, so the same tokens under the same model and
    settings always find the same segment, and different ones never collide.
    """

    fingerprint: str  # the model's weights
    dtype: str  # the KV's storage dtype ("float16" unless the model computes in bf16)
    sink_ids: tuple[int, ...] = ()  # tokens each segment is prefilled after (their KV dropped)

    @property
    def sink_setting(self) -> str:
        """The sink's part of a key: "alone" (the keys of archives made before sinks existed), or its tokens."""
        return "alone" if not self.sink_ids else "tokens:" + ",".join(map(str, self.sink_ids))

    def settings(self, codec: str = DEFAULT_CODEC) -> dict:
        """The KV-producing settings a key hashes (a lossy codec adds itself: its KV differs)."""
        return {"sink": self.sink_setting, "dtype": self.dtype, **codec_settings(codec)}

    def key_of(self, token_ids: Sequence[int], codec: str = DEFAULT_CODEC) -> str:
        return segment_key(self.fingerprint, token_ids, self.settings(codec))
