"""Is every page LMDB could read in the current snapshot of ``data.mdb`` structurally sound?

LMDB keeps no checksums and trusts its file completely: a node offset, a key
size or a child page number that was overwritten with garbage is followed as
is, LMDB reads outside the mapped file, and the process dies of SIGBUS (exit
135) or SIGSEGV with no exception and no message. Nothing can catch that once
LMDB has the file mapped, so this module checks the file *before* LMDB touches
it, with ordinary ``os.pread`` calls (never mmap): a read past the end of the
file only comes back short, so the checker itself can never crash.

It reads what a deep check must read to know that no cursor can go astray:
both meta pages; every branch and leaf page of the main tree, of each named
sub-database and of the free list (one ``pread`` of a page each); the header
of every overflow run a leaf points to; and the page lists the free list holds.
It does not read the bytes of ordinary values (see :func:`check_pages`).

The layout is LMDB 0.9's on a 64-bit build (``mdb.c``: ``MDB_page``,
``MDB_node``, ``MDB_meta``, ``MDB_db``), in native byte order as LMDB writes it.
"""

from __future__ import annotations

import itertools
import os
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# Page header flags (MDB_page.mp_flags).
P_BRANCH = 0x01
P_LEAF = 0x02
P_OVERFLOW = 0x04
P_META = 0x08
P_LEAF2 = 0x20
P_SUBP = 0x40
_P_IN_MEMORY = 0x10 | 0x8000  # P_DIRTY, P_KEEP: markers LMDB may leave behind (sub-pages keep P_DIRTY)

# Leaf node flags (MDB_node.mn_flags).
F_BIGDATA = 0x01
F_SUBDATA = 0x02
F_DUPDATA = 0x04

# Persistent MDB_db flags.
MDB_REVERSEKEY = 0x02
MDB_DUPSORT = 0x04
MDB_INTEGERKEY = 0x08
MDB_DUPFIXED = 0x10
MDB_INTEGERDUP = 0x20
MDB_REVERSEDUP = 0x40
_DB_FLAGS = 0x7E

P_INVALID = 0xFFFF_FFFF_FFFF_FFFF  # the root of an empty tree
MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
PAGE_HEADER = 16
NODE_HEADER = 8
DB_RECORD = 48  # sizeof(MDB_db)
MAX_DEPTH = 32  # LMDB's CURSOR_STACK: a deeper tree fails with MDB_CURSOR_FULL
MAX_PROBLEMS = 50  # enough to judge a file; keeps a file of pure garbage quick

FREE_TABLE = "free list"
MAIN_TABLE = "main"
HEADER_TABLE = "header"  # problems with the meta pages or the file as a whole

_HEADER = struct.Struct("=QHHHH")  # pgno, pad, flags, lower, upper
_OVERFLOW_HEADER = struct.Struct("=QHHI")  # pgno, pad, flags, pages
_NODE = struct.Struct("=HHHH")  # lo, hi, flags, ksize
_DB = struct.Struct("=IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_META = struct.Struct("=II")  # magic, version (then address, mapsize)
_META_TAIL = struct.Struct("=QQ")  # last_pg, txnid
_U64 = struct.Struct("=Q")
_META_DBS = 40  # mm_dbs[FREE_DBI], then mm_dbs[MAIN_DBI]
_META_LAST_PG = 136
_META_SIZE = 152
_DEFAULT_PAGE = 4096


class SnapshotMoved(Exception):
    """Neither meta page holds the asked-for transaction any more: a writer committed twice meanwhile. Retry."""


@dataclass
class PageProblem:
    """One finding: which page, what is wrong with it, and which tree it belongs to."""

    page: int  # page number, or -1 for a problem with the file as a whole
    what: str  # one short phrase, e.g. "node 3 runs past the end of the page"
    table: str  # "free list", "main", a sub-database name, or "header" for the meta pages

    def __str__(self) -> str:
        where = "file" if self.page < 0 else f"page {self.page}"
        return f"{where} ({self.table}): {self.what}"


@dataclass
class PageReport:
    """What one walk of a snapshot found. ``ok`` means no reader of that snapshot can be led astray."""

    pages_checked: int
    problems: list[PageProblem]
    txnid: int  # the transaction id of the meta page that was walked (-1 if none could be)
    tables: dict[str, int]  # sub-database name -> entries counted
    visited: set[int] = field(default_factory=set, repr=False)  # branch, leaf and overflow-head pages read
    overflow: set[int] = field(default_factory=set, repr=False)  # every page of every overflow run
    free: set[int] = field(default_factory=set, repr=False)  # pages the free list names

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class _Db:
    """An MDB_db record: the root and statistics of one B-tree."""

    pad: int
    flags: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    root: int

    @classmethod
    def read(cls, buf: bytes, offset: int) -> _Db:
        return cls(*_DB.unpack_from(buf, offset))


@dataclass(frozen=True)
class _Meta:
    page: int
    psize: int
    last_pg: int
    txnid: int
    free: _Db
    main: _Db


@dataclass
class _Count:
    branch_pages: int = 0
    leaf_pages: int = 0
    overflow_pages: int = 0
    entries: int = 0


@dataclass
class _Tree:
    """One tree being walked: how its keys compare, which node flags it may hold, what was counted."""

    table: str
    db: _Db
    kind: str  # "main", "table", "free" or "dups" (a sub-tree of duplicates)
    key: Callable[[bytes], Any] | None  # sort key for the tree's comparison; None: plain bytes order
    dupfixed: bool = False  # duplicates of fixed size: P_LEAF2 pages
    count: _Count = field(default_factory=_Count)

    @property
    def dupsort(self) -> bool:
        return self.kind in ("main", "table") and bool(self.db.flags & MDB_DUPSORT)

    @property
    def node_flags(self) -> int:
        """Leaf node flags this tree may hold."""
        if self.kind == "dups":
            return 0
        if self.dupsort:
            return F_DUPDATA | F_SUBDATA
        return F_BIGDATA | (F_SUBDATA if self.kind == "main" else 0)


class _Stop(Exception):
    """Enough problems were found; the walk ends."""


def _int_key(key: bytes) -> int:
    return int.from_bytes(key, sys.byteorder)


def _reverse_key(key: bytes) -> bytes:
    return key[::-1]


def _key_order(flags: int, integer: int, reverse: int) -> Callable[[bytes], Any] | None:
    """The sort key matching LMDB's comparison for these MDB_db flags (mdb_default_cmp)."""
    if flags & reverse:
        return _reverse_key
    if flags & integer:
        return _int_key
    return None


_PTR_STRUCTS: dict[int, struct.Struct] = {}


def _ptrs(buf: bytes, at: int, n: int) -> tuple[int, ...]:
    s = _PTR_STRUCTS.get(n)
    if s is None:
        s = _PTR_STRUCTS[n] = struct.Struct(f"={n}H")
    return s.unpack_from(buf, at)


def _node_offsets(buf: bytes, base: int, size: int, lower: int, upper: int) -> list[int] | str:
    """Absolute offsets of a page's nodes (base: where the page starts in buf), or why they cannot be trusted."""
    if lower & 1 or not PAGE_HEADER <= lower <= upper <= size:
        return f"its lower/upper bounds {lower}/{upper} do not fit a {size}-byte page"
    n = (lower - PAGE_HEADER) >> 1
    if n == 0:
        return "it holds no nodes"
    ptrs = _ptrs(buf, base + PAGE_HEADER, n)
    if min(ptrs) < upper or max(ptrs) > size - NODE_HEADER:
        i = next(i for i, p in enumerate(ptrs) if not upper <= p <= size - NODE_HEADER)
        return f"node {i} starts outside the page's node area ({ptrs[i]})"
    return [base + p for p in ptrs]


def _read_meta(fd: int, page: int, psize: int) -> _Meta | str:
    """Meta page ``page`` (at ``page * psize``), or why it is unusable."""
    raw = os.pread(fd, _META_SIZE, page * psize)
    if len(raw) < _META_SIZE:
        return f"meta page {page} is missing (the file is too short)"
    flags = _HEADER.unpack_from(raw)[2]
    magic, version = _META.unpack_from(raw, PAGE_HEADER)
    if not flags & P_META or magic != MAGIC:
        return f"meta page {page} is not an LMDB meta page"
    if version != DATA_VERSION:
        return f"meta page {page} has LMDB data version {version}, not {DATA_VERSION}"
    free, main = _Db.read(raw, _META_DBS), _Db.read(raw, _META_DBS + DB_RECORD)
    last_pg, txnid = _META_TAIL.unpack_from(raw, _META_LAST_PG)
    if free.pad < 512 or free.pad > 65536 or free.pad & (free.pad - 1):
        return f"meta page {page} gives an impossible page size {free.pad}"
    return _Meta(page, free.pad, last_pg, txnid, free, main)


def _read_metas(fd: int) -> tuple[list[_Meta], list[PageProblem]]:
    """Both meta pages, the valid ones first by page; a problem for each that LMDB would refuse."""
    first = _read_meta(fd, 0, _DEFAULT_PAGE)
    second = _read_meta(fd, 1, first.psize if isinstance(first, _Meta) else _DEFAULT_PAGE)
    metas = [m for m in (first, second) if isinstance(m, _Meta)]
    problems = [PageProblem(i, m, HEADER_TABLE) for i, m in enumerate((first, second)) if isinstance(m, str)]
    if len(metas) == 2 and metas[0].psize != metas[1].psize:
        problems.append(PageProblem(1, "the two meta pages disagree on the page size", HEADER_TABLE))
    return metas, problems


def _pick(metas: list[_Meta], txnid: int | None) -> _Meta | None:
    """The meta page LMDB would read (the newer one), or the one holding ``txnid``."""
    if txnid is not None:
        return next((m for m in metas if m.txnid == txnid), None)
    if not metas:
        return None
    return max(metas, key=lambda m: (m.txnid, -m.page))


class _Walker:
    """Walks the trees of one snapshot with plain reads, recording problems instead of following garbage."""

    def __init__(self, fd: int, file_size: int, meta: _Meta) -> None:
        self.fd = fd
        self.file_size = file_size
        self.psize = meta.psize
        self.last_pg = meta.last_pg
        self.meta = meta
        self.problems: list[PageProblem] = []
        self.seen: set[int] = set()  # every page a tree or an overflow run has claimed
        self.visited: set[int] = set()
        self.overflow: set[int] = set()
        self.free: set[int] = set()
        self.subdbs: list[tuple[str, _Db, int]] = []  # name, record, page of the main-tree leaf holding it
        self.id_lists: list[tuple[tuple[int, ...], int]] = []  # free page numbers, file offset of the list
        self.records: dict[str, list[tuple[bytes, bytes]]] | None = None  # when collecting: table -> (key, value)

    # -- bookkeeping -------------------------------------------------------------------------------------------

    def problem(self, page: int, what: str, table: str) -> None:
        self.problems.append(PageProblem(page, what, table))
        if len(self.problems) >= MAX_PROBLEMS:
            raise _Stop

    def pointer(self, pgno: int) -> str | None:
        """Why a reference to ``pgno`` is wrong (out of range, or to a page already in use), or None."""
        if pgno < 2:
            return f"points to meta page {pgno}"
        if pgno > self.last_pg:
            return f"points to page {pgno}, past the last page {self.last_pg}"
        if pgno in self.seen:
            return f"points to page {pgno}, which is already used elsewhere"
        return None

    def read(self, pgno: int, table: str) -> bytes | None:
        """One whole page, or None (and a problem) if the file ends before it."""
        buf = os.pread(self.fd, self.psize, pgno * self.psize) if (pgno + 1) * self.psize <= self.file_size else b""
        if len(buf) < self.psize:
            self.problem(pgno, f"lies past the end of the file ({self.file_size} bytes)", table)
            return None
        self.visited.add(pgno)
        return buf

    # -- trees -------------------------------------------------------------------------------------------------

    def tree(self, tree: _Tree, where: int) -> bool:
        """Walk one B-tree whose record sits on page ``where``; True if it was found sound throughout."""
        db, start = tree.db, len(self.problems)
        if db.root == P_INVALID:
            if db.depth or db.entries or db.branch_pages or db.leaf_pages or db.overflow_pages:
                self.problem(where, "an empty tree's record has nonzero counts", tree.table)
            return len(self.problems) == start
        if not 1 <= db.depth <= MAX_DEPTH:
            self.problem(where, f"the tree's depth {db.depth} is impossible", tree.table)
            return False
        bad = self.pointer(db.root)
        if bad:
            self.problem(where, f"the tree's root {bad}", tree.table)
            return False
        self.seen.add(db.root)
        stack = [(db.root, 1)]
        while stack:
            pgno, level = stack.pop()
            stack.extend(self.page(tree, pgno, level))
        if len(self.problems) == start:
            self.compare(tree, where)
        return len(self.problems) == start

    def compare(self, tree: _Tree, where: int) -> None:
        """The record's statistics must match what the walk counted (LMDB keeps them exact).

        Not the page counts of a table with duplicates: LMDB adds some of its
        sub-trees' pages to them, and does not take them all back on delete.
        """
        names = ("entries",) if tree.dupsort else ("entries", "branch_pages", "leaf_pages", "overflow_pages")
        for name in names:
            said, found = getattr(tree.db, name), getattr(tree.count, name)
            if said != found:
                label = name.replace("_", " ")
                self.problem(where, f"the tree's record counts {said} {label}, the tree has {found}", tree.table)

    def page(self, tree: _Tree, pgno: int, level: int) -> list[tuple[int, int]]:
        """Check one branch or leaf page; return the children to visit as (page, level)."""
        buf = self.read(pgno, tree.table)
        if buf is None:
            return []
        hpgno, _pad, flags, lower, upper = _HEADER.unpack_from(buf)
        if hpgno != pgno:
            self.problem(pgno, f"its header says it is page {hpgno}", tree.table)
            return []
        kind = flags & ~_P_IN_MEMORY
        depth = tree.db.depth
        if kind == P_BRANCH:
            if level >= depth:
                self.problem(pgno, f"a branch page at level {level} of a tree {depth} deep", tree.table)
                return []
            tree.count.branch_pages += 1
            return [(child, level + 1) for child in reversed(self.branch(tree, pgno, buf, lower, upper))]
        leaf = P_LEAF | (P_LEAF2 if tree.dupfixed else 0)
        if kind != leaf:
            self.problem(pgno, f"flags 0x{flags:04x} are not those of a branch or leaf page", tree.table)
        elif level != depth:
            self.problem(pgno, f"a leaf page at level {level} of a tree {depth} deep", tree.table)
        else:
            tree.count.leaf_pages += 1
            if tree.dupfixed:
                self.fixed(tree, pgno, buf, 0, self.psize, tree.db.pad)
            else:
                self.leaf(tree, pgno, buf, lower, upper)
        return []

    def branch(self, tree: _Tree, pgno: int, buf: bytes, lower: int, upper: int) -> list[int]:
        """A branch page's children (claimed), or none if anything on the page is wrong."""
        offsets = _node_offsets(buf, 0, self.psize, lower, upper)
        if isinstance(offsets, str):
            self.problem(pgno, offsets, tree.table)
            return []
        children: list[int] = []
        prev: Any = None
        for i, o in enumerate(offsets):
            lo, hi, fl, ksize = _NODE.unpack_from(buf, o)
            end = o + NODE_HEADER + ksize
            if end > self.psize:
                self.problem(pgno, f"node {i} runs past the end of the page", tree.table)
                return []
            if i:  # the first key of a branch page is implicitly "lowest" and never compared
                key = buf[o + NODE_HEADER : end] if tree.key is None else tree.key(buf[o + NODE_HEADER : end])
                if prev is not None and key <= prev:
                    self.problem(pgno, f"node {i}'s key is not above node {i - 1}'s", tree.table)
                    return []
                prev = key
            child = lo | hi << 16 | fl << 32
            bad = self.pointer(child)
            if bad:
                self.problem(pgno, f"node {i} {bad}", tree.table)
                return []
            self.seen.add(child)
            children.append(child)
        return children

    def leaf(self, tree: _Tree, pgno: int, buf: bytes, lower: int, upper: int) -> None:
        """Check every node of a leaf page and the value each one points to."""
        offsets = _node_offsets(buf, 0, self.psize, lower, upper)
        if isinstance(offsets, str):
            self.problem(pgno, offsets, tree.table)
            return
        self.nodes(tree, pgno, buf, offsets, self.psize)

    def nodes(self, tree: _Tree, pgno: int, buf: bytes, offsets: list[int], limit: int) -> None:
        """Leaf nodes at ``offsets``, each of which must end by ``limit``; counts the entries into ``tree``."""
        allowed, keyfn, psize, free = tree.node_flags, tree.key, self.psize, tree.kind == "free"
        prev: Any = None
        for i, o in enumerate(offsets):
            lo, hi, fl, ksize = _NODE.unpack_from(buf, o)
            size, data = lo | hi << 16, o + NODE_HEADER + ksize
            if fl & ~allowed:
                self.problem(pgno, f"node {i} has flags 0x{fl:x}, which this table cannot hold", tree.table)
                return
            if data + (8 if fl & F_BIGDATA else size) > limit:
                self.problem(pgno, f"node {i} runs past the end of the page", tree.table)
                return
            key = buf[o + NODE_HEADER : data] if keyfn is None else keyfn(buf[o + NODE_HEADER : data])
            if prev is not None and key <= prev:
                self.problem(pgno, f"node {i}'s key is not above node {i - 1}'s", tree.table)
                return
            prev = key
            if free and ksize != 8:
                self.problem(pgno, f"node {i}'s key is {ksize} bytes, not a transaction id", tree.table)
                return
            if fl:
                tree.count.entries += self.value(tree, pgno, i, buf, o, data, size, fl)
            else:
                tree.count.entries += 1
                if free:
                    self.id_list(buf[data : data + size], pgno * psize + data, pgno, i)
                elif self.records is not None and tree.kind == "table":
                    self.records.setdefault(tree.table, []).append(
                        (buf[o + NODE_HEADER : data], buf[data : data + size])
                    )

    def value(self, tree: _Tree, pgno: int, i: int, buf: bytes, o: int, data: int, size: int, fl: int) -> int:
        """Check a flagged node's value; return how many entries it holds."""
        if fl & F_DUPDATA:
            return self.duplicates(tree, pgno, i, buf, data, size, fl)
        if fl & F_SUBDATA:
            if tree.kind != "main" or fl & F_BIGDATA or size != DB_RECORD:
                self.problem(pgno, f"node {i} is not a valid sub-database record", tree.table)
                return 1
            name = buf[o + NODE_HEADER : data].decode("utf-8", "backslashreplace")
            self.subdbs.append((name, _Db.read(buf, data), pgno))
            return 1
        first = _U64.unpack_from(buf, data)[0]
        if self.run(tree, pgno, i, first, size) and tree.kind == "free":
            start = first * self.psize + PAGE_HEADER
            self.id_list(os.pread(self.fd, size, start), start, pgno, i)
        elif self.records is not None and tree.kind == "table" and first in self.overflow:
            value = os.pread(self.fd, size, first * self.psize + PAGE_HEADER)  # the run was checked to hold it
            self.records.setdefault(tree.table, []).append((buf[o + NODE_HEADER : data], value))
        return 1

    # -- overflow runs and the free list -----------------------------------------------------------------------

    def run(self, tree: _Tree, pgno: int, i: int, first: int, size: int) -> bool:
        """Check the overflow run holding node ``i``'s ``size``-byte value (its header only); True if sound."""
        bad = self.pointer(first)
        if bad:
            self.problem(pgno, f"node {i}'s big value {bad}", tree.table)
            return False
        if (first + 1) * self.psize > self.file_size:
            self.problem(first, f"lies past the end of the file ({self.file_size} bytes)", tree.table)
            return False
        head = os.pread(self.fd, PAGE_HEADER, first * self.psize)
        self.visited.add(first)
        hpgno, _pad, flags, pages = _OVERFLOW_HEADER.unpack_from(head)
        why = self.run_problem(first, hpgno, flags, pages, size)
        if why:
            self.problem(first, why, tree.table)
            return False
        run = range(first, first + pages)
        if not self.seen.isdisjoint(run):
            self.problem(first, "its overflow run overlaps pages used elsewhere", tree.table)
            return False
        self.seen.update(run)
        self.overflow.update(run)
        tree.count.overflow_pages += pages
        return True

    def run_problem(self, first: int, hpgno: int, flags: int, pages: int, size: int) -> str | None:
        if hpgno != first:
            return f"its header says it is page {hpgno}"
        if flags & ~_P_IN_MEMORY != P_OVERFLOW:
            return f"flags 0x{flags:04x} are not those of an overflow page"
        if pages < 1 or pages * self.psize < size + PAGE_HEADER:
            return f"its run of {pages} pages cannot hold the {size}-byte value it starts"
        if first + pages - 1 > self.last_pg:
            return f"its run of {pages} pages ends past the last page {self.last_pg}"
        if (first + pages) * self.psize > self.file_size:
            return f"its run of {pages} pages ends past the end of the file ({self.file_size} bytes)"
        return None

    def id_list(self, raw: bytes, start: int, pgno: int, i: int) -> None:
        """A free-list value: a count, then that many page numbers (checked once every tree is walked)."""
        if len(raw) < 8:
            self.problem(pgno, f"node {i}'s free-page list is too short to hold its count", FREE_TABLE)
            return
        n = _U64.unpack_from(raw)[0]
        if 8 + 8 * n > len(raw):
            self.problem(start // self.psize, f"a free-page list claims {n} pages in {len(raw)} bytes", FREE_TABLE)
            return
        self.id_lists.append((struct.unpack_from(f"={n}Q", raw, 8), start))

    def free_pages(self) -> None:
        """Every page the free list names must be a real page that no tree uses, named once."""
        for ids, start in self.id_lists:
            found = set(ids)
            if (
                len(found) == len(ids)
                and (not ids or (min(ids) >= 2 and max(ids) <= self.last_pg))
                and found.isdisjoint(self.seen)
                and found.isdisjoint(self.free)
            ):
                self.free |= found
                continue
            for j, pg in enumerate(ids):
                why = self.free_problem(pg)
                if why:
                    self.problem((start + 8 + 8 * j) // self.psize, why, FREE_TABLE)
                else:
                    self.free.add(pg)

    def free_problem(self, pg: int) -> str | None:
        if not 2 <= pg <= self.last_pg:
            return f"the free list names page {pg}, outside pages 2..{self.last_pg}"
        if pg in self.seen:
            return f"the free list names page {pg}, which a tree uses"
        if pg in self.free:
            return f"the free list names page {pg} twice"
        return None

    # -- duplicates (MDB_DUPSORT tables; kvblend has none, but LMDB would follow them) -------------------------

    def duplicates(self, tree: _Tree, pgno: int, i: int, buf: bytes, data: int, size: int, fl: int) -> int:
        """Check a node's duplicate values: an inline sub-page, or a sub-tree; return how many there are."""
        flags = tree.db.flags
        dups = _Tree(
            tree.table,
            tree.db,
            "dups",
            _key_order(flags, MDB_INTEGERDUP, MDB_REVERSEDUP),
            dupfixed=bool(flags & MDB_DUPFIXED),
        )
        if fl & F_SUBDATA:
            if size != DB_RECORD:
                self.problem(pgno, f"node {i}'s duplicates record is {size} bytes, not {DB_RECORD}", tree.table)
                return 0
            dups.db = _Db.read(buf, data)
            if dups.dupfixed and dups.db.pad < 1:
                self.problem(pgno, f"node {i}'s duplicates have no fixed size", tree.table)
                return 0
            self.tree(dups, pgno)
            return dups.count.entries
        return self.subpage(dups, pgno, i, buf, data, size)

    def subpage(self, dups: _Tree, pgno: int, i: int, buf: bytes, at: int, size: int) -> int:
        """An inline page of duplicates inside a leaf node; its offsets are relative to its own start."""
        if size < PAGE_HEADER:
            self.problem(pgno, f"node {i}'s duplicates page is only {size} bytes", dups.table)
            return 0
        _pg, pad, flags, lower, upper = _HEADER.unpack_from(buf, at)
        want = P_LEAF | P_SUBP | (P_LEAF2 if dups.dupfixed else 0)
        if flags & ~_P_IN_MEMORY != want:
            self.problem(pgno, f"node {i}'s duplicates page has flags 0x{flags:04x}", dups.table)
            return 0
        if dups.dupfixed:
            return self.fixed(dups, pgno, buf, at, size, pad)
        offsets = _node_offsets(buf, at, size, lower, upper)
        if isinstance(offsets, str):
            self.problem(pgno, f"node {i}'s duplicates page: {offsets}", dups.table)
            return 0
        self.nodes(dups, pgno, buf, offsets, at + size)
        return dups.count.entries

    def fixed(self, dups: _Tree, pgno: int, buf: bytes, at: int, size: int, ksize: int) -> int:
        """A P_LEAF2 page (duplicates of ``ksize`` bytes packed after the header); return how many."""
        lower, upper = _HEADER.unpack_from(buf, at)[3:]
        n = (lower - PAGE_HEADER) >> 1
        if (
            lower & 1
            or not PAGE_HEADER <= lower <= upper <= size
            or n < 1
            or ksize < 1
            or PAGE_HEADER + n * ksize > size
        ):
            self.problem(pgno, f"a fixed-size duplicates page ({n} x {ksize} bytes) does not fit", dups.table)
            return 0
        base = at + PAGE_HEADER
        keys = [buf[base + j * ksize : base + (j + 1) * ksize] for j in range(n)]
        if dups.key is not None:
            keys = [dups.key(k) for k in keys]
        if any(a >= b for a, b in itertools.pairwise(keys)):
            self.problem(pgno, "fixed-size duplicates are out of order", dups.table)
            return 0
        dups.count.entries += n
        return n

    # -- the whole snapshot ------------------------------------------------------------------------------------

    def walk(self, tables: set[str] | None) -> dict[str, int]:
        """Main tree, the named sub-databases (those in ``tables`` if given), then the free list."""
        m = self.meta
        if m.main.flags & ~_DB_FLAGS:
            self.problem(m.page, f"the main tree has unknown flags 0x{m.main.flags:x}", MAIN_TABLE)
        self.tree(_Tree(MAIN_TABLE, m.main, "main", _key_order(m.main.flags, MDB_INTEGERKEY, MDB_REVERSEKEY)), m.page)
        counts: dict[str, int] = {}
        for name, db, where in self.subdbs:
            if db.flags & ~_DB_FLAGS:
                self.problem(where, f"sub-database {name!r} has unknown flags 0x{db.flags:x}", MAIN_TABLE)
            elif tables is None or name in tables:
                sub = _Tree(name, db, "table", _key_order(db.flags, MDB_INTEGERKEY, MDB_REVERSEKEY))
                self.tree(sub, where)
                counts[name] = sub.count.entries
        self.tree(_Tree(FREE_TABLE, m.free, "free", _int_key), m.page)
        self.free_pages()
        return counts


def read_records(data_file: str | os.PathLike[str]) -> tuple[dict[str, list[tuple[bytes, bytes]]], PageReport]:
    """Every (key, value) of every named table that sound pages of the newest snapshot hold, read with plain reads,
    and the check's report.

    For rebuilding a damaged index (repair.py): LMDB itself would follow the damage and could kill the process,
    this walk skips it, so only the records on damaged pages (and below them) are lost.
    """
    return _walk_file(data_file, None, None, collect=True)


def check_pages(
    data_file: str | os.PathLike[str], txnid: int | None = None, tables: Iterable[str] | None = None
) -> PageReport:
    """Walk every page LMDB could read in one snapshot of ``data_file``, with plain reads; never raises on damage.

    ``txnid``: walk the snapshot of that transaction (the caller holds an
    LMDB read transaction with that id open, so its pages cannot be recycled
    meanwhile); :class:`SnapshotMoved` if neither meta page holds it any more.
    Without it, the newest snapshot is walked, as LMDB would read it.
    ``tables``: walk only these named sub-databases (the main tree and the
    free list are always walked).

    Checked: both meta pages; every page's number, header, flags, bounds and
    node offsets; that every node (header, key, inline value) lies inside its
    page; key order; child and overflow page numbers within the file and the
    snapshot; leaf depth; each tree's statistics; overflow run headers; the
    page numbers in the free list; that no page is used twice. Not checked:
    the bytes of values (a value may be garbage, LMDB will return it as is),
    and pages the snapshot does not reach (free or stale pages nobody reads).
    An index file that cannot be opened at all raises the usual OSError.
    """
    return _walk_file(data_file, txnid, tables)[1]


def _walk_file(
    data_file: str | os.PathLike[str], txnid: int | None, tables: Iterable[str] | None, collect: bool = False
) -> tuple[dict[str, list[tuple[bytes, bytes]]], PageReport]:
    with open(data_file, "rb") as f:
        fd = f.fileno()
        metas, problems = _read_metas(fd)
        meta = _pick(metas, txnid)
        if meta is None:
            if txnid is not None and metas and not problems:
                raise SnapshotMoved(f"no meta page holds transaction {txnid} any more")
            problems = problems or [PageProblem(-1, "no usable meta page", HEADER_TABLE)]
            return {}, PageReport(0, problems, -1, {})
        walker = _Walker(fd, os.fstat(fd).st_size, meta)  # size after the meta read: a writer only grows it
        walker.records = {} if collect else None
        walker.problems.extend(problems)
        counts: dict[str, int] = {}
        try:
            counts = walker.walk(None if tables is None else {tables} if isinstance(tables, str) else set(tables))
        except _Stop:
            walker.problems.append(PageProblem(-1, f"checking stopped after {MAX_PROBLEMS} problems", HEADER_TABLE))
    return walker.records or {}, PageReport(
        len(walker.visited), walker.problems, meta.txnid, counts, walker.visited, walker.overflow, walker.free
    )
