"""Continuous batching: one model thread serves every request, decoding all running sequences together.

vLLM's scheduler, for a CPU and one small model. On a CPU, decoding is bound by
reading the weights, so every sequence that is decoding advances in one
batched forward pass per step (kvblend.generation.decode_step: each sequence
keeps its own KV, ragged lengths, no padding), and sequences join and leave at
any step. A new request's work before its first token (retrieval, prefilling
the passages the archive misses, streaming the cached KV and fusing) is
already layer by layer; it runs in slices (kvblend.fusion.fuse_steps with row
chunks, vLLM's chunked prefill) between decode steps, under a time budget tied
to the decode step's own duration, so a long prompt arriving does not freeze
the streams that are running.

One iteration of the loop::

    admit waiting requests while the batch has room (--max-batch sequences)
    prefill turn: advance the oldest new request(s) for at most the budget
    decode turn:  one batched step for every decoding sequence; stream tokens

Greedy output does not depend on what else is in the batch: attention is per
sequence, and only the batched matrix products may round differently (within
1e-4 on the logits; tests hold it to that and to the same tokens).

Requests wait in a bounded queue (`max_queue`; one more is a 429). A client
that goes away cancels its request at the next step. Shutdown refuses what
waits (503) and gives running requests a grace period, after which their
clients get an error event, not a torn stream.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvblend.defaults import DEFAULT_MAX_BATCH, DEFAULT_MODE, DEFAULT_TOP_K
from kvblend.generation import DecodeState, Generation, decode_step, logprobs_of, next_token
from kvblend.options import PromptTemplate, QueryOptions, SamplingConfig
from kvblend.pipeline.query import Prepared, answered, finish_steps, prepare_steps
from kvblend.pipeline.results import QueryResult
from kvblend.serve.chunks import question_with_history
from kvblend.serve.schema import ApiError, ChatRequest
from kvblend.types import WAIT_POLL_S, WAITING, Steps, Waiting

if TYPE_CHECKING:
    from kvblend.pipeline.engine import Engine

log = logging.getLogger("kvblend.serve")

ROWS_PER_STEP = 256  # a prefill unit: the projections or attention + MLP of this many tokens of one layer
# Prefill time per iteration: what keeps the running streams' inter-token latency near ITL_FACTOR times a lone
# stream's (the decode step of the whole batch, plus this), and at least MIN_PREFILL_S so new requests progress.
ITL_FACTOR = 2.5
MIN_PREFILL_S = 0.015
IDLE_PREFILL_S = 0.25  # nothing decoding: prefill in slices this long, so new arrivals are admitted between


class Cancelled(Exception):
    """A request's client went away (or the server cut it)."""


@dataclass
class TokenEvent:
    """New text of one choice, and the tokens that made it (with log-probabilities when asked)."""

    choice: int
    text: str
    logprobs: list[dict] = field(default_factory=list)


@dataclass
class ChoiceResult:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict] | None


@dataclass
class Completed:
    """What a finished request's handler gets: the query report and every choice."""

    result: QueryResult
    choices: list[ChoiceResult]


class Job:
    """One request on its way through the queue and the model thread."""

    def __init__(self, request: ChatRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.enqueued = time.perf_counter()
        self.admitted = 0.0
        self.queue_wait_s = 0.0
        self.abort: ApiError | None = None  # why the server cut it (None: its client left)

    def emit(self, kind: str, value: Any = None) -> None:
        """Hand an event to the request's handler (thread-safe): token, done, error or cancelled."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self, abort: ApiError | None = None) -> None:
        """Stop at the next step; `abort` is the error its client gets, if still listening."""
        self.abort = self.abort or abort
        self.cancelled.set()

    def end_cancelled(self) -> None:
        self.emit("error", self.abort) if self.abort is not None else self.emit("cancelled")


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", "shutting_down", type="server_error")


def query_options(req: ChatRequest, max_stored_tokens: int | None = None) -> QueryOptions:
    """The pipeline options for a request: client chunks replace retrieval unless top_k asks for both."""
    top_k = req.top_k if req.top_k is not None else (0 if req.chunks else DEFAULT_TOP_K)
    return QueryOptions(
        mode=req.mode or DEFAULT_MODE,
        ratio=req.ratio,
        top_k=top_k,
        docs=tuple(req.docs),
        context_texts=tuple(req.chunks),
        store_context=req.store,
        restore_missing=req.store,
        max_stored_tokens=max_stored_tokens,
        template=PromptTemplate(system=req.system) if req.system else PromptTemplate(),
        sampling=SamplingConfig(req.max_tokens, req.temperature, req.top_p, req.seed),
    )


class Choice:
    """One sequence being generated: its KV, its sampler, stop rules, and the text streamed so far."""

    def __init__(self, job: Job, index: int, state: DecodeState, tokenizer: Any, stop_ids: set[int]):
        req = job.request
        self.job, self.index, self.state, self.tokenizer, self.stop_ids = job, index, state, tokenizer, stop_ids
        self.sampling = SamplingConfig(req.max_tokens, req.temperature, req.top_p, req.seed)
        seed = None if req.seed is None else (req.seed + index) % 2**63  # n samples: independent, repeatable
        self.generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` already streamed
        self.finish: str | None = None
        self.logprobs: list[dict] = []
        self.started = time.perf_counter()
        self.first_token_s = 0.0
        self.hit_eos = False

    @property
    def done(self) -> bool:
        return self.finish is not None

    def accept(self, logits: torch.Tensor) -> TokenEvent:
        """Sample the next token from `logits`, apply the request's stop rules, and say what new text to send."""
        req = self.job.request
        if req.ignore_eos or len(self.tokens) < req.min_tokens:
            logits = logits.clone()
            logits[list(self.stop_ids)] = float("-inf")  # vLLM's ignore_eos / min_tokens: no end before it
        token = next_token(logits.cpu(), self.sampling, self.generator)
        if not self.tokens:
            self.first_token_s = time.perf_counter() - self.started
        if token in self.stop_ids:  # not part of the answer: no text, no log-probability, not counted
            self.finish, self.hit_eos = "stop", True
            return TokenEvent(self.index, self._flush())
        entries = [self._logprob_entry(logits, token)] if req.logprobs else []
        self.tokens.append(token)
        self.logprobs.extend(entries)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        stops = req.stop if len(self.tokens) >= req.min_tokens else []  # vLLM: no stop string before min_tokens
        cut = _first_stop(full, stops, self.sent)
        if cut is not None:
            self.text, self.finish = full[:cut], "stop"
            return TokenEvent(self.index, self._flush(), entries)
        self.text = full
        if len(self.tokens) >= req.max_tokens:
            self.finish = "length"
            return TokenEvent(self.index, self._flush(), entries)
        safe = len(full) - _held_back(full, stops)  # a stop string may be starting: hold it back
        while safe > self.sent and full[safe - 1] == "\ufffd":  # a character whose bytes are still coming
            safe -= 1
        delta = full[self.sent : safe]
        self.sent = max(self.sent, safe)
        return TokenEvent(self.index, delta, entries)

    def _flush(self) -> str:
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta

    def _logprob_entry(self, logits: torch.Tensor, token: int) -> dict:
        logprob, top = logprobs_of(logits, token, self.job.request.top_logprobs)

        def piece(tid: int, lp: float) -> dict:
            return {"token": self.tokenizer.decode([tid]), "logprob": lp, "bytes": token_bytes(self.tokenizer, tid)}

        return {**piece(token, logprob), "top_logprobs": [piece(t, lp) for t, lp in top]}

    def result(self, strip: bool) -> ChoiceResult:
        """`strip`: a chat answer loses its leading whitespace, streamed or not (a stream cannot take back a
        trailing space, so neither answer loses it)."""
        text = self.text.lstrip() if strip else self.text
        return ChoiceResult(
            self.index,
            text,
            list(self.tokens),
            self.finish or "stop",
            self.logprobs if self.job.request.logprobs else None,
        )


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
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _first_stop(text: str, stops: list[str], start: int) -> int | None:
    """Where the earliest stop string begins in `text` (searching from a little before `start`), or None."""
    found = [i for s in stops if (i := text.find(s, max(0, start - len(s)))) != -1]
    return min(found) if found else None


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string (not sent yet)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best


@dataclass
class _Running:
    """A request from admission to its last token."""

    job: Job
    steps: Steps[Prepared] | None
    prepared: Prepared | None = None
    choices: list[Choice] = field(default_factory=list)


class Scheduler:
    """The bounded queue in front of the one model thread, which batches every running request."""

    def __init__(
        self,
        engine: Engine,
        max_queue: int,
        max_batch: int = DEFAULT_MAX_BATCH,
        rows_per_step: int = ROWS_PER_STEP,
        after_request: Callable[[Prepared], Steps[None]] | None = None,
        max_stored_tokens: int | None = None,
    ):
        self.engine = engine
        self.max_queue, self.max_batch, self.rows = max_queue, max_batch, rows_per_step
        self.max_stored_tokens = max_stored_tokens
        self.after_request = after_request  # bookkeeping after each request (e.g. keep the archive in its bound)
        self.stopping = False
        self.failed = False  # the model thread died (a bug): nothing will be answered any more
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._prefilling: list[_Running] = []
        self._decoding: list[_Running] = []
        self._background: deque[Steps[None]] = deque()
        self._last_decode_s = 0.0
        self._lone_decode_s = 0.0  # a decode step of one sequence (running mean): the ITL streams are held to
        self._thread = threading.Thread(target=self._run, name="kvblend-model", daemon=True)
        self._finished = threading.Event()

    # ── the event loop's side ──
    @property
    def depth(self) -> int:
        """Requests waiting for admission (not counting the running ones)."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Sequences admitted: prefilling or decoding."""
        return sum(r.job.request.n for r in self._prefilling) + sum(
            sum(not c.done for c in r.choices) for r in self._decoding
        )

    @property
    def busy(self) -> bool:
        return bool(self._prefilling or self._decoding)

    def start(self) -> None:
        self.engine.runner.step_rows = self.rows  # prefill and fusion yield inside big layers too
        self._thread.start()

    def submit(self, request: ChatRequest) -> Job:
        """Queue a request, or refuse it with a 429 when `max_queue` requests already wait."""
        with self._cond:
            if self.stopping:
                raise shutting_down()
            if self.failed:
                raise ApiError(
                    503,
                    "the server's model thread failed; restart it (see its log)",
                    "model_failed",
                    type="server_error",
                )
            room = max(0, self.max_batch - self.running)  # places in the batch the model thread is about to fill
            if len(self._waiting) >= self.max_queue + room:
                raise ApiError(
                    429,
                    f"the server is busy: {self.max_queue} requests already wait for the model; retry shortly",
                    "rate_limit_exceeded",
                    type="requests",
                )
            job = Job(request, asyncio.get_running_loop())
            self._waiting.append(job)
            self._cond.notify()
        return job

    def begin_shutdown(self, grace_s: float) -> None:
        """SIGTERM / Ctrl-C: refuse what waits now; running requests get `grace_s` to finish."""
        with self._cond:
            self.stopping = True
            while self._waiting:
                self._waiting.popleft().emit("error", shutting_down())
            self._cond.notify()
        timer = threading.Timer(grace_s, self._cut_running)
        timer.daemon = True
        timer.start()

    def _cut_running(self) -> None:
        for r in [*self._prefilling, *self._decoding]:
            r.job.cancel(shutting_down())
        with self._cond:
            self._cond.notify()

    async def stop(self) -> None:
        """After shutdown: wait for the model thread to finish its step, so no archive write is cut short."""
        if not self.stopping:
            self.begin_shutdown(0)
        self._cut_running()
        await asyncio.get_running_loop().run_in_executor(None, self._finished.wait)

    # ── the model thread ──
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._waiting or self._prefilling or self._decoding or self._background or self.stopping
                    ):
                        self._cond.wait()
                    if self.stopping and not (self._prefilling or self._decoding or self._background):
                        return
                    admitted = self._admit()
                self._drop_cancelled()
                for running in admitted:
                    self._start(running)
                if self._prefilling or self._background:
                    self._prefill_turn()
                if self._decoding:
                    self._decode_turn()
        except BaseException:  # a bug in the loop itself: fail every request rather than hang them
            log.exception("the model thread failed")
            with self._cond:
                self.failed = True  # /health says so, and new requests get a 503 instead of waiting forever
                waiting, self._waiting = list(self._waiting), deque()
            for job in [*(r.job for r in [*self._prefilling, *self._decoding]), *waiting]:
                job.emit("error", RuntimeError("the model thread failed"))
        finally:
            self._finished.set()

    def _admit(self) -> list[_Running]:
        """Waiting requests the batch has room for (under the lock)."""
        admitted = []
        while self._waiting and not self.stopping:
            job = self._waiting[0]
            if self.running and self.running + job.request.n > self.max_batch:
                break
            self._waiting.popleft()
            if job.cancelled.is_set():
                job.end_cancelled()
                continue
            job.admitted = time.perf_counter()
            job.queue_wait_s = job.admitted - job.enqueued
            running = _Running(job, None)
            self._prefilling.append(running)
            admitted.append(running)
        return admitted

    def _start(self, running: _Running) -> None:
        req = running.job.request
        self.engine.refresh()  # documents another process ingested since the last request
        question = question_with_history(req.history, req.question)
        running.steps = prepare_steps(
            self.engine, question, query_options(req, self.max_stored_tokens), lambda msg: log.warning("%s", msg)
        )

    def _drop_cancelled(self) -> None:
        for group in (self._prefilling, self._decoding):
            for r in [r for r in group if r.job.cancelled.is_set()]:
                group.remove(r)
                if r.steps is not None:
                    r.steps.close()  # leaves fuse_steps' `with feed`: the loader stops
                r.job.end_cancelled()

    def _prefill_turn(self) -> None:
        """Advance new requests (oldest first), then bookkeeping, for at most the budget.

        A request that is only waiting for another writer (a passage another request or node is prefilling)
        gives up its turn to the next one, so it never blocks the very request it waits for; when every one is
        waiting and nothing decodes, the thread sleeps a moment instead of spinning."""
        if self._decoding:
            lone = self._lone_decode_s or self._last_decode_s
            budget = max(MIN_PREFILL_S, ITL_FACTOR * lone - self._last_decode_s)
        else:
            budget = IDLE_PREFILL_S
        deadline = time.perf_counter() + budget
        waiting: set[int] = set()  # requests and bookkeeping that said WAITING this turn (by id)
        while time.perf_counter() < deadline and (self._prefilling or self._background):
            ready = [r for r in self._prefilling if id(r) not in waiting]
            chores = [s for s in self._background if id(s) not in waiting]
            if ready:
                if self._advance(ready[0], deadline) is WAITING:
                    waiting.add(id(ready[0]))
            elif chores:
                if self._advance_background(chores[0], deadline) is WAITING:
                    waiting.add(id(chores[0]))
            else:  # everyone waits on someone else's write
                if self._decoding:
                    return
                time.sleep(WAIT_POLL_S)
                waiting.clear()

    def _advance(self, running: _Running, deadline: float) -> Waiting | None:
        """Run a request's steps until the deadline, its first token, or it says it is WAITING (returned)."""
        assert running.steps is not None
        try:
            while time.perf_counter() < deadline:
                if next(running.steps) is WAITING:
                    return WAITING
        except StopIteration as done:
            self._prefilling.remove(running)
            prepared: Prepared = done.value
            self._guarded(running, lambda: self._first_tokens(running, prepared))
        except Exception as exc:
            self._fail(running, exc)
        return None

    def _guarded(self, running: _Running, work: Callable[[], None]) -> None:
        """Run one request's share of a turn; if it fails, that request fails and the others go on."""
        try:
            work()
        except Exception as exc:
            self._fail(running, exc)

    def _fail(self, running: _Running, exc: Exception) -> None:
        """End one request with an error (reported to its client by app.error_for, which logs a bug)."""
        for group in (self._prefilling, self._decoding):
            if running in group:
                group.remove(running)
        running.job.emit("error", exc)

    def _advance_background(self, steps: Steps[None], deadline: float) -> Waiting | None:
        """Run one piece of bookkeeping until the deadline, its end, or it says it is WAITING (returned)."""
        try:
            while time.perf_counter() < deadline:
                if next(steps) is WAITING:
                    return WAITING
        except StopIteration:
            self._background.remove(steps)
        except Exception as exc:  # bookkeeping never fails an answered request
            self._background.remove(steps)
            log.warning("after a request: %s", exc)
        return None

    def _first_tokens(self, running: _Running, prepared: Prepared) -> None:
        """The fused KV is ready: each choice gets its own decode buffers and samples its first token."""
        job, runner = running.job, self.engine.runner
        running.prepared = prepared
        stops = runner.stop_token_ids
        for i in range(job.request.n):
            state = DecodeState(runner, prepared.fused, job.request.max_tokens)
            running.choices.append(Choice(job, i, state, runner.tokenizer, stops))
        for choice in running.choices:
            self._send(choice, choice.accept(prepared.fused.last_logits))
        self._decoding.append(running)
        self._complete_finished()

    def _decode_turn(self) -> None:
        """One batched forward pass for every sequence that still decodes."""
        live = [(r, c) for r in self._decoding for c in r.choices if not c.done]
        if live:
            t0 = time.perf_counter()
            try:
                logits = decode_step(self.engine.runner, [c.state for _, c in live], [c.tokens[-1] for _, c in live])
            except Exception as exc:  # the batch's forward pass: its requests fail, the server goes on
                for running in list(self._decoding):
                    self._fail(running, exc)
                return
            self._last_decode_s = time.perf_counter() - t0
            if len(live) == 1:
                lone = self._lone_decode_s
                self._lone_decode_s = self._last_decode_s if not lone else 0.8 * lone + 0.2 * self._last_decode_s
            for (running, choice), row in zip(live, logits):
                if running in self._decoding:  # not failed by an earlier choice of its own
                    self._guarded(running, lambda: self._send(choice, choice.accept(row)))  # noqa: B023 (run now)
        self._complete_finished()

    def _send(self, choice: Choice, event: TokenEvent) -> None:
        if event.text or event.logprobs:
            choice.job.emit("token", event)

    def _complete_finished(self) -> None:
        for running in [r for r in self._decoding if all(c.done for c in r.choices)]:
            self._decoding.remove(running)
            job, prepared = running.job, running.prepared
            assert prepared is not None
            first = running.choices[0]
            ttft = first.started - job.admitted + first.first_token_s
            gen = Generation(
                first.tokens,
                first.result(strip=not job.request.legacy).text,
                first.first_token_s,
                time.perf_counter() - first.started,
                first.hit_eos,
            )
            result = answered(prepared, gen, ttft)
            job.emit("done", Completed(result, [c.result(strip=not job.request.legacy) for c in running.choices]))
            for choice in running.choices:
                choice.state.k, choice.state.v = [], []  # free the KV buffers now, not when the GC gets to them
            self._background.append(self._after(prepared))

    def _after(self, prepared: Prepared) -> Steps[None]:
        """Bookkeeping once the client has its answer: the pipeline's (archive the instruction prefix, touch
        what was used, store again what could not be read), then the server's (keep the archive in its bound)."""
        yield from finish_steps(self.engine, prepared)
        prepared.fused.kv = []  # the prefix is archived: the prompt's KV can go
        if self.after_request is not None:
            yield from self.after_request(prepared)
