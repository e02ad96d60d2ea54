"""`kvblend serve`'s Prometheus text, response bodies and error mapping: no model, no server."""

from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

from kvblend.errors import ArchiveBusyError, ArchiveError, UsageError
from kvblend.errors import NotFoundError
from kvblend.pipeline.query import ContextLengthError
from kvblend.pipeline.results import SegmentInfo
from kvblend.serve.app import error_for
from kvblend.serve.metrics import Metrics
from kvblend.serve.responses import chunk_body, completion_body, request_share
from kvblend.serve.async_bridge import ChoiceResult, Completed
from kvblend.serve.schema import ApiError, ChatRequest
from kvblend.serve.mapping import query_options

SAMPLE = re.compile(r'^[a-z_]+(\{[a-z]+="[^"]*"\})? -?[0-9.e+-]+$')


def test_metrics_text_is_prometheus_exposition():
    m = Metrics()
    m.request(200), m.request(200), m.request(429)
    m.answered(0.3, 0.25, ["hit", "computed", "hit"])
    m.answered(4.0, 1.1, ["computed"])
    outcomes = {"submitted": 7, "stop": 3, "length": 1, "abort": 2, "error": 0}
    text = m.render(queue_depth=3, busy=True, outcomes=outcomes)
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or SAMPLE.match(line), line
    assert 'kvblend_requests_total{status="200"} 2' in text
    assert 'kvblend_requests_total{status="429"} 1' in text
    assert 'kvblend_ttft_seconds_bucket{le="0.5"} 1' in text  # cumulative buckets
    assert 'kvblend_ttft_seconds_bucket{le="5.0"} 2' in text
    assert 'kvblend_ttft_seconds_bucket{le="+Inf"} 2' in text and "kvblend_ttft_seconds_count 2" in text
    assert 'kvblend_segments_total{source="hit"} 2' in text
    assert 'kvblend_segments_total{source="computed"} 2' in text
    assert "kvblend_queue_depth 3" in text and "kvblend_busy 1" in text
    assert "# TYPE kvblend_recompute_share histogram" in text
    assert "# TYPE kvblend_scheduler_submitted_total counter" in text and "kvblend_scheduler_submitted_total 7" in text
    assert 'kvblend_scheduler_finished_total{status="abort"} 2' in text
    assert 'kvblend_scheduler_finished_total{status="error"} 0' in text
    assert "kvblend_scheduler" not in Metrics().render(queue_depth=0, busy=False)  # only once sampled


def fake_result(stored_tokens=0, eos=False, n_tokens=4):
    segments = [SegmentInfo("a", None, 20, True, stored=stored_tokens > 0)]
    gen = SimpleNamespace(token_ids=list(range(n_tokens)), stopped_on_eos=eos)
    return SimpleNamespace(answer="Halifax", mode="blend", ratio=0.15, ttft_s=0.5, load_wait_s=0.01,
                           recompute_share=0.25, prompt_tokens=80, prefix_cached=True, segments=segments,
                           warnings=[], generation=gen)


def test_recompute_share_counts_passages_prefilled_to_be_stored():
    assert request_share(fake_result()) == 0.25
    assert request_share(fake_result(stored_tokens=20)) == 0.25 + 20 / 80


def test_completion_body_is_openai_shaped_with_a_kvblend_report():
    logprobs = [{"token": "Hal", "logprob": -0.1, "bytes": [72], "top_logprobs": [{"token": "Hal", "logprob": -0.1}]}]
    done = Completed(fake_result(), [ChoiceResult(0, "Halifax", [1, 2, 3, 4], "length", logprobs),
                                     ChoiceResult(1, "Bergen", [5, 6], "stop", None)])
    body = completion_body("chatcmpl-1", "m", done, queue_wait_s=0.2, legacy=False)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "Halifax"
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["choices"][0]["logprobs"] == {"content": logprobs} and body["choices"][1]["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 80, "completion_tokens": 6, "total_tokens": 86}
    report = body["kvblend"]
    assert {"ttft_s", "recompute_share", "segments", "load_wait_s"} <= set(report)
    assert report["segments"][0]["source"] == "hit"
    legacy = completion_body("cmpl-1", "m", done, queue_wait_s=0.2, legacy=True)
    assert legacy["object"] == "text_completion" and legacy["choices"][0]["text"] == "Halifax"
    assert legacy["choices"][0]["logprobs"]["tokens"] == ["Hal"]
    chunk = chunk_body("chatcmpl-1", "m", 0, False, "x")
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["delta"] == {"content": "x"}


def test_errors_map_to_statuses_users_can_act_on():
    assert error_for(NotFoundError("no such document")).status == 404
    too_long = error_for(ContextLengthError(9000, 64, 8192))
    assert "--top-k" in str(ContextLengthError(9000, 64, 8192))  # the CLI's own message names its flag
    assert (too_long.status, too_long.code, too_long.param) == (400, "context_length_exceeded", "messages")
    assert "--top-k" not in too_long.message and "kvblend.top_k" in too_long.message
    long_answer = error_for(ContextLengthError(67, 9000, 8192)).message  # the client's fields, the real room
    assert long_answer.endswith("max_completion_tokens (max_tokens) must be at most 8125 for this prompt")
    assert error_for(ContextLengthError(9000, 64, 8192), legacy=True).param == "prompt"  # /v1/completions
    assert error_for(UsageError("bad ratio")).status == 400
    assert error_for(ArchiveBusyError("busy")).status == 503
    assert error_for(ArchiveError("broken")).status == 500
    bug = error_for(RuntimeError("boom"))
    assert bug.status == 500 and "boom" not in bug.message  # no internals leak
    given = ApiError(429, "full", "rate_limit_exceeded")
    assert error_for(given) is given


def test_errors_never_name_the_servers_paths():
    """The archive's directory (as given and as its real path) never reaches a client, whatever the error."""
    hidden = ("/srv/kv", "/mnt/disk1/kv")
    empty = error_for(UsageError("the archive at /srv/kv is empty: run `kvblend ingest PATH` first"), hidden)
    assert empty.message.startswith("the archive at <archive> is empty") and "/srv" not in empty.message
    corrupt = error_for(ArchiveError("corrupt blob /mnt/disk1/kv/blobs/ab/cd.kv"), hidden)
    assert corrupt.message == "corrupt blob <archive>/blobs/ab/cd.kv" and corrupt.status == 500


def test_client_chunks_replace_retrieval_unless_top_k_asks_for_it():
    assert query_options(ChatRequest(question="Q", chunks=["A"])).top_k == 0
    assert query_options(ChatRequest(question="Q", chunks=["A"], top_k=2)).top_k == 2
    opts = query_options(ChatRequest(question="Q", system="Be brief.", store=False, max_tokens=5))
    assert opts.top_k > 0 and opts.template.system == "Be brief." and not opts.store_context
    assert opts.sampling.max_new_tokens == 5 and opts.context_texts == ()


def test_the_cli_module_imports_neither_fastapi_nor_torch():
    code = ("import sys, kvblend.cli.serve_cmds; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
