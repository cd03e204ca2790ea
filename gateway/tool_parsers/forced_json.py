"""The output of a ``required`` or named ``tool_choice``: whatever the model's own format, decoding is
constrained (structured outputs) to a JSON array of ``{"name": ..., "arguments": {...}}`` objects
(``gateway/tool_request.py`` builds its schema), read here as the calls. The array is held to the end;
an output that does not decode (cut short by ``max_tokens``) stays content, unchanged.
"""

from __future__ import annotations

import json

from gateway.tool_parsers.base import ToolCallParser, call_from_json
from gateway.tool_parsers.events import ContentText, Event


class ForcedJsonParser(ToolCallParser):
    """Reads a whole JSON array of calls at the end of the output."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return []

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        try:
            items = json.loads(buf)
        except ValueError:
            items = None
        calls = [call_from_json(i, ("arguments",)) for i in items] if isinstance(items, list) and items \
            else [None]
        if any(c is None for c in calls):
            return [ContentText(buf)] if buf else []
        out: list[Event] = []
        for call in calls:
            assert call is not None
            out += self.emit_call(*call)
        return out
