"""The output processor: what one generated sequence does with each step's logits.

Per token: sample it (or take the forced one), apply the stop rules (stop
tokens, max tokens, stop strings, min_tokens and ignore_eos as vLLM reads
them), detokenize incrementally, and record log-probabilities. `kvblend
query` (kvblend.generation.loop.generate) and the server's batched decode
steps (kvblend.serve.executor) both hand logits to a Sequence, so the rules
are written once.

Incremental detokenizing is tokenizers' DecodeStream: it holds a token back
until its bytes make whole UTF-8 characters (byte-level BPE as in SmolLM2,
SentencePiece byte fallback as in Gemma), so a stream never sends half an
emoji. On both bundled models' tokenizers its pieces join to exactly what
decoding the whole sequence gives (tests/e2e/test_detokenize.py); the text a
finished sequence reports is that whole decode, so an answer cut by its
token limit in the middle of a character still ends in U+FFFD, as before.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvblend.errors import NonFiniteLogitsError
from kvblend.fusion.fuse import FusionResult
from kvblend.generation.decode import DecodeState
from kvblend.generation.sampling import logprobs_of, next_token
from kvblend.model.runner import ModelRunner
from kvblend.options import SamplingConfig


@dataclass(frozen=True)
class OutputParams:
    """How one sequence is generated and when it ends (OpenAI's and vLLM's request fields)."""

    sampling: SamplingConfig = SamplingConfig()
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one (after min_tokens)
    min_tokens: int = 0  # no stop token or stop string before this many tokens
    ignore_eos: bool = False  # stop tokens are never sampled: the sequence runs to its limit
    logprobs: bool = False
    top_logprobs: int = 0
    forced_tokens: tuple[int, ...] | None = None  # teacher forcing (answer KL): these tokens, whatever the logits
    keep_logits: bool = False  # keep each step's logits (bench's KL)

    @property
    def max_tokens(self) -> int:
        return len(self.forced_tokens) if self.forced_tokens is not None else self.sampling.max_new_tokens


@dataclass
class Generation:
    """A finished sequence, as the pipeline reports it."""

    token_ids: list[int]
    text: str
    first_token_s: float  # from the start of decoding to the first token being known
    decode_s: float
    stopped_on_eos: bool
    step_logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        rest = len(self.token_ids) - 1
        return rest / self.decode_s if rest > 0 and self.decode_s > 0 else 0.0


@dataclass
class Delta:
    """What one step added to a sequence: the text to stream now, and that token's log-probabilities."""

    text: str
    logprobs: list[dict] = field(default_factory=list)


class Sequence:
    """One sequence being generated from a fused prompt: its sampler, stop rules, text, and (from its first
    decode step on) its KV buffers."""

    def __init__(
        self,
        runner: ModelRunner,
        fused: FusionResult,
        params: OutputParams,
        stop_ids: set[int] | None = None,
    ):
        self.runner, self.fused, self.params = runner, fused, params
        self.tokenizer = runner.tokenizer
        self.stop_ids = runner.stop_token_ids if stop_ids is None else stop_ids
        seed = params.sampling.seed
        self.generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        self.state: DecodeState | None = None  # built at the first decode step: not on the first token's path
        self.tokens: list[int] = []
        self.decoded = ""  # the whole characters decoded so far
        self.text = ""  # the answer so far: `decoded`, cut at a stop string; the whole decode once finished
        self.sent = 0  # characters of `text` already handed out
        self.finish: str | None = None  # "stop" or "length" once finished ("error" with `error` set)
        self.error: Exception | None = None  # what ended it without an answer (kvblend.generation.loop.step)
        self.hit_eos = False
        self.logprobs: list[dict] = []
        self.step_logits: list[torch.Tensor] = []
        self.started = time.perf_counter()
        self.first_token_s = 0.0
        self._detokenizer = Detokenizer(self.tokenizer)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def decode_state(self) -> DecodeState:
        """The KV buffers the next decode step writes into (the fused prompt's KV, copied once)."""
        if self.state is None:
            self.state = DecodeState(self.runner, self.fused, self.params.max_tokens)
        return self.state

    def release(self) -> None:
        """Free the KV buffers (a finished request in a server)."""
        if self.state is not None:
            self.state.release()

    def accept(self, logits: torch.Tensor) -> Delta:
        """Sample the next token from `logits`, apply the stop rules, and say what new text to send."""
        p = self.params
        if p.keep_logits:
            self.step_logits.append(logits.detach().float().cpu())
        if p.forced_tokens is not None:
            token = p.forced_tokens[len(self.tokens)]
        else:
            if p.ignore_eos or len(self.tokens) < p.min_tokens:
                logits = logits.clone()
                logits[list(self.stop_ids)] = float("-inf")  # vLLM's ignore_eos / min_tokens: no end before it
            logits = logits.cpu()
            if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):  # greedy read NaN as token 0:
                raise NonFiniteLogitsError(  # an empty answer, and sampling a torch traceback
                    "the model's logits are not finite (an fp16 overflow? Gemma's activations exceed fp16's range): "
                    "use --dtype bf16 or fp32"
                )
            token = next_token(logits, p.sampling, self.generator)
        if not self.tokens:
            self.first_token_s = time.perf_counter() - self.started
        if p.forced_tokens is None and token in self.stop_ids and not self._leading_line_break(token):
            self.finish, self.hit_eos = "stop", True  # not part of the answer: no text, no logprob
            return Delta(self._finish_whole())
        entries = [self._logprob_entry(logits, token)] if p.logprobs else []
        self.tokens.append(token)
        self.logprobs.extend(entries)
        self.decoded += self._detokenizer.step(token)
        stops = p.stop if len(self.tokens) >= p.min_tokens else ()  # vLLM: no stop string before min_tokens
        cut = _first_stop(self.decoded, stops, self.sent)
        if cut is not None:
            self.text, self.finish = self.decoded[:cut], "stop"
            return Delta(self._flush(), entries)
        if len(self.tokens) >= p.max_tokens:
            self.finish = "length"
            return Delta(self._finish_whole(), entries)
        self.text = self.decoded
        # A stop string may be starting: hold it back, before min_tokens too, where it cannot end the answer yet
        # but may once min_tokens is reached; sent text is never taken back.
        safe = len(self.text) - _held_back(self.text, p.stop)
        delta = self.text[self.sent : safe]
        self.sent = max(self.sent, safe)
        return Delta(delta, entries)

    def _leading_line_break(self, token: int) -> bool:
        """A base model's line break before its answer has any text: whitespace that leads the answer (each
        front end trims it), not the end of the answer's line."""
        return token in self.runner.line_break_ids and not self.decoded.strip()

    def _finish_whole(self) -> str:
        """Finished without a stop string: the text is the whole decode (a character the last token left
        incomplete shows as U+FFFD), and the rest of it goes out."""
        whole = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        self.text = whole if whole.startswith(self.text[: self.sent]) else self.decoded
        return self._flush()

    def _flush(self) -> str:
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta

    def _logprob_entry(self, logits: torch.Tensor, token: int) -> dict:
        logprob, top = logprobs_of(logits, token, self.params.top_logprobs)

        def piece(tid: int, lp: float) -> dict:
            return {"token": self.tokenizer.decode([tid]), "logprob": lp, "bytes": token_bytes(self.tokenizer, tid)}

        return {**piece(token, logprob), "top_logprobs": [piece(t, lp) for t, lp in top]}

    def generation(self, text: str) -> Generation:
        """The finished sequence's report, with `text` as its answer (each front end trims it its own way)."""
        return Generation(
            list(self.tokens),
            text,
            self.first_token_s,
            time.perf_counter() - self.started,
            self.hit_eos,
            self.step_logits,
        )


class Detokenizer:
    """Token ids in, whole characters out, one token at a time.

    tokenizers' DecodeStream when the tokenizer has the Rust backend (every tokenizer transformers loads for
    the supported models). A tokenizer without one (the unit tests' stubs) is decoded whole at every step and
    the new end handed out: right for a decode that only ever appends, which a stub's is."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend: Tokenizer | None = backend if isinstance(backend, Tokenizer) else None
        self.stream = DecodeStream(skip_special_tokens=True) if self.backend is not None else None
        self.ids: list[int] = []
        self.text = ""

    def step(self, token: int) -> str:
        if self.stream is not None and self.backend is not None:
            return self.stream.step(self.backend, token) or ""
        self.ids.append(token)
        whole = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece, self.text = whole[len(self.text) :], whole
        return piece


def token_bytes(tokenizer: Any, token: int) -> list[int]:
    """A token's own bytes (OpenAI's logprobs `bytes`: a client joins them to rebuild characters that span
    tokens, which decode alone to U+FFFD). Byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen) spells bytes as
    printable characters; SentencePiece has <0xNN> byte tokens and ▁ for a space."""
    text = tokenizer.decode([token])
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return [int(piece[3:5], 16)]
        table = _byte_decoder()
        if piece and all(ch in table for ch in piece):
            spelled = bytes(table[ch] for ch in piece)
            if spelled.decode("utf-8", "replace") == text:  # byte-level indeed (not SentencePiece's "é")
                return list(spelled)
    return list(text.encode("utf-8"))


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]  # the rest stand for themselves + 256, in order
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Where the earliest stop string begins in `text` at or after `start` (the characters sent: any stop
    string that could begin there is held back, so one that ends now begins after them), or None. A stop
    string wholly within the text sent before min_tokens is not one (vLLM's rule), and never cuts it."""
    found = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could be the start of a stop string (not sent yet)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best
