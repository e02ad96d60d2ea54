"""The Redis store: a whole archive on a Redis server or cluster, shared by every node that points at it.

Several serving nodes behind a load balancer each prefill the passages they
see; on one shared store the KV one node computed is a hit for all of them.
Everything lives in Redis: segment records, documents, retrieval embeddings,
profiles and tuned settings, and each segment's KV, **one key per layer**, in
the same payload format and codecs as the local blob files (codec.py), so a
query still streams layer by layer: the loader fetches layer i+1 of every
passage with one pipelined round trip while the fusor computes layer i.

Keys (``ns`` is ``kvblend``; data keys carry the format version)::

    {ns}:meta                     hash: format_version, created, model_name, model_fingerprint
    {ns}:v1:segs                  set: every segment key stored
    {ns}:v1:lru / :hits           sorted set (last access) / hash (uses), per segment key
    {ns}:v1:emb                   hash: segment key -> float32 embedding
    {ns}:v1:docs                  hash: document path -> document record (JSON)
    {ns}:v1:profiles / :tuned     hashes of JSON settings
    {ns}:v1:stats                 hash: stores (segments written), for the load tests' count
    {ns:<key>}:v1:rec             the segment record (JSON), written LAST
    {ns:<key>}:v1:L<i>:<gen>      layer i's payload, of the write generation <gen> the record names
    {ns:<key>}:v1:claim           who is computing the segment now (expires)

A segment's keys share a hash tag, so in a cluster they live on one slot,
while different segments spread over the masters. The record is written only
after every layer, so a reader never sees half a segment; each write uses a
fresh generation of layer keys, so two writers of one segment never mix
their bytes, and the one whose record lands second leaves only garbage for
``gc``. A segment about to be prefilled is *claimed* first (SET NX with an
expiry), so two nodes that meet the same new passage prefill it once.

Run as a cache (``maxmemory`` + ``allkeys-lru``), Redis may evict any key:
an evicted layer reads as missing and the segment is recomputed (and stored
again), exactly like a damaged blob in a local archive; an evicted record
is a segment the archive no longer has. ``verify`` names both.

Failures are one line (ArchiveUnavailableError): Redis not running, a
wrong password, a connection lost mid-request. The password is never part
of a message (location.py).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np

from kvblend.archive.codec import encode_layer
from kvblend.archive.local import FORMAT_VERSION
from kvblend.archive.location import RedisAddress
from kvblend.archive.records import (
    DocumentRecord,
    LayerEntry,
    Model,
    SegmentRecord,
    blob_metadata,
    checksum,
    describe,
)
from kvblend.archive.store import (
    Leftover,
    Store,
    dump_json,
    embedding_bytes,
    embedding_matrix,
    load_json,
)
from kvblend.errors import (
    ArchiveError,
    ArchiveModelMismatchError,
    ArchiveUnavailableError,
    ArchiveVersionError,
    CorruptBlobError,
)
from kvblend.types import LayerKV

T = TypeVar("T")

NAMESPACE = "kvblend"
CLAIM_TTL_S = 120  # a claim outlives any one segment's prefill; a crashed claimant's lapses
CONNECT_TIMEOUT_S = 3.0
IO_TIMEOUT_S = 15.0
BATCH = 256  # records per MGET when listing


class Keys:
    """Where everything of one archive lives in Redis."""

    def __init__(self, namespace: str = NAMESPACE):
        ns, v = namespace, f"v{FORMAT_VERSION}"
        self.meta = f"{{{ns}}}:meta"
        self.segs = f"{{{ns}}}:{v}:segs"
        self.lru = f"{{{ns}}}:{v}:lru"
        self.hits = f"{{{ns}}}:{v}:hits"
        self.emb = f"{{{ns}}}:{v}:emb"
        self.docs = f"{{{ns}}}:{v}:docs"
        self.stats = f"{{{ns}}}:{v}:stats"
        self.tables = {"meta": self.meta, "profiles": f"{{{ns}}}:{v}:profiles", "tuned": f"{{{ns}}}:{v}:tuned"}
        self._ns, self._v = ns, v

    def rec(self, key: str) -> str:
        return f"{{{self._ns}:{key}}}:{self._v}:rec"

    def layer(self, key: str, i: int, gen: str) -> str:
        return f"{{{self._ns}:{key}}}:{self._v}:L{i}:{gen}"

    def claim(self, key: str) -> str:
        return f"{{{self._ns}:{key}}}:{self._v}:claim"

    @property
    def layer_pattern(self) -> str:
        return f"{{{self._ns}:*}}:{self._v}:L*"

    def parse_layer(self, name: str) -> tuple[str, int, str] | None:
        """(segment key, layer, generation) of a layer key, or None."""
        head, sep, tail = name.partition(f"}}:{self._v}:L")
        if not sep or not head.startswith(f"{{{self._ns}:"):
            return None
        layer, _, gen = tail.partition(":")
        return (head[len(self._ns) + 2 :], int(layer), gen) if layer.isdigit() and gen else None


def connect(address: RedisAddress) -> Any:
    """A client for a single Redis or a cluster (asked of the server), failing fast instead of hanging:
    short timeouts, one retry, every connection error one ArchiveUnavailableError line."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options: dict[str, Any] = dict(
        username=address.username,
        password=address.password,
        ssl=address.tls,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=IO_TIMEOUT_S,
        retry=Retry(NoBackoff(), 1),
        client_name="kvblend",
    )
    with unavailable(address.display):
        client = redis.Redis(host=address.host, port=address.port, db=address.db, **options)
        if str(client.info("cluster").get("cluster_enabled", 0)) != "1":
            return client
        client.close()
        if address.db:
            raise ArchiveError(f"{address.display}: a Redis Cluster has only database 0")
        from redis.cluster import RedisCluster

        options.pop("retry")
        return RedisCluster(host=address.host, port=address.port, **options)


@contextmanager
def unavailable(where: str) -> Iterator[None]:
    """Redis errors as one line naming the server (never its password)."""
    import redis

    try:
        yield
    except redis.exceptions.AuthenticationError:
        raise ArchiveUnavailableError(f"Redis at {where} refused the credentials (wrong user or password)") from None
    except redis.exceptions.ResponseError as e:
        text = str(e)
        if text.startswith(("WRONGPASS", "NOAUTH", "NOPERM")):
            raise ArchiveUnavailableError(f"Redis at {where} refused the credentials ({text.split()[0]})") from None
        if text.startswith("OOM"):
            raise ArchiveUnavailableError(
                f"Redis at {where} is out of memory and evicts nothing (maxmemory "
                "without an eviction policy); free memory or set allkeys-lru"
            ) from None
        raise ArchiveError(f"Redis at {where}: {text.splitlines()[0] if text else type(e).__name__}") from None
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ArchiveUnavailableError(f"cannot reach Redis at {where} ({reason})") from None
    except redis.exceptions.RedisError as e:
        raise ArchiveUnavailableError(f"Redis at {where} failed ({type(e).__name__}: {e})") from None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStore(Store):
    """An archive on Redis (see the module docstring for the key layout and its guarantees)."""

    def __init__(self, client: Any, address: RedisAddress, readonly: bool, model: Model):
        self.client = client
        self.address = address
        self.location = address.display
        self.readonly = readonly
        self.model = model
        self.keys = Keys()
        self._closed = False

    @property
    def kind(self) -> str:
        return "redis"

    @property
    def cluster(self) -> bool:
        return type(self.client).__name__ == "RedisCluster"

    @classmethod
    def open(
        cls, address: RedisAddress, *, create: bool, readonly: bool, asked: Model, defer_binding: bool
    ) -> RedisStore:
        """Connect, then check what the archive is before anything is written: its format version, its model."""
        client = connect(address)
        store = cls(client, address, readonly, Model())
        try:
            with store._errors():
                meta = {_text(k): load_json(v) for k, v in client.hgetall(store.keys.meta).items()}
                # a cache may have evicted the meta hash itself: any index key left means an archive is here
                empty = not meta and not client.exists(store.keys.segs, store.keys.docs, store.keys.emb)
            if empty and not create:
                raise ArchiveError(
                    f"no archive at {address.display} (run `kvblend ingest PATH --archive {address.display}` first)"
                )
            store.model = store._check(meta, asked)
            if create and not readonly and "format_version" not in meta:
                store._stamp()
            if create and not readonly and not defer_binding:
                store.model = store._bind(asked)
        except BaseException:
            client.close()
            raise
        return store

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.close()

    # ── identity ──
    def _check(self, meta: dict[str, Any], asked: Model) -> Model:
        version = meta.get("format_version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
            raise ArchiveError(f"archive at {self.location} has a malformed format version {version!r}")
        if version is not None and version > FORMAT_VERSION:
            raise ArchiveVersionError(
                f"archive format v{version} is newer than this kvblend supports (v{FORMAT_VERSION}); upgrade kvblend"
            )
        have = Model(meta.get("model_name"), meta.get("model_fingerprint"))
        if asked.fingerprint and have.fingerprint and asked.fingerprint != have.fingerprint:
            a, b = have.name or have.fingerprint[:12], asked.name or asked.fingerprint[:12]
            hint = f"pass --model {have.name} or use another --archive" if have.name else "use another --archive"
            raise ArchiveModelMismatchError(
                f"archive at {self.location} was built with model {a}; you asked for model {b} ({hint})"
            )
        return have

    def _stamp(self) -> None:
        """Record the format version if it is missing (a new archive, or a cache evicted the meta hash)."""
        with self._errors():
            self.client.hsetnx(self.keys.meta, "format_version", dump_json(FORMAT_VERSION))
            self.client.hsetnx(self.keys.meta, "created", dump_json(time.time()))

    def _bind(self, asked: Model) -> Model:
        """Record the format version and the model if they are not (HSETNX: of two writers binding at once, one
        wins), then check the model. Every write does it, so an evicted meta hash is recorded again."""
        self._stamp()
        if asked.fingerprint:
            with self._errors():
                if self.client.hsetnx(self.keys.meta, "model_fingerprint", dump_json(asked.fingerprint)):
                    self.client.hset(self.keys.meta, "model_name", dump_json(asked.name))
                meta = {_text(k): load_json(v) for k, v in self.client.hgetall(self.keys.meta).items()}
        else:
            meta = {}
        return self._check(meta, asked) if meta else self.model

    @contextmanager
    def _errors(self) -> Iterator[None]:
        with unavailable(self.location):
            yield

    # ── segments ──
    def get_segment(self, key: str) -> SegmentRecord | None:
        with self._errors():
            raw = self.client.get(self.keys.rec(key))
        return None if raw is None else SegmentRecord.from_json(raw)

    def has_segment(self, key: str) -> bool:
        with self._errors():
            return bool(self.client.exists(self.keys.rec(key)))

    def _members(self) -> list[str]:
        with self._errors():
            return sorted(_text(m) for m in self.client.smembers(self.keys.segs))

    def _records(self, keys: Sequence[str]) -> list[SegmentRecord | None]:
        """Records of `keys` (None where evicted), with their use counts, fetched in pipelined batches."""
        out: list[SegmentRecord | None] = []
        for start in range(0, len(keys), BATCH):
            batch = keys[start : start + BATCH]
            with self._errors():
                pipe = self.client.pipeline(transaction=False)
                for key in batch:
                    pipe.get(self.keys.rec(key))
                raws = pipe.execute()
                scores = self.client.zmscore(self.keys.lru, batch)
                hits = self.client.hmget(self.keys.hits, batch)
            for raw, score, hit in zip(raws, scores, hits):
                rec = None if raw is None else SegmentRecord.from_json(raw)
                if rec is not None:
                    rec.last_access = float(score) if score is not None else rec.last_access
                    rec.hits = int(hit) if hit is not None else rec.hits
                out.append(rec)
        return out

    def iter_segments(self) -> Iterator[SegmentRecord]:
        for rec in self._records(self._members()):
            if rec is not None:
                yield rec

    def count_segments(self) -> int:
        return sum(1 for _ in self.iter_segments())

    def lost_segments(self) -> list[str]:
        """Segments listed but whose record is gone (Redis evicted it): the archive no longer has them."""
        members = self._members()
        return [k for k, rec in zip(members, self._records(members)) if rec is None]

    def claim(self, keys: Sequence[str]) -> list[str]:
        """Of `keys` nobody holds, those this process now may compute (another node computes the rest)."""
        if self.readonly or not keys:
            return []
        token = secrets.token_hex(8)
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.set(self.keys.claim(key), token, nx=True, ex=CLAIM_TTL_S)
            won = pipe.execute()
        return [k for k, ok in zip(keys, won) if ok]

    def put_segments(
        self,
        items: Sequence[tuple[SegmentRecord, Sequence[LayerKV]]],
        codec: str,
        level: int,
        embeddings: dict[str, Any] | None,
        asked: Model,
    ) -> list[SegmentRecord]:
        """Every layer under a fresh generation, then the records (each a single SET: visible whole or not at
        all), then the old generation's layers deleted."""
        self.check_writable()
        self.model = self._bind(asked)
        model = Model(self.model.name or asked.name, self.model.fingerprint or asked.fingerprint)
        records: list[SegmentRecord] = []
        seen: set[str] = set()
        for record, layers in items:
            if record.key in seen:
                continue
            seen.add(record.key)
            rec = describe(record, layers, codec)
            rec.blob = secrets.token_hex(4)  # the write generation its layer keys carry
            about = blob_metadata(rec, model, (embeddings or {}).get(rec.key))
            self._write_layers(
                rec,
                (
                    encode_layer(k, v, codec, level, segment=about if i == 0 else None)
                    for i, (k, v) in enumerate(layers)
                ),
            )
            records.append(rec)
        self._commit(records, embeddings or {})
        return records

    def _write_layers(self, rec: SegmentRecord, payloads: Iterable[bytes]) -> None:
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for i, data in enumerate(payloads):
                pipe.set(self.keys.layer(rec.key, i, rec.blob), data)
                rec.layers.append(LayerEntry(offset=0, length=len(data), checksum=checksum(data)))
            pipe.execute()

    def _commit(self, records: Sequence[SegmentRecord], embeddings: dict[str, Any]) -> None:
        if not records:
            return
        with self._errors():
            old = self._get_many([self.keys.rec(r.key) for r in records])
            pipe = self.client.pipeline(transaction=False)
            for rec in records:
                pipe.set(self.keys.rec(rec.key), rec.to_json().encode())
            pipe.execute()
            now = time.time()
            pipe = self.client.pipeline(transaction=False)
            pipe.sadd(self.keys.segs, *[r.key for r in records])
            pipe.zadd(self.keys.lru, {r.key: now for r in records})
            pipe.hincrby(self.keys.stats, "stores", len(records))
            vectors = {r.key: embedding_bytes(embeddings[r.key]) for r in records if r.key in embeddings}
            if vectors:
                pipe.hset(self.keys.emb, mapping=vectors)
            pipe.execute()
            stale = [SegmentRecord.from_json(raw) for raw in old if raw is not None]
            self._delete_layers(
                [
                    (r.key, r.blob, len(r.layers))
                    for r in stale
                    if (r.key, r.blob) not in {(n.key, n.blob) for n in records}
                ]
            )

    def _delete_layers(self, generations: Sequence[tuple[str, str, int]]) -> None:
        names = [self.keys.layer(key, i, gen) for key, gen, n in generations for i in range(n)]
        if names:
            with self._errors():
                pipe = self.client.pipeline(transaction=False)
                for name in names:
                    pipe.unlink(name)
                pipe.execute()

    def read_layer_raw(self, rec: SegmentRecord, layer: int) -> bytes:
        result = self.read_layers_raw([rec], layer)[0]
        if isinstance(result, CorruptBlobError):
            raise result
        return result

    def read_layers_raw(self, recs: Sequence[SegmentRecord], layer: int) -> list[bytes | CorruptBlobError]:
        """One pipelined round trip for layer `layer` of every segment (a cluster splits it by node)."""
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for rec in recs:
                pipe.get(self.keys.layer(rec.key, layer, rec.blob))
            got = pipe.execute()
        return [self._checked(rec, layer, data) for rec, data in zip(recs, got)]

    @staticmethod
    def _checked(rec: SegmentRecord, layer: int, data: bytes | None) -> bytes | CorruptBlobError:
        entry = rec.layers[layer]
        if data is None:
            reason = "layer is missing from Redis (evicted or removed)"
        elif len(data) != entry.length:
            reason = f"layer is {len(data)} bytes, its record says {entry.length}"
        elif checksum(data) != entry.checksum:
            reason = "checksum mismatch"
        else:
            return data
        return CorruptBlobError(f"segment {rec.key} layer {layer}: {reason}", rec.key, layer, reason)

    def touch(self, keys: Sequence[str]) -> int:
        if self.readonly or not keys:
            return 0
        try:
            with self._errors():
                present = [k for k, n in zip(keys, self._exists(keys)) if n]
                if present:
                    pipe = self.client.pipeline(transaction=False)
                    pipe.zadd(self.keys.lru, {k: time.time() for k in present})
                    for k in present:
                        pipe.hincrby(self.keys.hits, k, 1)
                    pipe.execute()
                return len(present)
        except ArchiveError:
            return 0

    def _get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """GET of keys that may live on different cluster slots: a pipeline, not MGET."""
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        return pipe.execute()

    def _exists(self, keys: Sequence[str]) -> list[int]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.keys.rec(key))
        return pipe.execute()

    def drop_segments(self, keys: Iterable[str]) -> list[str]:
        drop = sorted(set(keys))
        if not drop:
            return []
        self.check_writable()
        self._delete_segments(drop)
        return self._mark_documents(set(drop))

    def _delete_segments(self, keys: Sequence[str]) -> None:
        recs = [r for r in self._records(list(keys)) if r is not None]
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.unlink(self.keys.rec(key))
            pipe.execute()
            self.client.srem(self.keys.segs, *keys)
            self.client.zrem(self.keys.lru, *keys)
            self.client.hdel(self.keys.hits, *keys)
            self.client.hdel(self.keys.emb, *keys)
        self._delete_layers([(r.key, r.blob, len(r.layers)) for r in recs])

    def _mark_documents(self, gone: set[str]) -> list[str]:
        """Documents listing a key in `gone` lose it and are marked incomplete; returns their paths."""
        marked = []
        for doc in list(self.iter_documents()):
            if gone.intersection(doc.segment_keys):
                doc.drop_segments(gone)
                doc.incomplete = True
                self.put_document(doc)
                marked.append(doc.path)
        return marked

    # ── documents ──
    def get_document(self, path: str) -> DocumentRecord | None:
        with self._errors():
            raw = self.client.hget(self.keys.docs, path)
        return None if raw is None else DocumentRecord.from_json(raw)

    def iter_documents(self) -> Iterator[DocumentRecord]:
        with self._errors():
            rows = self.client.hgetall(self.keys.docs)
        for _, raw in sorted(rows.items()):
            yield DocumentRecord.from_json(raw)

    def count_documents(self) -> int:
        with self._errors():
            return int(self.client.hlen(self.keys.docs))

    def put_document(self, doc: DocumentRecord) -> None:
        self.check_writable()
        with self._errors():
            self.client.hset(self.keys.docs, doc.path, doc.to_json().encode())

    def replace_document(self, doc: DocumentRecord, keep: Collection[str] = frozenset()) -> list[str]:
        old = self.get_document(doc.path)
        self.put_document(doc)
        stale = set(old.segment_keys if old else ()) - set(doc.segment_keys) - set(keep)
        if stale:
            stale -= {k for other in self.iter_documents() for k in other.segment_keys}
            self._delete_segments(sorted(stale))
        return sorted(stale)

    def remove_documents(self, paths: Sequence[str]) -> list[str]:
        self.check_writable()
        removed, candidates = [], set()
        for path in dict.fromkeys(paths):
            doc = self.get_document(path)
            if doc is None:
                continue
            with self._errors():
                self.client.hdel(self.keys.docs, path)
            removed.append(doc.path)
            candidates.update(doc.segment_keys)
        unused = candidates - {k for other in self.iter_documents() for k in other.segment_keys}
        if unused:
            self._delete_segments(sorted(unused))
        return removed

    def strip_dangling(self, dangling: dict[str, list[str]]) -> list[str]:
        marked = []
        for path, missing in dangling.items():
            doc = self.get_document(path)
            if doc is not None:
                doc.drop_segments(set(missing))
                doc.incomplete = True
                self.put_document(doc)
                marked.append(path)
        return marked

    # ── side tables ──
    def get_json(self, table: str, name: str) -> Any:
        with self._errors():
            return load_json(self.client.hget(self.keys.tables[table], name))

    def put_json(self, table: str, name: str, value: Any) -> None:
        self.check_writable()
        with self._errors():
            self.client.hset(self.keys.tables[table], name, dump_json(value))

    def json_items(self, table: str) -> Iterator[tuple[str, Any]]:
        with self._errors():
            rows = self.client.hgetall(self.keys.tables[table])
        for k, raw in sorted(rows.items()):
            yield _text(k), load_json(raw)

    def put_embeddings(self, pairs: Sequence[tuple[str, Any]]) -> None:
        self.check_writable()
        if pairs:
            with self._errors():
                self.client.hset(self.keys.emb, mapping={k: embedding_bytes(v) for k, v in pairs})

    def has_embedding(self, key: str) -> bool:
        with self._errors():
            return bool(self.client.hexists(self.keys.emb, key))

    def get_embeddings(self, keys: Iterable[str] | None = None) -> tuple[list[str], np.ndarray]:
        with self._errors():
            if keys is None:
                rows = [(_text(k), v) for k, v in self.client.hgetall(self.keys.emb).items()]
            else:
                wanted = list(keys)
                rows = [
                    (k, v)
                    for k, v in zip(wanted, self.client.hmget(self.keys.emb, wanted) if wanted else [])
                    if v is not None
                ]
        return embedding_matrix(sorted(rows))

    # ── upkeep ──
    def _scan(self, pattern: str) -> list[str]:
        with self._errors():
            return [_text(k) for k in self.client.scan_iter(match=pattern, count=1000)]

    def leftovers(self) -> list[Leftover]:
        """Layer keys of a generation no record names, whose segment nobody is computing now (a crashed or
        losing writer's layers)."""
        live = {(r.key, r.blob) for r in self.iter_segments()}
        groups: dict[tuple[str, str], list[str]] = {}
        for name in self._scan(self.keys.layer_pattern):
            parsed = self.keys.parse_layer(name)
            if parsed is not None and (parsed[0], parsed[2]) not in live:
                groups.setdefault((parsed[0], parsed[2]), []).append(name)
        if not groups:
            return []
        keys = sorted({key for key, _ in groups})
        with self._errors():
            claimed = dict(zip(keys, self._get_many([self.keys.claim(k) for k in keys])))
        out: list[Leftover] = []
        for (key, _gen), names in sorted(groups.items()):
            if claimed.get(key) is None:
                out.extend(Leftover(name, self._size(name)) for name in names)
        return out

    def _size(self, name: str) -> int:
        with self._errors():
            return int(self.client.strlen(name))

    def delete_leftovers(self, leftovers: Sequence[Leftover]) -> int:
        if not leftovers:
            return 0
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for item in leftovers:
                pipe.unlink(item.name)
            pipe.execute()
        return sum(item.size for item in leftovers)

    def segment_bytes(self, rec: SegmentRecord) -> int:
        return rec.stored_bytes

    def usage(self) -> dict[str, Any]:
        """Redis's memory (summed over a cluster's masters), its limit and eviction policy, the stores counted."""
        with self._errors():
            infos = self._per_node(lambda node: node.info("memory"))
            stores = int(self.client.hget(self.keys.stats, "stores") or 0)
        used = sum(int(i.get("used_memory", 0)) for i in infos)
        limit = sum(int(i.get("maxmemory", 0)) for i in infos)
        policy = sorted({str(i.get("maxmemory_policy", "")) for i in infos})
        return {
            "redis_used_memory_bytes": used,
            "redis_maxmemory_bytes": limit,
            "redis_policy": ",".join(policy),
            "redis_nodes": len(infos),
            "segments_stored_total": stores,
            "lost_segments": len(self.lost_segments()),
        }

    def _per_node(self, fn: Callable[[Any], T]) -> list[T]:
        if not self.cluster:
            return [fn(self.client)]
        return [fn(self.client.get_redis_connection(node)) for node in self.client.get_primaries()]

    def size_bytes(self, include_index: bool = True) -> int:
        payload = sum(rec.stored_bytes for rec in self.iter_segments())
        if not include_index:
            return payload
        with self._errors():
            index = sum(
                int(self.client.memory_usage(k) or 0)
                for k in (self.keys.emb, self.keys.docs, self.keys.segs, self.keys.lru, self.keys.hits)
            )
        return payload + index

    def stores_counted(self) -> int:
        """Segments written since the archive began (each prefill that was stored, across every node)."""
        with self._errors():
            return int(self.client.hget(self.keys.stats, "stores") or 0)

    # ── a storage probe for `kvblend profile` ──
    def measure_reads(self, segments: Sequence[Sequence[bytes]], runs: int = 3) -> list[float]:
        """MB/s of reading scratch payloads back layer by layer as the loader does (one pipelined fetch per
        layer over every segment); the scratch keys expire on their own if this is interrupted."""
        self.check_writable()
        token = secrets.token_hex(4)
        names = [
            [self.keys.layer(f"scratch-{token}-{s}", i, "p") for i in range(len(seg))] for s, seg in enumerate(segments)
        ]
        total = sum(len(p) for seg in segments for p in seg)
        try:
            with self._errors():
                pipe = self.client.pipeline(transaction=False)
                for seg, keys in zip(segments, names):
                    for data, name in zip(seg, keys):
                        pipe.set(name, data, ex=600)
                pipe.execute()
                rates = []
                for _ in range(max(1, runs)):
                    t0 = time.perf_counter()
                    for i in range(max(len(k) for k in names)):
                        pipe = self.client.pipeline(transaction=False)
                        for keys in names:
                            if i < len(keys):
                                pipe.get(keys[i])
                        pipe.execute()
                    rates.append(total / (time.perf_counter() - t0) / 1e6)
        finally:
            with self._errors():
                pipe = self.client.pipeline(transaction=False)
                for keys in names:
                    for name in keys:
                        pipe.unlink(name)
                pipe.execute()
        return rates
