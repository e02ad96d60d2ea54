"""Response bodies in OpenAI's shapes, each carrying what kvblend did in a `kvblend` object.

OpenAI clients keep fields they do not know (`response.model_extra`), so the
`kvblend` report rides along without breaking any client.
"""

from __future__ import annotations

import time
import uuid

from kvblend.pipeline.results import QueryResult
from kvblend.serve.chunks import segments_report


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def request_share(result: QueryResult) -> float:
    """Compute this request did, as a share of a full prefill of its prompt.

    The fusion's recomputed token-layers, plus the passages that missed the
    archive and were prefilled alone (every layer) to be stored: on a miss the
    share is high, on the next request's hit it falls to the fusion's alone.
    """
    stored = sum(s.tokens for s in result.segments if s.stored)
    return result.recompute_share + stored / max(1, result.prompt_tokens)


def kvblend_report(result: QueryResult, queue_wait_s: float) -> dict:
    """The response's `kvblend` object."""
    return {
        "mode": result.mode,
        "ratio": result.ratio,
        "ttft_s": round(result.ttft_s, 4),
        "queue_wait_s": round(queue_wait_s, 4),
        "load_wait_s": round(result.load_wait_s, 4),
        "recompute_share": round(request_share(result), 4),
        "fusion_recompute_share": round(result.recompute_share, 4),
        "prompt_tokens": result.prompt_tokens,
        "prefix_cached": result.prefix_cached,
        "segments": segments_report(result.segments),
        "warnings": result.warnings,
    }


def finish_reason(result: QueryResult, max_tokens: int) -> str:
    """'length' when generation stopped at max_tokens, else 'stop'."""
    gen = result.generation
    if gen is not None and not gen.stopped_on_eos and len(gen.token_ids) >= max_tokens:
        return "length"
    return "stop"


def usage(result: QueryResult) -> dict:
    completion = len(result.generation.token_ids) if result.generation is not None else 0
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion}


def completion_body(cid: str, model: str, result: QueryResult, max_tokens: int, queue_wait_s: float) -> dict:
    """A non-streamed `chat.completion`."""
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": result.answer},
            "finish_reason": finish_reason(result, max_tokens),
            "logprobs": None,
        }],
        "usage": usage(result),
        "kvblend": kvblend_report(result, queue_wait_s),
    }


def chunk_body(cid: str, model: str, delta: dict, finish: str | None = None, **extra) -> dict:
    """One streamed `chat.completion.chunk` (extra: usage, kvblend, or choices=[] for the usage chunk)."""
    body = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
    body.update(extra)
    return body


def models_body(model: str, created: int) -> dict:
    """`GET /v1/models`: the one model this server holds."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "kvblend"}]}
