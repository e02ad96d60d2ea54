"""The requests the server accepts (chat and legacy completions) as pydantic models, and the OpenAI error shape
for what it refuses.

A body is validated by the models below; `refusal` turns pydantic's first
error into a 400 in OpenAI's shape naming the offending parameter, as vLLM's
handler does (FastAPI's own answer to a validation error is a 422 in its own
shape, which OpenAI clients do not understand). The wording stays kvblend's
("n must be at least 1 and at most 8"): each error names where it is
("messages[2].content", "kvblend.ratio") and says what would be accepted.
The models are strict (no "5" for 5, no true for 1), as the OpenAI API is.

A parameter kvblend cannot honour is refused, never silently ignored: an app
asking for tools must learn it did not get them. Parameters that change
nothing about a greedy answer at their neutral value (``presence_penalty: 0``)
are accepted; so are vLLM's sampling extensions that load-testing tools send
(``ignore_eos``, ``min_tokens``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvblend.defaults import DEFAULT_MAX_NEW_TOKENS
from kvblend.options import MODES
from kvblend.serve.chunks import Conversation, conversation, split_blocks

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
    # vLLM's sampling extras that clients send at their defaults: top_k off (-1, or 0 in newer vLLM), min_p off
    "top_k": (-1, 0),
    "min_p": 0,
}


def _empty(value: Any) -> bool:
    """null, false or empty, by type: `0 in (None, False)` is true in Python, and 0 is a value (a
    repetition_penalty of 0 or best_of 0 is a request vLLM refuses, not an absent one)."""
    return value is None or value is False or (isinstance(value, (list, dict)) and not value)


def _neutral(name: str, value: Any) -> bool:
    """The parameter's default, of its own type: `true` is no best_of of 1."""
    if name not in NEUTRAL:
        return False
    neutral = NEUTRAL[name]
    if isinstance(neutral, tuple):  # several spellings of "off", each of its exact type (a top_k of 0.0 is none)
        return any(type(value) is type(n) and value == n for n in neutral)
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


MAX_STOP = 4  # as OpenAI
MAX_N = 8
MAX_TOP_LOGPROBS = 20
MAX_LEGACY_LOGPROBS = 5
MAX_JSON_DEPTH = 64  # a real request nests a few levels; deeper is an attack on the parser
WHERE = "{where}"  # in a refusal's wording: the parameter's path, filled in by `refusal`


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


# ── refusals: pydantic's errors in kvblend's words ──
# pydantic's error types for a value of the wrong JSON type, as kvblend has always worded them
TYPE_PHRASES = {
    "int_type": "{where} must be an integer",
    "float_type": "{where} must be a number",
    "finite_number": "{where} must be a number",
    "string_type": "{where} must be a str",
    "bool_type": "{where} must be a bool",
    "list_type": "{where} must be a list",
    "dict_type": "{where} must be an object",
    "model_type": "{where} must be an object",
    "model_attributes_type": "{where} must be an object",
}
CODES = {"invalid_value", "unsupported_parameter"}  # the error types our own validators raise, used as codes


def refused(phrase: str, code: str = "invalid_value", param: str | None = None) -> PydanticCustomError:
    """A refusal raised inside a model: `phrase` may say {where}; `param` overrides the parameter it names."""
    return PydanticCustomError(code, phrase, {"param": param} if param else None)


def refusal(exc: ValidationError) -> ApiError:
    """The 400 for a body the models refuse: the first error, worded and named as kvblend's API always has."""
    error = exc.errors(include_url=False)[0]
    loc = tuple(error["loc"])
    ctx = error.get("ctx") or {}
    custom = error["type"] in CODES
    phrase = error["msg"] if custom else TYPE_PHRASES.get(error["type"], "{where}: " + error["msg"])
    where = _path(loc)
    message = phrase.replace(WHERE, where) if where else phrase.replace(WHERE, "the request body")
    return invalid(message, ctx.get("param") or _param(loc), error["type"] if custom else "invalid_value")


def _path(loc: tuple) -> str:
    """pydantic's location as a client writes it: messages[2].content, kvblend.ratio."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _param(loc: tuple) -> str | None:
    """The parameter an error names: the path up to the first array index (messages[2].content: messages)."""
    names: list[str] = []
    for part in loc:
        if isinstance(part, int):
            break
        names.append(str(part))
    return ".".join(names) or None


def _in_range(value: int, low: int, high: int | None = None) -> int:
    if value < low or (high is not None and value > high):
        raise refused(f"{WHERE} must be at least {low}" + (f" and at most {high}" if high is not None else ""))
    return value


def _range(low: int, high: int | None = None) -> AfterValidator:
    return AfterValidator(lambda value: _in_range(value, low, high))


def _between(low: float, high: float, above_low: bool = False) -> WrapValidator:
    """A number in [low, high] (or (low, high] when `above_low`); a refusal quotes the number as sent."""

    def check(value: Any, handler: Any) -> float:
        number = handler(value)
        if not low <= number <= high:
            raise refused(f"{WHERE} must be between {low:g} and {high:g}, not {value}")
        if above_low and number <= low:
            raise refused(f"{WHERE} must be in ({low:g}, {high:g}]")
        return float(number)

    return WrapValidator(check)


def _phrased(phrase: str) -> WrapValidator:
    """Any error inside the value becomes one refusal worded as `phrase` (a value of several accepted shapes)."""

    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise refused(phrase) from None

    return WrapValidator(check)


def _stop_list(items: list[str]) -> list[str]:
    if not all(items):
        raise refused(f"{WHERE} must be a non-empty string or an array of non-empty strings")
    if len(items) > MAX_STOP:
        raise refused(f"{WHERE} takes at most {MAX_STOP} sequences, not {len(items)}")
    return list(dict.fromkeys(items))


def _one_of(choices: tuple[str, ...]) -> AfterValidator:
    def check(value: str) -> str:
        if value not in choices:
            raise refused(f"{WHERE} must be one of {', '.join(choices)}")
        return value

    return AfterValidator(check)


Number = Annotated[float, Field(allow_inf_nan=False)]
Stop = Annotated[  # a string or up to four, each non-empty
    list[str],
    BeforeValidator(lambda value: [value] if isinstance(value, str) else value),
    _phrased(f"{WHERE} must be a non-empty string or an array of non-empty strings"),
    AfterValidator(_stop_list),
]


# ── the models ──
class _Strict(BaseModel):
    """No coercion (as the OpenAI API: "5" is no integer); unknown keys are dropped unless a model refuses them."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = None


class KvblendOptions(_Strict):
    """The request's `kvblend` object: what CacheBlend does for this request."""

    mode: Annotated[str, _one_of(MODES)] | None = None
    ratio: Annotated[Number, _between(0.0, 1.0)] | None = None
    top_k: Annotated[int, _range(0)] | None = None  # None: retrieval's default without client chunks, none with them
    docs: (
        Annotated[list[Annotated[str, Field(min_length=1)]], _phrased(f"{WHERE} must be an array of document names")]
        | None
    ) = None
    store: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        unknown = sorted(set(data) - set(cls.model_fields)) if isinstance(data, dict) else []
        if unknown:
            known = ", ".join(sorted(cls.model_fields))
            raise refused(
                f"unknown kvblend option(s): {', '.join(unknown)} (known: {known})", "unsupported_parameter", "kvblend"
            )
        return data


def _text_part(value: Any, handler: Any) -> Any:
    """A content part: only {"type": "text", "text": ...}; any other kind is named in the refusal."""
    try:
        return handler(value)
    except ValidationError:
        kind = value.get("type") if isinstance(value, dict) else type(value).__name__
        if kind == "text":  # a text part with no text, or text that is no string: not a kind of part refused
            raise refused(f"{WHERE}.text must be a string") from None
        raise refused(f"{WHERE}: only text parts are supported, not {kind!r}", "unsupported_parameter") from None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


def _content(value: Any) -> Any:
    """A message's content: a string (one text part), an array of parts, or null (checked per role)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if value is None or isinstance(value, list):
        return value
    raise refused(f"{WHERE} must be a string or an array of text parts")


class Message(_Strict):
    """One chat message; its other keys (a `name`) are dropped."""

    role: Any = None
    content: Annotated[list[Annotated[TextPart, WrapValidator(_text_part)]] | None, BeforeValidator(_content)] = None
    tool_calls: Any = None

    @model_validator(mode="after")
    def _supported(self) -> Message:
        if self.role == "assistant" and self.tool_calls:
            raise refused(f"{WHERE} has tool calls, which kvblend serve does not support", "unsupported_parameter")
        if self.content is None and self.role != "assistant":
            raise refused(f"{WHERE}.content must be a string or an array of text parts")
        if self.role not in ("system", "developer", "user", "assistant"):
            raise refused(
                f"{WHERE}.role {self.role!r} is not supported: send system, developer, user and assistant messages",
                "unsupported_parameter",
            )
        return self

    @property
    def texts(self) -> list[str]:
        return [part.text for part in self.content or []]


def _non_empty_array(value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise refused(f"{WHERE} must be a non-empty array")
    return value


class _Body(_Strict):
    """What both endpoints take: sampling, stop rules, streaming, vLLM's extensions and the `kvblend` object."""

    model: str | None = None
    max_tokens: Annotated[int, _range(1)] | None = None
    max_completion_tokens: Annotated[int, _range(1)] | None = None
    temperature: Annotated[Number, _between(0.0, 2.0)] | None = None
    top_p: Annotated[Number, _between(0.0, 1.0, above_low=True)] | None = None
    seed: Annotated[int, _range(-(2**63), 2**64 - 1)] | None = None  # vLLM: any 64-bit integer
    n: Annotated[int, _range(1, MAX_N)] | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, _range(0)] | None = None
    kvblend: KvblendOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        for name, value in data.items() if isinstance(data, dict) else ():
            if name in cls.model_fields or name in IGNORED:
                continue
            if _empty(value) or _neutral(name, value):
                continue
            raise refused(
                f"unsupported parameter: {name}={json.dumps(value)[:60]} (kvblend serve does not support it)",
                "unsupported_parameter",
                name,
            )
        return data

    @property
    def max_new_tokens(self) -> int:
        given = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return given if given is not None else DEFAULT_MAX_NEW_TOKENS

    def _check_common(self, chunks: list[str]) -> None:
        """The rules across fields, in the order a client fixes them."""
        if self.min_tokens is not None and self.min_tokens > self.max_new_tokens:
            raise refused(
                f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_new_tokens})", param="min_tokens"
            )
        if self.stream_options is not None and not self.stream:
            options = self.stream_options
            if options.model_fields_set or options.model_extra:
                raise refused("stream_options is only allowed when stream is true", param="stream_options")
        kv = self.kvblend
        if kv is not None and kv.top_k == 0 and not chunks and not kv.docs:
            raise refused(
                "kvblend.top_k 0 retrieves nothing: send passages, name docs, or ask for 1 or more", param="kvblend"
            )
        # what `kvblend query` warns of: here refused, as every parameter kvblend cannot honour is
        if kv is not None and kv.ratio is not None and kv.mode not in (None, "blend"):
            raise refused(
                f"kvblend.ratio has no effect with kvblend.mode {kv.mode}: only blend selects tokens to recompute",
                param="kvblend.ratio",
            )
        if kv is not None and kv.top_k and kv.docs:
            raise refused("kvblend.top_k has no effect with kvblend.docs: nothing is retrieved", param="kvblend.top_k")

    def _request(self, conv: Conversation, legacy: bool) -> ChatRequest:
        kv = self.kvblend or KvblendOptions()
        return ChatRequest(
            question=conv.question,
            chunks=conv.chunks,
            system=conv.system,
            history=conv.history,
            model=self.model,
            max_tokens=self.max_new_tokens,
            temperature=self.temperature if self.temperature is not None else ChatRequest.temperature,
            top_p=self.top_p if self.top_p is not None else ChatRequest.top_p,
            seed=None if self.seed is None else self.seed % 2**63,  # torch's generators take 0..2^63-1
            n=self.n or 1,
            stop=self.stop or [],
            ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0,
            stream=bool(self.stream),
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
            legacy=legacy,
            mode=kv.mode,
            ratio=kv.ratio,
            top_k=kv.top_k,
            docs=kv.docs or [],
            store=kv.store if kv.store is not None else True,
        )


class ChatBody(_Body):
    """`POST /v1/chat/completions`: system/developer texts, earlier turns, and the last user turn (passages +
    question)."""

    messages: Annotated[list[Message], BeforeValidator(_non_empty_array)] = Field(None, validate_default=True)
    logprobs: bool | None = None
    top_logprobs: Annotated[int, _range(0, MAX_TOP_LOGPROBS)] | None = None
    _conversation: Conversation = PrivateAttr()

    @model_validator(mode="after")
    def _rules(self) -> ChatBody:
        if self.messages[-1].role != "user":
            raise refused("the last message must be the user's", param="messages")
        self._conversation = _conversation(self.messages)
        if self.top_logprobs and not self.logprobs:
            raise refused("top_logprobs needs logprobs: true", param="top_logprobs")
        self._check_common(self._conversation.chunks)
        return self

    def request(self) -> ChatRequest:
        req = self._request(self._conversation, legacy=False)
        req.logprobs, req.top_logprobs = bool(self.logprobs), self.top_logprobs or 0
        return req


def _legacy_logprobs(value: Any) -> Any:
    """The legacy API's logprobs: the number of alternatives, 0 to 5 (true: 0; false or null: none)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise refused(f"{WHERE} must be an integer")
    return _in_range(value, 0, MAX_LEGACY_LOGPROBS)


def _prompt(value: Any) -> Any:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str) or not value.strip():
        raise refused(f"{WHERE} must be a non-empty string")
    return value


class CompletionBody(_Body):
    """`POST /v1/completions`: `prompt` is one string, read as a chat user message's text would be (passages
    separated by <<<chunk>>> lines, the last block the question)."""

    prompt: Annotated[str, BeforeValidator(_prompt)] = Field(None, validate_default=True)
    logprobs: Annotated[bool | int | None, BeforeValidator(_legacy_logprobs)] = None
    top_logprobs: Any = None
    _conversation: Conversation = PrivateAttr()

    @model_validator(mode="after")
    def _rules(self) -> CompletionBody:
        try:
            self._conversation = conversation([], [self.prompt])
        except ValueError as exc:
            raise refused(str(exc), param="prompt") from None
        if self.top_logprobs is not None:
            raise refused("/v1/completions takes the number of alternatives as logprobs: N", param="top_logprobs")
        self._check_common(self._conversation.chunks)
        return self

    def request(self) -> ChatRequest:
        req = self._request(self._conversation, legacy=True)
        if self.logprobs is not None and self.logprobs is not False:  # an integer (0 too), or true: 0
            req.logprobs, req.top_logprobs = True, 0 if self.logprobs is True else self.logprobs
        return req


def _conversation(messages: list[Message]) -> Conversation:
    """System/developer texts, earlier user and assistant turns, and the last user turn (passages + question)."""
    system = [t for m in messages if m.role in ("system", "developer") for t in m.texts]
    turns = [(m.role, m.texts) for m in messages if m.role in ("user", "assistant")]
    history = [(role, "\n".join(block for t in texts for block in split_blocks(t))) for role, texts in turns[:-1]]
    try:
        conv = conversation(system, turns[-1][1])
    except ValueError as exc:
        raise refused(str(exc), param="messages") from None
    return Conversation(conv.system, conv.chunks, conv.question, [(r, t) for r, t in history if t])


def parse_chat_request(body: dict) -> ChatRequest:
    """Validate a chat completion body; raise ApiError(400) naming the first problem."""
    try:
        return ChatBody.model_validate(body).request()
    except ValidationError as exc:
        raise refusal(exc) from None


def parse_completion_request(body: dict) -> ChatRequest:
    """Validate a legacy completion body; raise ApiError(400) naming the first problem."""
    try:
        return CompletionBody.model_validate(body).request()
    except ValidationError as exc:
        raise refusal(exc) from None
