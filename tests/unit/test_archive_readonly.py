"""Reading never writes: read commands work on an archive the user cannot write, create nothing and
write nothing back; odd format versions are refused; a writer binds the model only when it stores KV."""

from __future__ import annotations

import json

import lmdb
import pytest

from hardening_helpers import N_SEGMENTS, build_archive, public_dir, readonly_tree, run_as, snapshot, tree
from kvblend.archive import Archive
from kvblend.errors import ArchiveDamagedError
from support import one_line_error, run_cli

READ_COMMANDS = [["ls"], ["stats"], ["show", "seg01"], ["show", "/docs/a.md"], ["verify"], ["gc", "--dry-run"],
                 ["ls", "--json"], ["stats", "--json"], ["path", "--json"]]
WRITE_COMMANDS = [["gc"], ["rm", "/docs/a.md"], ["verify", "--repair"], ["verify", "--rebuild-index"]]


def test_read_commands_work_on_an_archive_the_user_cannot_write():
    with public_dir() as base:
        arc = build_archive(base / "arc")
        with readonly_tree(arc) as user:
            before = snapshot(arc)
            for command in READ_COMMANDS:
                proc = run_as(user, *command, "--archive", arc)
                assert proc.returncode == 0, (command, proc.stderr)
                assert "not writable" not in proc.stderr
            assert "seg01" in run_as(user, "show", "seg01", "--archive", arc).stdout
            for command in WRITE_COMMANDS:  # refused in one line, saying why
                line = one_line_error(run_as(user, *command, "--archive", arc))
                assert "not writable" in line, (command, line)
            assert snapshot(arc) == before


def test_tune_on_an_archive_the_user_cannot_write_says_so_before_calibrating():
    """tune stores its setting at the end: it loaded the model and ran the whole calibration (minutes, by
    default) before saying the archive was not writable."""
    from kvblend.archive.records import normalize_path
    from kvblend.machine import machine_info
    from kvblend.model.source import resolve_model_source, source_fingerprint
    from tuning_helpers import synthetic_profile

    source = resolve_model_source(None)
    fp = source_fingerprint(source)
    with public_dir() as base:
        arc = base / "arc"
        here = synthetic_profile("nvme", 0.004, 0.007, path=normalize_path(arc), bytes_per_token_layer=4096,
                                 machine=machine_info(), fingerprint=fp, L=3072)
        with Archive.open(arc, create=True, model_name=source.name, model_fingerprint=fp) as ar:
            ar.put_profile("here", here.to_dict())
        with readonly_tree(arc) as user:
            before = snapshot(arc)
            proc = run_as(user, "tune", "--archive", arc, "--compute", "cpu", "--limit", "1", "--ratios", "0.5")
            assert "not writable" in one_line_error(proc) and "r=0.5" not in proc.stdout + proc.stderr
            assert snapshot(arc) == before


def test_a_folder_the_user_cannot_search_is_a_skip_line_not_a_traceback():
    """Another user's private folder inside a shared tree: Python 3.11's is_file() raised PermissionError in the
    walk's archive check, and a file under it given by path raised in the path check (two tracebacks)."""
    with public_dir() as base:
        (base / "stub").mkdir()
        with readonly_tree(base / "stub") as user:
            docs = base / "docs"
            (docs / "private").mkdir(parents=True)
            (docs / "private" / "in.txt").write_text("Inside text about whales.")
            docs.chmod(0o755)
            (docs / "private").chmod(0o000)  # no search permission for the user (root's mode 000 for others too)
            try:
                walked = run_as(user, "ingest", docs, "--archive", base / "arc")
                line = one_line_error(walked)  # nothing else to read: said before any model loads
                assert walked.returncode == 2 and "docs/private (permission denied)" in line, line
                given = run_as(user, "ingest", docs / "private" / "in.txt", "--archive", base / "arc")
                line = one_line_error(given)
                assert given.returncode == 2 and "cannot read" in line and "permission denied" in line, line
            finally:
                (docs / "private").chmod(0o755)
            assert not (base / "arc").exists()


def test_read_commands_create_and_modify_nothing(tmp_path):
    arc = build_archive(tmp_path / "arc")
    (arc / "lock").unlink()  # writers create it; readers must not
    (arc / "reserve").unlink()
    before, paths = snapshot(arc), tree(arc)
    for command in READ_COMMANDS:
        assert run_cli(*command, "--archive", arc).returncode == 0, command
    assert snapshot(arc) == before and tree(arc) == paths


def _set_format_version(arc, raw: bytes | None) -> None:
    env = lmdb.open(str(arc / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn)
        if raw is None:
            txn.delete(b"format_version", db=meta)
        else:
            txn.put(b"format_version", raw, db=meta)
    env.close()


def _format_version(arc) -> bytes | None:
    env = lmdb.open(str(arc / "index"), max_dbs=16, readonly=True, lock=False)
    with env.begin() as txn:
        value = txn.get(b"format_version", db=env.open_db(b"meta", txn=txn, create=False))
    env.close()
    return value


@pytest.mark.parametrize("raw", [b"1.5", b"0", b"-1", b'"1"', b"true", b"garbage"])
def test_malformed_format_version_is_refused(tmp_path, raw):
    arc = build_archive(tmp_path / "arc")
    _set_format_version(arc, raw)
    for command in (["ls"], ["gc"], ["verify"]):
        line = one_line_error(run_cli(*command, "--archive", arc))
        assert "format version" in line and "not a positive integer" in line, (command, line)
    with pytest.raises(ArchiveDamagedError):
        Archive.open(arc)
    assert _format_version(arc) == raw  # refused untouched


def test_missing_format_version_is_not_written_back_by_readers(tmp_path):
    arc = build_archive(tmp_path / "arc")
    _set_format_version(arc, None)
    for command in (["ls"], ["stats"], ["verify"], ["show", "seg00"], ["gc", "--dry-run"]):
        assert run_cli(*command, "--archive", arc).returncode == 0, command
    with Archive.open(arc, create=False, model_name="tiny", model_fingerprint="fp-tiny", defer_binding=True):
        pass  # how `query` opens it
    assert _format_version(arc) is None
    assert json.loads(run_cli("stats", "--archive", arc, "--json", check=True).stdout)["segments"] == N_SEGMENTS


def test_failed_model_load_does_not_bind_a_new_archive(tmp_path):
    """`ingest --model garbage.gguf` fails; the archive it may have created stays unbound."""
    doc = tmp_path / "a.md"
    doc.write_text("Some text to ingest.\n")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    arc = tmp_path / "new"
    proc = run_cli("ingest", doc, "--model", garbage, "--archive", arc, timeout=300)
    one_line_error(proc)
    assert not arc.exists()  # not even an empty archive (its folder, index and 4 MB disk reserve)


def test_writable_open_of_unwritable_dir_reads_and_refuses_writes_in_one_line():
    with public_dir() as base:
        arc = build_archive(base / "arc")
        with readonly_tree(arc) as user:
            code = ("import sys\n"
                    "from kvblend.archive import Archive\n"
                    "from kvblend.errors import ArchiveError\n"
                    f"ar = Archive.open({str(arc)!r}, create=False, model_name='tiny', model_fingerprint='fp-tiny')\n"
                    "assert ar.readonly and ar.count_segments() == 6 and ar.touch(['seg00']) == 0\n"
                    "try:\n"
                    "    ar.put_profile('x', {})\n"
                    "except ArchiveError as e:\n"
                    "    print(e)\n")
            proc = user.run(user.python, "-c", code)
            assert proc.returncode == 0, proc.stderr
            assert "is not writable; this command needs to write" in proc.stdout


def test_repair_keeps_a_blob_it_cannot_read():
    """A blob the user may not read (another owner, an I/O error) is not known to be damaged: `verify --repair`
    reports it and exits 1, but keeps it (it used to drop the segment and unlink the intact blob)."""
    import os

    from hardening_helpers import NOBODY

    if os.geteuid() != 0:
        pytest.skip("needs root, to give one blob to another owner than the archive's")
    with public_dir() as base:
        arc = build_archive(base / "arc")
        with readonly_tree(arc) as user:
            for p in [arc, *arc.rglob("*")]:
                os.chown(p, NOBODY, NOBODY)  # the user owns, and may repair, the archive ...
            blob = sorted((arc / "blobs").rglob("*.kvb"))[0]
            os.chown(blob, 0, 0)
            blob.chmod(0o600)  # ... but not this blob
            proc = run_as(user, "verify", "--repair", "--archive", arc)
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert "Permission denied" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
        assert blob.exists()
        with Archive.open(arc, readonly=True) as ar:
            assert sum(1 for _ in ar.iter_segments()) == N_SEGMENTS
            assert ar.verify().ok  # root reads it: it was intact all along


def test_a_shared_archive_whose_lock_file_another_member_made_takes_writes():
    """In an archive a group shares, the lock file belongs to whoever made it (0644): every other member's
    gc, rm and ingest ended in a PermissionError traceback, opening it for writing. flock needs only reading."""
    import os

    from hardening_helpers import NOBODY

    if os.geteuid() != 0:
        pytest.skip("needs root, to give the lock file to another owner than the archive's")
    with public_dir() as base:
        arc = build_archive(base / "arc")
        with readonly_tree(arc) as user:
            for p in [arc, *arc.rglob("*")]:
                os.chown(p, NOBODY, NOBODY)
            lock = arc / "lock"
            lock.touch()
            os.chown(lock, 0, 0)
            lock.chmod(0o644)
            proc = run_as(user, "gc", "--archive", arc)
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
            proc = run_as(user, "rm", "/docs/a.md", "--archive", arc)
            assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_blob_folder_the_user_may_not_list_or_change_is_one_line():
    """A folder of blobs another user made (one `sudo kvblend ingest`): gc and verify ended in a
    PermissionError traceback, listing it or deleting from it."""
    import os

    from hardening_helpers import NOBODY

    if os.geteuid() != 0:
        pytest.skip("needs root, to give one blob folder to another owner than the archive's")
    with public_dir() as base:
        arc = build_archive(base / "arc")
        with readonly_tree(arc) as user:
            for p in [arc, *arc.rglob("*")]:
                os.chown(p, NOBODY, NOBODY)
            folder = sorted((arc / "blobs").iterdir())[0]
            (folder / "orphan.kvb").write_bytes(b"left behind")  # root's, in a folder nobody may not change
            os.chown(folder, 0, 0)
            folder.chmod(0o755)
            line = one_line_error(run_as(user, "gc", "--archive", arc))
            assert "cannot delete" in line and "Permission denied" in line
            folder.chmod(0o700)
            for command in (["verify"], ["gc", "--dry-run"]):
                line = one_line_error(run_as(user, *command, "--archive", arc))
                assert "cannot list" in line and "Permission denied" in line, (command, line)
