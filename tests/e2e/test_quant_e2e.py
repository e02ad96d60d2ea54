"""Lossy codecs end to end with the real model and the installed CLI: ingest with int4, a lossless context
file stored beside it, verify and stats per codec, a damaged int4 blob found by `verify` and recomputed by
`query`, then a re-ingest with lossless (new segments, the document moved over, the int4 ones gone)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support import DOCS, run_cli as run


def _flip_layer_byte(arc: Path, key: str, layer: int) -> None:
    show = json.loads(run("show", key, "--archive", arc, "--json", check=True).stdout)
    blob = arc / show["blob"]
    data = bytearray(blob.read_bytes())
    offset = sum(show["layer_bytes"][:layer]) + show["layer_bytes"][layer] // 2
    data[offset] ^= 0xFF
    blob.write_bytes(bytes(data))


def test_int4_archive_mixes_with_lossless_and_survives_a_damaged_blob(tmp_path):
    docs, arc = tmp_path / "docs", tmp_path / "arc"
    docs.mkdir()
    shutil.copy(DOCS / "plants.md", docs / "plants.md")
    ingest = ("ingest", docs, "--archive", arc, "--chunk-tokens", "128", "--json")
    first = json.loads(run(*ingest, "--codec", "int4", check=True).stdout)
    n = first["segments_new"]
    assert n >= 2 and first["bytes_written"] < 0.4 * first["raw_bytes"]  # the 0.30x target is a benchmark (BENCHMARKS.md), not a test
    again = json.loads(run(*ingest, "--codec", "int4", check=True).stdout)
    assert again["documents_unchanged"] == 1 and again["segments_new"] == 0

    # A mixed archive: a lossless context file stored beside the int4 document.
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("The Tern-4 sonar is assembled in the Harwick plant, managed by Ada Ruiz.\n")
    question = ("query", "Who manages the plant where the Tern-4 sonar is built?", "--archive", arc,
                "--doc", docs / "plants.md", "--context-file", ctx, "--store", "--max-tokens", "4", "--json")
    answer = json.loads(run(*question, check=True).stdout)
    assert answer["answer"].strip() and not answer["warnings"]
    stats = json.loads(run("stats", "--archive", arc, "--json", check=True).stdout)
    assert {"int4", "zstd-shuffle"} <= set(stats["bytes_per_token_by_codec"])
    assert stats["bytes_per_token_by_codec"]["int4"] < 0.30 * stats["bytes_per_token_raw"]
    verified = json.loads(run("verify", "--deep", "--archive", arc, "--json", check=True).stdout)
    assert verified["ok"] and verified["codecs"]["int4"] == n

    # A bit flip in an int4 blob: verify names the segment, query warns and recomputes it.
    key = answer["segments"][0]["key"]
    _flip_layer_byte(arc, key, 3)
    proc = run("verify", "--archive", arc, "--json")
    assert proc.returncode == 1 and {p["segment"] for p in json.loads(proc.stdout)["problems"]} == {key}
    damaged = json.loads(run(*question, check=True).stdout)
    assert damaged["answer"].strip()
    assert any(key[:12] in w and "recomput" in w for w in damaged["warnings"])
    assert run("verify", "--archive", arc).returncode == 0  # stored again under its own key, as int4
    assert not json.loads(run(*question, check=True).stdout)["warnings"]

    # Another kind of codec: new segments (own keys); the document now points at them; the int4 ones go
    # (the lossless context file stays).
    moved = json.loads(run(*ingest, "--codec", "lossless", check=True).stdout)
    assert moved["segments_new"] == n and moved["documents_unchanged"] == 0
    stats = json.loads(run("stats", "--archive", arc, "--json", check=True).stdout)
    assert set(stats["bytes_per_token_by_codec"]) == {"zstd-shuffle"}
    assert run("verify", "--archive", arc).returncode == 0
