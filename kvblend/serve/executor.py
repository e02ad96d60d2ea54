"""The executor: the model work a SchedulerOutput asks for, on the model thread.

It builds admitted requests' steps (retrieval, stored misses, KV streaming and
fusion; kvblend.pipeline.query.prepare_steps), runs the prefill slices in the
order and for the time the scheduler decided, gives a fused request its
sequences and their first tokens, runs one batched decode step
(kvblend.generation.step, the decode loop `kvblend query` uses too) and builds
the answer of a request whose choices all ended. It changes no request's
state: it reports what happened (ExecutorOutput) and the scheduler's `update`
applies it. Chunk sizes (`rows_per_step`) are passed down with each call,
never set on the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvblend.generation import Sequence, step
from kvblend.pipeline.query import Prepared, answered, finish_steps, prepare_steps
from kvblend.serve.async_bridge import ChoiceResult, Completed
from kvblend.serve.chunks import question_with_history
from kvblend.serve.mapping import output_params, query_options
from kvblend.serve.scheduler import ExecutorOutput, Request, SchedulerOutput
from kvblend.types import WAIT_POLL_S, WAITING, Steps, Waiting

if TYPE_CHECKING:
    from kvblend.pipeline.engine import Engine

log = logging.getLogger("kvblend.serve")

ROWS_PER_STEP = 256  # a prefill unit: the projections or attention + MLP of this many tokens of one layer


class Executor:
    """Runs each decision's model work; owns nothing between iterations but the engine."""

    def __init__(
        self,
        engine: Engine,
        rows_per_step: int = ROWS_PER_STEP,
        after_request: Callable[[Prepared], Steps[None]] | None = None,
        max_stored_tokens: int | None = None,
    ):
        self.engine, self.rows = engine, rows_per_step
        self.after_request = after_request  # bookkeeping after each request (e.g. keep the archive in its bound)
        self.max_stored_tokens = max_stored_tokens

    def execute(self, decision: SchedulerOutput) -> ExecutorOutput:
        out = ExecutorOutput()
        for req in decision.dropped:
            release(req)
        for req in decision.start:
            try:
                self._start(req)
            except Exception as exc:
                out.failed.append((req, exc))
        self.prefill(decision, out)
        if decision.decode:
            self._decode(decision.decode, out)
        return out

    def _start(self, req: Request) -> None:
        self.engine.refresh()  # documents another process ingested since the last request
        question = question_with_history(req.chat.history, req.chat.question)
        opts = query_options(req.chat, self.max_stored_tokens)
        req.steps = prepare_steps(self.engine, question, opts, lambda msg: log.warning("%s", msg), self.rows)

    # ── prefill ──
    def prefill(self, decision: SchedulerOutput, out: ExecutorOutput) -> None:
        """Advance new requests (oldest first), then bookkeeping, for at most the decision's budget.

        A request that is only waiting for another writer (a passage another request or node is prefilling)
        gives up its turn to the next one, so it never blocks the very request it waits for; when every one is
        waiting and nothing decodes, the thread sleeps a moment instead of spinning."""
        failed = {id(r) for r, _ in out.failed}
        requests = [r for r in decision.prefill if id(r) not in failed and r.steps is not None]
        chores = list(decision.background)
        deadline = time.perf_counter() + decision.prefill_budget_s
        waiting: set[int] = set()  # requests and chores that said WAITING this turn (by id)
        while time.perf_counter() < deadline and (requests or chores):
            ready = [r for r in requests if id(r) not in waiting]
            idle = [c for c in chores if id(c) not in waiting]
            if ready:
                req = ready[0]
                if self._advance(req, deadline, out) is WAITING:
                    waiting.add(id(req))
                else:
                    if req.prepared is not None or any(r is req for r, _ in out.failed):
                        requests.remove(req)
            elif idle:
                chore = idle[0]
                said = _advance_chore(chore, deadline)
                if said is WAITING:
                    waiting.add(id(chore))
                elif said == "done":
                    chores.remove(chore)
                    out.chores_done.append(chore)
            else:  # everyone waits on someone else's write
                if decision.decode:
                    return
                time.sleep(WAIT_POLL_S)
                waiting.clear()

    def _advance(self, req: Request, deadline: float, out: ExecutorOutput) -> Waiting | None:
        """Run a request's steps until the deadline, its first tokens, or it says it is WAITING (returned)."""
        assert req.steps is not None
        try:
            while time.perf_counter() < deadline:
                if next(req.steps) is WAITING:
                    return WAITING
        except StopIteration as done:
            req.steps = None
            req.prepared = done.value
            try:
                self._first_tokens(req, out)
            except Exception as exc:
                out.failed.append((req, exc))
        except Exception as exc:
            req.steps = None
            out.failed.append((req, exc))
        return None

    def _first_tokens(self, req: Request, out: ExecutorOutput) -> None:
        """The fused KV is ready: each choice becomes a sequence and samples its first token from its logits."""
        prepared, runner = req.prepared, self.engine.runner
        assert prepared is not None
        stops = runner.stop_token_ids
        req.sequences = [Sequence(runner, prepared.fused, output_params(req.chat, i), stops) for i in range(req.chat.n)]
        out.first_tokens.append((req, [seq.accept(prepared.fused.last_logits) for seq in req.sequences]))
        self._complete_if_done(req, out)

    # ── decode ──
    def _decode(self, requests: list[Request], out: ExecutorOutput) -> None:
        """One batched decode step for every sequence that is still generating."""
        live = [(req, i, seq) for req in requests for i, seq in enumerate(req.sequences) if not seq.finished]
        if live:
            t0 = time.perf_counter()
            try:
                deltas = step(self.engine.runner, [seq for _, _, seq in live])
            except Exception as exc:  # the batch's step: its requests fail, the server goes on
                out.failed.extend((req, exc) for req in requests)
                for req in requests:
                    release(req)
                return
            out.decode_s, out.decode_batch = time.perf_counter() - t0, len(live)
            failed = {id(req): seq.error for req, _, seq in live if seq.error is not None}  # its logits, not the batch
            for req in (r for r in requests if id(r) in failed):
                out.failed.append((req, failed[id(req)]))
                release(req)
            out.decoded.extend((req, i, delta) for (req, i, _), delta in zip(live, deltas) if id(req) not in failed)
            requests = [r for r in requests if id(r) not in failed]
        for req in requests:
            self._complete_if_done(req, out)

    def _complete_if_done(self, req: Request, out: ExecutorOutput) -> None:
        """Every choice ended: the answer, the KV freed, and the bookkeeping to run once the client has it."""
        if not all(seq.finished for seq in req.sequences):
            return
        prepared = req.prepared
        assert prepared is not None
        strip = not req.chat.legacy  # a chat answer loses its leading whitespace, streamed or not
        texts = [seq.text.lstrip() if strip else seq.text for seq in req.sequences]
        first = req.sequences[0]
        ttft = first.started - req.admitted + first.first_token_s
        result = answered(prepared, first.generation(texts[0]), ttft, self.engine.runner)
        choices = [
            ChoiceResult(i, text, list(seq.tokens), seq.finish or "stop", seq.logprobs if req.chat.logprobs else None)
            for i, (seq, text) in enumerate(zip(req.sequences, texts))
        ]
        release(req)
        out.completed.append((req, Completed(result, choices), self._after(prepared)))

    def _after(self, prepared: Prepared) -> Steps[None]:
        """Bookkeeping once the client has its answer, a job for the engine's write-behind queue (the
        scheduler queues it there; it runs in idle time beside the request's stored passages, queued when they
        were prefilled): the pipeline's writes (archive the instruction prefix, touch what was used, store again
        what could not be read), then the server's (keep the archive in its bound)."""
        yield from finish_steps(self.engine, prepared, self.rows)
        prepared.fused.kv = []  # the prefix is archived: the prompt's KV can go
        if self.after_request is not None:
            yield from self.after_request(prepared)


def release(req: Request) -> None:
    """Free what a request holds on the model thread: its steps (leaving fuse_steps' `with feed` stops the
    loader) and its sequences' KV buffers."""
    if req.steps is not None:
        req.steps.close()
        req.steps = None
    for seq in req.sequences:
        seq.release()


def _advance_chore(steps: Steps[None], deadline: float) -> Waiting | str | None:
    """Run one piece of bookkeeping until the deadline ("done" at its end) or it says it is WAITING."""
    try:
        while time.perf_counter() < deadline:
            if next(steps) is WAITING:
                return WAITING
    except StopIteration:
        return "done"
    except Exception as exc:  # bookkeeping never fails an answered request
        log.warning("after a request: %s", exc)
        return "done"
    return None
