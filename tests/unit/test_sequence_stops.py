"""The output processor's stop strings (kvblend.generation.sequence): what a stream sends is what the answer
holds, whatever min_tokens says. No model: tokens are forced, the text comes from a stub vocabulary."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvblend.generation.sequence import OutputParams, Sequence

VOCAB = ["<eos>", "D", "r", "ones", " fly", "."]


class Vocab:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == 0))


def run(tokens: list[int], stop: tuple[str, ...], min_tokens: int = 0) -> tuple[str, str]:
    """(what the stream sent, the answer's text) for forced `tokens`."""
    runner = SimpleNamespace(tokenizer=Vocab(), stop_token_ids={0})
    seq = Sequence(runner, None, OutputParams(stop=stop, min_tokens=min_tokens, forced_tokens=tuple(tokens)))
    sent = ""
    while not seq.finished:
        sent += seq.accept(torch.zeros(len(VOCAB))).text
    return sent, seq.text


@pytest.mark.parametrize("min_tokens", [0, 1, 2])
def test_a_stop_string_ending_at_min_tokens_cuts_what_was_never_sent(min_tokens):
    """"Dr" ends at the second token. Before min_tokens nothing can stop the answer, but the "D" that may begin a
    stop string is held back all the same, so the cut never takes back sent text (it sent "D" before)."""
    sent, text = run([1, 2, 3, 4], ("Dr",), min_tokens)
    assert (sent, text) == ("", "")


def test_a_stop_string_wholly_before_min_tokens_is_no_stop_and_is_sent():
    sent, text = run([1, 2, 3, 4, 5], ("Dr",), min_tokens=3)
    assert sent == text == "Drones fly."


def test_a_stop_string_after_min_tokens_cuts_and_the_stream_matches():
    sent, text = run([1, 2, 3, 4, 5], (" fly",), min_tokens=1)
    assert sent == text == "Drones"


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logits_that_are_not_finite_are_one_line_not_an_empty_answer(temperature):
    """Gemma 3 under --dtype fp16 overflows to NaN: greedy read NaN as token 0 and answered "" (exit 0), and
    sampling ended in torch's "probability tensor contains either inf, nan" traceback."""
    from kvblend.errors import NonFiniteLogitsError
    from kvblend.options import SamplingConfig

    runner = SimpleNamespace(tokenizer=Vocab(), stop_token_ids={0})
    seq = Sequence(runner, None, OutputParams(sampling=SamplingConfig(temperature=temperature, seed=1)))
    with pytest.raises(NonFiniteLogitsError, match="use --dtype bf16 or fp32"):
        seq.accept(torch.full((len(VOCAB),), float("nan")))
    masked = torch.zeros(len(VOCAB))
    masked[0] = float("-inf")  # -inf is a masked token, not an overflow
    assert seq.accept(masked).text in VOCAB[1:]


def test_one_sequences_bad_logits_end_it_alone_and_not_its_batch(monkeypatch):
    """NaN logits raised mid-step, and the server failed every request of the batch: now the sequence ends with
    its error (what the server answers that request) and the others decode on."""
    from kvblend.errors import NonFiniteLogitsError
    from kvblend.generation import loop

    runner = SimpleNamespace(tokenizer=Vocab(), stop_token_ids={0})
    bad, good = (Sequence(runner, None, OutputParams()) for _ in range(2))
    rows = torch.zeros(2, len(VOCAB))
    rows[0] = float("nan")
    rows[1, 3] = 5.0
    monkeypatch.setattr(loop, "decode_step", lambda runner, states, tokens: rows)
    monkeypatch.setattr(Sequence, "decode_state", lambda self: None)
    monkeypatch.setattr(Sequence, "last_token", property(lambda self: 1))
    deltas = loop.step(runner, [bad, good])
    assert isinstance(bad.error, NonFiniteLogitsError) and bad.finished and deltas[0].text == ""
    assert good.error is None and not good.finished and deltas[1].text == "ones"


def test_a_base_models_line_break_before_its_answer_is_not_its_end():
    """Gemma 3's likeliest first token after "Answer:" is a line break, which ended the answer before any text
    (four answers in six came back empty); once the answer has text, a line break still ends it."""
    from kvblend.generation import SamplingConfig

    vocab = ["<eos>", "\n", "Hal", "ifax", " and more"]

    class Lines:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(vocab[i] for i in ids if not (skip_special_tokens and i == 0))

    runner = SimpleNamespace(tokenizer=Lines(), stop_token_ids={0, 1}, line_break_ids=frozenset({1}))
    seq = Sequence(runner, None, OutputParams(sampling=SamplingConfig(max_new_tokens=8)))
    for token in (1, 1, 2, 3, 1, 4):  # greedy picks each in turn
        if seq.finished:
            break
        seq.accept(torch.nn.functional.one_hot(torch.tensor(token), len(vocab)).float())
    assert seq.tokens == [1, 1, 2, 3] and seq.text.strip() == "Halifax" and seq.finish == "stop"
    # an end-of-sequence token ends it at once, text or not
    seq = Sequence(runner, None, OutputParams(sampling=SamplingConfig(max_new_tokens=8)))
    seq.accept(torch.nn.functional.one_hot(torch.tensor(0), len(vocab)).float())
    assert seq.finished and seq.tokens == []
