"""A checkpoint's tokenizer: `tokenizer.json` through `tokenizers`, its chat template through jinja2.

transformers' tokenizer classes are a layer over the same Rust `tokenizers`
object plus a jinja2 chat template; kvblend uses only that, so it reads both
itself (see kvblend.model.transformer for why transformers stays out of a
command's start-up). What transformers adds and kvblend keeps:

* special tokens by name (`bos_token`, `eos_token`, ... from tokenizer_config.json);
* the chat template rendered as transformers renders it: a sandboxed jinja2
  environment with trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now`,
  a `tojson` that does not escape HTML, and the special tokens as variables;
* `clean_up_tokenization_spaces` on decode where the config asks for it.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kvblend.errors import ModelNotFoundError, UnsupportedModelError
from kvblend.model.config import read_json_object

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TextTokenizer:
    """Encode, decode and render chats with a checkpoint's own tokenizer files."""

    def __init__(self, backend: Tokenizer, config: dict[str, Any], chat_template: str | None):
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map: dict[str, str] = {}
        for name in _SPECIAL_NAMES:
            value = config.get(name)
            if isinstance(value, dict):  # older files: an AddedToken spelled out
                value = value.get("content")
            if isinstance(value, str) and backend.token_to_id(value) is not None:
                self.special_tokens_map[name] = value

    @classmethod
    def read(cls, directory: Path) -> TextTokenizer:
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, where transformers v5 writes it)."""
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelNotFoundError(f"no tokenizer.json in {directory} (kvblend reads fast tokenizers only)")
        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ModelNotFoundError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else e}") from None
        config_path = directory / "tokenizer_config.json"
        config = read_json_object(config_path) if config_path.is_file() else {}
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return cls(backend, config, template if isinstance(template, str) and template.strip() else None)

    def __len__(self) -> int:
        """The vocabulary with added tokens, as len() of a transformers tokenizer."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # ── special tokens ──
    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend_tokenizer.token_to_id(token)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)

    # ── text ──
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids; with `add_special_tokens` the file's post-processor adds what it adds (BOS, for Gemma)."""
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat template renders it (text, not ids).

        Templates that allow no system turn (Mistral v0.1/v0.2, Gemma 1: "Conversation roles must alternate")
        get the system text in front of the first user message, as other servers do; a template that still
        refuses, or does not parse, is one line naming it, not a jinja traceback."""
        import jinja2

        if self.chat_template is None:
            raise ModelNotFoundError("this model has no chat template")
        try:
            template = self._template
        except jinja2.TemplateError as e:
            raise UnsupportedModelError(f"the model's chat template does not parse: {e}") from None
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens_map
            )
        except jinja2.TemplateError as e:
            merged = _system_into_user(messages)
            if merged is not None:
                try:
                    return template.render(
                        messages=merged, add_generation_prompt=add_generation_prompt, **self.special_tokens_map
                    )
                except jinja2.TemplateError:
                    pass
            raise UnsupportedModelError(f"the model's chat template refused the prompt: {e}") from None

    @cached_property
    def _template(self) -> Any:
        """Compiled once: transformers' environment (chat templates are untrusted code: sandboxed)."""
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(
            x: Any,
            ensure_ascii: bool = False,
            indent: int | None = None,
            separators: Any = None,
            sort_keys: bool = False,
        ) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template or "")


def _system_into_user(messages: list[dict[str, str]]) -> list[dict[str, str]] | None:
    """The conversation with its system turns put in front of the first user turn; None if it has none."""
    system = [m["content"] for m in messages if m.get("role") == "system"]
    rest = [dict(m) for m in messages if m.get("role") != "system"]
    if not system or not rest or rest[0].get("role") != "user":
        return None
    rest[0]["content"] = "\n\n".join([*system, rest[0]["content"]])
    return rest


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text
