"""Render Hugging Face chat templates with jinja2, the way ``transformers.apply_chat_template`` does.

Environment (per the transformers chat-templating docs): ``ImmutableSandboxedEnvironment`` (templates are
untrusted code), ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter that does not HTML-escape, globals ``raise_exception(msg)`` and ``strftime_now(fmt)``, and the
``{% generation %}`` block tag (rendered as its body). Variables: ``messages``, ``add_generation_prompt``,
``tools``, ``documents``, ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` and any extra kwargs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.text.tokenizer import TextTokenizer


class ChatTemplateError(ValueError):
    """The template is missing, does not parse, or called ``raise_exception`` (message says which)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text in some templates; render the body."""

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API uses a class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile (and cache) a chat template source string.

    Raises:
        ChatTemplateError: the template has a syntax error.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from exc


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    special_tokens: Mapping[str, str | None] | None = None,
    **extra: Any,
) -> str:
    """The prompt text for ``messages`` (dicts with ``role``, ``content``, …).

    ``special_tokens`` supplies ``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token`` strings.

    Raises:
        ChatTemplateError: syntax error, ``raise_exception`` called by the template, or a render error.
    """
    context: dict[str, Any] = {**(special_tokens or {}), **extra}
    context.update(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                   tools=tools, documents=documents)
    try:
        return compile_chat_template(template).render(**context)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc


def apply_chat_template(
    tokenizer: TextTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **extra: Any,
) -> str:
    """Render with ``chat_template`` or the tokenizer's own; its special tokens become variables.

    Tokenize the result with ``tokenizer.encode(text, add_special_tokens=False)`` (the template already
    places bos), as transformers does.

    Raises:
        ChatTemplateError: no template given and the tokenizer has none, or rendering failed.
    """
    template = chat_template or tokenizer.chat_template
    if template is None:
        raise ChatTemplateError("the tokenizer has no chat template and none was given")
    specials = {name: getattr(tokenizer.special, name) for name in
                ("bos_token", "eos_token", "unk_token", "pad_token")}
    return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                special_tokens=specials, **extra)
