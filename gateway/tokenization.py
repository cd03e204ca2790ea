"""vLLM's tokenizer endpoints: ``POST /tokenize`` (text or chat messages → token ids, as the generation
endpoints tokenize them) and ``POST /detokenize`` (token ids → text, special tokens kept)."""

from __future__ import annotations

from gateway.errors import bad_request
from gateway.openai_requests import DetokenizeRequest, TokenizeRequest
from gateway.openai_responses import DetokenizeResponse, TokenizeResponse
from gateway.prepare import (
    check_ids,
    check_message_keys,
    check_model,
    encode_text,
    max_model_len,
    render_messages,
    text_processor,
)
from gateway.service import GatewayService
from gateway.tool_request import template_tools


def tokenize(svc: GatewayService, body: TokenizeRequest) -> TokenizeResponse:
    """The token ids of ``body.prompt`` or of ``body.messages`` (and ``body.tools``) rendered by the chat
    template.

    Raises:
        APIError: 400 when neither or both of ``prompt`` and ``messages`` are given, ``tools`` or
            ``chat_template_kwargs`` come without ``messages``, a message sets a key chat refuses
            (``unsupported_parameter`` naming ``messages.<i>.<key>``), a tool is invalid (as on chat),
            the text is not valid Unicode or the template fails; 404 for another ``model``; 503 without
            a worker or tokenizer.
    """
    check_model(svc, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        check_message_keys(body.messages)
    text = text_processor(svc)
    if body.messages is not None:
        tools = template_tools(body.tools) if body.tools else None
        rendered = render_messages(text, body.message_dicts(), body.chat_template_kwargs,
                                   body.add_generation_prompt, tools)
        ids = encode_text(text, rendered, bool(body.add_special_tokens), "messages")
    else:
        for name in ("chat_template_kwargs", "tools"):
            if getattr(body, name):
                raise bad_request(f"{name} needs messages", name)
        assert body.prompt is not None
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = encode_text(text, body.prompt, special, "prompt")
    strs = [text.vocab_token(t) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(len(ids), max_model_len(svc), ids, strs)


def detokenize(svc: GatewayService, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of ``body.tokens``, special tokens kept.

    Raises:
        APIError: 400 ``invalid_token_id`` naming ``tokens`` for an id outside the vocabulary; 404 for
            another ``model``; 503 without a worker or tokenizer.
    """
    check_model(svc, body.model)
    text = text_processor(svc)
    check_ids(body.tokens, text.vocab_size, "tokens")
    return DetokenizeResponse(text.decode(body.tokens, skip_special_tokens=False))
