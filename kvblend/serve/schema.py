"""The requests the server accepts (chat and legacy completions), and the OpenAI error shape for what it refuses.

Parsed by hand rather than by a pydantic model so that every refusal is a 400
in OpenAI's shape naming the offending parameter (a validation framework
answers 422 in its own shape, which OpenAI clients do not understand). A
parameter kvblend cannot honour is refused, never silently ignored: an app
asking for tools must learn it did not get them. Parameters that change
nothing about a greedy answer at their neutral value (``presence_penalty: 0``)
are accepted; so are vLLM's sampling extensions that load-testing tools send
(``ignore_eos``, ``min_tokens``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from kvblend.defaults import DEFAULT_MAX_NEW_TOKENS
from kvblend.options import MODES
from kvblend.serve.chunks import Conversation, conversation, split_blocks

# Accepted and used (both endpoints; `messages` only for chat, `prompt` only for completions).
SUPPORTED = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "n",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "ignore_eos",
    "min_tokens",
    "kvblend",
}
# Accepted and ignored: they change nothing about the answer.
IGNORED = {"user", "metadata", "store", "service_tier", "echo_prompt"}
# Anything else is accepted only at its neutral value (OpenAI's default, or null/false/empty).
NEUTRAL = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "parallel_tool_calls": None,
    "response_format": {"type": "text"},
}
KVBLEND_KEYS = {"mode", "ratio", "top_k", "docs", "store"}
MAX_STOP = 4  # as OpenAI
MAX_N = 8
MAX_TOP_LOGPROBS = 20
MAX_JSON_DEPTH = 64  # a real request nests a few levels; deeper is an attack on the parser


class ApiError(Exception):
    """A refusal with its HTTP status, in OpenAI's {"error": {message, type, code, param}} shape."""

    def __init__(
        self, status: int, message: str, code: str, type: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, type, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param=param)


@dataclass
class ChatRequest:
    """One completion request (chat or legacy), validated; the `kvblend` object's fields are the last five."""

    question: str
    chunks: list[str] = field(default_factory=list)
    system: str | None = None
    history: list[tuple[str, str]] = field(default_factory=list)  # earlier (role, text) turns
    model: str | None = None
    max_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0  # greedy unless asked: answers match `kvblend query` (OpenAI's default is 1)
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    include_usage: bool = False
    legacy: bool = False  # /v1/completions: text choices, not messages
    mode: str | None = None
    ratio: float | None = None
    top_k: int | None = None  # None: retrieval's default without client chunks, none with them
    docs: list[str] = field(default_factory=list)
    store: bool = True


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 (also for JSON nested deeper than any request needs, which
    would otherwise exhaust the parser's recursion)."""
    if _depth_exceeds(raw, MAX_JSON_DEPTH):
        raise invalid(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate ("\ud800") is no text to tokenize
    except (UnicodeError, ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, 4,300+ digit ints
        reason = "too deeply nested" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise invalid(f"the request body is not valid JSON ({reason})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    return body


def _depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than `limit` (a linear scan, no recursion)."""
    depth, in_string, escaped = 0, False, False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def parse_chat_request(body: dict) -> ChatRequest:
    """Validate a chat completion body; raise ApiError(400) naming the first problem."""
    _refuse_unsupported(body, "messages")
    req = _with_conversation(_conversation(body.get("messages")))
    _sampling(req, body)
    return req


def parse_completion_request(body: dict) -> ChatRequest:
    """Validate a legacy completion body: `prompt` is one string, read as a chat user message's text would be
    (passages separated by <<<chunk>>> lines, the last block the question)."""
    _refuse_unsupported(body, "prompt")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise invalid("prompt must be a non-empty string", "prompt")
    try:
        req = _with_conversation(conversation([], [prompt]))
    except ValueError as exc:
        raise invalid(str(exc), "prompt") from None
    req.legacy = True
    _sampling(req, body)
    given = body.get("logprobs")
    if given is not None and given is not False:  # the legacy API: an integer, the number of alternatives (0 too)
        req.logprobs = True
        req.top_logprobs = _int(given, "logprobs", low=0, high=5) if given is not True else 0
    if body.get("top_logprobs") is not None:
        raise invalid("/v1/completions takes the number of alternatives as logprobs: N", "top_logprobs")
    return req


def _with_conversation(conv: Conversation) -> ChatRequest:
    return ChatRequest(question=conv.question, chunks=conv.chunks, system=conv.system, history=conv.history)


def _sampling(req: ChatRequest, body: dict) -> None:
    req.model = _typed(body, "model", str, None)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(name) is not None:
        req.max_tokens = _int(body[name], name, low=1)
    req.temperature = _number(body, "temperature", req.temperature, 0.0, 2.0)
    req.top_p = _number(body, "top_p", req.top_p, 0.0, 1.0)
    if req.top_p <= 0:
        raise invalid("top_p must be in (0, 1]", "top_p")
    if body.get("seed") is not None:
        # vLLM takes any 64-bit integer; torch's generators take 0..2^63-1
        req.seed = _int(body["seed"], "seed", low=-(2**63), high=2**64 - 1) % 2**63
    if body.get("n") is not None:
        req.n = _int(body["n"], "n", low=1, high=MAX_N)
    req.stop = _stop(body.get("stop"))
    if not req.legacy:
        req.logprobs = bool(_typed(body, "logprobs", bool, False))
        if body.get("top_logprobs") is not None:
            req.top_logprobs = _int(body["top_logprobs"], "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
            if req.top_logprobs and not req.logprobs:
                raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    req.ignore_eos = bool(_typed(body, "ignore_eos", bool, False))
    if body.get("min_tokens") is not None:
        req.min_tokens = _int(body["min_tokens"], "min_tokens", low=0)
        if req.min_tokens > req.max_tokens:
            raise invalid(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({req.max_tokens})", "min_tokens")
    req.stream = bool(_typed(body, "stream", bool, False))
    options = _typed(body, "stream_options", dict, None) or {}
    if options and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    req.include_usage = bool(_typed(options, "include_usage", bool, False))
    _kvblend_options(req, _typed(body, "kvblend", dict, None) or {})


def _stop(value: Any) -> list[str]:
    """`stop`: a string or up to four non-empty strings."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise invalid("stop must be a non-empty string or an array of non-empty strings", "stop")
    if len(items) > MAX_STOP:
        raise invalid(f"stop takes at most {MAX_STOP} sequences, not {len(items)}", "stop")
    return list(dict.fromkeys(items))


def _refuse_unsupported(body: dict, content_key: str) -> None:
    for name, value in body.items():
        if name in SUPPORTED or name in IGNORED or name == content_key:
            continue
        if value in (None, False, [], {}) or (name in NEUTRAL and value == NEUTRAL[name]):
            continue
        raise invalid(
            f"unsupported parameter: {name}={json.dumps(value)[:60]} (kvblend serve does not support it)",
            name,
            code="unsupported_parameter",
        )


def _conversation(messages: Any) -> Conversation:
    """System/developer texts, earlier user and assistant turns, and the last user turn (passages + question)."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty array", "messages")
    system: list[str] = []
    turns: list[tuple[str, list[str]]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            raise invalid(
                f"messages[{i}] has tool calls, which kvblend serve does not support",
                "messages",
                code="unsupported_parameter",
            )
        texts = _texts(message.get("content"), f"messages[{i}].content", optional=role == "assistant")
        if role in ("system", "developer"):
            system.extend(texts)
        elif role in ("user", "assistant"):
            turns.append((role, texts))
        else:
            raise invalid(
                f"messages[{i}].role {role!r} is not supported: send system, developer, user and assistant messages",
                "messages",
                code="unsupported_parameter",
            )
    if not turns or messages[-1].get("role") != "user":
        raise invalid("the last message must be the user's", "messages")
    history = [(role, "\n".join(block for t in texts for block in split_blocks(t))) for role, texts in turns[:-1]]
    try:
        conv = conversation(system, turns[-1][1])
    except ValueError as exc:
        raise invalid(str(exc), "messages") from None
    return Conversation(conv.system, conv.chunks, conv.question, [(r, t) for r, t in history if t])


def _texts(content: Any, where: str, optional: bool = False) -> list[str]:
    """A message content as its text parts: a string, or an array of {"type": "text"} parts."""
    if content is None and optional:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or an array of text parts", "messages")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(
                f"{where}: only text parts are supported, not {kind!r}", "messages", code="unsupported_parameter"
            )
        texts.append(part["text"])
    return texts


def _kvblend_options(req: ChatRequest, options: dict) -> None:
    """The request's `kvblend` object: mode, ratio, top_k, docs, store."""
    unknown = sorted(set(options) - KVBLEND_KEYS)
    if unknown:
        raise invalid(
            f"unknown kvblend option(s): {', '.join(unknown)} (known: {', '.join(sorted(KVBLEND_KEYS))})",
            "kvblend",
            code="unsupported_parameter",
        )
    req.mode = _typed(options, "mode", str, None)
    if req.mode is not None and req.mode not in MODES:
        raise invalid(f"kvblend.mode must be one of {', '.join(MODES)}", "kvblend")
    if options.get("ratio") is not None:
        req.ratio = _number(options, "ratio", 0.0, 0.0, 1.0)
    if options.get("top_k") is not None:
        req.top_k = _int(options["top_k"], "kvblend.top_k", low=0)
        if req.top_k == 0 and not req.chunks and not options.get("docs"):
            raise invalid(
                "kvblend.top_k 0 retrieves nothing: send passages, name docs, or ask for 1 or more", "kvblend"
            )
    docs = _typed(options, "docs", list, None) or []
    if not all(isinstance(d, str) and d for d in docs):
        raise invalid("kvblend.docs must be an array of document names", "kvblend")
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
        raise invalid(f"{name} must be at least {low}" + (f" and at most {high}" if high is not None else ""), name)
    return value
