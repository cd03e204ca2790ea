"""The output of a ``required`` or named ``tool_choice``: whatever the model's own format, decoding is
constrained (structured outputs) to a JSON array of ``{"name": ..., "arguments": {...}}`` objects
(``gateway/tool_request.py`` builds its schema, ``name`` first), read here as the calls, each call's
arguments streaming as they are written (``call_reader.CallArrayReader``). An output cut by
``max_tokens`` before its first call started stays content, unchanged; a call cut short keeps the
arguments written so far.
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
        if self._array is not None:
            array, self._array = self._array, None
            out += array.finish()
            if array.outcome == "not_call":
                out += self.content.write(array.raw)
        return out + self.content.finish()
