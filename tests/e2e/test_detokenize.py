"""The output processor on the default model's real tokenizer: tokenizers' DecodeStream streams whole
characters only, and its pieces join to exactly what decoding the whole answer gives (multibyte text, emoji,
a character cut by the token limit, a stop string after multibyte text)."""

from __future__ import annotations

import pytest
import torch

from kvblend.generation import OutputParams, SamplingConfig, Sequence

TEXTS = ["Héllo wörld — naïve café 東京タワー 🚀🎉 👨‍👩‍👧 emoji! ✓", "日本語のテキストと😀混ざった", " Ærøskøbing Ωμέγα ∑ ∫ ½ €"]


def stream(runner, tokens: list[int], **params) -> tuple[Sequence, list[str]]:
    """The tokens teacher-forced through a Sequence (no model step: the logits are not read)."""
    seq = Sequence(runner, None, OutputParams(SamplingConfig(), forced_tokens=tuple(tokens), **params))  # type: ignore[arg-type]
    logits = torch.zeros(len(runner.tokenizer))
    pieces = []
    while not seq.finished:
        pieces.append(seq.accept(logits).text)
    return seq, pieces


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_are_whole_characters_and_join_to_the_whole_decode(default_runner, text):
    tok = default_runner.tokenizer
    tokens = tok.encode(text, add_special_tokens=False)
    seq, pieces = stream(default_runner, tokens)
    assert "".join(pieces) == tok.decode(tokens, skip_special_tokens=True) == text == seq.text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # some character spans tokens: held back until its last byte came


def test_a_character_cut_by_the_token_limit_ends_the_answer_as_the_whole_decode_does(default_runner):
    tok = default_runner.tokenizer
    tokens = tok.encode("Go 🚀", add_special_tokens=False)
    cut = next(n for n in range(1, len(tokens)) if tok.decode(tokens[:n]).endswith("\ufffd"))
    seq, pieces = stream(default_runner, tokens[:cut])
    assert seq.finish == "length" and seq.text == tok.decode(tokens[:cut]) == "".join(pieces)
    assert seq.text.endswith("\ufffd") and not any("\ufffd" in p for p in pieces[:-1])


def test_a_stop_string_after_multibyte_text_cuts_it_there(default_runner):
    tok = default_runner.tokenizer
    tokens = tok.encode("Café ☕ au lait. Fin", add_special_tokens=False)
    seq, pieces = stream(default_runner, tokens, stop=(" au",))
    assert seq.finish == "stop" and seq.text == "Café ☕" == "".join(pieces)
