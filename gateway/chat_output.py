"""A chat choice's text → OpenAI message parts: the reasoning parser first (``reasoning_content``), then
the tool-call parser over the content that follows (``tool_calls``), the same way streamed and not.

``ChatOutputSpec`` says which parsers a request uses (chosen in gateway/prepare.py); ``ChatOutputParser``
is one choice's state. With ``parallel_tool_calls: false`` only the first call is kept (the events of
later calls are dropped, streamed and not).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.reasoning import ReasoningParser
from gateway.tool_parsers import FORCED, PARSERS, ToolCallParser
from gateway.tool_parsers.events import (
    ContentText,
    Event,
    ParsedOutput,
    ReasoningText,
    ToolCallArguments,
    ToolCallStart,
    fold,
)


@dataclass(frozen=True)
class ChatOutputSpec:
    """The parsers of a chat request: ``reasoning`` (a ``gateway.reasoning`` name or None) and ``tools``
    (a ``gateway.tool_parsers.PARSERS`` key, or None: tool calls are not parsed);
    ``parallel_tool_calls`` False keeps only the first call."""

    reasoning: str | None = None
    tools: str | None = None
    parallel_tool_calls: bool = True

    @property
    def only_tool_calls(self) -> bool:
        """Whether the output is tool calls alone (a ``required`` or named ``tool_choice``): no content."""
        return self.tools == FORCED

    @property
    def active(self) -> bool:
        """Whether any parser runs (else the text is the content, as is)."""
        return self.reasoning is not None or self.tools is not None


class ChatOutputParser:
    """One choice's parsers; ``feed`` its text piece by piece, then ``finish``; ``num_calls`` counts the
    tool calls emitted so far."""

    def __init__(self, spec: ChatOutputSpec) -> None:
        self.spec = spec
        self._reasoning = ReasoningParser(spec.reasoning) if spec.reasoning else None
        self._tools: ToolCallParser | None = PARSERS[spec.tools]() if spec.tools else None
        self.num_calls = 0

    def _tool(self, events: list[Event]) -> list[Event]:
        if self._tools is None:
            return events
        out: list[Event] = []
        for e in events:
            out += self._tools.feed(e.text) if isinstance(e, ContentText) else [e]
        return out

    def _keep(self, events: list[Event]) -> list[Event]:
        kept = []
        for e in events:
            if isinstance(e, ToolCallStart | ToolCallArguments) and not self.spec.parallel_tool_calls \
                    and e.index > 0:
                continue
            if isinstance(e, ToolCallStart):
                self.num_calls += 1
            kept.append(e)
        return kept

    def feed(self, text: str) -> list[Event]:
        """Events for the next piece of the choice's text."""
        events: list[Event] = self._reasoning.feed(text) if self._reasoning else [ContentText(text)]
        return self._keep(self._tool(events))

    def finish(self) -> list[Event]:
        """Events for everything still held when the choice ends."""
        events = self._tool(self._reasoning.finish()) if self._reasoning else []
        if self._tools is not None:
            events += self._tools.finish()
        return self._keep(events)


def parse_whole(spec: ChatOutputSpec, text: str) -> ParsedOutput:
    """A whole choice's text split into content, reasoning and tool calls (what a stream's deltas add up
    to)."""
    parser = ChatOutputParser(spec)
    return fold(parser.feed(text) + parser.finish())


def merge_texts(events: list[Event]) -> list[Event]:
    """``events`` with neighbouring content (or reasoning) texts joined into one."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, ContentText) and isinstance(last, ContentText):
            out[-1] = ContentText(last.text + e.text)
        elif isinstance(e, ReasoningText) and isinstance(last, ReasoningText):
            out[-1] = ReasoningText(last.text + e.text)
        else:
            out.append(e)
    return out
