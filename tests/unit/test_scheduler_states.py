"""The scheduler's request states without a model: admission into the batch, a 429 past the queue, a client that
leaves, a failure, shutdown, and counts that add up (what /metrics reports)."""

from __future__ import annotations

import asyncio

import pytest

from kvblend.serve.async_bridge import Job
from kvblend.serve.scheduler import ExecutorOutput, RequestStatus, Scheduler
from kvblend.serve.schema import ApiError, ChatRequest


def events(loop: asyncio.AbstractEventLoop, job: Job) -> list[str]:
    """The kinds of the events the model thread sent `job` so far."""
    loop.run_until_complete(asyncio.sleep(0))  # run the call_soon_threadsafe callbacks
    kinds = []
    while not job.events.empty():
        kinds.append(job.events.get_nowait()[0])
    return kinds


def test_requests_move_through_their_states_and_the_counts_add_up():
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(max_queue=1, max_batch=2)
        jobs = [scheduler.submit(ChatRequest(question=f"Q{i}"), loop) for i in range(3)]
        with pytest.raises(ApiError) as busy:  # two places in the batch and one in the queue: full
            scheduler.submit(ChatRequest(question="Q3"), loop)
        assert busy.value.status == 429 and scheduler.depth == 3

        first = scheduler.schedule()
        assert [r.job for r in first.start] == jobs[:2] and first.prefill == first.start and not first.decode
        assert all(r.status is RequestStatus.PREFILLING for r in first.start)
        assert scheduler.running == 2 and scheduler.depth == 1 and scheduler.busy

        jobs[0].cancel()  # its client went away
        second = scheduler.schedule()
        assert [r.job for r in second.dropped] == [jobs[0]] and [r.job for r in second.start] == [jobs[2]]
        assert second.dropped[0].status is RequestStatus.FINISHED_ABORTED
        assert events(loop, jobs[0]) == ["cancelled"]

        scheduler.update(ExecutorOutput(failed=[(second.start[0], RuntimeError("boom"))]))
        assert second.start[0].status is RequestStatus.FINISHED_ERROR and events(loop, jobs[2]) == ["error"]

        scheduler.begin_shutdown()
        with pytest.raises(ApiError) as closing:
            scheduler.submit(ChatRequest(question="late"), loop)
        assert closing.value.status == 503
        scheduler.cut()  # the grace period is over: the one still running ends with an error event
        third = scheduler.schedule()
        assert [r.job for r in third.dropped] == [jobs[1]] and events(loop, jobs[1]) == ["error"]
        assert not scheduler.wait_for_work()  # stopping, nothing left: the model thread ends

        counts = scheduler.outcomes()
        assert counts == {"submitted": 3, "stop": 0, "length": 0, "abort": 2, "error": 1}
        assert counts["submitted"] == sum(n for status, n in counts.items() if status != "submitted")
    finally:
        loop.close()


def test_prefill_slices_keep_the_streams_itl_near_a_multiple_of_a_lone_step_and_never_under_the_floor():
    """Beside decoding streams each iteration prefills for ITL_FACTOR lone steps less the batch's step, but plans
    for at least MIN_ITL_S of ITL: with ~12 ms lone steps, 2.5x left 15 ms slices and the batch never filled."""
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(max_queue=4, max_batch=4)
        scheduler.submit(ChatRequest(question="Q"), loop)
        request = scheduler.schedule().start[0]
        scheduler.update(ExecutorOutput(first_tokens=[(request, [])]))
        assert request.status is RequestStatus.DECODING
        # (lone step, the batch's last step) -> prefill time: the 100 ms floor less the batch's step; 2.5 lone
        # steps less it where that is longer; never under 15 ms.
        for lone, batch, want in ((0.012, 0.030, 0.070), (0.2, 0.3, 0.2), (0.05, 0.2, 0.015)):
            scheduler._lone_decode_s = 0.0  # the next lone step sets it afresh
            scheduler.update(ExecutorOutput(decode_s=lone, decode_batch=1))
            scheduler.update(ExecutorOutput(decode_s=batch, decode_batch=3))
            assert scheduler.schedule().prefill_budget_s == pytest.approx(want)
    finally:
        loop.close()


def test_more_choices_than_the_batch_holds_are_refused_not_decoded_past_the_bound():
    """A lone request with n=4 under --max-batch 2 was admitted (nothing else ran) and decoded 4 sequences."""
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(max_queue=1, max_batch=2)
        with pytest.raises(ApiError) as refused:
            scheduler.submit(ChatRequest(question="Q", n=3), loop)
        assert (refused.value.status, refused.value.param) == (400, "n") and "--max-batch (2)" in str(refused.value)
        assert scheduler.depth == 0 and scheduler.outcomes()["submitted"] == 0
        scheduler.submit(ChatRequest(question="Q", n=2), loop)  # as many as it holds: fine
    finally:
        loop.close()
