"""The index's LMDB engine is kvblend's choice, not the environment's; and the index is walked (lmdb.verify) only
where its file may have changed behind kvblend's back (issue 35).

Archives are real (built through the API, read by the installed `kvblend` script in subprocesses). Which opens
walk the file is observed by wrapping the real walk (it still runs) and counting its calls.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import lmdb
import pytest

from hardening_helpers import N_SEGMENTS, build_archive, index_pages
from kvblend.archive import Archive, rebuild_index
from kvblend.archive import index as index_module
from kvblend.archive.indexcheck import STAMP_FILE, file_problems
from support import REPO, one_line_error, run_cli

MAGIC = 0xBEEFC0DE
READ_COMMANDS = (["ls"], ["stats"], ["verify"], ["gc", "--dry-run"], ["show", "seg01"])


def data_version(arc) -> int:
    """The LMDB data version in meta page 0 of the archive's index (read here, not through the code under test)."""
    head = (arc / "index" / "data.mdb").read_bytes()[:64]
    at = next(at for at in range(0, 60, 4) if struct.unpack_from("=I", head, at)[0] == MAGIC)
    return struct.unpack_from("=I", head, at + 4)[0]


BUILD = "import sys; sys.path[:0] = [sys.argv[2], sys.argv[3]]; from hardening_helpers import build_archive; " \
        "from pathlib import Path; build_archive(Path(sys.argv[1]))"


@pytest.mark.parametrize("engine", ["0", "1"])
def test_lmdb_default_lib_version_in_the_environment_changes_nothing(tmp_path, engine):
    """LMDB_DEFAULT_LIB_VERSION=1 made py-lmdb write a new index with LMDB 1.0, and every command then called it
    damaged. Now a new index is LMDB 0.9's whatever the variable says, and every command works with it set."""
    env = {**os.environ, "LMDB_DEFAULT_LIB_VERSION": engine, "PYTHONPATH": str(REPO)}
    arc = tmp_path / "arc"
    subprocess.run([sys.executable, "-c", BUILD, str(arc), str(REPO / "tests" / "unit"), str(REPO / "tests")],
                   check=True, env=env, timeout=300)
    assert data_version(arc) == 1
    for command in READ_COMMANDS:
        proc = run_cli(*command, "--archive", arc, env={"LMDB_DEFAULT_LIB_VERSION": engine})
        assert proc.returncode == 0 and not proc.stderr, (command, proc.stderr)
    assert run_cli("verify", "--archive", arc, env={"LMDB_DEFAULT_LIB_VERSION": engine}).stdout.startswith(
        f"ok: {N_SEGMENTS} segments")


def test_an_index_lmdb_1_0_wrote_keeps_its_engine_and_is_checked_alike(tmp_path):
    """An index in LMDB 1.0's format (what a first ingest left with the variable set, before the engine was
    pinned) opens with LMDB 1.0, is written and verified as it is, and its damage is one line like any other."""
    arc = tmp_path / "arc"
    (arc / "index").mkdir(parents=True)
    lmdb.open(str(arc / "index"), lib_version=1).close()  # the empty index such a first ingest left
    build_archive(arc)
    assert data_version(arc) == 3
    with Archive.open(arc) as ar:
        assert ar.store.index.env.lib_version()[0] == 1
        assert ar.touch(["seg01"]) == 1 and ar.verify().ok
    for command in READ_COMMANDS:
        assert run_cli(*command, "--archive", arc).returncode == 0, command
    assert data_version(arc) == 3  # never converted

    tree, _ = index_pages(arc / "index" / "data.mdb")
    with open(arc / "index" / "data.mdb", "r+b") as f:
        f.seek(tree[-1] * 4096 + 24)  # LMDB 1.0's page header is 24 bytes
        f.write(b"\xff" * (4096 - 24))
    for command in (["stats"], ["verify"], ["rm", "/docs/a.md"]):
        proc = run_cli(*command, "--archive", arc)
        line = one_line_error(proc)
        assert proc.returncode > 0 and "damaged" in line and "--rebuild-index" in line, (command, line)
    assert rebuild_index(arc).segments_restored == N_SEGMENTS
    assert data_version(arc) == 1  # a rebuilt index is a new one
    assert run_cli("verify", "--archive", arc).returncode == 0


@pytest.fixture
def walks(monkeypatch) -> list[str]:
    """The data files walked from now on, in this process (the real walk runs)."""
    seen: list[str] = []
    real = file_problems

    def counted(data, txnid=None):
        seen.append(str(data))
        return real(data, txnid)

    monkeypatch.setattr(index_module, "file_problems", counted)
    return seen


TOUCH = "import sys; from kvblend.archive import Archive; ar = Archive.open(sys.argv[1]); ar.touch(['seg02']); ar.close()"


def test_a_stamped_index_is_not_walked_at_open_or_before_a_commit(tmp_path, walks):
    arc = build_archive(tmp_path / "arc")
    walks.clear()  # a new index is walked at its first open (LMDB just wrote it; nothing stamped it yet)
    with Archive.open(arc) as ar:
        for _ in range(3):
            assert ar.touch(["seg01"]) == 1
        ar.put_profile("nvme", {"read_GBps": 3.0})
        # another kvblend process commits (and stamps): this one's next commit trusts the stamp
        subprocess.run([sys.executable, "-c", TOUCH, str(arc)], check=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                       timeout=120)
        assert ar.touch(["seg01"]) == 1
    with Archive.open(arc, readonly=True) as ar:
        assert ar.get_segment("seg01").hits == 4 and ar.get_segment("seg02").hits == 1
    assert walks == []
    with Archive.open(arc, readonly=True) as ar:
        assert ar.verify().ok  # verify always walks
    assert len(walks) == 1


def _restamp(arc, **changes) -> None:
    path = arc / "index" / STAMP_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("how", ["no stamp", "rebooted", "written by another program", "copied"])
def test_an_unclean_index_is_walked_once_then_trusted_again(tmp_path, walks, how):
    built = build_archive(tmp_path / "arc")
    walks.clear()
    arc = built
    if how == "no stamp":  # an archive older than the stamp, or a writer killed between its commit and its stamp
        (arc / "index" / STAMP_FILE).unlink()
    elif how == "rebooted":  # a power loss may have torn pages; a clean reboot looks the same
        _restamp(arc, boot="another boot")
    elif how == "written by another program":  # the same bytes written back: ctime moves, nothing is damaged
        with open(arc / "index" / "data.mdb", "r+b") as f:
            page = f.read(4096)
            f.seek(0)
            f.write(page)
    else:
        arc = tmp_path / "copy"
        shutil.copytree(built, arc)
    with Archive.open(arc, readonly=True) as ar:  # a reader walks, and cannot stamp
        assert ar.count_segments() == N_SEGMENTS
    with Archive.open(arc, readonly=True):
        pass
    assert len(walks) == 2
    with Archive.open(arc) as ar:  # a writer walks, and its first commit stamps
        assert ar.touch(["seg01"]) == 1
    assert len(walks) == 3
    with Archive.open(arc) as ar, Archive.open(arc, readonly=True):
        assert ar.touch(["seg01"]) == 1
    assert len(walks) == 3


def test_a_page_garbled_in_place_after_a_clean_close_is_refused_at_the_next_open(tmp_path):
    """No copy, no crash: bytes overwritten in the closed archive's own index file. Its stamp no longer matches, so
    the next command walks the file before LMDB reads a page."""
    arc = build_archive(tmp_path / "arc", n=40)
    tree, _ = index_pages(arc / "index" / "data.mdb")
    with open(arc / "index" / "data.mdb", "r+b") as f:
        f.seek(tree[len(tree) // 2] * 4096 + 16)
        f.write(b"\xff" * (4096 - 16))
    for command in (["stats"], ["ls"], ["gc", "--dry-run"]):
        proc = run_cli(*command, "--archive", arc)
        line = one_line_error(proc)
        assert proc.returncode > 0 and "corrupted" in line and "--rebuild-index" in line, (command, line)
    assert file_problems(arc / "index" / "data.mdb")


TOUCH_LOOP = ("import sys; from kvblend.archive import Archive; ar = Archive.open(sys.argv[1]); print(flush=True)\n"
              "for i in range(int(sys.argv[2])): ar.touch([f'seg{i % 6:02d}'])\nar.close()")


def test_verify_beside_a_committing_writer_reports_no_damage(tmp_path):
    """`verify` walks the snapshot its read transaction holds while another process commits: the walk is trusted
    only if no commit landed meanwhile (else walked again), so a moving file never reads as a damaged one.
    (Replaces pagecheck's held-snapshot test.)"""
    arc = build_archive(tmp_path / "arc", n=40)
    writer = subprocess.Popen([sys.executable, "-c", TOUCH_LOOP, str(arc), "400"], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        writer.stdout.readline()  # opened
        with Archive.open(arc, readonly=True) as ar:
            walked = 0
            while writer.poll() is None or walked < 3:
                assert ar.store.structure_problems() == []
                walked += 1
    finally:
        writer.wait(timeout=120)
        writer.stdout.close()
    assert writer.returncode == 0
    with Archive.open(arc, readonly=True) as ar:
        assert sum(r.hits for r in ar.iter_segments()) == 400
