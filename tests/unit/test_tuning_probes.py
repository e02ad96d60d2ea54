"""The measurements behind a profile, on scratch files and a tiny model."""

from __future__ import annotations

import os

import pytest
import torch

from kvblend.archive import encode_layer
from kvblend.errors import UsageError
from kvblend.tuning.probes import measure_decompress, measure_disk_read, measure_layer_cost, measure_ram_read
from support import tiny_runner


def test_measure_disk_read_layout_and_cleanup(tmp_path):
    segments = [[os.urandom(50_000 + 1000 * i) for i in range(4)] for _ in range(3)]
    m = measure_disk_read(tmp_path, segments, cold_runs=1, warm_runs=1)
    assert m.scratch_bytes == sum(len(p) for s in segments for p in s)
    assert m.reads == 12
    assert m.read_cold_MBps > 0 and m.read_warm_MBps > 0
    assert m.cold_resident_fraction is None or 0.0 <= m.cold_resident_fraction <= 1.0
    assert list(tmp_path.iterdir()) == []  # scratch file removed
    with pytest.raises(UsageError):
        measure_disk_read(tmp_path / "missing", segments)
    ram = measure_ram_read(segments, runs=1)
    assert ram.read_cold_MBps == ram.read_warm_MBps > 0


def test_a_killed_profiles_scratch_file_is_deleted_by_the_next_profile_of_that_folder(tmp_path):
    """A profile killed outright leaves its scratch file (up to 64 MB): the next one deletes those of processes
    that are gone, never a running one's."""
    dead = tmp_path / ".kvblend-profile-99999999-0bad.scratch"  # above any pid_max
    running = tmp_path / f".kvblend-profile-{os.getpid()}-0ace.scratch"
    dead.write_bytes(b"x" * 100)
    running.write_bytes(b"y" * 10)
    measure_disk_read(tmp_path, [[os.urandom(1000)]], cold_runs=1, warm_runs=1)
    assert sorted(tmp_path.iterdir()) == [running]


def test_a_folder_profile_cannot_write_to_is_one_line(tmp_path):
    """A read-only file system raised OSError (EROFS), not PermissionError: a traceback."""
    from hardening_helpers import small_tmpfs
    import subprocess

    with small_tmpfs(tmp_path / "ro") as mount:
        if subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True).returncode:
            pytest.skip("cannot remount a tmpfs read-only here")
        with pytest.raises(UsageError, match="cannot write a scratch file in .*read-only file system"):
            measure_disk_read(mount, [[os.urandom(1000)]])


def test_measure_decompress_reports_compressed_and_raw_rates():
    k = torch.randn(2, 64, 16).half()
    payloads = [encode_layer(k, k.clone(), "zstd-shuffle", 3) for _ in range(3)]
    m = measure_decompress(payloads, "zstd-shuffle", min_seconds=0.01)
    assert m.raw_bytes == 3 * 2 * k.numel() * 2
    assert m.decompress_MBps > 0
    assert m.decompress_raw_MBps == pytest.approx(m.decompress_MBps * m.raw_bytes / m.compressed_bytes)


def test_measure_layer_cost_on_tiny_model():
    runner = tiny_runner("llama")
    cost = measure_layer_cost(runner, [32, 64, 128], repeats=1)
    assert [r.L for r in cost.per_length] == [32, 64, 128]
    assert cost.a_s_per_token >= 0 and cost.b_s_per_token2 >= 0
    assert all(r.layer_s > 0 for r in cost.per_length)
    assert cost.selective_check.L == 128 and cost.selective_check.measured_s > 0
