"""Document discovery: walking, text detection, JSON/JSONL records, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvblend.documents import Document, Skipped, content_hash, iter_documents
from kvblend.errors import UsageError
from support import CALIBRATION, DOCS, QUESTIONS


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


def test_directory_walk_is_recursive_sorted_and_skips_hidden(tmp_path):
    root = tmp_path / "kb"
    write(root / "b.md", "B doc")
    write(root / "a.txt", "A doc")
    write(root / "sub" / "z.rst", "Z doc")
    write(root / "sub" / "deeper" / "c.weird", "C doc, any extension")
    write(root / "A-upper.md", "upper")
    write(root / ".git" / "config", "[core]")
    write(root / ".hidden.md", "hidden file")
    write(root / "sub" / ".cache" / "x.md", "hidden dir")
    docs, skipped = iter_documents([root])
    shown = root.as_posix()
    assert [d.path for d in docs] == [
        f"{shown}/A-upper.md",
        f"{shown}/a.txt",
        f"{shown}/b.md",
        f"{shown}/sub/deeper/c.weird",
        f"{shown}/sub/z.rst",
    ]
    assert skipped == []
    assert docs[1].text == "A doc"
    # same call, same answer
    assert iter_documents([root]) == (docs, skipped)


def test_document_hash_is_blake2b_of_text(tmp_path):
    f = write(tmp_path / "x.md", "héllo\n")
    (doc,), _ = iter_documents([f])
    assert doc == Document(f.as_posix(), "héllo\n", content_hash("héllo\n"), name="x.md", format="markdown")
    assert content_hash("a") != content_hash("b")
    assert len(doc.content_hash) == 64
    import hashlib

    assert doc.content_hash == hashlib.blake2b("héllo\n".encode(), digest_size=32).hexdigest()


def test_line_endings_and_bom_are_normalised(tmp_path):
    a = write(tmp_path / "crlf.txt", b"\xef\xbb\xbfone\r\ntwo\rthree\n")
    b = write(tmp_path / "lf.txt", "one\ntwo\nthree\n")
    (da, db), _ = iter_documents([a, b])
    assert da.text == db.text == "one\ntwo\nthree\n"
    assert da.content_hash == db.content_hash


def test_binary_undecodable_empty_are_skipped_with_reasons(tmp_path):
    write(tmp_path / "img.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    write(tmp_path / "noise.txt", bytes(128 + (i * 7919 + 13) % 128 for i in range(4096)))
    write(tmp_path / "empty.md", "")
    write(tmp_path / "blank.md", "  \n\n\t")
    write(tmp_path / "unseen.txt", "\u200b\u200b\ufeff\n\x01\x02\x1b[0m\x1b[2K\n")  # nothing that shows
    write(tmp_path / "ok.md", "fine")
    docs, skipped = iter_documents([tmp_path])
    p = tmp_path.as_posix()
    assert [d.path for d in docs] == [f"{p}/ok.md"]
    assert docs[0].encoding == ""  # UTF-8 is not worth a word
    assert sorted(skipped, key=lambda s: s.path) == [
        Skipped(f"{p}/blank.md", "empty"),
        Skipped(f"{p}/empty.md", "empty"),
        Skipped(f"{p}/img.png", "binary"),
        Skipped(f"{p}/noise.txt", "not UTF-8, and no other text encoding reads it as text"),
        Skipped(f"{p}/unseen.txt", "empty"),
    ]


MENU = "Café menu\n\nThe crème brûlée costs 7 €. Our naïve chef from Zürich bakes bread.\n"


@pytest.mark.parametrize(
    "data, encoding, text",
    [
        (MENU.encode("utf-16"), "utf-16", MENU),  # Notepad's "Unicode", Windows PowerShell's `>`: LE with a BOM
        (b"\xfe\xff" + MENU.encode("utf-16-be"), "utf-16", MENU),
        (MENU.encode("utf-32"), "utf-32", MENU),
        # short Western text ties cp1250 with cp1252 in the detector; cp1250 would read "crčme brűlée naďve"
        (MENU.encode("cp1252"), "cp1252", MENU),
        ("caf\xe9".encode("latin-1"), "cp1252", "café"),
        ("東京の天気は晴れです。明日は雨が降るでしょう。会議は午後三時に始まります。".encode("shift_jis"), "cp932",
         "東京の天気は晴れです。明日は雨が降るでしょう。会議は午後三時に始まります。"),
        ("Москва - столица России. Это крупнейший город страны.".encode("cp1251"), "cp1251",
         "Москва - столица России. Это крупнейший город страны."),
    ],
    ids=["utf-16-le", "utf-16-be", "utf-32", "cp1252", "latin-1", "shift-jis", "cp1251"],
)
def test_text_in_other_encodings_is_read_and_its_encoding_recorded(tmp_path, data, encoding, text):
    f = write(tmp_path / "notes.txt", data.replace(b"\n", b"\r\n") if encoding == "cp1252" else data)
    (doc,), skipped = iter_documents([f])
    assert skipped == []
    assert (doc.text, doc.encoding) == (text, encoding)
    assert doc.content_hash == content_hash(text)  # the same text in UTF-8 is the same document, the same KV


def test_a_saved_web_pages_assets_are_left_out_in_one_line(tmp_path):
    """"Save page as... complete" writes Page.html and Page_files/ (scripts, style sheets, images): the page is
    read, its assets are not (a script would become KV as prose does). A *_files folder without its page is
    an ordinary folder."""
    root = tmp_path / "saved"
    write(root / "Pump guide.html", "<!DOCTYPE html><html><body><h1>Pump guide</h1><p>Prime the casing.</p></body></html>")
    write(root / "Pump guide_files" / "app.js", "function f(){return 1}")
    write(root / "Pump guide_files" / "style.css", "body{margin:0}")
    write(root / "Pump guide_files" / "sub" / "frame.html", "<html><body><p>ad frame</p></body></html>")
    write(root / "minutes_files" / "notes.md", "# Minutes\n\nThe pump was serviced.")
    docs, skipped = iter_documents([root])
    shown = root.as_posix()
    assert [d.path for d in docs] == [f"{shown}/Pump guide.html", f"{shown}/minutes_files/notes.md"]
    assert skipped == [
        Skipped(f"{shown}/Pump guide_files/", f"assets of the saved web page {shown}/Pump guide.html (read from the page)")
    ]


def test_rtf_and_damaged_utf16_are_skipped_not_read_as_text(tmp_path):
    write(tmp_path / "letter.txt", r"{\rtf1\ansi{\fonttbl{\f0 Times;}}\f0 Dear reader,\par}")  # RTF by its content
    write(tmp_path / "half.txt", b"\xff\xfe" + "Half a ".encode("utf-16-le") + b"\x00\xd8")
    docs, skipped = iter_documents([tmp_path])
    p = tmp_path.as_posix()
    assert docs == []
    assert sorted(skipped, key=lambda s: s.path) == [
        Skipped(f"{p}/half.txt", "not valid UTF-16 (damaged text after a UTF-16 byte-order mark)"),
        Skipped(f"{p}/letter.txt", "unsupported format (RTF: save it as .docx or plain text)"),
    ]


def test_permission_denied_is_skipped(tmp_path, monkeypatch):
    secret = write(tmp_path / "secret.md", "top secret")
    write(tmp_path / "open.md", "open")
    real = Path.read_bytes

    def read_bytes(self):
        if self.name == "secret.md":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    docs, skipped = iter_documents([tmp_path])
    assert [d.text for d in docs] == ["open"]
    assert skipped == [Skipped(secret.as_posix(), "permission denied")]


def test_missing_path_is_a_one_line_usage_error(tmp_path):
    write(tmp_path / "a.md", "a")
    with pytest.raises(UsageError) as e:
        iter_documents([tmp_path / "a.md", tmp_path / "nope.md"])
    assert str(e.value) == f"no such file or directory: {(tmp_path / 'nope.md').as_posix()}"
    assert "\n" not in str(e.value)


def test_empty_directory_is_a_usage_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    write(empty / ".git" / "HEAD", "ref")  # hidden content does not count
    with pytest.raises(UsageError, match=r"^no documents found under .*empty$"):
        iter_documents([empty])


def test_jsonl_one_document_per_line(tmp_path):
    lines = [
        json.dumps({"text": "first", "content": "ignored"}),
        json.dumps({"content": "second"}),
        "",
        json.dumps({"body": "third", "text": None}),
        json.dumps({"title": "no text here"}),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"text": "   "}),
        json.dumps({"text": "line\r\nbreaks"}),
    ]
    f = write(tmp_path / "data.jsonl", "\n".join(lines) + "\n")
    docs, skipped = iter_documents([f])
    p = f.as_posix()
    assert [(d.path, d.text) for d in docs] == [
        (f"{p}#L1", "first"),
        (f"{p}#L2", "second"),
        (f"{p}#L4", "third"),
        (f"{p}#L9", "line\nbreaks"),
    ]
    assert [(s.path, s.reason) for s in skipped] == [
        (f"{p}#L5", "no text, content or body field"),
        (f"{p}#L6", "invalid JSON"),
        (f"{p}#L7", "not a JSON object"),
        (f"{p}#L8", "empty"),
    ]
    assert docs[0].content_hash == content_hash("first")


def test_json_list_single_object_or_plain_text(tmp_path):
    lst = write(tmp_path / "list.json", json.dumps([{"text": "one"}, {"x": 1}, {"body": "three"}]))
    obj = write(tmp_path / "obj.json", json.dumps({"content": "single", "id": 7}))
    other = write(tmp_path / "other.json", json.dumps({"name": "config", "n": 3}))
    bad = write(tmp_path / "bad.json", "{ this is not json")
    nums = write(tmp_path / "nums.json", "[1, 2, 3]")
    docs, skipped = iter_documents([lst, obj, other, bad, nums])
    assert [(d.path, d.text) for d in docs] == [
        (f"{lst.as_posix()}#0", "one"),
        (f"{lst.as_posix()}#2", "three"),
        (obj.as_posix(), "single"),
        (other.as_posix(), json.dumps({"name": "config", "n": 3})),
        (bad.as_posix(), "{ this is not json"),
        (nums.as_posix(), "[1, 2, 3]"),
    ]
    assert skipped == [Skipped(f"{lst.as_posix()}#1", "no text, content or body field")]


def test_same_file_twice_is_read_once_and_argument_order_is_kept(tmp_path):
    a = write(tmp_path / "d" / "a.md", "a")
    z = write(tmp_path / "z.md", "z")
    docs, _ = iter_documents([z, tmp_path / "d", a])
    assert [d.text for d in docs] == ["z", "a"]


def test_relative_paths_are_shown_as_given(tmp_path, monkeypatch):
    write(tmp_path / "kb" / "x.md", "x")
    monkeypatch.chdir(tmp_path)
    docs, _ = iter_documents([Path("kb")])
    assert docs[0].path == "kb/x.md"
    docs, _ = iter_documents([Path(".")])
    assert docs[0].path == "kb/x.md"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_is_skipped_not_read(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    docs, skipped = iter_documents([fifo])
    assert docs == [] and skipped == [Skipped(fifo.as_posix(), "not a regular file")]


def test_fixture_docs_are_all_read():
    root = DOCS
    docs, skipped = iter_documents([root])
    assert len(docs) == 12 and skipped == []
    assert all(d.path.endswith(".md") for d in docs)


# ─────────────────────────────── fixtures ───────────────────────────────



def _fixture_docs() -> dict[str, tuple[str, str]]:
    """name -> (title from the '# ' heading, body below it)."""
    out = {}
    for f in sorted(DOCS.glob("*.md")):
        head, body = f.read_text(encoding="utf-8").split("\n", 1)
        assert head.startswith("# ")
        out[f.name] = (head[2:].strip(), body.strip())
    return out


def test_fixture_questions_are_two_hop_and_answerable():
    docs = _fixture_docs()
    questions = json.loads(QUESTIONS.read_text(encoding="utf-8"))
    assert len(questions) >= 10
    for q in questions:
        assert set(q) == {"question", "answers", "docs"}
        assert q["question"].endswith("?")
        a, b = q["docs"]
        assert a != b and a in docs and b in docs
        assert len(q["answers"][0].split()) <= 5  # short canonical answer (aliases may be longer)
        # the (first) answer is stated in one of the two documents, never in the question
        first = q["answers"][0]
        assert any(first in docs[n][1] for n in q["docs"]), q
        assert first.lower() not in q["question"].lower()
    # at least the two-hop pairs differ: no single pair covers most questions
    pairs = {tuple(q["docs"]) for q in questions}
    assert len(pairs) >= 8


def test_fixture_calibration_matches_questions_and_musique_schema():
    docs = _fixture_docs()
    by_title = {title: (name, body) for name, (title, body) in docs.items()}
    assert len(by_title) == len(docs)  # titles are unique
    questions = json.loads(QUESTIONS.read_text(encoding="utf-8"))
    records = json.loads(CALIBRATION.read_text(encoding="utf-8"))
    assert len(records) >= 8 and len(records) == len(questions)
    positions = set()
    for rec, q in zip(records, questions):
        assert set(rec) == {"ctxs", "question", "answers"}
        assert rec["question"] == q["question"] and rec["answers"] == q["answers"]
        assert len(rec["ctxs"]) == 6
        names = []
        for ctx in rec["ctxs"]:
            assert set(ctx) == {"title", "text"}
            name, body = by_title[ctx["title"]]
            assert ctx["text"] == body
            names.append(name)
        assert len(set(names)) == 6
        assert set(q["docs"]) <= set(names)
        positions.add(tuple(names.index(n) for n in q["docs"]))
    assert len(positions) >= 6  # the needed documents move around


def test_names_and_texts_that_are_no_utf8_are_skipped_with_a_reason(tmp_path):
    """A file name with undecodable bytes and a JSON record with a lone surrogate escape: no archive record, manifest
    or printed line can hold them, so they are skipped and named; ingest used to fail after prefilling them."""
    (tmp_path / "good.md").write_text("A good document.")
    with open(os.path.join(os.fsencode(tmp_path), b"bad\xff.md"), "w") as f:
        f.write("Its name is no UTF-8.")
    (tmp_path / "notes.jsonl").write_text('{"text": "fine"}\n{"text": "broken \\ud800 here"}\n')
    docs, skipped = iter_documents([tmp_path])
    assert sorted(d.name for d in docs) == ["good.md", "notes.jsonl#L1"]
    reasons = {s.path.rsplit("/", 1)[-1]: s.reason for s in skipped}
    assert reasons["bad\ufffd.md"].startswith("file name is not valid UTF-8")
    assert "surrogate" in reasons["notes.jsonl#L2"]
    for s in skipped:
        s.path.encode("utf-8")  # printable


def test_a_broken_or_looping_symbolic_link_is_named_as_one(tmp_path):
    (tmp_path / "dead.txt").symlink_to(tmp_path / "gone.txt")
    (tmp_path / "a.txt").symlink_to(tmp_path / "b.txt")
    (tmp_path / "b.txt").symlink_to(tmp_path / "a.txt")
    write(tmp_path / "ok.txt", "fine")
    docs, skipped = iter_documents([tmp_path])
    assert [d.path for d in docs] == [f"{tmp_path.as_posix()}/ok.txt"]
    assert sorted((Path(s.path).name, s.reason) for s in skipped) == [
        ("a.txt", "a broken symbolic link"), ("b.txt", "a broken symbolic link"), ("dead.txt", "a broken symbolic link")]


def test_files_of_one_run_that_would_share_a_name_are_named_by_their_paths(tmp_path, monkeypatch):
    """`ingest docs-2023 docs-2024`: two README.md were two documents named README.md, cited as one source, and
    `show README.md` could only say "ambiguous"."""
    from kvblend.documents import find_files

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "notes.md").write_text(f"notes of {folder}")
    (tmp_path / "a" / "other.md").write_text("other")
    monkeypatch.chdir(tmp_path)
    files, _ = find_files([Path("a"), Path("b")])
    assert [f.name for f in files] == ["a/notes.md", "other.md", "b/notes.md"]  # only those that collide
    files, _ = find_files([Path("a/notes.md"), Path("b/notes.md"), Path("a/other.md")])
    assert [f.name for f in files] == ["a/notes.md", "b/notes.md", "other.md"]  # only those that collide
    files, _ = find_files([tmp_path / "a", tmp_path / "b"])  # given absolute: named below what they share
    assert [f.name for f in files] == ["a/notes.md", "other.md", "b/notes.md"]


def test_a_linked_folder_is_named_as_left_out_and_a_file_gone_since_the_walk_says_so(tmp_path):
    """A symbolic link to a folder is not followed: it was left out in silence ("no documents found" where it
    was all there was). A file deleted between the walk and its turn was "not a regular file", as a FIFO is."""
    from kvblend.documents import find_files, read_file

    write(tmp_path / "elsewhere" / "notes.md", "Notes kept elsewhere.")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "projects").symlink_to(tmp_path / "elsewhere")
    files, skipped = find_files([tmp_path / "docs"])
    assert files == [] and [s.reason for s in skipped] == [
        "a symbolic link to a folder (not followed: give its path to ingest it)"
    ]
    assert skipped[0].path.endswith("docs/projects/")
    victim = write(tmp_path / "docs" / "victim.md", "Soon gone.")
    files, _ = find_files([tmp_path / "docs"])
    victim.unlink()
    reading = read_file(files[0])
    assert reading.docs == [] and [s.reason for s in reading.skipped] == ["no such file (deleted during the ingest?)"]


def test_a_context_file_of_a_format_ingest_converts_is_converted_not_read_raw():
    """query --context-file read a web page's tags, scripts and styles (or a PDF's operators) into the KV, and
    refused a compressed PDF as "binary"; ingest converts them. A scanned PDF says why it has no text."""
    from kvblend.documents import read_user_text

    docs = Path(__file__).resolve().parents[2] / "fixtures" / "documents"
    page = read_user_text(docs / "article.html", "context file", convert=True)
    assert page.strip() and "<" not in page and "function" not in page
    assert "Orca" in read_user_text(docs / "manual.pdf", "context file", convert=True)
    with pytest.raises(UsageError, match="no text layer"):
        read_user_text(docs / "scanned.pdf", "context file", convert=True)
    assert read_user_text(docs / "quickstart.md", "context file", convert=True) == \
        read_user_text(docs / "quickstart.md", "context file")  # text stays as it is
