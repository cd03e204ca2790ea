"""A ``developer`` message (OpenAI's newer name for the system message) is rendered as a ``system`` one
when the model's chat template does not know the role (SmolLM2's: the developer text replaces the
default system prompt, no ``developer`` turn), and passed as is to a template that handles it."""

from __future__ import annotations

import copy

from gateway.openai_requests import ChatCompletionRequest
from gateway.prepare import render_messages
from gateway.responses_api import ResponsesRequest, chat_body
from gateway.text import TextProcessor


def _render(proc: TextProcessor, messages: list[dict[str, str]]) -> str:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    return render_messages(proc, body.message_dicts(), None)


def test_developer_is_system_for_a_template_without_the_role(proc: TextProcessor) -> None:
    assert proc.chat_template is not None and "developer" not in proc.chat_template
    user = {"role": "user", "content": "hi"}
    as_developer = _render(proc, [{"role": "developer", "content": "Be brief."}, user])
    assert as_developer == _render(proc, [{"role": "system", "content": "Be brief."}, user])
    assert "developer" not in as_developer and "Be brief." in as_developer
    assert "You are a helpful AI assistant" not in as_developer  # the default system prompt is replaced
    responses = chat_body(ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "developer", "content": "Be brief."}, user]}))
    assert render_messages(proc, ChatCompletionRequest.model_validate(responses).message_dicts(),
                           None) == as_developer


def test_a_template_that_knows_developer_gets_it(proc: TextProcessor) -> None:
    tokenizer = copy.copy(proc.tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'developer' %}D{% else %}"
                               "{{ m.role }}{% endif %}:{{ m.content }};{% endfor %}")
    own = TextProcessor(tokenizer)
    text = _render(own, [{"role": "developer", "content": "x"}, {"role": "user", "content": "hi"}])
    assert text == "D:x;user:hi;"
