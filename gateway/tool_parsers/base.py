"""The shape of a tool-call parser and the content rules every format shares.

Content rules (the same streamed and not): text outside the calls is content, except whitespace that
touches a call (between two calls, before the first call, after the last), which is dropped; a choice
without calls keeps its text exactly. A call's arguments stream as the model writes them (the readers
of ``call_reader``: a call starts once its name and the opening brace of its arguments are read); text
that turns out not to be a call before that (not JSON, no ``name``, arguments not an object) stays in
the content as the model wrote it, never a silent drop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from gateway.tool_parsers.events import ContentText, Event, ToolCallStart, new_call_id


class ContentWriter:
    """Content text with the whitespace rule: trailing whitespace is held until non-whitespace follows
    (then written) or a call starts (then dropped); after a call, leading whitespace is dropped."""

    def __init__(self) -> None:
        self._held = ""
        self._after_call = False

    def write(self, text: str) -> list[Event]:
        """Events for ``text`` (content that is not part of a call)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        joined = self._held + text
        body = joined.rstrip()
        self._held = joined[len(body):]
        return [ContentText(body)] if body else []

    def call_starts(self) -> None:
        """A call starts: whitespace held before it is dropped."""
        self._held = ""

    def call_ends(self) -> None:
        """A call ended: whitespace right after it is dropped."""
        self._after_call = True

    def finish(self) -> list[Event]:
        """The whitespace still held (the text ended with it, after content)."""
        held, self._held = self._held, ""
        return [ContentText(held)] if held else []


class ToolCallParser(ABC):
    """Reads one choice's text (after any reasoning) and emits content and tool-call events. One instance
    per choice; ``feed`` any number of times, then ``finish`` once."""

    def __init__(self) -> None:
        self.content = ContentWriter()
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Events for the next piece of text (possibly none: text held until it can be told apart)."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """Events for the text still held when the choice ends."""

    def start_call(self, name: str) -> tuple[list[Event], int]:
        """The events that open the next call (held whitespace before it dropped, its start with a new
        id) and the call's index, for its ``ToolCallArguments`` fragments."""
        index = self.num_calls
        self.num_calls += 1
        self.content.call_starts()
        return [ToolCallStart(index, new_call_id(), name)], index
