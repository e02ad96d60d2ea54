"""Each bad document of issue 32, ingested alone into an archive that already holds a document: the exit status,
the line printed, and whether the archive's files stayed the same (names, sizes, contents).

Usage: python scripts/bench_bad_documents.py [--out bench-out/bad_documents.json]
Prints a Markdown table; the bad documents are made by tests/unit/document_helpers.py from the committed
fixtures, as the tests make them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "unit"))
from document_helpers import DOCS, make_bad_documents  # noqa: E402

KVBLEND = str(Path(sys.executable).parent / "kvblend")


def snapshot(archive: Path) -> dict[str, tuple[int, str]]:
    """Every file under the archive: relative name → (size, SHA-256 of its bytes), except LMDB's reader table
    ``index/lock.mdb``, where any reader (`kvblend ls` too) registers to read beside a writer; an ingest of a
    PDF or other converted file opens the archive to ask whether it already holds the file's bytes."""
    files = {}
    for path in sorted(archive.rglob("*")):
        if path.is_file() and path.name != "lock.mdb":
            data = path.read_bytes()
            files[str(path.relative_to(archive))] = (len(data), hashlib.sha256(data).hexdigest())
    return files


def ingest(*args: str | Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([KVBLEND, "ingest", *map(str, args)], capture_output=True, text=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "bad_documents.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bad_dir, archive = Path(tmp) / "bad", Path(tmp) / "archive"
        expected = make_bad_documents(bad_dir)
        ingest(DOCS / "quickstart.md", "--archive", archive).check_returncode()
        before = snapshot(archive)
        for name in expected:
            proc = ingest(bad_dir / name, "--archive", archive)
            after = snapshot(archive)
            lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
            rows.append(
                {
                    "file": name,
                    "exit": proc.returncode,
                    "stderr_lines": len(lines),
                    "line": lines[-1] if lines else "",
                    "traceback": "Traceback" in proc.stderr,
                    "archive_unchanged": after == before,
                    "changed": sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)),
                }
            )
        # all of them in one run beside a good document: the run goes on and ingests the good one
        mixed = Path(tmp) / "mixed"
        mixed.mkdir()
        for name in expected:
            os.link(bad_dir / name, mixed / name)
        os.link(DOCS / "article.html", mixed / "article.html")
        proc = ingest(mixed, "--archive", archive, "--json")
        report = json.loads(proc.stdout)
        run = {"exit": proc.returncode, "documents": report["documents"], "skipped": len(report["skipped"])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "mixed_run": run}, indent=2) + "\n")
    print("| file | exit | line printed | archive unchanged |")
    print("|---|---:|---|---|")
    for r in rows:
        unchanged = "yes" if r["archive_unchanged"] else "no: " + ", ".join(r["changed"])
        print(f"| {r['file']} | {r['exit']} | `{r['line']}` | {unchanged} |")
    print(
        f"\nAll {len(rows)} beside article.html in one run: exit {run['exit']}, {run['documents']} document "
        f"ingested, {run['skipped']} skipped."
    )


if __name__ == "__main__":
    main()
