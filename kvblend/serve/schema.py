"""The chat request as the server accepts it, and the OpenAI error shape for what it refuses.

Parsed by hand rather than by a pydantic model so that every refusal is a 400
in OpenAI's shape naming the offending parameter (a validation framework
answers 422 in its own shape, which OpenAI clients do not understand). A
parameter kvblend cannot honour is refused, never silently ignored: an app
asking for n=2 or tools must learn it did not get them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from kvblend.defaults import DEFAULT_MAX_NEW_TOKENS
from kvblend.options import MODES
from kvblend.serve.chunks import conversation

# Accepted and used.
SUPPORTED = {"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
             "stream", "stream_options", "kvblend"}
# Accepted and ignored: they change nothing about the answer.
IGNORED = {"user", "metadata", "store", "service_tier"}
# Anything else is accepted only at its neutral value (OpenAI's default, or null/false/empty).
NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "top_logprobs": 0}
KVBLEND_KEYS = {"mode", "ratio", "top_k", "docs", "store"}


class ApiError(Exception):
    """A refusal with its HTTP status, in OpenAI's {"error": {message, type, code, param}} shape."""

    def __init__(self, status: int, message: str, code: str, type: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, type, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param=param)


@dataclass
class ChatRequest:
    """One chat completion request, validated; `kvblend_*` fields come from its `kvblend` object."""

    question: str
    chunks: list[str] = field(default_factory=list)
    system: str | None = None
    model: str | None = None
    max_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0  # greedy unless asked: answers match `kvblend query` (OpenAI's default is 1)
    top_p: float = 1.0
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    mode: str | None = None
    ratio: float | None = None
    top_k: int | None = None  # None: retrieval's default without client chunks, none with them
    docs: list[str] = field(default_factory=list)
    store: bool = True


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    return body


def parse_chat_request(body: dict) -> ChatRequest:
    """Validate a chat completion body; raise ApiError(400) naming the first problem."""
    _refuse_unsupported(body)
    conv = _conversation(body.get("messages"))
    req = ChatRequest(question=conv.question, chunks=conv.chunks, system=conv.system)
    req.model = _typed(body, "model", str, None)
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if tokens is not None:
        req.max_tokens = _int(tokens, "max_tokens", low=1)
    req.temperature = _number(body, "temperature", req.temperature, 0.0, 2.0)
    req.top_p = _number(body, "top_p", req.top_p, 0.0, 1.0)
    if req.top_p <= 0:
        raise invalid("top_p must be in (0, 1]", "top_p")
    if body.get("seed") is not None:
        req.seed = _int(body["seed"], "seed", low=0, high=2**63 - 1)
    req.stream = bool(_typed(body, "stream", bool, False))
    options = _typed(body, "stream_options", dict, None) or {}
    req.include_usage = bool(options.get("include_usage", False)) and req.stream
    _kvblend_options(req, _typed(body, "kvblend", dict, None) or {})
    return req


def _refuse_unsupported(body: dict) -> None:
    for name, value in body.items():
        if name in SUPPORTED or name in IGNORED:
            continue
        if value in (None, False, [], {}) or (name in NEUTRAL and value == NEUTRAL[name]):
            continue
        raise invalid(f"unsupported parameter: {name}={json.dumps(value)[:60]} (kvblend serve does not support it)",
                      name, code="unsupported_parameter")


def _conversation(messages: Any):
    """System/developer texts and user text parts; one question, no assistant turns."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty array", "messages")
    system, user = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        texts = _texts(message.get("content"), f"messages[{i}].content")
        if role in ("system", "developer"):
            system.extend(texts)
        elif role == "user":
            user.extend(texts)
        else:
            raise invalid(f"messages[{i}].role {role!r} is not supported: send system and user messages "
                          "(kvblend answers one question, without earlier turns)", "messages",
                          code="unsupported_parameter")
    if messages[-1].get("role") != "user":
        raise invalid("the last message must be the user's", "messages")
    try:
        return conversation(system, user)
    except ValueError as exc:
        raise invalid(str(exc), "messages") from None


def _texts(content: Any, where: str) -> list[str]:
    """A message content as its text parts: a string, or an array of {"type": "text"} parts."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or an array of text parts", "messages")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"{where}: only text parts are supported, not {kind!r}", "messages",
                          code="unsupported_parameter")
        texts.append(part["text"])
    return texts


def _kvblend_options(req: ChatRequest, options: dict) -> None:
    """The request's `kvblend` object: mode, ratio, top_k, docs, store."""
    unknown = sorted(set(options) - KVBLEND_KEYS)
    if unknown:
        raise invalid(f"unknown kvblend option(s): {', '.join(unknown)} (known: {', '.join(sorted(KVBLEND_KEYS))})",
                      "kvblend", code="unsupported_parameter")
    req.mode = _typed(options, "mode", str, None)
    if req.mode is not None and req.mode not in MODES:
        raise invalid(f"kvblend.mode must be one of {', '.join(MODES)}", "kvblend")
    if options.get("ratio") is not None:
        req.ratio = _number(options, "ratio", 0.0, 0.0, 1.0)
    if options.get("top_k") is not None:
        req.top_k = _int(options["top_k"], "kvblend.top_k", low=0)
    docs = _typed(options, "docs", list, None) or []
    if not all(isinstance(d, str) and d for d in docs):
        raise invalid("kvblend.docs must be an array of document paths", "kvblend")
    req.docs = docs
    req.store = bool(_typed(options, "store", bool, True))


def _typed(obj: dict, name: str, kind: type, default: Any) -> Any:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise invalid(f"{name} must be a {kind.__name__ if kind is not dict else 'object'}", name)
    return value


def _number(obj: dict, name: str, default: float, low: float, high: float) -> float:
    value = obj.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"{name} must be a number", name)
    if not low <= value <= high:
        raise invalid(f"{name} must be between {low:g} and {high:g}, not {value}", name)
    return float(value)


def _int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer", name)
    if value < low or (high is not None and value > high):
        raise invalid(f"{name} must be at least {low}" + (f" and at most {high}" if high else ""), name)
    return value
