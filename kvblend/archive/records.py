"""What the archive stores about segments and documents, and how segments are named.

Records are JSON so the format is inspectable (``python -m lmdb``) and never
needs pickle. Readers ignore fields they do not know, so format v1 may gain
optional fields without a version bump (see FORMAT.md). A record that is not
valid JSON means the index is damaged (LMDB keeps no checksums of values),
so it is reported as such rather than as a traceback.

Keys: a segment's key hashes the model fingerprint, its token ids and every
setting that shapes its KV (:class:`KeyScheme`), so the same text under another
model or setting never collides. Profiles and tuned settings are stored under
names built here too (:func:`tuned_key`, :func:`profile_name`). No torch here:
`kvblend query` looks its tuned ratio up before any model is loaded.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import re
import time
import zlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

from kvblend.archive.codec import (
    check_codec,
    dtype_name,
    is_lossless,
)
from kvblend.archive.location import Location
from kvblend.defaults import DEFAULT_CODEC, DEFAULT_SELECT
from kvblend.errors import ArchiveDamagedError, ArchiveError
from kvblend.types import LayerKV

if TYPE_CHECKING:
    import numpy as np

T = TypeVar("T")

_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{2,128}$")
_LMDB_KEY_LIMIT = 480  # LMDB's default max key size is 511 bytes; keep a margin


def check_key(key: str) -> str:
    """Segment keys become file names, so only hash-like keys are accepted."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ArchiveError(f"invalid segment key {key!r}: use 2-128 characters from [A-Za-z0-9_-]")
    return key


def load_record(raw: str | bytes | memoryview, what: str = "index record") -> Any:
    """Parse one stored JSON value; garbage means a damaged index file, not a bug."""
    try:
        return json.loads(bytes(raw) if isinstance(raw, memoryview) else raw)
    except (ValueError, UnicodeDecodeError):
        raise damaged_index(f"an {what} is not valid JSON") from None


def damaged_index(what: str) -> ArchiveDamagedError:
    return ArchiveDamagedError(
        f"archive index is damaged: {what}; run `kvblend verify --rebuild-index` with the same --archive to restore it"
    )


def checksum(data: bytes) -> str:
    """Checksum of one stored payload: CRC-32 (zlib), 8 hex digits.

    It guards against torn writes and bit rot, not against an adversary, and it
    runs on every layer of every query: zlib's CRC-32 checks ~3 GB/s per core
    where BLAKE2b managed ~0.6 GB/s, which on a 2-core host was ~3% of a
    blended query's time stolen from the fusor.
    """
    return f"{zlib.crc32(data):08x}"


def _from_dict(cls: type[T], d: dict[str, Any]) -> T:
    """Build a dataclass from a dict, ignoring unknown keys (forward-compatible reads). A record that parses
    but lacks a field (a flipped bit turned "checksum" into "bhecksum") is a damaged index, not a bug."""
    if not isinstance(d, dict):
        raise damaged_index(f"a {cls.__name__} record is not a JSON object")
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    try:
        return cls(**{k: v for k, v in d.items() if k in names})
    except TypeError:
        raise damaged_index(f"a {cls.__name__} record lacks fields") from None


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
        layers = d.get("layers", [])
        if not isinstance(layers, list):
            raise damaged_index("a SegmentRecord's layers are not a list")
        rec.layers = [_from_dict(LayerEntry, x) for x in layers]
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


def drop_listed(d: dict[str, Any], gone: Collection[str]) -> None:
    """Remove the keys in ``gone`` from a document record's dict (``segment_keys``), and their ``sources`` with
    them: the two lists are parallel, and a source left behind would name another segment's pages."""
    keys = d.get("segment_keys", [])
    sources = d.get("sources")
    if isinstance(sources, list) and len(sources) == len(keys):
        d["sources"] = [src for key, src in zip(keys, sources) if key not in gone]
    elif sources is not None:
        d["sources"] = []  # not parallel (damaged): no provenance rather than the wrong one
    d["segment_keys"] = [k for k in keys if k not in gone]


def _strings(value: Any) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _int_pair(value: Any) -> list[int] | None:
    """``[first, last]`` as a record stores a page or row range; None for anything else (absent, damaged)."""
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
        return list(value)
    return None


@dataclass
class DocumentRecord:
    """Index record of one ingested document: its segments in order, and where in the document each came from.

    Provenance lives here, not in the segment's record: the same text (so the same segment, the same KV) can
    occur in two documents, on different pages under different headings. ``sources[i]`` describes
    ``segment_keys[i]`` as ``{"pages": [first, last] or None, "section": str or None}``, and a sheet's (XLSX, ODS,
    CSV, TSV) also ``"rows": [first, last]`` (the row numbers it holds, or None). Records written before
    provenance existed have no ``sources`` (nor ``format``, ``pages``): they read as "text", 0 pages, and
    segments of unknown origin (:meth:`source`).

    Records written by older kvblends may carry an ``mtime`` (always 0.0); it
    is dropped on read like any unknown field.
    """

    path: str  # absolute path: what the document is found by when ingested again
    content_hash: str = ""
    segment_keys: list[str] = field(default_factory=list)
    n_tokens: int = 0
    ingested: float = 0.0
    size: int = 0  # bytes of the source file
    incomplete: bool = False  # some segments were dropped (evicted or corrupt): re-ingest to restore
    extra: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # as ingested, relative to its root (what users and servers are shown; never a full path)
    format: str = "text"  # what the file was read as: "text", "markdown", "json", "pdf", "html", "docx", ...
    pages: int = 0  # page count; 0 for formats without pages
    sources: list[dict[str, Any]] = field(default_factory=list)  # parallel to segment_keys (see the class doc)
    encoding: str = ""  # what a plain-text file was decoded from when not UTF-8 ("utf-16", "cp1252", ...); else ""
    # kvblend.documents.source_hash of a converted file's bytes (with the converter's identity): an ingest that
    # finds it equal knows the file unchanged without converting it again. "" for text and older records.
    source_hash: str = ""

    @property
    def display_name(self) -> str:
        """The name to show: as ingested relative to its root, else (records of older kvblends) the file name."""
        return self.name or os.path.basename(self.path) or self.path

    def source(self, index: int) -> dict[str, Any]:
        """Where segment ``index`` came from: ``{"pages": [first, last] or None, "section": str or None, "sections":
        [str, ...] or None (every section it holds, where more than one), "rows": [first, last] or None}``; all
        None when the record does not say (written before provenance, or its sources are not parallel), rows None
        for a document without rows."""
        if len(self.sources) == len(self.segment_keys) and 0 <= index < len(self.sources):
            src = self.sources[index]
            if isinstance(src, dict):
                section, sections = src.get("section"), src.get("sections")
                return {
                    "pages": _int_pair(src.get("pages")),
                    "section": section if isinstance(section, str) else None,
                    # more than one; or, in a passage that opens before any heading, the ones it then holds
                    "sections": sections
                    if _strings(sections) and (len(sections) > 1 or (sections and not isinstance(section, str)))
                    else None,
                    "rows": _int_pair(src.get("rows")),
                }
        return {"pages": None, "section": None, "sections": None, "rows": None}

    def drop_segments(self, gone: Collection[str]) -> None:
        """Forget the segments in ``gone`` (evicted, damaged), keeping ``sources`` parallel to ``segment_keys``."""
        d: dict[str, Any] = {"segment_keys": self.segment_keys, "sources": self.sources}
        drop_listed(d, gone)
        self.segment_keys, self.sources = d["segment_keys"], d["sources"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DocumentRecord:
        rec = _from_dict(cls, d)
        if not isinstance(rec.sources, list):  # a damaged or foreign value: provenance unknown, the record usable
            rec.sources = []
        return rec

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


def segment_key(fingerprint: str, token_ids: Sequence[int], settings: dict) -> str:
    """Key = hash(model fingerprint, token ids, KV-producing settings): no collisions across models."""
    import numpy as np

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


def normalize_path(path: str | os.PathLike[str]) -> str:
    """Absolute, symlink-free spelling of a location, so the same place always gets the same key."""
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


def _short_hash(text: str, size: int) -> str:
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def location_key(where: str | os.PathLike[str] | Location) -> str:
    """A stable name of an archive's place: a directory's real path, or a Redis URL without its password."""
    return where.key if isinstance(where, Location) else normalize_path(where)


def tuned_key(
    model_name: str, compute: str, archive_path: str | os.PathLike[str] | Location, select: str = DEFAULT_SELECT
) -> str:
    """Name of the tuned settings for a model on a compute device type with the archive at a location,
    for one selection policy.

    The archive location is part of the key because loading speed (and so the
    ratio) depends on where the archive is: move it to another disk and the
    tuned ratio no longer applies. The path is hashed so the key stays short
    (LMDB keys are limited to 511 bytes). Each policy has its own (tuning one
    replaced another's); the default policy's key is the one settings had before
    the policy was part of it, where settings of other policies may also be found.
    """
    key = f"{model_name[:200]}|{compute}|{_short_hash(location_key(archive_path), 8)}"
    return key if select == DEFAULT_SELECT else f"{key}|{select}"


def profile_name(hostname: str, model_name: str, compute: str, storage_label: str, storage_path: str | None) -> str:
    """One stored profile per (machine, model, compute, storage): re-profiling replaces it."""
    where = storage_label
    if storage_path is not None:
        where += "@" + _short_hash(storage_path, 6)
    return f"{hostname[:100]}|{model_name[:200]}|{compute}|{where[:100]}"


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
        record,
        n_tokens=n_tokens,
        token_ids=[int(t) for t in record.token_ids],
        dtype=dtype_name(k0.dtype),
        codec=codec,
        n_layers=len(layers),
        kv_heads=kv_heads,
        head_dim=head_dim,
        layers=[],
        created=record.created or now,
        last_access=record.last_access or now,
        extra=dict(record.extra),
    )


def blob_metadata(rec: SegmentRecord, model: Model, embedding: Any = None) -> dict[str, Any]:
    """What layer 0 of a blob says about its segment: every record field that is not about the tensors."""
    import numpy as np

    about: dict[str, Any] = {
        "key": rec.key,
        "token_ids": rec.token_ids,
        "text": rec.text,
        "base_position": rec.base_position,
        "extra": rec.extra,
        "created": rec.created,
        "model_name": model.name,
        "model_fingerprint": model.fingerprint,
    }
    if embedding is not None:
        vector = np.ascontiguousarray(np.asarray(embedding, dtype="<f4").reshape(-1))
        about["embedding"] = base64.b64encode(vector.tobytes()).decode("ascii")
    return about


def record_from_blob(
    about: Mapping[str, Any], tensors: Mapping[str, Any], layers: list[LayerEntry], blob: str
) -> tuple[SegmentRecord, np.ndarray | None]:
    """Inverse of :func:`blob_metadata`: the record (and embedding) a rebuilt index gets for a blob.

    ``tensors``: codec, dtype and shape [kv_heads, n_tokens, head_dim] from
    the payload header (``codec.describe_payload``). Raises ValueError when
    the two disagree, e.g. token ids for another number of tokens.
    """
    import numpy as np

    kv_heads, n_tokens, head_dim = (int(x) for x in tensors["shape"])
    token_ids = [int(t) for t in about.get("token_ids") or []]
    if token_ids and len(token_ids) != n_tokens:
        raise ValueError(f"{len(token_ids)} token ids for {n_tokens} KV tokens")
    created = float(about.get("created") or 0.0)
    rec = SegmentRecord(
        key=str(about["key"]),
        n_tokens=n_tokens,
        token_ids=token_ids,
        text=str(about.get("text", "")),
        dtype=str(tensors["dtype"]),
        codec=str(tensors["codec"]),
        n_layers=len(layers),
        kv_heads=kv_heads,
        head_dim=head_dim,
        base_position=int(about.get("base_position") or 0),
        layers=layers,
        blob=blob,
        created=created,
        last_access=created,
        extra=dict(about.get("extra") or {}),
    )
    vector = None
    if about.get("embedding"):
        vector = np.frombuffer(base64.b64decode(about["embedding"]), dtype="<f4").astype(np.float32)
    return rec, vector


@dataclass(frozen=True)
class Model:
    """A model identity: the name shown to users and the fingerprint that is compared."""

    name: str | None = None
    fingerprint: str | None = None
