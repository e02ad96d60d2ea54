"""Mailboxes to text (issue 32): a mailing list's folder as an mbox, read by kvblend (each message as an .eml is
read, under its subject, attachments read) against the same file read as plain text (what kvblend did before it
knew the format): time, and tokens by the default model's tokenizer.

The folder: 200 messages written by Python's `mailbox` and `email` packages, as Thunderbird or Mailman keep
them. Their bodies are the README files of this machine's /usr/share/doc (the bundled documents where there are
none), quoted-printable as mail clients send non-ASCII text; every other one is a reply quoting the message
before; every fourth carries an HTML alternative; every tenth an attachment, in turn a fixture PDF, DOCX, XLSX
and PPTX. Best of 5.

    .venv/bin/python scripts/bench_mailbox.py
"""

from __future__ import annotations

import json
import mailbox
import sys
import tempfile
from email.message import EmailMessage
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvblend import conversion  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from benchlib import best_of  # noqa: E402

ATTACHMENTS = [
    ("manual.pdf", "application", "pdf"),
    ("report.docx", "application", "vnd.openxmlformats-officedocument.wordprocessingml.document"),
    ("budget.xlsx", "application", "vnd.openxmlformats-officedocument.spreadsheetml.sheet"),
    ("briefing.pptx", "application", "vnd.openxmlformats-officedocument.presentationml.presentation"),
]


def bodies() -> list[tuple[str, str]]:
    found = sorted(Path("/usr/share/doc").glob("*/README*"))
    texts = [(p.parent.name, p.read_text(errors="replace")[:6000]) for p in found if p.is_file() and p.suffix != ".gz"]
    if not texts:
        texts = [(p.stem, p.read_text()) for p in sorted((ROOT / "kvblend" / "data" / "docs").iterdir())]
    return [(name, text) for name, text in texts if text.strip()]


def folder(path: Path, n: int = 200) -> Path:
    texts, box = bodies(), mailbox.mbox(path)
    previous = ""
    for i in range(n):
        name, text = texts[i % len(texts)]
        msg = EmailMessage()
        msg["From"] = f"Member {i % 7} <m{i % 7}@lists.example>"
        msg["To"] = "dev@lists.example"
        msg["Date"] = f"Tue, {1 + i % 28:02d} Sep 2026 {i % 24:02d}:{i % 60:02d}:00 +0000"
        if i % 2 and previous:
            msg["Subject"] = f"Re: {name}"
            quoted = "\n".join("> " + line for line in previous.splitlines()[:40])
            body = f"Thanks, see below.\n\n{quoted}\n"
        else:
            msg["Subject"] = f"About {name}"
            body = text
        msg.set_content(body, cte="quoted-printable")
        if i % 4 == 0:
            paragraphs = "".join(f"<p>{p}</p>" for p in body.split("\n\n")[:20])
            msg.add_alternative(f"<html><body>{paragraphs}</body></html>", subtype="html")
        if i % 10 == 0:
            file, maintype, subtype = ATTACHMENTS[(i // 10) % len(ATTACHMENTS)]
            data = (ROOT / "fixtures" / "documents" / file).read_bytes()
            msg.add_attachment(data, maintype=maintype, subtype=subtype, filename=file)
        box.add(msg)
        previous = body
    box.flush()
    box.close()
    return path


def main() -> None:
    from kvblend.model import load_model

    with tempfile.TemporaryDirectory() as tmp:
        data = folder(Path(tmp) / "dev.mbox").read_bytes()
    best, text = best_of(5, lambda: conversion.convert("mbox", data).text)
    runner = load_model(compute="cpu")
    print(
        json.dumps(
            {
                "messages": 200,
                "bytes": len(data),
                "kvblend ms": round(1000 * best, 1),
                "ms per MB": round(1000 * best / (len(data) / 1e6)),
                "tokens as text": runner.count_tokens(data.decode("utf-8", "replace")),
                "tokens converted": runner.count_tokens(text),
                "message headings": sum(1 for line in text.splitlines() if line.startswith("# ")),
                "attachments read": text.count("## Attachment: "),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
