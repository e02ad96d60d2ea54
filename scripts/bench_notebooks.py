"""Jupyter notebooks to text (issue 32): kvblend's reading (Python's json: cells, text outputs, no plots) beside
nbconvert's Markdown exporter, the usual alternative, and beside the notebook read as the JSON text it is (what
kvblend did before it knew the format).

Input: a folder of real notebooks (e.g. the *Python Data Science Handbook*'s, chapters 2-4). nbconvert is not a
kvblend dependency: give the Python of a venv that has it (`python -m venv /tmp/nbc && /tmp/nbc/bin/pip install
nbconvert`) and it is timed there, in its own process. Tokens are counted with the default model's tokenizer.
Best of 3 in one process for each converter.

    .venv/bin/python scripts/bench_notebooks.py NOTEBOOK_DIR [--nbconvert-python /tmp/nbc/bin/python]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvblend import conversion  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from benchlib import best_of  # noqa: E402

NBCONVERT = """
import json, sys, time
from pathlib import Path
import nbformat
from nbconvert import MarkdownExporter
files = sorted(Path(sys.argv[1]).glob("*.ipynb"))
exporter = MarkdownExporter()
best, outs = None, {}
for _ in range(3):
    t0 = time.perf_counter()
    outs = {f.name: exporter.from_notebook_node(nbformat.reads(f.read_text(), as_version=4))[0] for f in files}
    best = min(best or 1e9, time.perf_counter() - t0)
print(json.dumps({"seconds": best, "texts": outs}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--nbconvert-python", type=Path, help="a Python with nbconvert installed")
    args = parser.parse_args()
    from kvblend.model import load_model

    files = sorted(args.folder.glob("*.ipynb"))
    if not files:
        sys.exit(f"no .ipynb files in {args.folder}")
    raw = {f.name: f.read_bytes() for f in files}
    best, texts = best_of(3, lambda: {name: conversion.convert("ipynb", data).text for name, data in raw.items()})
    runner = load_model(compute="cpu")

    def tokens(docs: dict[str, str]) -> int:
        return sum(runner.count_tokens(text) for text in docs.values())

    megabytes = sum(len(d) for d in raw.values()) / 1e6
    rows = {
        "as JSON text (before)": {"seconds": None, "tokens": tokens({n: d.decode() for n, d in raw.items()})},
        "kvblend (json)": {"seconds": best, "tokens": tokens(texts), "plots left": 0},
    }
    if args.nbconvert_python:
        out = subprocess.run([str(args.nbconvert_python), "-c", NBCONVERT, str(args.folder)], capture_output=True,
                             text=True, check=True).stdout
        other = json.loads(out)
        joined = "".join(other["texts"].values())
        rows["nbconvert MarkdownExporter"] = {"seconds": other["seconds"], "tokens": tokens(other["texts"]),
                                              "plots left": joined.count("![png]"),
                                              "HTML tables": joined.count("<table")}
    for row in rows.values():
        if row["seconds"] is not None:
            row["ms per MB"] = round(1000 * row["seconds"] / megabytes, 1)
    print(json.dumps({"notebooks": len(files), "MB": round(megabytes, 2), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
