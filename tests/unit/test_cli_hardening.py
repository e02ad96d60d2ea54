"""Odd inputs and awkward moments at the command line: Ctrl-C, a busy archive, a FIFO, empty values,
readers beside a live writer, one line per bad segment, plain --help."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from archive_crash_writer import key_for
from archive_helpers import layers
from hardening_helpers import build_archive
from kvblend.archive import Archive, SegmentRecord
from kvblend.documents import read_user_text
from kvblend.errors import UsageError
from support import REPO, kvblend_script, one_line_error, run_cli

WRITER = Path(__file__).with_name("archive_crash_writer.py")


def _wait_until_open(pid: int, path: Path, timeout: float = 60) -> None:
    """Wait until process ``pid`` has ``path`` open (it is then past start-up, inside the command)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd")):
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never opened {path}")


def _from_a_terminal(argv: list[str]) -> list[str]:
    """`argv` started with SIGINT at its default, as a shell in a terminal starts a command. A test run from a
    background job (`nohup`, `&` in a script) inherits SIGINT ignored, and an ignored signal stays ignored across
    exec, so no Ctrl-C could reach kvblend there (the test hung in such a run). The same pid, exec'd in place."""
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", reset, *argv]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to see the waiting process")
def test_ctrl_c_exits_130_with_one_line(tmp_path):
    arc = build_archive(tmp_path / "arc")
    with Archive.open(arc) as holder, holder.writer():  # so `gc --wait` blocks on the lock
        proc = subprocess.Popen(_from_a_terminal([*kvblend_script(), "gc", "--wait", "--archive", str(arc)]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_until_open(proc.pid, arc / "lock")
            time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 130
    assert stderr.strip() == "kvblend: interrupted"


def test_gc_dry_run_and_readers_run_while_another_process_writes(tmp_path):
    arc = build_archive(tmp_path / "arc")
    with Archive.open(arc) as holder, holder.writer():
        busy = one_line_error(run_cli("gc", "--archive", arc))
        assert "--wait" in busy and f"pid {os.getpid()}" in busy
        for command in (["gc", "--dry-run"], ["verify"], ["ls"], ["stats"]):
            assert run_cli(*command, "--archive", arc).returncode == 0, command


def test_reading_during_a_live_write(tmp_path):
    """Query-like reads (records, layers, verify, ls) beside a writer committing segments in another process."""
    arc = tmp_path / "arc"
    Archive.open(arc).close()
    writer = subprocess.Popen([sys.executable, str(WRITER), str(arc), "0", "1000", "2"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO)
    watchdog = threading.Timer(120, writer.kill)
    watchdog.start()
    try:
        assert writer.stdout.readline().strip() == key_for(0)
        for _ in range(3):
            with Archive.open(arc, readonly=True) as ar:
                for rec in ar.iter_segments():
                    ar.read_layer_raw(rec, rec.n_layers - 1)
            for command in (["verify"], ["ls"], ["gc", "--dry-run"]):
                proc = run_cli(*command, "--archive", arc)
                assert proc.returncode == 0, (command, proc.stderr)
        assert writer.poll() is None, "the writer finished before the reads: nothing was tested"
    finally:
        watchdog.cancel()
        writer.kill()
        writer.communicate()


def test_verify_prints_one_line_per_bad_segment(tmp_path):
    arc = build_archive(tmp_path / "arc", n_layers=24)
    with Archive.open(arc, readonly=True) as ar:
        rec = ar.get_segment("seg02")
    os.truncate(arc / rec.blob, rec.layers[1].offset + 5)  # layers 1..23 cut off
    proc = run_cli("verify", "--archive", arc)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "seg02" in lines[0] and "layers 1-23" in lines[0], proc.stderr
    report = json.loads(run_cli("verify", "--archive", arc, "--json").stdout)
    assert len(report["problems"]) == 23  # the JSON keeps every finding


def test_verify_names_damage_to_the_index_alone_and_fails(tmp_path, monkeypatch, capsys):
    """Where the index's own structure was the only problem, verify printed nothing and exited 0 (its JSON said
    `ok: false` with no problem listed). In process: such damage is refused at open before verify runs, so the
    store's structure check is made to report it."""
    from kvblend.archive.maintenance import VerifyReport
    from kvblend.archive.facade import Archive as Facade
    from kvblend.cli.main import main

    arc = build_archive(tmp_path / "arc")
    damage = VerifyReport(segments_checked=3, structure=["page 7 (branch): its keys are out of order"])
    monkeypatch.setattr(Facade, "verify", lambda self, repair=False, deep=False: damage)
    with pytest.raises(SystemExit) as done:
        main(["verify", "--archive", str(arc)])
    assert done.value.code == 1
    assert "damaged index" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["verify", "--archive", str(arc), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["structure"] == damage.structure


@pytest.mark.parametrize("command", ["ls", "show", "stats", "rm", "verify", "gc", "path", "ingest", "query"])
def test_help_shows_no_type_placeholders_for_flags(command):
    text = run_cli(command, "--help", check=True).stdout
    assert "<bool>" not in text and "BOOLEAN" not in text


def test_path_json(tmp_path):
    arc = build_archive(tmp_path / "arc")
    assert json.loads(run_cli("path", "--archive", arc, "--json", check=True).stdout) == \
        {"path": str(arc), "store": "local", "exists": True}
    assert json.loads(run_cli("path", "--archive", tmp_path / "none", "--json", check=True).stdout)["exists"] is False


@pytest.mark.parametrize("size,error", [("", "not a size"), ("0", "--max-size must be more than 0 bytes"),
                                        ("0.4", "--max-size must be more than 0 bytes")])
def test_gc_empty_or_zero_max_size_is_a_usage_error(tmp_path, size, error):
    """`--max-size 0` evicted every segment, where serve refused the same bound."""
    arc = build_archive(tmp_path / "arc")
    proc = run_cli("gc", "--max-size", size, "--archive", arc)
    assert proc.returncode == 2 and error in one_line_error(proc)
    with Archive.open(arc, readonly=True) as ar:
        assert ar.count_segments() == 6  # nothing evicted


def test_sizes_read_every_unit_they_are_written_in():
    from kvblend.cli.common import human_bytes, parse_size

    assert parse_size("5Ti") == 5 * 2**40 and parse_size("2 TiB") == 2 * 2**40 and parse_size("1Gi") == 2**30
    for n in (512, 1, 0):
        assert parse_size(human_bytes(n)) == n  # "512 bytes", "1 byte": what human_bytes writes reads back


def test_context_file_fifo_fails_fast(tmp_path):
    fifo = tmp_path / "some.fifo"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="not a regular file"):
        read_user_text(fifo, "context file")
    proc = run_cli("query", "q?", "--context-file", fifo, "--archive", tmp_path / "arc", timeout=120)
    assert proc.returncode == 2 and "not a regular file" in one_line_error(proc)


def test_read_user_text_keeps_reading_regular_files(tmp_path):
    f = tmp_path / "ctx.txt"
    f.write_bytes(b"line one\r\nline two\rthree\n")
    assert read_user_text(f, "context file") == "line one\nline two\nthree\n"
    with pytest.raises(UsageError, match="no such context file"):
        read_user_text(tmp_path / "missing.txt", "context file")
    with pytest.raises(UsageError, match="is a directory"):
        read_user_text(tmp_path, "context file")
    (tmp_path / "windows.txt").write_bytes("line one\r\nand a café\r\n".encode("utf-16"))  # Notepad's "Unicode"
    assert read_user_text(tmp_path / "windows.txt", "context file") == "line one\nand a café\n"
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe" + "cut".encode("utf-16-le") + b"\x00\xd8")
    with pytest.raises(UsageError, match=r"cannot read context file .*bad.txt as text \(not valid UTF-16"):
        read_user_text(tmp_path / "bad.txt", "context file")
    (tmp_path / "noise.bin").write_bytes(bytes(range(256)))
    with pytest.raises(UsageError, match=r"as text \(binary\)"):
        read_user_text(tmp_path / "noise.bin", "context file")


def test_a_segment_put_leaves_a_manifest_and_rm_removes_it(tmp_path):
    """Document manifests (what a rebuild reads) follow the index: written with a document, gone with it."""
    arc = build_archive(tmp_path / "arc")
    assert len(list((arc / "documents").glob("*.json"))) == 2
    assert run_cli("rm", "/docs/a.md", "--archive", arc).returncode == 0
    assert len(list((arc / "documents").glob("*.json"))) == 1
    with Archive.open(arc) as ar:
        ar.put_segment(SegmentRecord(key="zz1"), layers(1))
    stale = arc / "documents" / "0123456789abcdef0123456789abcdef.json"
    stale.write_text("{}")
    report = json.loads(run_cli("gc", "--archive", arc, "--json", check=True).stdout)
    assert report["orphan_manifests"] == ["documents/0123456789abcdef0123456789abcdef.json"] and not stale.exists()


@pytest.mark.parametrize("flags", [["--temperature", "nan"], ["--temperature", "inf"], ["--temperature", "-1"],
                                   ["--top-p", "nan"], ["--top-p", "0"], ["--top-p", "inf"], ["--seed", "-1"]])
def test_bad_sampling_values_are_usage_errors_before_the_model_loads(flags, tmp_path):
    proc = run_cli("query", "q?", *flags, "--archive", tmp_path / "none", timeout=120)
    line = one_line_error(proc)
    assert proc.returncode == 2 and flags[0] in line, line
    assert not (tmp_path / "none").exists()


def test_check_layer_zero_is_a_usage_error_except_for_the_probe(tmp_path):
    proc = run_cli("query", "q?", "--check-layers", "0", "--select", "hkvd", "--archive", tmp_path / "none", timeout=120)
    line = one_line_error(proc)
    assert proc.returncode == 2 and "--check-layers 0" in line and "--select probe" in line, line
    # the probe passes this check and reaches the archive (there is none)
    proc = run_cli("query", "q?", "--check-layers", "0", "--archive", tmp_path / "none", timeout=120)
    assert "--check-layers" not in one_line_error(proc)


def test_sampling_flags_have_help():
    text = run_cli("query", "--help", check=True).stdout
    for flag, words in (("--top-p", "Nucleus"), ("--seed", "Random seed"), ("--temperature", "greedy")):
        assert words in text.split(flag, 1)[1].split("\n  -", 1)[0], flag


def test_ingest_rate_leaves_out_the_model_load():
    from kvblend.pipeline.results import IngestReport

    report = IngestReport(tokens_new=900, seconds=10.0, model_load_seconds=9.0)
    assert report.tokens_per_s == pytest.approx(900.0)  # was 90: the load counted as prefill time
    assert report.to_dict()["model_load_seconds"] == 9.0


def test_ls_keeps_the_names_of_incomplete_documents_readable(tmp_path):
    """At 80 columns (always, piped) the note "0 (incomplete: ingest it again)" squeezed the document column to
    nothing: the names that needed ingesting again were the ones not shown."""
    arc = build_archive(tmp_path / "arc")
    with Archive.open(arc) as ar:
        names = sorted({d.display_name for d in ar.iter_documents()})
        ar.gc(max_size_bytes=1)  # evicts every segment: every document incomplete
    listing = run_cli("ls", "--archive", arc, check=True).stdout
    assert "incomplete" in listing
    for name in names:
        assert name in listing, listing
