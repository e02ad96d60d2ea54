"""Response bodies in OpenAI's shapes (chat completions and legacy completions), each carrying what kvblend did
in a `kvblend` object.

OpenAI clients keep fields they do not know (`response.model_extra`), so the
`kvblend` report rides along without breaking any client.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from kvblend.pipeline.results import QueryResult
from kvblend.serve.async_bridge import ChoiceResult, Completed
from kvblend.serve.chunks import segments_report


def completion_id(legacy: bool = False) -> str:
    return f"{'cmpl' if legacy else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"


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


def usage(done: Completed) -> dict:
    completion = sum(len(c.token_ids) for c in done.choices)
    prompt = done.result.prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries}


def legacy_logprobs(entries: list[dict] | None, start: int = 0) -> dict | None:
    """The legacy completions API's logprobs: parallel lists, the alternatives as {token: logprob}; `start`: the
    text offset of the first entry (a streamed chunk's, counted from the answer's start)."""
    if entries is None:
        return None
    offsets, at = [], start
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def _choice(choice: ChoiceResult, legacy: bool) -> dict:
    if legacy:
        return {
            "index": choice.index,
            "text": choice.text,
            "finish_reason": choice.finish_reason,
            "logprobs": legacy_logprobs(choice.logprobs),
        }
    return {
        "index": choice.index,
        "message": {"role": "assistant", "content": choice.text},
        "finish_reason": choice.finish_reason,
        "logprobs": chat_logprobs(choice.logprobs),
    }


def completion_body(cid: str, model: str, done: Completed, queue_wait_s: float, legacy: bool) -> dict:
    """A non-streamed `chat.completion` (or legacy `text_completion`)."""
    return {
        "id": cid,
        "object": "text_completion" if legacy else "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(c, legacy) for c in done.choices],
        "usage": usage(done),
        "kvblend": kvblend_report(done.result, queue_wait_s),
    }


def chunk_body(
    cid: str,
    model: str,
    index: int,
    legacy: bool,
    text: str | None = None,
    role: bool = False,
    finish: str | None = None,
    logprobs: list[dict] | None = None,
    text_offset: int = 0,
    **extra: Any,
) -> dict:
    """One streamed chunk of a choice (extra: usage, kvblend, or choices=[] for the usage chunk)."""
    if legacy:
        choice: dict = {
            "index": index,
            "text": text or "",
            "finish_reason": finish,
            "logprobs": legacy_logprobs(logprobs, text_offset) if logprobs else None,
        }
    else:
        delta: dict = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {
            "index": index,
            "delta": delta,
            "finish_reason": finish,
            "logprobs": chat_logprobs(logprobs) if logprobs else None,
        }
    body = {
        "id": cid,
        "object": "text_completion" if legacy else "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    body.update(extra)
    return body


def models_body(model: str, created: int) -> dict:
    """`GET /v1/models`: the one model this server holds."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "kvblend"}]}
