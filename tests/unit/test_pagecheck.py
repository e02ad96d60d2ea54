"""The structural page checker: it finds every damaged page LMDB would read, and when it says ok, LMDB cannot crash.

Each environment is a real one written by py-lmdb, shaped like an archive index
(named tables, values big enough for overflow pages, deletes so the free list
holds pages). Damage is what users meet: a page whose body, or header, was
overwritten with 0xFF. Reading a damaged copy with LMDB happens in a
subprocess, since a crash there is a signal, not an exception.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from kvblend.archive.pagecheck import PageReport, SnapshotMoved, check_pages

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


def build_index(path: Path, *, records: int = 200, rounds: int = 3, seed: int = 7) -> dict[str, int]:
    """An LMDB environment shaped like an archive index; returns each table's entry count as LMDB reports it."""
    rnd = random.Random(seed)
    env = lmdb.open(str(path), max_dbs=8, map_size=64 << 20)
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


def build_dupsort(path: Path) -> dict[str, int]:
    """Tables with duplicate values (inline sub-pages and sub-trees, fixed-size too): not ours, but LMDB's."""
    env = lmdb.open(str(path), max_dbs=8, map_size=64 << 20)
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


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    path = tmp_path_factory.mktemp("index")
    return path / "data.mdb", build_index(path)


@pytest.fixture(scope="module")
def dupsort(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    path = tmp_path_factory.mktemp("dupsort")
    return path / "data.mdb", build_dupsort(path)


def named(report: PageReport) -> set[int]:
    return {p.page for p in report.problems}


def test_healthy_index_is_ok_and_counts_every_table(index: tuple[Path, dict[str, int]]) -> None:
    data, counts = index
    report = check_pages(data)
    assert report.ok, report.problems
    assert report.pages_checked == len(report.visited) > 0
    assert report.tables == counts
    assert report.overflow and report.free  # the environment exercises overflow runs and a non-empty free list
    assert not report.visited & report.free and not report.overflow & report.free


def test_tables_restricts_the_named_tables_walked(index: tuple[Path, dict[str, int]]) -> None:
    data, counts = index
    report = check_pages(data, tables=["segments"])
    assert report.ok, report.problems
    assert report.tables == {"segments": counts["segments"]}
    assert report.pages_checked < check_pages(data).pages_checked


def test_healthy_duplicates_are_ok(dupsort: tuple[Path, dict[str, int]]) -> None:
    data, counts = dupsort
    report = check_pages(data)
    assert report.ok, report.problems
    assert report.tables == counts


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
            report = check_pages(copy)
            os.pwrite(f.fileno(), original[at:at + PAGE], at)
            if page in must_name:
                assert not report.ok and page in named(report), (page, report.problems)
            elif report.ok:
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


@pytest.mark.parametrize("which", ["index", "dupsort"])
def test_every_damaged_page_is_found_or_harmless(which: str, request: pytest.FixtureRequest,
                                                 tmp_path: Path) -> None:
    data, _ = request.getfixturevalue(which)
    healthy = check_pages(data)
    tree_pages = healthy.visited - healthy.overflow  # branch and leaf pages; overflow bodies are value bytes
    for span, must_name in ((BODY, tree_pages), (HEADER, healthy.visited)):
        passed = sweep(data, tmp_path, span, must_name)
        assert not set(passed) & must_name
        assert_lmdb_survives(data, tmp_path, span, passed)


def test_truncated_files_are_damaged_not_fatal(index: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    data, _ = index
    healthy = check_pages(data)
    copy = tmp_path / "data.mdb"
    for size in (max(healthy.visited) * PAGE, 2 * PAGE + 100, PAGE + 100, 100, 0):
        shutil.copyfile(data, copy)
        os.truncate(copy, size)
        report = check_pages(copy)
        assert not report.ok, size


def test_garbage_file_is_damaged_quickly(tmp_path: Path) -> None:
    copy = tmp_path / "data.mdb"
    copy.write_bytes(b"\xff" * (PAGE * 40))
    report = check_pages(copy)
    assert not report.ok and report.pages_checked == 0


def test_a_held_snapshot_is_walked_until_two_commits_replace_it(tmp_path: Path) -> None:
    build_index(tmp_path, records=60, rounds=1)
    env = lmdb.open(str(tmp_path), max_dbs=8, map_size=64 << 20)
    segments = env.open_db(b"segments")
    with env.begin() as held:
        old = held.id()
        entries = held.stat(segments)["entries"]
        with env.begin(write=True) as txn:
            for i in range(50):
                txn.put(f"new{i:03d}".encode(), b"v" * 3000, db=segments)
        report = check_pages(tmp_path / "data.mdb", txnid=old)
        assert report.ok, report.problems
        assert report.txnid == old and report.tables["segments"] == entries
        assert check_pages(tmp_path / "data.mdb").txnid == old + 1
        with env.begin(write=True) as txn:
            txn.delete(b"new000", db=segments)
        with pytest.raises(SnapshotMoved):
            check_pages(tmp_path / "data.mdb", txnid=old)
    env.close()
