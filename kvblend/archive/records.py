"""The index's records: segments, their layers, documents; and the keys they are stored under.

Records are JSON so the format is inspectable (``python -m lmdb``) and never
needs pickle. Readers ignore fields they do not know, so format v1 may gain
optional fields without a version bump (see FORMAT.md). A record that is not
valid JSON means the index file itself is damaged (LMDB keeps no checksums of
values), so it is reported as such rather than as a traceback.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from kvblend.errors import ArchiveDamagedError, ArchiveError

T = TypeVar("T")

_LMDB_KEY_LIMIT = 480  # LMDB's default max key size is 511 bytes; keep a margin


def load_record(raw: str | bytes, what: str = "index record") -> Any:
    """Parse one stored JSON value; garbage means a damaged index file, not a bug."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ArchiveDamagedError(f"archive index is damaged: an {what} is not valid JSON; "
                                  "run `kvblend verify --rebuild-index` with the same --archive to restore it") from None


def checksum(data: bytes) -> str:
    """Checksum of one stored payload: CRC-32 (zlib), 8 hex digits.

    It guards against torn writes and bit rot, not against an adversary, and it
    runs on every layer of every query: zlib's CRC-32 checks ~3 GB/s per core
    where BLAKE2b managed ~0.6 GB/s, which on a 2-core host was ~3% of a
    blended query's time stolen from the fusor.
    """
    return f"{zlib.crc32(data):08x}"


def _from_dict(cls: type[T], d: dict[str, Any]) -> T:
    """Build a dataclass from a dict, ignoring unknown keys (forward-compatible reads)."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class LayerEntry:
    """Where layer i of a segment lies in its blob: one contiguous (offset, length) read."""

    offset: int
    length: int
    checksum: str  # CRC-32 (8 hex digits) of the compressed payload bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SegmentRecord:
    """Index record of one cached segment (a chunk's KV, every layer)."""

    key: str
    n_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    dtype: str = ""
    codec: str = ""
    n_layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    base_position: int = 0  # position of the first token when the KV was prefilled
    layers: list[LayerEntry] = field(default_factory=list)
    blob: str = ""  # path of the blob file, relative to the archive root
    created: float = 0.0
    last_access: float = 0.0
    hits: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [layer.to_dict() if isinstance(layer, LayerEntry) else dict(layer) for layer in self.layers]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SegmentRecord:
        rec = _from_dict(cls, d)
        rec.layers = [_from_dict(LayerEntry, x) for x in d.get("layers", [])]
        return rec

    @classmethod
    def from_json(cls, data: str | bytes) -> SegmentRecord:
        return cls.from_dict(load_record(data))

    @property
    def stored_bytes(self) -> int:
        """Compressed bytes of all layers."""
        return sum(layer.length for layer in self.layers)

    @property
    def raw_bytes(self) -> int:
        """Size of this segment's KV as fp16 (K and V, every layer): the uncompressed reference."""
        return self.n_layers * self.raw_layer_bytes

    @property
    def raw_layer_bytes(self) -> int:
        """One layer's K and V as fp16: what a loader's read of that layer stands for."""
        return 2 * 2 * self.kv_heads * self.head_dim * self.n_tokens


@dataclass
class DocumentRecord:
    """Index record of one ingested document: its segments in order.

    Records written by older kvblends may carry an ``mtime`` (always 0.0); it
    is dropped on read like any unknown field.
    """

    path: str  # absolute path
    content_hash: str = ""
    segment_keys: list[str] = field(default_factory=list)
    n_tokens: int = 0
    ingested: float = 0.0
    size: int = 0  # bytes of the source file
    incomplete: bool = False  # some segments were dropped (evicted or corrupt): re-ingest to restore
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DocumentRecord:
        return _from_dict(cls, d)

    @classmethod
    def from_json(cls, data: str | bytes) -> DocumentRecord:
        return cls.from_dict(load_record(data))


def document_db_key(path: str) -> bytes:
    """LMDB key of a document: its path, or a hash of it when the path exceeds LMDB's key limit."""
    raw = path.encode("utf-8", "surrogateescape")
    if len(raw) <= _LMDB_KEY_LIMIT:
        return raw
    return b"#blake2b:" + hashlib.blake2b(raw, digest_size=32).hexdigest().encode()


def name_db_key(name: str, what: str) -> bytes:
    """LMDB key of a short name (segment key, profile, meta entry); long names are a usage error."""
    raw = name.encode("utf-8")
    if not raw or len(raw) > _LMDB_KEY_LIMIT:
        raise ArchiveError(f"{what} name must be 1-{_LMDB_KEY_LIMIT} bytes, got {len(raw)}")
    return raw


#: Version of the tuned-setting objects `kvblend tune` stores (kvblend.tuning.tune.TunedSetting writes it).
TUNED_VERSION = 1


@dataclass(frozen=True)
class TunedRatio:
    """What every reader of a stored tuned setting relies on: its version, the ratio, and the selection policy
    whose quality floor it was measured for (settings stored before policies existed were measured with hkvd).

    `kvblend tune` stores a richer object (kvblend.tuning.tune.TunedSetting) that starts with these fields;
    a query reads only this part, through :meth:`from_stored`, so both agree on one schema.
    """

    ratio: float
    select: str = "hkvd"

    @classmethod
    def from_stored(cls, value: Any) -> TunedRatio | None:
        """The ratio part of a stored setting; None when nothing usable is stored (absent, another version,
        or a ratio outside (0, 1]): a query then runs with the default ratio rather than failing."""
        if not isinstance(value, dict) or value.get("version", TUNED_VERSION) != TUNED_VERSION:
            return None
        ratio = value.get("ratio")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
            return None
        return cls(float(ratio), str(value.get("select", "hkvd")))
