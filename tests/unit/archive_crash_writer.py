"""Helper for the archive crash test: put segments in a loop until killed.

Usage: python tests/unit/archive_crash_writer.py ARCHIVE START [COUNT [SLOW_MS]]

SLOW_MS sleeps that long after writing each layer to the blob (a slow disk),
so a kill at a random moment most likely lands mid-write.

Each segment's key encodes its seed (``crash<seed as 8 hex digits>``), and its
KV is drawn from ``expected_layers(seed)``, so the test can check every
committed segment bit for bit. A key is printed (and flushed) only after
``put_segment`` returned, i.e. after its index transaction committed: the
test kills this process with SIGKILL at various points and then checks that
every printed key survived intact.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

N_LAYERS, KV_HEADS, N_TOKENS, HEAD_DIM = 30, 2, 64, 64


def key_for(seed: int) -> str:
    return f"crash{seed:08x}"


def expected_layers(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (KV_HEADS, N_TOKENS, HEAD_DIM)
    return [(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())
            for _ in range(N_LAYERS)]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for an uninstalled checkout
    from kvblend.archive import Archive, SegmentRecord

    path, start = sys.argv[1], int(sys.argv[2])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 1_000_000
    slow_ms = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    if slow_ms:
        import time

        from kvblend.archive import blobs

        write_all = blobs._write_all

        def slow_write_all(fd: int, data: bytes) -> None:
            write_all(fd, data)
            time.sleep(slow_ms / 1000)

        blobs._write_all = slow_write_all
    with Archive.open(path) as archive, archive.writer(wait=10.0):
        for seed in range(start, start + count):
            record = SegmentRecord(key=key_for(seed), token_ids=list(range(N_TOKENS)), text=f"segment {seed}")
            archive.put_segment(record, expected_layers(seed))
            print(key_for(seed), flush=True)


if __name__ == "__main__":
    main()
