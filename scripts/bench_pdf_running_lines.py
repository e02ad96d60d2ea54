"""What dropping running headers, footers and page numbers takes out of real PDFs (issue 32).

    python scripts/bench_pdf_running_lines.py FILE.pdf [...]

For each PDF: pages, characters and lines of kvblend's text with and without
`conversion._drop_running_lines`, the lines it took out (most frequent first),
and the time that step costs, best of 5.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

from kvblend import conversion


def main(paths: list[str]) -> None:
    keep_all = conversion._drop_running_lines
    for path in paths:
        data = Path(path).read_bytes()
        conversion._drop_running_lines = lambda pages, keep=None: (pages, set())  # type: ignore[assignment]
        try:
            before = conversion.convert("pdf", data)
        finally:
            conversion._drop_running_lines = keep_all
        after = conversion.convert("pdf", data)
        pages = [before.text[s:e] for s, e in zip(before.page_starts, [*before.page_starts[1:], len(before.text)])]
        best = min(_timed(lambda: keep_all([p.strip() for p in pages])) for _ in range(5))
        gone = collections.Counter(before.text.split("\n")) - collections.Counter(after.text.split("\n"))
        print(f"{path}: {len(pages)} pages, {len(before.text):,} -> {len(after.text):,} characters "
              f"({1 - len(after.text) / len(before.text):.1%} less), {sum(gone.values())} lines dropped, "
              f"{best * 1000:.2f} ms")
        for line, n in gone.most_common(6):
            print(f"    {n} x {line!r}")


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


if __name__ == "__main__":
    main(sys.argv[1:])
