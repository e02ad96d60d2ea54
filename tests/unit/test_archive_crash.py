"""Crash safety: a writer SIGKILLed at random moments never leaves a partial or unreadable segment."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from archive_crash_writer import N_LAYERS as CRASH_LAYERS
from archive_crash_writer import expected_layers, key_for
from archive_helpers import same
from kvblend.archive import Archive
from support import REPO

WRITER = Path(__file__).with_name("archive_crash_writer.py")


def _run_and_kill(path: Path, start: int, *, after_commits: int, delay: float) -> list[str]:
    """Start the writer, SIGKILL it ``delay`` s after its Nth commit; return every key it reported committed."""
    cmd = [sys.executable, str(WRITER), str(path), str(start), "1000", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    watchdog = threading.Timer(60, proc.kill)  # never hang the suite
    watchdog.start()
    keys: list[str] = []
    try:
        while len(keys) < after_commits:
            line = proc.stdout.readline().strip()
            assert line, proc.stderr.read()
            keys.append(line)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        keys += proc.stdout.read().split()  # committed before the kill landed
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return keys


def test_crash_while_writing_never_leaves_partial_segments(tmp_path):
    path = tmp_path / "ar"
    Archive.open(path).close()
    committed: list[str] = []
    start = 0
    rng = random.Random(7)
    # Each blob write takes ~60 ms (2 ms per layer), so the random delays land in
    # tensor generation, mid-blob, between rename and commit, or just after commit.
    for after in (1, 3, 7, 2):
        delay = rng.uniform(0.0, 0.08)
        keys = _run_and_kill(path, start, after_commits=after, delay=delay)
        assert keys == [key_for(s) for s in range(start, start + len(keys))]
        committed += keys
        start += len(keys) + 1  # the interrupted seed may or may not have committed; skip it

        with Archive.open(path) as ar:
            report = ar.verify()
            assert report.ok, report.problems
            for rec in ar.iter_segments():
                assert rec.n_layers == len(rec.layers) == CRASH_LAYERS
                assert (ar.path / rec.blob).stat().st_size == sum(e.length for e in rec.layers)
            for key in committed:
                kv = expected_layers(int(key[len("crash"):], 16))
                for i in (0, CRASH_LAYERS // 2, CRASH_LAYERS - 1):
                    k, v = ar.read_layer(key, i)
                    assert same(k, kv[i][0]) and same(v, kv[i][1])
            for rec in ar.iter_segments():  # every layer of every segment reads back intact
                for i in range(rec.n_layers):
                    ar.read_layer_raw(rec, i)

    with Archive.open(path) as ar:
        ar.gc()
        assert ar.verify().ok and ar.verify().temp_files == 0 and ar.verify().orphan_blobs == 0
        assert set(committed) <= {r.key for r in ar.iter_segments()}
