"""Hardening with the real default model: query on a read-only archive, a lost index rebuilt and queried,
a corrupted index met by query, ingest and query whatever LMDB engine the environment names, and a failed
model load that leaves a new archive unbound."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

# The archive test helpers live beside the unit tests; pytest puts that folder on the path only
# when it collects from it, so an e2e-only run adds it here.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))

from hardening_helpers import (  # noqa: E402
    home_for, index_pages, public_dir, readonly_tree, run_as, seed_model_cache, snapshot,
)
from support import DOCS, one_line_error, run_cli  # noqa: E402

QUESTION = "Who manages the plant where the Tern-4 sonar is built?"
NAMES = ("plants.md", "sonar-products.md")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """An archive of two fixture documents, ingested by the real CLI."""
    root = tmp_path_factory.mktemp("hard")
    docs = root / "docs"
    docs.mkdir()
    for name in NAMES:
        shutil.copy(DOCS / name, docs / name)
    run_cli("ingest", docs, "--archive", root / "arc", "--chunk-tokens", "128", check=True)
    return root / "arc"


@pytest.fixture(scope="module")
def first_answer(built, tmp_path_factory) -> dict:
    """`query --no-prefix-cache` on an untouched copy of `built`: the answer the damaged copies must give again
    once rebuilt (computed once for the module; each model load costs seconds)."""
    arc = tmp_path_factory.mktemp("hard-first") / "arc"
    shutil.copytree(built, arc)
    return json.loads(_query(arc, "--no-prefix-cache", check=True).stdout)


def _query(arc, *extra, runner=run_cli, **kwargs):
    return runner("query", QUESTION, "--archive", arc, "--top-k", "3", "--max-tokens", "4", "--json", *extra, **kwargs)


def test_query_on_an_archive_the_user_cannot_write(built, default_runner):
    with public_dir() as base:
        arc = base / "arc"
        shutil.copytree(built, arc)
        with readonly_tree(arc) as user:
            before = snapshot(arc)
            home = home_for(user, base)
            seed_model_cache(user, home, default_runner)
            proc = _query(arc, runner=lambda *a: run_as(user, *a, timeout=600, home=home))
            assert proc.returncode == 0, proc.stderr
            result = json.loads(proc.stdout)
            assert result["segments"] and all(s["cached"] for s in result["segments"])
            # a new passage to --store: answered from the prompt, nothing stored (it failed the whole query)
            (base / "ctx.txt").write_text("A brand new passage about the Wren tram, which leaves at 11:05.")
            (base / "ctx.txt").chmod(0o644)
            proc = _query(arc, "--context-file", base / "ctx.txt", "--store",
                          runner=lambda *a: run_as(user, *a, timeout=600, home=home))
            assert proc.returncode == 0 and "--store skipped" in proc.stderr, proc.stderr
            assert not any(s.get("stored") for s in json.loads(proc.stdout)["segments"])
            assert snapshot(arc) == before  # no usage counts, no prefix stored: nothing written


def test_lost_index_rebuilt_then_query_answers_the_same(built, first_answer, tmp_path):
    arc = tmp_path / "arc"
    shutil.copytree(built, arc)
    first = first_answer
    (arc / "index" / "data.mdb").unlink()
    line = one_line_error(_query(arc))
    assert "damaged" in line and "--rebuild-index" in line
    rebuilt = json.loads(run_cli("verify", "--rebuild-index", "--archive", arc, "--json", check=True).stdout)
    assert rebuilt["documents_restored"] == 2 and not rebuilt["incomplete_documents"] and not rebuilt["lost_blobs"]
    again = _query(arc, "--no-prefix-cache", check=True)
    result = json.loads(again.stdout)
    assert result["answer"] == first["answer"] and [s["key"] for s in result["segments"]] == \
        [s["key"] for s in first["segments"]]
    assert all(s["cached"] for s in result["segments"])  # embeddings and KV came back from the blobs


def test_garbled_index_pages_are_one_line_for_query_and_the_rebuild_answers_again(built, first_answer, tmp_path):
    """The corruption users hit: bytes 16..4095 of index pages overwritten. LMDB followed the garbage and `query`
    died of SIGBUS after its first token (the usage-count write); now it stops at once in one line, names the
    repair, and after `verify --rebuild-index` answers as before."""
    arc = tmp_path / "arc"
    shutil.copytree(built, arc)
    first = first_answer
    data = arc / "index" / "data.mdb"
    with open(data, "r+b") as f:
        for page in index_pages(data)[0][1:]:  # every tree page but the main tree's root
            f.seek(page * 4096 + 16)
            f.write(b"\xff" * (4096 - 16))
    proc = _query(arc)
    line = one_line_error(proc)
    assert proc.returncode > 0 and "damaged" in line and "--rebuild-index" in line
    run_cli("verify", "--rebuild-index", "--archive", arc, check=True)
    again = _query(arc, "--no-prefix-cache", check=True)
    assert json.loads(again.stdout)["answer"] == first["answer"]


@pytest.mark.parametrize("engine", ["0", "1"])
def test_ingest_and_query_whatever_lmdb_engine_the_environment_names(built, tmp_path, engine):
    """With LMDB_DEFAULT_LIB_VERSION=1 the first `kvblend ingest` into a new archive failed ("meta page 0 is not
    an LMDB meta page") and every later command called the archive damaged (issue 35). The index's engine is now
    pinned: ingest and query work with either value set, on a new archive and on one built without it."""
    env = {"LMDB_DEFAULT_LIB_VERSION": engine}
    arc = tmp_path / "arc"
    proc = run_cli("ingest", built.parent / "docs" / NAMES[1], "--archive", arc, "--chunk-tokens", "128", env=env)
    assert proc.returncode == 0 and "damaged" not in proc.stderr, proc.stderr
    for archive in (arc, built):
        proc = _query(archive, "--no-prefix-cache", runner=lambda *a: run_cli(*a, env=env))
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["segments"]


def test_failed_model_load_leaves_a_new_archive_unbound(built, tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file" * 20)
    arc = tmp_path / "new"
    docs = built.parent / "docs"
    one_line_error(run_cli("ingest", docs / NAMES[0], "--model", garbage, "--archive", arc))
    # was: "was built with model garbage"
    run_cli("ingest", docs / NAMES[0], "--archive", arc, "--chunk-tokens", "128", check=True)
