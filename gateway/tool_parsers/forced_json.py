"""The output of a ``required`` or named ``tool_choice``: whatever the model's own format, decoding is
constrained (structured outputs) to a JSON array of ``{"name": ..., "arguments": {...}}`` objects
(``gateway/tool_request.py`` builds its schema, ``name`` first), read here as the calls, each call's
arguments streaming as they are written (``call_reader.CallArrayReader``).

The grammar lets the text end inside the array only when the output is cut (``max_tokens``, or the
context's end). Such a text is never content (it would hand pdserve's internal array format to the
client as the assistant's text): a call whose name was written whole is a call, with the arguments
written so far (the empty text when they had not opened yet: the client sees ``finish_reason``
``length``, as with OpenAI's calls cut by ``max_tokens``); a call cut before its name was complete, and
an array cut before any call, are dropped (content null). The same events come streamed and not: a
call cut after its name and before its arguments starts in the stream's last chunk. Text the reader
cannot continue the array with (which the grammar does not produce) stays content as written, never a
silent drop.
"""

from __future__ import annotations

from gateway.tool_parsers.base import ToolCallParser
from gateway.tool_parsers.call_reader import CallArrayReader
from gateway.tool_parsers.events import Event


class ForcedJsonParser(ToolCallParser):
    """Reads the JSON array of calls as it is written."""

    def __init__(self) -> None:
        super().__init__()
        self._array: CallArrayReader | None = CallArrayReader(self, ("arguments",))

    def feed(self, text: str) -> list[Event]:
        if self._array is None:
            return self.content.write(text)
        events, used = self._array.feed(text)
        if used is None:
            return events
        array, self._array = self._array, None
        if array.outcome == "call":
            self.content.call_ends()
        return events + self.content.write(array.unread + text[used:])

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._array is not None:  # cut inside the array (module docstring): no content from it
            array, self._array = self._array, None
            out += array.finish(named_stands=True)
            if array.outcome == "call":
                self.content.call_ends()
        return out + self.content.finish()
