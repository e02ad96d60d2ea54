"""The command line: one-line errors, non-zero exits, archive left unharmed; ingest incremental."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvblend.defaults import DEFAULT_RATIO
from kvblend.model import quant_kernels
from support import DOCS, FIXTURES, kvblend_script, one_line_error
from support import run_cli as run


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    """A real archive of three fixture documents, built by the real CLI (segments of ~128 tokens)."""
    root = tmp_path_factory.mktemp("cli")
    docs = root / "docs"
    docs.mkdir()
    for name in ("plants.md", "sonar-products.md", "suppliers.md"):
        shutil.copy(DOCS / name, docs / name)
    (docs / "image.bin").write_bytes(bytes(range(256)) * 4)
    proc = run("ingest", docs, "--archive", root / "arc", "--chunk-tokens", "128", "--json", check=True)
    report = json.loads(proc.stdout)
    assert report["documents"] == 3
    assert report["segments_new"] >= 9
    assert any(s["path"].endswith("image.bin") for s in report["skipped"])
    assert "image.bin" in proc.stderr  # the skip is announced
    return root



def test_reingest_unchanged_computes_nothing_and_edit_recomputes_only_its_segments(archive, tmp_path):
    arc = tmp_path / "arc"
    shutil.copytree(archive / "arc", arc)
    again = json.loads(run("ingest", archive / "docs", "--archive", arc, "--chunk-tokens", "128", "--json", check=True).stdout)
    assert again["segments_new"] == 0
    assert again["documents_unchanged"] == 3
    assert again["prefill_seconds"] == 0
    docs = tmp_path / "docs"
    shutil.copytree(archive / "docs", docs)
    plants = docs / "plants.md"
    paragraphs = plants.read_text().split("\n\n")
    middle = len(paragraphs) // 2
    paragraphs[middle] = paragraphs[middle].replace(".", ", as the records show.", 1)
    plants.write_text("\n\n".join(paragraphs))
    edited = json.loads(run("ingest", docs, "--archive", arc, "--chunk-tokens", "128", "--json", check=True).stdout)
    total_segments = edited["segments_new"] + edited["segments_reused"]
    assert 1 <= edited["segments_new"] <= 2
    assert edited["segments_reused"] >= total_segments - 2
    assert run("verify", "--archive", arc).returncode == 0


def test_reingest_unchanged_never_loads_the_model(archive, tmp_path):
    """Unchanged documents are recognised by content hash alone: no model, no tokenizer."""
    from kvblend.pipeline import Engine

    arc = tmp_path / "arc"
    shutil.copytree(archive / "arc", arc)
    with Engine(arc) as engine:
        report = engine.ingest([archive / "docs"], chunk_tokens=128)
        assert engine._runner is None
    assert report.documents_unchanged == 3 and report.segments_new == 0


def test_ingest_dry_run_writes_nothing_and_estimates_what_ingest_then_does(archive, tmp_path):
    """`ingest --dry-run` reads and splits as ingest would, measures one new segment, and writes nothing: not
    to an existing archive (its files byte for byte), and no archive where there is none. The ingest after it
    prefills the segments and tokens it said, and stores the bytes it estimated."""
    arc = tmp_path / "arc"
    shutil.copytree(archive / "arc", arc)

    def files() -> dict:
        return {p: p.read_bytes() for p in sorted(arc.rglob("*")) if p.is_file() and "lock" not in p.name}

    before = files()
    notes = tmp_path / "notes.html"  # converted: a file whose bytes the archive records is not read again
    notes.write_text("<html><body><h1>Harbour notes</h1><p>The Tern-4 sonar left Halifax on the 3rd of May, two "
                     "weeks late, after its housing failed a pressure test at 412 kPa.</p></body></html>")
    asked = (archive / "docs", notes, "--archive", arc, "--chunk-tokens", "128", "--json")
    plan = json.loads(run("ingest", *asked, "--dry-run", check=True).stdout)
    assert files() == before
    assert (plan["documents"], plan["documents_unchanged"], plan["segments_new"]) == (4, 3, 1), plan
    assert plan["sample_tokens"] == plan["tokens_new"] > 0 and plan["estimated_seconds"] > 0 and plan["fits"] is True
    assert any(s["path"].endswith("image.bin") for s in plan["skipped"])
    done = json.loads(run("ingest", *asked, check=True).stdout)
    assert (done["segments_new"], done["tokens_new"]) == (plan["segments_new"], plan["tokens_new"])
    assert abs(done["bytes_written"] - plan["estimated_bytes"]) <= 0.05 * done["bytes_written"], (done, plan)
    # under another codec nothing stored is reusable: every document, the unread HTML too, is new work
    again = json.loads(run("ingest", *asked, "--dry-run", "--codec", "int8", check=True).stdout)
    assert (again["documents"], again["documents_unchanged"]) == (4, 0), again
    assert again["tokens_new"] == again["tokens_total"] == done["tokens_total"] > 0, (again, done)
    fresh = tmp_path / "fresh"
    proc = run("ingest", notes, "--archive", fresh, "--dry-run", check=True)
    assert not fresh.exists()
    assert proc.stdout.startswith("dry run, nothing written: 1 documents (0 unchanged), 1 segments new"), proc.stdout
    assert "would store about" in proc.stdout and "free where the archive is" in proc.stdout, proc.stdout


def test_query_json_and_the_prefix_cache(archive, tmp_path):
    """`query --json` carries every documented field; the instruction prefix is archived by the
    first query and reused by the next, unless `--no-prefix-cache`; `-v` adds the timing table.
    Then `--dtype bf16` over the same archive (ingested in fp32, KV stored fp16): the passages' KV is reused
    (converted), while the instruction prefix, exact KV, is not fp32's: bf16 archives one under its own key and
    reuses that. (One archive, one test: each query is a model load.)"""
    arc = tmp_path / "arc"
    shutil.copytree(archive / "arc", arc)
    question = "Who manages the plant where the Tern-4 sonar is built?"
    # hkvd selects the same tokens with the prefix cached or not; the probe's budget moves with it (test_query.py)
    base = ("query", question, "--archive", arc, "--top-k", "3", "--max-tokens", "4", "--select", "hkvd", "--json")
    first = json.loads(run(*base, "--seed", "7", check=True).stdout)
    for field in ("answer", "mode", "ratio", "ttft_s", "load_wait_s", "prompt_tokens", "recomputed_tokens",
                  "segments", "tokens_per_s", "prefix_cached"):
        assert field in first, field
    # the warning printed on stderr is in the JSON too (a script reading only it never saw one)
    assert any(w.startswith("--seed has no effect at --temperature 0") for w in first["warnings"])
    assert first["mode"] == "blend" and first["ratio"] == DEFAULT_RATIO and not first["prefix_cached"]
    assert len(first["segments"]) == 3 and all(s["cached"] for s in first["segments"])
    assert {"key", "document", "tokens", "cached"} <= set(first["segments"][0])
    # --weights auto with no profile stored: the bundled GGUF's own Q4_1, where kvblend's CPU kernels run it
    assert first["weights"] == ("int4" if quant_kernels.kernels() is not None else "fp32")
    # A query runs on kvblend's own forward pass, tokenizer and embedder: transformers (~5 s to import) is
    # needed only to convert a GGUF the first time, so here a transformers that refuses to import changes nothing.
    poisoned = tmp_path / "poisoned"
    (poisoned / "transformers").mkdir(parents=True)
    (poisoned / "transformers" / "__init__.py").write_text('raise ImportError("transformers was imported")\n')
    second = run(*base, "-v", check=True, env={"PYTHONPATH": str(poisoned)})
    again = json.loads(second.stdout)
    assert again["prefix_cached"] and again["answer"] == first["answer"]
    assert again["recomputed_tokens"] < first["recomputed_tokens"]
    assert "TTFT" in second.stderr and "instruction prefix" in second.stderr
    off = json.loads(run(*base, "--no-prefix-cache", "--enforce-eager", check=True).stdout)  # eager: a no-op here
    assert not off["prefix_cached"] and off["recomputed_tokens"] == first["recomputed_tokens"]

    bf16 = json.loads(run(*base, "--dtype", "bf16", check=True).stdout)
    assert bf16["answer"].strip() and all(s["cached"] for s in bf16["segments"])
    assert not bf16["prefix_cached"]  # the fp32 prefix is not bf16's: it computes (and archives) its own
    bf16_again = json.loads(run(*base, "--dtype", "bf16", check=True).stdout)
    assert bf16_again["prefix_cached"] and bf16_again["answer"] == bf16["answer"]


def test_ls_stats_show_json(archive):
    arc = archive / "arc"
    docs = json.loads(run("ls", "--archive", arc, "--json", check=True).stdout)
    assert len(docs) == 3 and all(d["segments"] >= 2 and d["bytes"] > 0 for d in docs)
    stats = json.loads(run("stats", "--archive", arc, "--json", check=True).stdout)
    assert stats["segments"] >= 9
    key = json.loads(run("show", docs[0]["path"], "--archive", arc, "--json", check=True).stdout)["segments"][0]
    seg = json.loads(run("show", key[:10], "--archive", arc, "--json", check=True).stdout)
    assert seg["key"] == key and len(seg["layer_bytes"]) == 30
    assert run("path", "--archive", arc, check=True).stdout.strip() == str(arc)


def test_verify_names_corrupt_blob_and_repair_fixes_it(archive, tmp_path):
    arc = tmp_path / "arc"
    shutil.copytree(archive / "arc", arc)
    docs = json.loads(run("ls", "--archive", arc, "--json").stdout)
    key = json.loads(run("show", docs[0]["path"], "--archive", arc, "--json").stdout)["segments"][0]
    seg = json.loads(run("show", key, "--archive", arc, "--json").stdout)
    blob = arc / seg["blob"]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    bad = run("verify", "--archive", arc)
    assert bad.returncode == 1 and key in bad.stderr
    assert run("verify", "--repair", "--archive", arc).returncode == 0
    assert run("verify", "--archive", arc).returncode == 0


def test_bad_input_is_one_line_and_leaves_archive_unharmed(archive, tmp_path):
    arc = tmp_path / "arc"
    shutil.copytree(archive / "arc", arc)
    snapshot = {p: p.read_bytes() for p in sorted(arc.rglob("*")) if p.is_file() and "lock" not in p.name}
    assert "no such file" in one_line_error(run("ingest", tmp_path / "missing", "--archive", arc))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no documents" in one_line_error(run("ingest", empty, "--archive", arc))
    binaries = tmp_path / "binaries"
    binaries.mkdir()
    (binaries / "blob.bin").write_bytes(bytes(range(256)))
    assert "no readable text documents" in one_line_error(run("ingest", binaries, "--archive", arc))
    assert "batch-tokens" in one_line_error(run("ingest", archive / "docs", "--archive", arc, "--batch-tokens", "0"))
    assert "chunk-tokens" in one_line_error(run("ingest", archive / "docs", "--archive", arc, "--chunk-tokens", "0"))
    assert "no such document" in one_line_error(run("query", "q?", "--doc", "nope.md", "--archive", arc))
    assert "top-k" in one_line_error(run("query", "q?", "--top-k", "0", "--archive", arc))
    assert "ratio" in one_line_error(run("query", "q?", "--ratio", "0", "--archive", arc))
    assert "mode" in one_line_error(run("query", "q?", "--mode", "fast", "--archive", arc))
    assert "no archive" in one_line_error(run("query", "q?", "--archive", tmp_path / "nowhere"))
    assert "not a size" in one_line_error(run("gc", "--max-size", "lots", "--archive", arc))
    assert "no such document" in one_line_error(run("rm", "nope.md", "--archive", arc))
    after = {p: p.read_bytes() for p in sorted(arc.rglob("*")) if p.is_file() and "lock" not in p.name}
    assert [p for p in snapshot if p.suffix != ".mdb"] == [p for p in after if p.suffix != ".mdb"]
    assert all(snapshot[p] == after[p] for p in snapshot if p.suffix != ".mdb")
    assert run("verify", "--archive", arc).returncode == 0


def test_archive_of_another_model_is_refused_with_both_names(archive, tmp_path):
    import torch
    import transformers as tf

    other = tmp_path / "tiny-llama"
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=49152, architectures=["LlamaForCausalLM"])
    tf.LlamaForCausalLM(cfg).save_pretrained(other)
    msg = one_line_error(run("query", "q?", "--model", other, "--archive", archive / "arc"))
    assert "SmolLM2-135M-Instruct" in msg and "tiny-llama" in msg
    # a dry run says so too, rather than plan an ingest the archive would refuse
    msg = one_line_error(run("ingest", archive / "docs", "--model", other, "--archive", archive / "arc", "--dry-run"))
    assert "SmolLM2-135M-Instruct" in msg and "tiny-llama" in msg


def test_demo_on_an_archive_of_another_model_suggests_what_the_demo_takes(tmp_path):
    """The model-mismatch hint said "pass --model ...", which the demo does not take (it runs the default model)."""
    from kvblend.archive import Archive

    with Archive.open(tmp_path / "gemma", create=True, model_name="gemma3-270m", model_fingerprint="fp-gemma"):
        pass  # bound to another model on its first writable open
    proc = run("demo", "--archive", tmp_path / "gemma")
    line = proc.stderr.strip().splitlines()[-1]  # after the demo's stage line
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and line.startswith("kvblend: error:")
    assert "gemma3-270m" in line and "another --archive" in line and "--model" not in line


def test_newer_format_version_is_refused(archive, tmp_path):
    import lmdb

    arc = tmp_path / "arc"
    shutil.copytree(archive / "arc", arc)
    env = lmdb.open(str(arc / "index"), max_dbs=16)
    with env.begin(write=True) as txn:  # as a future kvblend would have written it
        txn.put(b"format_version", b"99", db=env.open_db(b"meta", txn=txn))
    env.close()
    assert "newer" in one_line_error(run("ls", "--archive", arc))


def test_gc_dry_run_then_max_size_evicts(archive, tmp_path):
    arc = tmp_path / "arc"
    shutil.copytree(archive / "arc", arc)
    dry = json.loads(run("gc", "--max-size", "1MB", "--dry-run", "--archive", arc, "--json", check=True).stdout)
    assert dry["freed_bytes"] > 0 and dry["evicted"]
    assert json.loads(run("stats", "--archive", arc, "--json").stdout)["segments"] >= 9  # dry run kept all
    human = run("gc", "--max-size", "1MB", "--dry-run", "--archive", arc, check=True).stdout
    assert f"{len(dry['incomplete_documents'])} documents would be incomplete" in human  # JSON-only before
    real = json.loads(run("gc", "--max-size", "1MB", "--archive", arc, "--json", check=True).stdout)
    assert real["evicted"] == dry["evicted"] and real["incomplete_documents"] == dry["incomplete_documents"]
    stats = json.loads(run("stats", "--archive", arc, "--json").stdout)
    assert stats["stored_bytes"] <= 1_000_000
    assert run("verify", "--archive", arc).returncode == 0


def test_kill_9_during_real_ingest_loses_nothing_committed(tmp_path):
    """`kvblend ingest` (each batch stored on a background thread while the next prefills)
    killed with SIGKILL mid-run, at and between commits: each time the archive opens, `verify`
    passes, every document lists only complete, retrievable segments, and a final run completes
    what was left without redoing what was committed."""
    import signal
    import time

    from kvblend.archive import Archive
    from kvblend.errors import ArchiveError

    docs = tmp_path / "docs"
    docs.mkdir()
    for name in sorted(p.name for p in DOCS.glob("*.md"))[:4]:  # ~1,900 tokens: 5-6 batches, 2 of them killed
        shutil.copy(DOCS / name, docs / name)
    arc = tmp_path / "arc"
    args = [*kvblend_script(), "ingest", str(docs), "--archive", str(arc), "--chunk-tokens", "96",
            "--batch-tokens", "384", "--json"]

    def committed() -> set[str]:
        try:
            with Archive.open(arc, create=False, readonly=True) as ar:
                return {s.key for s in ar.iter_segments()}
        except ArchiveError:  # not created yet by the ingest under test
            return set()

    seen: set[str] = set()
    # right after a commit, then inside the next batch (each kill costs a model load: two points, not more)
    for extra_delay in (0.0, 0.6):
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 240
        while len(committed()) <= len(seen) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(extra_delay)
        assert proc.poll() is None, "ingest finished before the kill: nothing was tested"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        check = run("verify", "--archive", arc, "--json")
        assert check.returncode == 0, check.stdout + check.stderr
        with Archive.open(arc, create=False, readonly=True) as ar:
            keys = {s.key for s in ar.iter_segments()}
            for doc in ar.iter_documents():
                assert set(doc.segment_keys) <= keys, doc.path
            embedded, _ = ar.get_embeddings(keys)
            assert set(embedded) == keys  # committed with its segment: retrieval sees every one
        assert seen <= keys  # a restart never loses what an earlier run committed
        seen = keys
    final = run("ingest", docs, "--archive", arc, "--chunk-tokens", "96", "--json", check=True)
    report = json.loads(final.stdout)
    assert report["documents"] == len(list(docs.iterdir()))
    assert report["segments_reused"] >= len(seen)  # committed work was not redone
    assert run("verify", "--archive", arc).returncode == 0


def in_a_terminal(*args: object, timeout: float = 300) -> tuple[int, str]:
    """Run the installed `kvblend ARGS` with its output on a pseudo-terminal, as a user at a shell sees it (the
    progress bars draw only there); its exit status and everything it wrote."""
    import os
    import pty
    import select
    import time

    main, child = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "CI"}  # bars are off on CI; this is a user's terminal
    proc = subprocess.Popen([*kvblend_script(), *map(str, args)], stdin=child, stdout=child, stderr=child, env=env)
    os.close(child)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([main], [], [], 1)[0]:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal closed: the process has gone
                break
            if not chunk:
                break
            chunks.append(chunk)
        elif proc.poll() is not None:
            break
    os.close(main)
    return proc.wait(60), b"".join(chunks).decode(errors="replace")


def test_ingest_in_a_terminal_shows_its_progress_file_by_file_and_its_summary(tmp_path):
    """The bar a user sees: files read and prefilled as the ingest goes (converting a folder of PDFs takes a
    while), the file being read, then the summary; and on a second run, documents known unchanged."""
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(DOCS / "plants.md", docs / "plants.md")
    shutil.copy(FIXTURES / "documents" / "manual.pdf", docs / "manual.pdf")
    for expect in ("(0 unchanged)", "(2 unchanged)"):
        code, shown = in_a_terminal("ingest", docs, "--archive", tmp_path / "arc", "--compute", "cpu")
        assert code == 0 and "Traceback" not in shown, shown
        assert "ingest" in shown and "files" in shown and f"2 documents {expect}" in shown, shown
