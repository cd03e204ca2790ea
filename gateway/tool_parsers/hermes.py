"""Hermes / Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any
number, anywhere in the text (NousResearch Hermes-2-Pro function-calling format, adopted by Qwen2.5 and
Qwen3 chat templates). A block not closed when the text ends is still a call when its JSON decodes (a
model may stop right after the object). Each call's arguments arrive as one fragment once its block is
complete.
"""

from __future__ import annotations

import json

from gateway.tool_parsers.base import ToolCallParser, call_from_json
from gateway.tool_parsers.events import ContentText, Event, held_prefix

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallParser):
    """Streaming parser of ``<tool_call>`` blocks (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._in_call = False
        self._scanned = 0  # in a call: the buffer before this holds no END (no rescan per piece)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._in_call:
                end = self._buf.find(END, max(0, self._scanned - len(END) + 1))
                if end < 0:
                    self._scanned = len(self._buf)
                    return out
                out += self._close(self._buf[:end], closed=True)
                self._buf = self._buf[end + len(END):]
                continue
            start = self._buf.find(START)
            if start < 0:
                keep = held_prefix(self._buf, START)
                out += self.content.write(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            out += self.content.write(self._buf[:start])
            self._buf = self._buf[start + len(START):]
            self._in_call, self._scanned = True, 0

    def _close(self, body: str, closed: bool) -> list[Event]:
        self._in_call = False
        try:
            call = call_from_json(json.loads(body))
        except ValueError:
            call = None
        if call is None:  # not a call: the text stays content, as written
            return self.content.write(START + body + (END if closed else ""))
        self.content.call_starts()
        out = self.emit_call(*call)
        self.content.call_ends()
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._in_call:
            out += self._close(self._buf, closed=False)
        elif self._buf:
            out += self.content.write(self._buf)
        self._buf = ""
        return out + self.content.finish()


__all__ = ["END", "START", "ContentText", "HermesParser"]
