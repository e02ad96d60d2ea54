"""The serving scheduler's prefill turn: a request blocked on another writer never holds the turn."""

from __future__ import annotations

import threading

from kvblend.serve.async_bridge import Job
from kvblend.serve.executor import Executor
from kvblend.serve.scheduler import ExecutorOutput, Request, SchedulerOutput
from kvblend.serve.schema import ChatRequest
from kvblend.types import WAITING, Steps


def _request(steps: Steps) -> Request:
    """A request already admitted, its steps built: the prefill turn runs them and nothing else."""
    req = Request(Job(ChatRequest(question="Q"), loop=None))  # type: ignore[arg-type]  # sends no event
    req.steps = steps
    return req


def _waits_for(stored: threading.Event, polls: list[int]) -> Steps[None]:
    """A request whose passage another request is prefilling: it can only wait (a claim held elsewhere)."""
    while not stored.is_set():
        polls.append(1)
        yield WAITING
    while True:
        yield None


def _prefills(stored: threading.Event, layers: list[int]) -> Steps[None]:
    """The request that holds the claim: it stores the passage after a few layers of work."""
    for layer in range(5):
        layers.append(layer)
        yield None
    stored.set()
    while True:
        yield None


def test_a_request_waiting_on_another_writer_gives_its_turn_to_the_next():
    """The oldest request waits for a passage the younger one is prefilling (same node, or another node's claim):
    within one turn the younger one runs and stores it. Before, the oldest kept the turn until its 60 s wait
    ran out, so two concurrent requests sharing a new passage cost a minute."""
    stored, polls, layers = threading.Event(), [], []
    executor = Executor(engine=None)  # type: ignore[arg-type]  # the turn never touches the model
    older, younger = _request(_waits_for(stored, polls)), _request(_prefills(stored, layers))
    executor.prefill(SchedulerOutput(prefill=[older, younger], prefill_budget_s=0.25), ExecutorOutput())
    assert stored.is_set() and layers == [0, 1, 2, 3, 4]
    assert polls  # the oldest was asked first, and said it was waiting


def test_bookkeeping_waiting_on_another_writer_lets_the_next_bookkeeping_run():
    """After answers, one request's bookkeeping (storing a passage again) may wait for a write that a later
    request's bookkeeping makes: the later one runs in the same turn, and the waiting one finishes on the next."""
    stored, polls, layers = threading.Event(), [], []

    def finishes(steps: Steps[None]) -> Steps[None]:
        for step in steps:
            if stored.is_set() and step is None:
                return
            yield step

    executor = Executor(engine=None)  # type: ignore[arg-type]
    chores = [finishes(_waits_for(stored, polls)), _prefills(stored, layers)]
    first = ExecutorOutput()
    executor.prefill(SchedulerOutput(background=list(chores), prefill_budget_s=0.25), first)
    assert stored.is_set() and layers == [0, 1, 2, 3, 4] and polls and not first.chores_done
    second = ExecutorOutput()
    executor.prefill(SchedulerOutput(background=list(chores), prefill_budget_s=0.25), second)
    assert second.chores_done == [chores[0]]  # the waiting one ended once the write was there; the other idles on
