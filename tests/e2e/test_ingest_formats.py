"""`kvblend ingest` over bad documents (issue 32): one line each naming why, the run goes on, the archive untouched.

One real ingest (the default model) of every kind of bad document beside one good DOCX, then the bad ones alone
against the archive it made: refused in one line, with the archive's files as they were.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from document_helpers import DOCS, make_bad_documents
from hardening_helpers import snapshot

from support import one_line_error, run_cli


def test_ingest_skips_each_bad_document_in_one_line_and_leaves_the_archive_as_it_was(tmp_path):
    bad = tmp_path / "bad"
    expected = make_bad_documents(bad)
    mixed = tmp_path / "mixed"
    shutil.copytree(bad, mixed)
    shutil.copy(DOCS / "report.docx", mixed / "report.docx")
    # good text in other encodings beside them: read, and their encoding recorded
    (mixed / "menu.txt").write_bytes("Le crème brûlée coûte 7 €.\r\nNaïve.\r\n".encode("cp1252"))
    (mixed / "exported.txt").write_bytes("Orders shipped: 12\r\n".encode("utf-16"))  # Windows PowerShell's `>`
    arc = tmp_path / "arc"

    proc = run_cli("ingest", mixed, "--archive", arc, "--json", check=True)
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    assert report["documents"] == 3 and report["segments_new"] >= 3
    listed = {Path(d["name"]).name: d for d in json.loads(run_cli("ls", "--archive", arc, "--json").stdout)}
    assert {name: d["encoding"] for name, d in listed.items()} == {
        "menu.txt": "cp1252", "exported.txt": "utf-16", "report.docx": ""}
    table = run_cli("ls", "--archive", arc).stdout
    assert re.search(r"menu\.txt\s*│\s*text, cp1252", table), table
    shown = json.loads(run_cli("show", "menu.txt", "--archive", arc, "--json").stdout)
    assert shown["encoding"] == "cp1252"
    lines = [line for line in proc.stderr.splitlines() if line.startswith("skipped ")]
    assert len(lines) == len(expected), proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr  # no converter spoke for itself
    for name, pattern in expected.items():
        (line,) = [line for line in lines if line.startswith(f"skipped {(mixed / name).as_posix()}: ")]
        assert re.search(pattern, line.split(": ", 1)[1]), line

    before = snapshot(arc)
    msg = one_line_error(run_cli("ingest", bad, "--archive", arc))
    assert msg.startswith(f"kvblend: error: no readable text documents to ingest; skipped {len(expected)}: ")
    assert snapshot(arc) == before  # names, modes, bytes
