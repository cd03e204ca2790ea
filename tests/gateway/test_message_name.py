"""A message's ``name`` goes to the chat template and is honoured where the template uses it; where it
does not (SmolLM2's, which never reads it), the name would be dropped without a word, so it is a 400
(``unsupported_parameter``) naming ``messages.<i>.name``, judged per role: a template that renders the
names of user messages only refuses the name of an assistant message."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gateway.errors import APIError
from gateway.openai_requests import ChatCompletionRequest
from gateway.prepare import render_messages
from gateway.text import TextProcessor


def _render(proc: TextProcessor, messages: list[dict[str, Any]]) -> str:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    return render_messages(proc, body.message_dicts(), None)


def _with_template(proc: TextProcessor, template: str) -> TextProcessor:
    tokenizer = copy.copy(proc.tokenizer)
    tokenizer.chat_template = template
    return TextProcessor(tokenizer)


def test_a_template_that_never_reads_name_refuses_it(proc: TextProcessor) -> None:
    with pytest.raises(APIError) as err:
        _render(proc, [{"role": "system", "content": "Be brief."},
                       {"role": "user", "name": "bob", "content": "hi"}])
    e = err.value
    assert (e.status, e.param, e.code) == (400, "messages.1.name", "unsupported_parameter")
    assert "chat template does not use the name" in e.message
    assert _render(proc, [{"role": "user", "content": "hi"}])  # without a name: fine


def test_a_template_that_renders_names_gets_them(proc: TextProcessor) -> None:
    own = _with_template(proc, "{% for m in messages %}{{ m.role }}"
                               "{% if m.name %}({{ m.name }}){% endif %}:{{ m.content }};{% endfor %}")
    text = _render(own, [{"role": "user", "name": "bob", "content": "hi"},
                         {"role": "assistant", "name": "ann", "content": "yo"}])
    assert text == "user(bob):hi;assistant(ann):yo;"


def test_names_are_judged_per_role(proc: TextProcessor) -> None:
    own = _with_template(proc, "{% for m in messages %}{{ m.role }}{% if m.role == 'user' and m.name %}"
                               "({{ m.name }}){% endif %}:{{ m.content }};{% endfor %}")
    messages = [{"role": "user", "name": "bob", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "and?"}, {"role": "assistant", "name": "ann", "content": "so"}]
    with pytest.raises(APIError) as err:
        _render(own, messages)
    assert err.value.param == "messages.3.name"
    assert _render(own, messages[:3]) == "user(bob):hi;assistant:yo;user:and?;"
