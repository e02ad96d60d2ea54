"""Response bodies in OpenAI's shapes (chat completions and legacy completions), each carrying what kvblend did
in a `kvblend` object.

Built from the `openai` package's own response types, so a body is the shape
the official client parses, checked field by field as it is built. Those
types keep fields they do not declare (pydantic's extra="allow"; a client sees
them as `response.model_extra`), so the `kvblend` report rides along without
breaking any client. A body is dumped with only the fields set here (an
explicit null included), as OpenAI sends them.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, cast

from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.completion_choice import Logprobs
from pydantic import BaseModel

from kvblend.pipeline.results import QueryResult
from kvblend.serve.async_bridge import Completed
from kvblend.serve.chunks import segments_report

ChatFinish = Literal["stop", "length"]  # how a choice ends here (the scheduler's ChoiceResult.finish_reason)
LegacyFinish = Literal["stop", "length"]


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


def usage(done: Completed) -> CompletionUsage:
    completion = sum(len(c.token_ids) for c in done.choices)
    prompt = done.result.prompt_tokens
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def chat_logprobs(entries: list[dict] | None) -> ChoiceLogprobs | None:
    return None if entries is None else ChoiceLogprobs(content=_token_logprobs(entries))


def _token_logprobs(entries: list[dict]) -> list[ChatCompletionTokenLogprob]:
    return [ChatCompletionTokenLogprob.model_validate(e) for e in entries]


def legacy_logprobs(entries: list[dict] | None, start: int = 0) -> Logprobs | None:
    """The legacy completions API's logprobs: parallel lists, the alternatives as {token: logprob}; `start`: the
    text offset of the first entry (a streamed chunk's, counted from the answer's start)."""
    if entries is None:
        return None
    offsets, at = [], start
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return Logprobs(
        tokens=[e["token"] for e in entries],
        token_logprobs=[e["logprob"] for e in entries],
        top_logprobs=[{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        text_offset=offsets,
    )


def _dump(body: BaseModel, kvblend: dict | None = None) -> dict:
    """A response model as its JSON object: the fields set here (an explicit null too), then kvblend's extension."""
    out = body.model_dump(mode="json", exclude_unset=True)
    return out if kvblend is None else {**out, "kvblend": kvblend}


def completion_body(
    cid: str, model: str, done: Completed, queue_wait_s: float, legacy: bool, created: int | None = None
) -> dict:
    """A non-streamed `chat.completion` (or legacy `text_completion`); `created`: when the request came (OpenAI
    and vLLM stamp a request once, and every chunk of a stream alike), else now."""
    created = int(time.time()) if created is None else created
    report = kvblend_report(done.result, queue_wait_s)
    if legacy:
        choices = [
            CompletionChoice(
                index=c.index,
                text=c.text,
                finish_reason=cast(LegacyFinish, c.finish_reason),
                logprobs=legacy_logprobs(c.logprobs),
            )
            for c in done.choices
        ]
        legacy_body = Completion(
            id=cid, object="text_completion", created=created, model=model, choices=choices, usage=usage(done)
        )
        return _dump(legacy_body, report)
    chat_choices = [
        ChatChoice(
            index=c.index,
            message=ChatCompletionMessage(role="assistant", content=c.text),
            finish_reason=cast(ChatFinish, c.finish_reason),
            logprobs=chat_logprobs(c.logprobs),
        )
        for c in done.choices
    ]
    body = ChatCompletion(
        id=cid, object="chat.completion", created=created, model=model, choices=chat_choices, usage=usage(done)
    )
    return _dump(body, report)


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
    kvblend: dict | None = None,
    created: int | None = None,
) -> dict:
    """One streamed chunk of a choice (`kvblend`: the report, on the first choice's final chunk)."""
    created = int(time.time()) if created is None else created
    if legacy:
        # A legacy chunk is a `Completion` whose choice has no finish_reason until the last one: OpenAI streams a
        # null there, which the type does not allow, so the choice is built unvalidated (as the client reads it).
        choice = CompletionChoice.construct(
            index=index,
            text=text or "",
            finish_reason=finish,
            logprobs=legacy_logprobs(logprobs, text_offset) if logprobs else None,
        )
        chunk = Completion(id=cid, object="text_completion", created=created, model=model, choices=[choice])
        return _dump(chunk, kvblend)
    if role:
        delta = ChoiceDelta(role="assistant", content="")
    else:
        delta = ChoiceDelta(content=text) if text else ChoiceDelta()
    chunk_choice = ChunkChoice(
        index=index,
        delta=delta,
        finish_reason=cast(ChatFinish | None, finish),
        logprobs=ChunkLogprobs(content=_token_logprobs(logprobs)) if logprobs else None,
    )
    chat_chunk = ChatCompletionChunk(
        id=cid, object="chat.completion.chunk", created=created, model=model, choices=[chunk_choice]
    )
    return _dump(chat_chunk, kvblend)


def usage_chunk(cid: str, model: str, legacy: bool, done: Completed, created: int | None = None) -> dict:
    """The stream's last chunk when `stream_options.include_usage` asks: no choices, the usage."""
    created = int(time.time()) if created is None else created
    if legacy:
        return _dump(
            Completion(id=cid, object="text_completion", created=created, model=model, choices=[], usage=usage(done))
        )
    return _dump(
        ChatCompletionChunk(
            id=cid, object="chat.completion.chunk", created=created, model=model, choices=[], usage=usage(done)
        )
    )


def models_body(model: str, created: int) -> dict:
    """`GET /v1/models`: the one model this server holds."""
    return {"object": "list", "data": [_dump(Model(id=model, object="model", created=created, owned_by="kvblend"))]}
