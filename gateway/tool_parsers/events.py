"""What the tool-call and reasoning parsers emit while reading a chat choice's text, and the fold of those
events into the non-streamed result.

A parser is fed the choice's text in pieces (``feed``) and told when it ended (``finish``); it answers
events in output order: ``ContentText`` (text for ``delta.content`` / ``message.content``),
``ReasoningText`` (``reasoning_content``), ``ToolCallStart`` (a call's index, id and function name) and
``ToolCallArguments`` (a fragment of that call's arguments, a JSON text). The non-streamed message is
the fold of the same events (``fold``), so a stream's concatenated deltas equal the whole response
whatever the pieces were.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ContentText:
    """Text outside tool calls and reasoning."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningText:
    """Text inside a reasoning block (``<think>...</think>``)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A tool call begins: its position among the choice's calls, its id (``call_<random>``), the name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    """A fragment of call ``index``'s arguments (the fragments of one call concatenate to a JSON text)."""

    index: int
    fragment: str


Event = ContentText | ReasoningText | ToolCallStart | ToolCallArguments


def new_call_id() -> str:
    """``call_`` and 24 random alphanumerics (OpenAI's shape of a tool call id)."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One whole tool call: id, function name, arguments (a JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """A choice's text split into content (None when empty), reasoning (None when none) and tool calls."""

    content: str | None
    reasoning: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def fold(events: list[Event]) -> ParsedOutput:
    """The non-streamed result of ``events``: texts concatenated, each call's fragments joined."""
    content, reasoning = [], []
    names: dict[int, tuple[str, str]] = {}
    args: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ContentText):
            content.append(e.text)
        elif isinstance(e, ReasoningText):
            reasoning.append(e.text)
        elif isinstance(e, ToolCallStart):
            names[e.index] = (e.id, e.name)
            args.setdefault(e.index, [])
        else:
            args.setdefault(e.index, []).append(e.fragment)
    calls = [ParsedCall(names[i][0], names[i][1], "".join(args[i])) for i in sorted(names)]
    return ParsedOutput("".join(content) or None, "".join(reasoning) if reasoning else None, calls)


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker`` (0 when none): text
    that must wait for the next piece before it can be told apart from the marker."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
