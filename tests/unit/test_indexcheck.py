"""The index check (lmdb.verify, indexcheck.py): it finds every damaged page LMDB would read, and when it says ok,
LMDB cannot crash; the salvage reads exactly the records on sound pages.

Each environment is a real one written by py-lmdb, shaped like an archive index
(named tables, values big enough for overflow pages, deletes so the free list
holds pages), by both engines kvblend opens: LMDB 0.9 (data version 1, what new
indexes use) and 1.0 (data version 3). Damage is what users meet: a page whose
body, or header, was overwritten with 0xFF. Reading a damaged copy with LMDB
happens in a subprocess, since a crash there is a signal, not an exception.
(Moved from test_pagecheck.py when pagecheck.py was retired, issue 35.)
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from hardening_helpers import index_pages
from kvblend.archive.indexcheck import SnapshotGone, file_problems, read_records

TABLES = ("meta", "segments", "documents", "embeddings")
PAGE = 4096
BODY = (16, PAGE)  # every byte after the page header
HEADER = (0, 16)  # the page header: page number, flags, bounds

# Reads every record of every table of each damaged copy of a data file, one copy at a time, printing the
# number of each copy it survived. argv: original data.mdb, a scratch directory, then page:start:end specs.
READER = r"""
import shutil, sys, lmdb
src, scratch, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
shutil.copyfile(src, scratch + "/data.mdb")
with open(src, "rb") as f:
    original = f.read()
for n, spec in enumerate(specs):
    page, start, end = map(int, spec.split(":"))
    at = page * 4096
    with open(scratch + "/data.mdb", "r+b") as f:
        f.seek(at + start)
        f.write(b"\xff" * (end - start))
    try:
        env = lmdb.open(scratch, readonly=True, lock=False, max_dbs=16)
        try:
            with env.begin() as txn:
                names = [k for k, _ in txn.cursor()]
                for name in names:
                    try:
                        db = env.open_db(name, txn=txn, create=False)
                    except lmdb.Error:
                        continue
                    for k, v in txn.cursor(db=db):
                        len(k), len(v), v[-1:]
        finally:
            env.close()
    except lmdb.Error:
        pass
    with open(scratch + "/data.mdb", "r+b") as f:
        f.seek(at)
        f.write(original[at:at + 4096])
    print(n, flush=True)
"""


def build_index(path: Path, *, records: int = 200, rounds: int = 3, seed: int = 7, engine: int = 0) -> dict[str, int]:
    """An LMDB environment shaped like an archive index; returns each table's entry count as LMDB reports it."""
    rnd = random.Random(seed)
    env = lmdb.open(str(path), max_dbs=8, map_size=64 << 20, lib_version=engine)
    dbs = {name: env.open_db(name.encode()) for name in TABLES}
    for _ in range(rounds):
        with env.begin(write=True) as txn:
            txn.put(b"format", b'{"version": 3}', db=dbs["meta"])
            for _ in range(records):
                table = rnd.choice(TABLES[1:])
                size = rnd.choice([60, 180, 400, 900, 2500, 6000] if table != "embeddings" else [1200, 3000])
                txn.put(f"{table[:3]}{rnd.randrange(records * 2):05d}".encode(), rnd.randbytes(size), db=dbs[table])
        with env.begin(write=True) as txn:  # drop a third of two tables: their pages go to the free list
            for table in ("segments", "documents"):
                for key in [k for k, _ in txn.cursor(db=dbs[table])][::3]:
                    txn.delete(key, db=dbs[table])
        with env.begin(write=True) as txn:  # rewrite some values in place, some bigger
            for key, value in list(txn.cursor(db=dbs["segments"]))[::4]:
                txn.put(key, value + rnd.randbytes(rnd.choice([10, 3000])), db=dbs["segments"])
    with env.begin() as txn:
        counts = {name: txn.stat(db)["entries"] for name, db in dbs.items()}
    env.close()
    return counts


def build_dupsort(path: Path, engine: int = 0) -> dict[str, int]:
    """Tables with duplicate values (inline sub-pages and sub-trees, fixed-size too): not ours, but LMDB's."""
    env = lmdb.open(str(path), max_dbs=8, map_size=64 << 20, lib_version=engine)
    dups = env.open_db(b"dups", dupsort=True)
    fixed = env.open_db(b"fixed", dupsort=True, dupfixed=True)
    plain = env.open_db(b"plain")
    with env.begin(write=True) as txn:
        for i in range(60):
            for j in range(1 if i % 3 == 0 else 3 if i % 3 == 1 else 200):
                txn.put(f"key{i:03d}".encode(), f"value{j:05d}".encode() * (1 + i % 4), db=dups)
                txn.put(f"key{i:03d}".encode(), j.to_bytes(8, "big"), db=fixed)
            txn.put(f"key{i:03d}".encode(), b"x" * (100 if i % 2 else 3000), db=plain)
    with env.begin(write=True) as txn:
        for i in range(0, 60, 4):
            txn.delete(f"key{i:03d}".encode(), db=dups)
    with env.begin() as txn:
        counts = {"dups": txn.stat(dups)["entries"], "fixed": txn.stat(fixed)["entries"],
                  "plain": txn.stat(plain)["entries"]}
    env.close()
    return counts


@pytest.fixture(scope="module", params=[0, 1], ids=["lmdb0.9", "lmdb1.0"])
def index(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    path = tmp_path_factory.mktemp("index")
    return path / "data.mdb", build_index(path, engine=request.param)


@pytest.fixture(scope="module", params=[0, 1], ids=["lmdb0.9", "lmdb1.0"])
def dupsort(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    path = tmp_path_factory.mktemp("dupsort")
    return path / "data.mdb", build_dupsort(path, engine=request.param)


def named(problems: list[str]) -> set[int]:
    """The pages the problems name."""
    return {int(n) for p in problems for n in re.findall(r"\bpage (\d+)", p)}


def lmdb_records(data: Path) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every record of every named table, as LMDB itself reads them (a healthy file only)."""
    env = lmdb.open(str(data.parent), readonly=True, lock=False, max_dbs=16)
    try:
        with env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
            # LMDB 1.0 stores a table's name with its NUL terminator
            return {name.rstrip(b"\0").decode(): list(txn.cursor(db=env.open_db(name, txn=txn, create=False)))
                    for name in names}
    finally:
        env.close()


def test_healthy_index_is_ok_and_its_records_are_read_as_lmdb_reads_them(index: tuple[Path, dict[str, int]]) -> None:
    data, counts = index
    assert file_problems(data) == []
    tree, heads = index_pages(data)
    assert tree and heads  # the environment exercises branch, leaf and overflow pages
    records, problems = read_records(data)
    assert problems == []
    assert records == lmdb_records(data)
    assert {name: len(rows) for name, rows in records.items()} == counts


def test_healthy_duplicates_pass_but_for_lmdb_verify_page_counts(dupsort: tuple[Path, dict[str, int]]) -> None:
    """Tables with duplicates (kvblend has none): lmdb.verify 3.0.0 disputes a DUPSORT table's leaf-page count once
    keys with duplicate sub-trees were deleted (LMDB does not take all their pages back out of the count), and
    nothing else."""
    data, _ = dupsort
    assert [re.sub(r"\d+", "N", p) for p in file_problems(data)] == [
        "main/dups DB: walked N leaf pages (N with dup sub-trees), record says N"
    ] or [p for p in file_problems(data) if "leaf pages" not in p or "record says" not in p] == []


def test_salvage_of_a_damaged_index_keeps_only_true_records(index: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    """Each tree page garbled in turn: what the salvage returns is a subset of the true records, byte for byte, and
    for most pages only a part is lost (the records on that page and below it)."""
    data, counts = index
    truth = {name: dict(rows) for name, rows in lmdb_records(data).items()}
    copy = tmp_path / "data.mdb"
    original = data.read_bytes()
    tree, _ = index_pages(data)
    kept: list[int] = []
    for page in tree:
        shutil.copyfile(data, copy)
        with open(copy, "r+b") as f:
            f.seek(page * PAGE + 16)
            f.write(b"\xff" * (PAGE - 16))
        records, problems = read_records(copy)
        assert problems and page in named(problems), page
        for name, rows in records.items():
            assert all(truth[name].get(k) == v for k, v in rows), (page, name)
        kept.append(sum(len(rows) for rows in records.values()))
    total = sum(counts.values())
    assert all(n <= total for n in kept) and sum(0 < n < total for n in kept) > len(tree) // 2  # most lose a part
    assert data.read_bytes() == original


def sweep(data: Path, scratch: Path, span: tuple[int, int], must_name: set[int]) -> list[int]:
    """Overwrite ``span`` of each page with 0xFF in turn: pages in ``must_name`` must be named.

    Returns the pages whose damaged copy the checker passed (each then must be readable by LMDB).
    """
    copy = scratch / "data.mdb"
    shutil.copyfile(data, copy)
    original = data.read_bytes()
    passed = []
    with open(copy, "r+b") as f:
        for page in range(2, len(original) // PAGE):
            at = page * PAGE
            os.pwrite(f.fileno(), b"\xff" * (span[1] - span[0]), at + span[0])
            problems = file_problems(copy)
            os.pwrite(f.fileno(), original[at:at + PAGE], at)
            if page in must_name:
                assert problems and page in named(problems), (page, problems)
            elif not problems:
                passed.append(page)
    return passed


def assert_lmdb_survives(data: Path, scratch: Path, span: tuple[int, int], pages: list[int]) -> None:
    """Every damaged copy the checker passed must be read in full by LMDB without a crash (a signal)."""
    if not pages:
        return
    specs = [f"{page}:{span[0]}:{span[1]}" for page in pages]
    done = subprocess.run([sys.executable, "-c", READER, str(data), str(scratch), *specs],
                          check=False, capture_output=True, text=True, timeout=600)
    survived = len(done.stdout.split())
    culprit = pages[survived] if survived < len(pages) else None
    assert done.returncode >= 0, f"LMDB died of signal {-done.returncode} reading page {culprit} damaged by {span}"
    assert done.returncode == 0, done.stderr


def test_every_damaged_page_is_found_or_harmless(index: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    found_or_harmless(index[0], tmp_path)


def test_every_damaged_duplicates_page_is_found_or_harmless(dupsort: tuple[Path, dict[str, int]],
                                                            tmp_path: Path) -> None:
    found_or_harmless(dupsort[0], tmp_path)


def found_or_harmless(data: Path, tmp_path: Path) -> None:
    tree, heads = index_pages(data)  # branch and leaf pages; overflow bodies are value bytes, only heads are read
    for span, must_name in ((BODY, set(tree)), (HEADER, set(tree) | set(heads))):
        passed = sweep(data, tmp_path, span, must_name)
        assert not set(passed) & must_name
        assert_lmdb_survives(data, tmp_path, span, passed)


def test_truncated_files_are_damaged_not_fatal(index: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    data, _ = index
    tree, heads = index_pages(data)
    copy = tmp_path / "data.mdb"
    for size in (max(tree + heads) * PAGE, 2 * PAGE + 100, PAGE + 100, 100, 0):
        shutil.copyfile(data, copy)
        os.truncate(copy, size)
        assert file_problems(copy), size
        assert read_records(copy)[1], size


def test_garbage_file_is_damaged_quickly(tmp_path: Path) -> None:
    copy = tmp_path / "data.mdb"
    copy.write_bytes(b"\xff" * (PAGE * 40))
    assert file_problems(copy) == ["not an LMDB data file (MDB_MAGIC not found in first page), or an unsupported "
                                   "32-bit / foreign-endian file"]
    assert read_records(copy)[0] == {}


def test_a_walk_pinned_to_a_held_snapshot_ignores_later_commits(tmp_path: Path) -> None:
    """A reader holds snapshot N while a writer commits N + 1, which extends the file. A walk that reads the file
    as it was before that growth but the newest meta page would call N + 1's new pages "beyond EOF"; pinned to N
    it finds the file sound. Once N + 2 overwrote N's meta slot, the pinned walk says so instead of guessing."""
    path = tmp_path / "env"
    env = lmdb.open(str(path), map_size=1 << 26, max_dbs=2)
    try:
        db = env.open_db(b"t")
        with env.begin(write=True) as txn:
            for i in range(50):
                txn.put(b"k%03d" % i, b"v" * 100, db=db)
        data = path / "data.mdb"
        reader = env.begin(write=False)
        held = reader.id()
        before = data.read_bytes()
        with env.begin(write=True) as txn:  # N + 1: large values, so the file grows past ``before``
            for i in range(50):
                txn.put(b"big%03d" % i, os.urandom(3000), db=db)
        assert data.stat().st_size > len(before)
        torn = tmp_path / "torn.mdb"  # the writer's file, as a walk that sized it before the growth sees it
        torn.write_bytes(data.read_bytes()[: len(before)])
        assert any("beyond EOF" in p for p in file_problems(torn))
        assert file_problems(torn, txnid=held) == []
        assert file_problems(data, txnid=held) == []
        assert file_problems(data) == []
        with env.begin(write=True) as txn:  # N + 2 writes N's meta slot
            txn.put(b"last", b"x", db=db)
        with pytest.raises(SnapshotGone):
            file_problems(data, txnid=held)
        reader.abort()
    finally:
        env.close()
