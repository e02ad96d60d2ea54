"""Transcripts to text (issue 32): an hour's meeting as WebVTT, read by kvblend (webvtt-py: paragraphs by speaker
under a time heading every two minutes) against the same file read as plain text (what kvblend did before it
knew the format): time, and tokens by the default model's tokenizer.

The meeting: 1,200 captions of 8 words (dpkg's triggers spec, as speech), 3 s each, two speakers taking turns
every 45 s, as Teams and Zoom export one (cue numbers, timings, `<v Name>` voices). Best of 5.

    .venv/bin/python scripts/bench_transcripts.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvblend import conversion  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from benchlib import best_of  # noqa: E402

SPEECH = Path("/usr/share/doc/dpkg/spec/triggers.txt")


def clock(t: float) -> str:
    return f"{int(t) // 3600:02d}:{int(t) % 3600 // 60:02d}:{t % 60:06.3f}"


def meeting(seconds: float = 3600.0) -> bytes:
    words = SPEECH.read_text().split() if SPEECH.is_file() else ("the pump is rated at 412 kPa " * 100).split()
    cues, t, w = [], 0.0, 0
    while t < seconds:
        text = " ".join(words[w % len(words) : w % len(words) + 8])
        w += 8
        who = "Ana Ruiz" if (t // 45) % 2 else "Ben Ode"
        cues.append(f"{len(cues) + 1}\n{clock(t)} --> {clock(t + 3.0)}\n<v {who}>{text}\n")
        t += 3.0
    return ("WEBVTT\n\n" + "\n".join(cues)).encode()


def main() -> None:
    from kvblend.model import load_model

    vtt = meeting()
    best, text = best_of(5, lambda: conversion.convert("vtt", vtt).text)
    runner = load_model(compute="cpu")
    print(
        json.dumps(
            {
                "bytes": len(vtt),
                "webvtt-py ms": round(1000 * best, 1),
                "ms per MB": round(1000 * best / (len(vtt) / 1e6)),
                "tokens as text": runner.count_tokens(vtt.decode()),
                "tokens converted": runner.count_tokens(text),
                "sections": text.count("## "),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
