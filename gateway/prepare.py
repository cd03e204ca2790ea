"""Request → ``Prepared``: validation against the deployment (model, caps, vocabulary, context length),
chat template, tokenization, the mapping of the body into ``SamplingParams`` (``sampling_params``: the
one place OpenAI fields become the type the workers receive), and the fan-out into choices (``n``
samples of each prompt).

Choice order follows the OpenAI Completions reference: for a list of prompts, prompt ``j``'s sample ``i``
is choice ``j * n + i``. Each choice is its own worker request: request id ``<id>-<index>`` (just ``<id>``
when there is one choice) and seed ``seed + i`` (wrapped into int64) when ``seed`` is set, so a seeded
request reproduces every choice. Stop strings stay in the gateway (``GenerationInput.stop``); the workers
get ``stop_token_ids``. Every check raises ``APIError`` (400/404/503) before anything is sent.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams, SamplingParamsError, StructuredOutput
from gateway.chat_output import ChatOutputSpec
from gateway.errors import bad_request, not_found_model, unavailable
from gateway.openai_requests import (
    INT64_MAX,
    MAX_STOP_CHARS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from gateway.reasoning import select_reasoning_parser
from gateway.request_state import GenerationInput
from gateway.service import GatewayService
from gateway.structured_output import structured_output_of
from gateway.text import TextProcessor, TokenizerNotFoundError
from gateway.tool_parsers import select_tool_parser, template_renders_tools
from gateway.tool_prompt import fallback_messages
from gateway.tool_request import ToolPlan, auto_tool_structured_output, plan_tools, tool_structured_output

Body = ChatCompletionRequest | CompletionRequest
NO_PARSING = ChatOutputSpec()
# chat template variables a request's chat_template_kwargs may not override (the messages, the generation
# prompt switch, the tokenizer's special tokens, the tools (the request's own field) and documents
# (not supported yet))
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "tools", "documents", "bos_token",
                                    "eos_token", "unk_token", "pad_token", "chat_template"})


@dataclass(frozen=True)
class ChoiceInput:
    """One choice: its ``index`` in the response, its worker request, and text to prepend (echo).
    ``prompt_only``: ``max_tokens: 0`` with echo: the workers sample one token (they need one), which
    the response drops."""

    index: int
    inp: GenerationInput
    echo_text: str = ""
    prompt_only: bool = False


@dataclass(frozen=True)
class Prepared:
    """A validated request. ``num_prompt_tokens`` counts each distinct prompt once (usage, tokens);
    ``logprobs`` is None (off) or the number of top alternatives per token; ``n`` choices per prompt
    (prompt ``j``'s are ``choices[j * n : (j + 1) * n]``); ``output``: how a chat choice's text is split
    into content, reasoning and tool calls (gateway/chat_output.py). ``echo_logprobs``: completions
    ``echo`` with ``logprobs``: the logprobs start with the prompt's tokens; ``prompt_logprobs``: vLLM's
    field (None: off, else the top-N per prompt token)."""

    request_id: str
    model: str
    chat: bool
    include_usage: bool
    choices: tuple[ChoiceInput, ...]
    num_prompt_tokens: int
    logprobs: int | None
    n: int = 1
    output: ChatOutputSpec = NO_PARSING
    echo_logprobs: bool = False
    prompt_logprobs: int | None = None


def served_model(svc: GatewayService) -> str | None:
    """``--model-name`` or the model the workers registered (None before any registration)."""
    if svc.settings.model_name:
        return svc.settings.model_name
    live = svc.registry.live()
    return live[0].info.model if live else None


def max_model_len(svc: GatewayService) -> int:
    """Smallest ``max_model_len`` (tokens) over live workers (2048 with none)."""
    return min((w.info.max_model_len for w in svc.registry.live()), default=2048)


def _check_caps(svc: GatewayService, body: Body) -> None:
    s = svc.settings
    if body.n > s.max_n:
        raise bad_request(f"n must be <= {s.max_n}, got {body.n}", "n")
    stops = body.stop_list()
    if len(stops) > s.max_stop:
        raise bad_request(f"at most {s.max_stop} stop strings, got {len(stops)}", "stop")
    if any(not x for x in stops):  # it would match before any text: refused rather than dropped
        raise bad_request("stop strings must not be empty", "stop")
    if any(len(x) > MAX_STOP_CHARS for x in stops):
        raise bad_request(f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")
    if len(body.stop_token_ids or ()) > s.max_stop:
        raise bad_request(f"at most {s.max_stop} stop_token_ids", "stop_token_ids")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    unsupported = body.unsupported_fields()
    if unsupported:
        raise bad_request(f"{unsupported[0]} is not supported yet", unsupported[0], "unsupported_parameter")
    if isinstance(body, ChatCompletionRequest):
        check_message_keys(body.messages)
    if body.store:
        raise bad_request("store: true is not supported: pdserve stores no completions", "store",
                          "unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise bad_request("stream_options.include_obfuscation: true is not supported: pdserve pads no "
                          "streaming chunks", "stream_options.include_obfuscation", "unsupported_parameter")
    if isinstance(body, CompletionRequest):
        _check_completion(body)
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs is not supported with stream", "prompt_logprobs")
    for token_id, bias in (body.logit_bias or {}).items():
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias of token {token_id} is {bias}, outside [-{MAX_LOGIT_BIAS:g}, "
                              f"{MAX_LOGIT_BIAS:g}]", "logit_bias")


def check_message_keys(messages: Sequence[ChatMessage]) -> None:
    """Refuse the first key a message sets that pdserve cannot honour (``ChatMessage.unsupported_keys``:
    what an assistant message of a response carries back, e.g. ``refusal``), for every endpoint that takes
    chat messages (chat completions, ``/tokenize``).

    Raises:
        APIError: 400 ``unsupported_parameter`` naming ``messages.<i>.<key>``.
    """
    found = next((f"messages.{i}.{key}" for i, m in enumerate(messages) for key in m.unsupported_keys()),
                 None)
    if found is not None:
        raise bad_request(f"{found} is not supported yet", found, "unsupported_parameter")


def _check_completion(body: CompletionRequest) -> None:
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of must equal n ({body.n}): choosing the best of more samples is not "
                          f"supported, got best_of {body.best_of}", "best_of")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens 0 is only allowed with echo (the response is the prompt alone)",
                          "max_tokens")
    if body.max_tokens == 0 and body.min_tokens:
        raise bad_request(f"min_tokens {body.min_tokens} exceeds max_tokens 0", "min_tokens")


def check_ids(ids: Iterable[int], vocab: int, param: str) -> None:
    """Raises ``APIError`` (400 ``invalid_token_id`` naming ``param``) for an id outside [0, vocab)."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"{param}: token id {bad} is out of range [0, {vocab})", param, "invalid_token_id")


# a chat template that handles the developer role compares a message's role with it
_DEVELOPER_ROLE = re.compile(r"""['"]developer['"]""")


def render_messages(text: TextProcessor, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None,
                    add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> str:
    """The chat template applied to ``messages`` with ``kwargs`` (``chat_template_kwargs``) as template
    variables and ``tools`` (OpenAI tool objects) as its ``tools``. A template that does not render
    tools gets pdserve's fallback instead (gateway/tool_prompt.py) when there are tools or the history
    holds tool calls or tool results. A ``developer`` message is rendered as a ``system`` one when the
    template never names ``'developer'`` as a quoted string (it would otherwise be a turn of a role the
    model does not know, beside the template's default system prompt); a template that knows the role
    gets it as is. A message's ``name`` goes to the template, which is honoured only where the template
    uses it: when removing the names of every message of one role leaves the prompt unchanged, the first
    such name is refused (the template renders none of them).

    Raises:
        APIError: 400 naming ``chat_template_kwargs`` when it sets a reserved variable
            (``RESERVED_TEMPLATE_VARS``), ``messages`` when the template fails or there is none, or
            ``messages.<i>.name`` (``unsupported_parameter``) for a name the template does not render.
    """
    kwargs = kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    rendered = _render(text, messages, kwargs, add_generation_prompt, tools)
    for role in dict.fromkeys(m["role"] for m in messages if "name" in m):  # each role once, in order
        unnamed = [{k: v for k, v in m.items() if k != "name"} if m["role"] == role else m for m in messages]
        if _render(text, unnamed, kwargs, add_generation_prompt, tools) == rendered:
            i = next(i for i, m in enumerate(messages) if m["role"] == role and "name" in m)
            raise bad_request(f"messages.{i}.name is not supported by this model: its chat template does "
                              f"not use the name of a {role} message", f"messages.{i}.name",
                              "unsupported_parameter")
    return rendered


def _render(text: TextProcessor, messages: list[dict[str, Any]], kwargs: dict[str, Any],
            add_generation_prompt: bool, tools: list[dict[str, Any]] | None) -> str:
    """``render_messages`` without its checks."""
    if not _DEVELOPER_ROLE.search(text.chat_template or ""):  # OpenAI: developer messages are system messages
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    if not template_renders_tools(text.chat_template):
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = fallback_messages(messages, tools)
        tools = None
    if tools:
        kwargs = {**kwargs, "tools": tools}
    try:
        return text.render_chat(messages, add_generation_prompt, **kwargs)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc


def encode_text(text: TextProcessor, s: str, add_special_tokens: bool, param: str) -> list[int]:
    """``s``'s token ids. Raises ``APIError`` (400 naming ``param``) when ``s`` is not valid Unicode."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON allows lone surrogates (\ud800); the tokenizer does not
        raise bad_request(f"{param} is not valid Unicode: {exc.reason}", param) from exc
    return text.encode(s, add_special_tokens=add_special_tokens)


def chat_tools(svc: GatewayService, text: TextProcessor, body: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan with the served model's parsers (``--tool-call-parser`` and
    ``--reasoning-parser``, ``auto``: by its chat template). A ``required`` or named ``tool_choice``
    gets its structured-output constraint in ``prepare`` (``tool_structured_output``), as does ``auto``
    with a strict tool (``auto_tool_structured_output``).

    Raises:
        APIError: 400 naming the tool field at fault (gateway/tool_request.py).
    """
    template = text.chat_template
    plan = plan_tools(body, select_tool_parser(svc.settings.tool_call_parser, template),
                      select_reasoning_parser(svc.settings.reasoning_parser, template))
    return plan


def _prompts(text: TextProcessor, body: Body, plan: ToolPlan | None) -> list[tuple[list[int], str]]:
    """(token ids, prompt text for echo) of each prompt, in order; ``plan``: a chat request's tools."""
    if isinstance(body, ChatCompletionRequest):
        rendered = render_messages(text, body.message_dicts(), body.chat_template_kwargs,
                                   tools=plan.template_tools if plan else None)
        return [(encode_text(text, rendered, False, "messages"), rendered)]
    prompt = body.prompt
    if isinstance(prompt, str):
        return [(encode_text(text, prompt, True, "prompt"), prompt)]
    if not prompt:
        raise bad_request("the prompt list is empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        items: list[str | list[int]] = [[int(t) for t in prompt]]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((encode_text(text, item, True, "prompt"), item))
        else:
            check_ids(item, text.vocab_size, "prompt")
            out.append((list(item), text.decode(item, skip_special_tokens=False)))
    return out


def _max_tokens(svc: GatewayService, body: Body, n_prompt: int) -> int:
    limit, param = max_model_len(svc), "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if n_prompt == 0:
        raise bad_request("the prompt is empty", param)
    cap = svc.settings.max_prompt_tokens
    if cap is not None and n_prompt > cap:
        raise bad_request(f"prompt has {n_prompt} tokens, more than --max-prompt-tokens {cap}", param,
                          "context_length_exceeded")
    asked = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        if asked is not None and asked != body.max_completion_tokens:
            raise bad_request(f"max_tokens ({asked}) and max_completion_tokens "
                              f"({body.max_completion_tokens}) differ: give one of them (max_tokens is the "
                              "older name of max_completion_tokens)", "max_tokens")
        asked = body.max_completion_tokens
    wanted = asked if asked is not None else limit - n_prompt
    if wanted == 0 and isinstance(body, CompletionRequest):  # echo only (_check_completion): one token
        wanted = 1  # sampled by the workers, dropped by the gateway
    if n_prompt + wanted > limit or wanted < 1:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{n_prompt + max(wanted, 1)} tokens ({n_prompt} in the prompt, "
                          f"{max(wanted, 1)} for the completion).",
                          param if n_prompt >= limit else "max_tokens", "context_length_exceeded")
    if body.min_tokens > wanted:
        raise bad_request(f"min_tokens {body.min_tokens} exceeds max_tokens {wanted}", "min_tokens")
    return wanted


def _requested_logprobs(body: Body) -> int | None:
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _prompt_logprobs(body: Body) -> int | None:
    """The top-N the workers compute per prompt token: the larger of completions ``echo`` with
    ``logprobs`` and vLLM's ``prompt_logprobs`` (None: neither asked)."""
    if not isinstance(body, CompletionRequest):
        return body.prompt_logprobs
    asked = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None]
    return max(asked) if asked else None


def sampling_params(body: Body, max_tokens: int, seed: int | None,
                    structured_output: StructuredOutput | None = None) -> SamplingParams:
    """The workers' sampling params of one choice: ``max_tokens`` as resolved against the context length,
    ``seed`` that choice's (``derived_seed``), ``structured_output`` the request's (validated by
    ``structured_output_of``), no stop strings.

    Raises:
        APIError: 400 naming the parameter ``SamplingParams`` refuses (e.g. ``top_k`` 0).
    """
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, repetition_penalty=body.repetition_penalty, seed=seed,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens, logprobs=_requested_logprobs(body),
            prompt_logprobs=_prompt_logprobs(body),
            logit_bias=tuple(sorted((body.logit_bias or {}).items())), structured_output=structured_output)
    except SamplingParamsError as exc:
        raise bad_request(str(exc).removeprefix("SamplingParams."), exc.field) from exc


def derived_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample ``sample`` of a prompt: ``seed + sample`` wrapped into int64 (None stays None)."""
    if seed is None:
        return None
    return (seed + sample + INT64_MAX + 1) % (1 << 64) - INT64_MAX - 1


def check_model(svc: GatewayService, model: str | None) -> str:
    """The served model's name; ``model`` (None: not given) must be it.

    Raises:
        APIError: 503 before any worker registered (and no ``--model-name``), 404 for another model.
    """
    served = served_model(svc)
    if served is None:
        raise unavailable("no worker has registered yet")
    if model is not None and model != served:
        raise not_found_model(model)
    return served


def text_processor(svc: GatewayService) -> TextProcessor:
    """The tokenizer. Raises ``APIError`` 503 while it cannot be loaded."""
    try:
        return svc.text()
    except TokenizerNotFoundError as exc:
        raise unavailable(f"tokenizer unavailable: {exc}") from exc


def prepare(svc: GatewayService, body: Body, request_id: str) -> Prepared:
    """Validate, tokenize and fan out into choices. Raises ``APIError`` (400/404/503) naming the problem."""
    model = check_model(svc, body.model)
    _check_caps(svc, body)
    text = text_processor(svc)
    check_ids(list(body.stop_token_ids or ()), text.vocab_size, "stop_token_ids")
    check_ids(body.logit_bias or {}, text.vocab_size, "logit_bias")
    plan = chat_tools(svc, text, body) if isinstance(body, ChatCompletionRequest) else None
    structured = structured_output_of(body.response_format, body.structured_outputs)
    if plan is not None and plan.forced_schema is not None:
        if structured is not None:
            raise bad_request("tool_choice 'required' or a named function constrains the output to tool "
                              "calls; it cannot be combined with response_format or structured_outputs",
                              "tool_choice")
        structured = tool_structured_output(plan.forced_schema)
        structured_param: str | None = "tool_choice"
    elif plan is not None and plan.strict_tag is not None:
        if structured is not None:
            raise bad_request(f"{plan.strict_param}: a strict tool under tool_choice 'auto' constrains the "
                              "output's tool calls; it cannot be combined with response_format or "
                              "structured_outputs", plan.strict_param)
        structured = auto_tool_structured_output(plan.strict_tag)
        structured_param = plan.strict_param
    else:
        structured_param = None if structured is None else (
            "structured_outputs" if body.structured_outputs is not None else "response_format")
    prompts = _prompts(text, body, plan)
    if len(prompts) * body.n > svc.settings.max_queue:
        raise bad_request(f"{len(prompts)} prompts x n={body.n} choices exceed --max-queue "
                          f"{svc.settings.max_queue}", "n")
    echo = isinstance(body, CompletionRequest) and body.echo
    many, choices = len(prompts) * body.n > 1, []
    # stop strings cut message text; a required or named tool_choice makes the output all tool calls,
    # which a stop string would leave unparseable (README: tool calls)
    stops = () if plan is not None and plan.forced_schema is not None else tuple(body.stop_list())
    for j, (ids, prompt_text) in enumerate(prompts):
        max_tokens = _max_tokens(svc, body, len(ids))
        for i in range(body.n):
            index = j * body.n + i
            inp = GenerationInput(f"{request_id}-{index}" if many else request_id, ids,
                                  sampling_params(body, max_tokens, derived_seed(body.seed, i),
                                                  structured),
                                  stops, structured_param)
            choices.append(ChoiceInput(index, inp, prompt_text if echo else "", body.max_tokens == 0))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    completion = isinstance(body, CompletionRequest)
    return Prepared(request_id, model, not completion, include_usage,
                    tuple(choices), sum(len(ids) for ids, _ in prompts), _requested_logprobs(body), body.n,
                    plan.output if plan else NO_PARSING,
                    echo_logprobs=echo and body.logprobs is not None,
                    prompt_logprobs=body.prompt_logprobs)
