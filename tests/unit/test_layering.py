"""The architecture as the README draws it: one-way imports, and a CLI that starts without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

PACKAGE = REPO / "kvblend"
# Each layer may import only layers with a lower rank (and itself). README, "How it is built".
RANK = {
    "cli": 8, "serve": 7, "tuning": 6, "evaluation": 5, "pipeline": 4,
    "fusion": 3, "generation": 3, "prompt": 3, "retrieval": 3, "documents": 3, "segmenter": 3, "provenance": 3,
    "feeds": 2, "conversion": 2, "archive": 1, "model": 1,
    "options": 0.5, "types": 0, "defaults": 0, "errors": 0, "machine": 0, "data": 0,
}
# generation decodes a FusionResult; provenance names sections by the segmenter's headings
SIBLINGS_ALLOWED = {("generation", "fusion"), ("fusion", "prompt"), ("provenance", "segmenter")}


def kvblend_imports(path: Path) -> list[tuple[str, int]]:
    """Every `kvblend.X...` module the file imports (at any depth: local imports count too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvblend."):
            found.append((node.module.split(".")[1], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name.split(".")[1], node.lineno) for a in node.names if a.name.startswith("kvblend.")]
    return found


def layer_of(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def test_every_module_is_ranked():
    layers = {layer_of(p) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE}
    assert layers <= set(RANK), layers - set(RANK)


def test_no_module_imports_a_layer_above_it():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent == PACKAGE and path.name == "__init__.py":
            continue  # the public API re-exports from every layer, lazily
        me = layer_of(path)
        for other, line in kvblend_imports(path):
            if other != me and RANK[other] >= RANK[me] and (me, other) not in SIBLINGS_ALLOWED:
                upward.append(f"{path.relative_to(REPO)}:{line} imports kvblend.{other}")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("argv", [["--help"], ["ls", "--archive", "/nonexistent/kvblend"], ["path", "--json"],
                                  ["query", "--help"], ["serve", "--help"]])
def test_commands_that_touch_no_model_never_import_torch(argv):
    code = (f"import sys\nsys.argv = ['kvblend', *{argv!r}]\nfrom kvblend.cli.main import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'matplotlib', 'fastapi') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in proc.stdout, proc.stdout + proc.stderr
