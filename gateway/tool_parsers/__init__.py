"""Tool-call parsers, one module per format family (``hermes``, ``llama3_json``, ``mistral``), and the
choice of one for a model: the ``--tool-call-parser`` flag, else its chat template's format.

Choice by template (``auto``): a template that does not render ``tools`` gets pdserve's fallback tool
prompt, which asks for Hermes blocks (``gateway/tool_prompt.py``), so ``hermes``; otherwise the markers
the template writes: ``<tool_call>`` → ``hermes``, ``[TOOL_CALLS]`` / ``[AVAILABLE_TOOLS]`` → ``mistral``,
``<|python_tag|>`` or Llama-3 headers → ``llama3_json``; none of these → ``none`` (tools are then refused
with a 400 that names ``--tool-call-parser``).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.tool_parsers.base import ToolCallParser
from gateway.tool_parsers.forced_json import ForcedJsonParser
from gateway.tool_parsers.hermes import HermesParser
from gateway.tool_parsers.llama3_json import Llama3JsonParser
from gateway.tool_parsers.mistral import MistralParser

TOOL_CALL_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
CHOICES = ("auto", *TOOL_CALL_PARSERS, "none")
FORCED = "forced_json"  # the parser of a required or named tool_choice (gateway/tool_request.py)
PARSERS: dict[str, Callable[[], ToolCallParser]] = {**TOOL_CALL_PARSERS, FORCED: ForcedJsonParser}


def template_renders_tools(template: str | None) -> bool:
    """Whether the chat template uses the ``tools`` variable (else pdserve renders its fallback prompt)."""
    return template is not None and "tools" in template


def select_tool_parser(flag: str, template: str | None) -> str:
    """The parser name (a key of ``TOOL_CALL_PARSERS``, or ``none``) for ``--tool-call-parser`` ``flag``
    and the model's chat template source (None: the model has none)."""
    if flag != "auto":
        return flag
    if not template_renders_tools(template):
        return "hermes"
    assert template is not None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3_json"
    return "none"


__all__ = ["CHOICES", "FORCED", "PARSERS", "TOOL_CALL_PARSERS", "ToolCallParser", "select_tool_parser",
           "template_renders_tools"]
