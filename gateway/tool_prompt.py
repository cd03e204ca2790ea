"""Tools for a chat template that does not render them (it never reads the ``tools`` variable, e.g. the
embedded SmolLM2's): pdserve's fallback, in the Hermes format its ``hermes`` parser reads.

* The tools are listed in a system message: the first message's content when it is a system (or
  developer) message gets the listing after a blank line, else a system message holding only the
  listing comes first. The listing is ``FALLBACK_HEADER``, one JSON object per tool (OpenAI's
  ``{"type": "function", "function": {...}}``) between ``<tools>`` and ``</tools>``, and
  ``FALLBACK_FOOTER`` asking for ``<tool_call>`` blocks.
* An assistant message's ``tool_calls`` become ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  blocks after its content, one per line.
* A ``tool`` message becomes a ``user`` message holding ``<tool_response>...</tool_response>``;
  consecutive tool messages share one user message (roles stay alternating for strict templates).

Source of the format: NousResearch's Hermes-2-Pro function-calling prompt (the listing and block shapes;
the wording here is pdserve's own).
"""

from __future__ import annotations

import json
from typing import Any

FALLBACK_HEADER = "Functions you may call:"
FALLBACK_FOOTER = 'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'


def tool_listing(tools: list[dict[str, Any]]) -> str:
    """The system text that lists ``tools`` (OpenAI tool objects) in the Hermes format."""
    lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return f"{FALLBACK_HEADER}\n<tools>\n{lines}\n</tools>\n{FALLBACK_FOOTER}"


def _call_text(call: dict[str, Any]) -> str:
    fn = call["function"]
    args = fn["arguments"]
    body = {"name": fn["name"], "arguments": args if isinstance(args, dict) else _raw(args)}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def _raw(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> \
        list[dict[str, Any]]:
    """``messages`` (``ChatMessage.template_dict`` shapes) rewritten for a template without tool support:
    text-only messages with the roles system, user and assistant (and developer where given), the tools
    listed when ``tools`` is non-empty (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content'] or ''}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        content = m["content"] or ""
        if m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m["role"], "content": content})
    for m in out:
        m.pop("_tool", None)
    if tools:
        listing = tool_listing(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{listing}" if out[0]["content"] else listing
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out
