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
    {ns:<key>}:v1:W:<gen>         a write of generation <gen> under way (expires; its record not yet written)

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from kvblend.archive.core import FORMAT_VERSION
from kvblend.archive.location import RedisAddress
from kvblend.archive.records import LayerEntry, SegmentRecord, checksum, load_record
from kvblend.archive.store import Leftover, Store, Txn, dump_json
from kvblend.errors import ArchiveError, ArchiveUnavailableError, CorruptBlobError

T = TypeVar("T")

NAMESPACE = "kvblend"
#: Deletes a claim only while it is still the caller's (KEYS[1] holds ARGV[1]).
_RELEASE_SCRIPT = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
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
        self.tables = {
            "meta": self.meta,
            "profiles": f"{{{ns}}}:{v}:profiles",
            "tuned": f"{{{ns}}}:{v}:tuned",
            "documents": self.docs,
            "embeddings": self.emb,
        }
        self._ns, self._v = ns, v

    def hash(self, table: str) -> str:
        """The hash that holds a table other than ``segments``."""
        return self.tables[table]

    def rec(self, key: str) -> str:
        return f"{{{self._ns}:{key}}}:{self._v}:rec"

    def layer(self, key: str, i: int, gen: str) -> str:
        return f"{{{self._ns}:{key}}}:{self._v}:L{i}:{gen}"

    def claim(self, key: str) -> str:
        return f"{{{self._ns}:{key}}}:{self._v}:claim"

    def writing(self, key: str, gen: str) -> str:
        return f"{{{self._ns}:{key}}}:{self._v}:W:{gen}"

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
        # asked on database 0: a cluster refuses to SELECT any other before it could say it is one
        client = redis.Redis(host=address.host, port=address.port, db=0, **options)
        if str(client.info("cluster").get("cluster_enabled", 0)) != "1":
            if address.db:
                client.close()
                client = redis.Redis(host=address.host, port=address.port, db=address.db, **options)
                client.ping()  # a database past the server's count is refused here, as before
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
        # A pipeline's error names its command with every argument ("Command # 3 (SET key <KV bytes>) of
        # pipeline caused error: ..."), and redis-py strips the reply's code (OOM, NOPERM) into the class
        text = str(e).rpartition(" of pipeline caused error: ")[2]
        if isinstance(e, redis.exceptions.NoPermissionError) or text.startswith(("WRONGPASS", "NOAUTH", "NOPERM")):
            if isinstance(e, redis.exceptions.NoPermissionError) and not text.startswith("NOPERM"):
                text = f"NOPERM {text}"
            raise ArchiveUnavailableError(
                f"Redis at {where} refused the credentials ({text.split()[0]}: {text.partition(' ')[2]})"
            ) from None
        if isinstance(e, redis.exceptions.OutOfMemoryError) or text.startswith("OOM"):
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


def _names_generation(raw: bytes | None, gen: str) -> bool:
    """Whether a segment's record (None: none) names write generation `gen` (a damaged one names none)."""
    if raw is None:
        return False
    try:
        rec = load_record(raw)
    except ArchiveError:
        return False
    return isinstance(rec, dict) and str(rec.get("blob")) == gen


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _RedisTxn(Txn):
    """A Txn on Redis: each step lands at once and atomically, in order (a cluster has no multi-key
    transaction). Enough for the rules, which write a record only after what it names, and bind the model
    with write-if-absent (HSETNX), so of two nodes binding at once one wins."""

    def __init__(self, store: RedisStore):
        self._store = store

    def get(self, table: str, name: str) -> bytes | None:
        return self._store.get(table, name)

    def get_many(self, table: str, names: Sequence[str]) -> list[bytes | None]:
        return self._store.get_many(table, names)

    def put(self, table: str, name: str, value: bytes) -> None:
        self._store._put(table, name, value)

    def put_new(self, table: str, name: str, value: bytes) -> bool:
        if table == "segments":
            raise ArchiveError("a segment record is written whole, never only if absent")
        with self._store._errors():
            return bool(self._store.client.hsetnx(self._store.keys.hash(table), name, value))

    def delete(self, table: str, name: str) -> None:
        self._store._delete(table, name)

    def scan(self, table: str) -> Iterator[tuple[str, bytes]]:
        return iter(list(self._store.scan(table)))


class RedisStore(Store):
    """An archive on Redis (see the module docstring for the key layout and its guarantees).

    Segment records are one key each (with their layers on one cluster slot), listed in a set, with their
    last access and hits kept beside them in a sorted set and a hash, so ``touch`` never rewrites a record
    another node may be replacing; every other table is one hash.
    """

    def __init__(self, client: Any, address: RedisAddress, readonly: bool):
        self.client = client
        self.address = address
        self.location = address.display
        self.readonly = readonly
        self.keys = Keys()
        self._closed = False
        self._claim_token = secrets.token_hex(8)  # this process's claims: only it releases them

    @property
    def kind(self) -> str:
        return "redis"

    @property
    def cluster(self) -> bool:
        return type(self.client).__name__ == "RedisCluster"

    @classmethod
    def open(cls, address: RedisAddress, *, create: bool, readonly: bool) -> RedisStore:
        """Connect, and refuse an empty database unless creating (the core then checks what the archive is)."""
        client = connect(address)
        store = cls(client, address, readonly)
        try:
            with store._errors():
                # a cache may have evicted the meta hash itself: any index key left means an archive is here
                keys = store.keys
                empty = not client.exists(keys.meta, keys.segs, keys.docs, keys.emb)
            if empty and not create:
                raise ArchiveError(
                    f"no archive at {address.display} (run `kvblend ingest PATH --archive {address.display}` first)"
                )
        except BaseException:
            client.close()
            raise
        return store

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.close()

    @contextmanager
    def _errors(self) -> Iterator[None]:
        with unavailable(self.location):
            yield

    # ── records ──
    def get_many(self, table: str, names: Sequence[str]) -> list[bytes | None]:
        if not names:
            return []
        if table == "segments":
            return self._records(list(names))
        with self._errors():
            return list(self.client.hmget(self.keys.hash(table), list(names)))

    def scan(self, table: str) -> Iterator[tuple[str, bytes]]:
        if table == "segments":
            members = self._members()
            for start in range(0, len(members), BATCH):
                batch = members[start : start + BATCH]
                for key, raw in zip(batch, self._records(batch)):
                    if raw is not None:
                        yield key, raw
            return
        with self._errors():
            rows = self.client.hgetall(self.keys.hash(table))
        for k, raw in sorted(rows.items()):
            yield _text(k), raw

    def count(self, table: str) -> int:
        if table == "segments":
            return super().count(table)
        with self._errors():
            return int(self.client.hlen(self.keys.hash(table)))

    def write(self, edit: Callable[[Txn], T]) -> T:
        self.check_writable()
        with self._errors():
            return edit(_RedisTxn(self))

    def _put(self, table: str, name: str, value: bytes) -> None:
        with self._errors():
            if table != "segments":
                self.client.hset(self.keys.hash(table), name, value)
                return
            self.client.set(self.keys.rec(name), value)  # visible whole or not at all, and before it is listed
            pipe = self.client.pipeline(transaction=False)  # (a cluster pipeline may reorder keys of two slots)
            pipe.sadd(self.keys.segs, name)
            pipe.zadd(self.keys.lru, {name: time.time()})
            pipe.hincrby(self.keys.stats, "stores", 1)
            gen = load_record(value).get("blob")
            if gen:  # its layers are named by a record now: the write is over
                pipe.unlink(self.keys.writing(name, str(gen)))
            pipe.execute()

    def _delete(self, table: str, name: str) -> None:
        with self._errors():
            if table != "segments":
                self.client.hdel(self.keys.hash(table), name)
                return
            pipe = self.client.pipeline(transaction=False)
            pipe.unlink(self.keys.rec(name))
            pipe.srem(self.keys.segs, name)
            pipe.zrem(self.keys.lru, name)
            pipe.hdel(self.keys.hits, name)
            pipe.execute()

    def _members(self) -> list[str]:
        with self._errors():
            return sorted(_text(m) for m in self.client.smembers(self.keys.segs))

    def _records(self, keys: Sequence[str]) -> list[bytes | None]:
        """Records of `keys` (None where evicted), with their use counts, fetched in pipelined batches."""
        out: list[bytes | None] = []
        for start in range(0, len(keys), BATCH):
            batch = keys[start : start + BATCH]
            with self._errors():  # one round trip: the records, then their last access and hits
                pipe = self.client.pipeline(transaction=False)
                for key in batch:
                    pipe.get(self.keys.rec(key))
                pipe.zmscore(self.keys.lru, batch)
                pipe.hmget(self.keys.hits, batch)
                *raws, scores, hits = pipe.execute()
            for raw, score, hit in zip(raws, scores, hits):
                if raw is not None:
                    try:
                        d = load_record(raw)
                    except ArchiveError:
                        d = None
                    if not isinstance(d, dict):
                        # A record no kvblend wrote (Redis neither tears nor rots a value): the segment is as
                        # good as evicted, so `verify` names it lost and `verify --repair` drops it. Called
                        # damaged, it sent the user to --rebuild-index, which a Redis archive has not.
                        raw = None
                    elif score is not None or hit is not None:
                        d["last_access"] = float(score) if score is not None else d.get("last_access", 0.0)
                        d["hits"] = int(hit) if hit is not None else d.get("hits", 0)
                        raw = dump_json(d)
                out.append(raw)
        return out

    def _get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """GET of keys that may live on different cluster slots: a pipeline, not MGET."""
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        return pipe.execute()

    def touch(self, keys: Sequence[str]) -> int:
        if self.readonly or not keys:
            return 0
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.keys.rec(key))
            present = [k for k, n in zip(keys, pipe.execute()) if n]
            if present:
                pipe = self.client.pipeline(transaction=False)
                pipe.zadd(self.keys.lru, {k: time.time() for k in present})
                for k in present:
                    pipe.hincrby(self.keys.hits, k, 1)
                pipe.execute()
            return len(present)

    def lost_segments(self) -> list[str]:
        """Segments listed but whose record is gone (Redis evicted it): the archive no longer has them."""
        members = self._members()
        return [k for k, raw in zip(members, self._records(members)) if raw is None]

    def claim(self, keys: Sequence[str]) -> list[str]:
        """Of `keys` nobody holds, those this process now may compute (another node computes the rest)."""
        if self.readonly or not keys:
            return []
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.set(self.keys.claim(key), self._claim_token, nx=True, ex=CLAIM_TTL_S)
            won = pipe.execute()
        return [k for k, ok in zip(keys, won) if ok]

    def release(self, keys: Sequence[str]) -> None:
        """Drop this process's claims on `keys` (stored, or given up): a claim left to lapse made the next
        ingest of those segments within CLAIM_TTL_S (a document removed and added again, a segment gc evicted)
        wait CLAIM_WAIT_S for a writer that had long finished. Another process's claim is left alone."""
        if self.readonly or not keys:
            return
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:  # compare-and-delete, one key a script: a cluster routes each to its own node
                pipe.eval(_RELEASE_SCRIPT, 1, self.keys.claim(key), self._claim_token)
            pipe.execute()

    # ── payloads ──
    def put_payloads(self, staged: Sequence[tuple[SegmentRecord, Iterable[bytes]]]) -> None:
        """Every layer under a fresh write generation (named in ``blob``), so two writers of one segment never
        mix their bytes: the one whose record lands second leaves only garbage for ``gc``."""
        self.check_writable()
        for rec, payloads in staged:
            rec.blob = secrets.token_hex(4)
            rec.layers = []
            with self._errors():
                pipe = self.client.pipeline(transaction=False)
                # Redis has no writer lock: this marks the generation as being written until its record lands
                # (a stored miss is not claimed), so a concurrent gc does not take its layers for garbage
                pipe.set(self.keys.writing(rec.key, rec.blob), 1, ex=CLAIM_TTL_S)
                for i, data in enumerate(payloads):
                    pipe.set(self.keys.layer(rec.key, i, rec.blob), data)
                    rec.layers.append(LayerEntry(offset=0, length=len(data), checksum=checksum(data)))
                pipe.execute()

    def read_payloads(self, recs: Sequence[SegmentRecord], layer: int) -> list[bytes | CorruptBlobError]:
        """One pipelined round trip for layer `layer` of every segment (a cluster splits it by node)."""
        with self._errors():
            got = self._get_many([self.keys.layer(rec.key, layer, rec.blob) for rec in recs])
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

    def delete_payloads(self, recs: Sequence[SegmentRecord]) -> None:
        names = [self.keys.layer(r.key, i, r.blob) for r in recs if r.blob for i in range(len(r.layers))]
        if not names:
            return
        with suppress(ArchiveError), self._errors():  # what is left is a leftover for gc
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.unlink(name)
            pipe.execute()

    # ── upkeep ──
    def _scan_keys(self, pattern: str) -> list[str]:
        with self._errors():
            return [_text(k) for k in self.client.scan_iter(match=pattern, count=1000)]

    def leftovers(self) -> list[Leftover]:
        """Layer keys of a generation no record names, whose segment nobody is computing now (a crashed or
        losing writer's layers)."""
        live = {(key, str(load_record(raw).get("blob"))) for key, raw in self.scan("segments")}
        groups: dict[tuple[str, str], list[str]] = {}
        for name in self._scan_keys(self.keys.layer_pattern):
            parsed = self.keys.parse_layer(name)
            if parsed is not None and (parsed[0], parsed[2]) not in live:
                groups.setdefault((parsed[0], parsed[2]), []).append(name)
        if not groups:
            return []
        keys = sorted({key for key, _ in groups})
        gens = sorted(groups)
        # the set of segments is one key Redis may evict: each record is asked directly. Markers before records:
        # a writer sets its record, then unlinks its marker, so a write that ends between the two reads is seen
        # by its record (the other order saw neither, and took the layers of a just-committed segment)
        with self._errors():
            claimed = dict(zip(keys, self._get_many([self.keys.claim(k) for k in keys])))
            writing = dict(zip(gens, self._get_many([self.keys.writing(k, g) for k, g in gens])))
            records = dict(zip(keys, self._get_many([self.keys.rec(k) for k in keys])))
        out: list[Leftover] = []
        for (key, gen), names in sorted(groups.items()):
            named = _names_generation(records.get(key), gen)
            if claimed.get(key) is None and writing.get((key, gen)) is None and not named:
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
        payload = sum(SegmentRecord.from_json(raw).stored_bytes for _, raw in self.scan("segments"))
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
