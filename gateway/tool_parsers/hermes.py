"""Hermes / Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any
number, anywhere in the text (NousResearch Hermes-2-Pro function-calling format, adopted by Qwen2.5 and
Qwen3 chat templates). A call's arguments stream as they are written (``call_reader.CallReader``). A
block whose object is not a call stays content as written (from ``<tool_call>`` to ``</tool_call>``);
text left in a block after its call's object is content too. A block not closed when the text ends is
a call once its call started (a model may stop right after the object, or be cut by ``max_tokens``).
"""

from __future__ import annotations

from gateway.tool_parsers.base import ToolCallParser
from gateway.tool_parsers.call_reader import CallReader
from gateway.tool_parsers.events import ContentText, Event, held_prefix

START, END = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


class HermesParser(ToolCallParser):
    """Streaming parser of ``<tool_call>`` blocks (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._state = "text"  # text; call (the reader reads the object); rest (the block after it)
        self._reader: CallReader | None = None
        self._not_call = False  # in rest: the block's object was not a call (the block is content)
        self._scanned = 0  # in rest: the buffer before this holds no END (no rescan per piece)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._state == "call":
                assert self._reader is not None
                events, used = self._reader.feed(self._buf)
                out += events
                if used is None:
                    self._buf = ""
                    return out
                self._buf = self._buf[used:]
                self._not_call = self._reader.outcome == "not_call"
                if self._not_call:
                    self._buf = START + self._reader.raw + self._buf
                self._state, self._scanned = "rest", 0
                continue
            if self._state == "rest":
                end = self._buf.find(END, max(0, self._scanned - len(END) + 1))
                if end < 0:
                    self._scanned = len(self._buf)
                    return out
                out += self._end_block(self._buf[:end] + (END if self._not_call else ""))
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
            self._state, self._reader = "call", CallReader(self, ARGUMENT_KEYS)

    def _end_block(self, rest: str) -> list[Event]:
        """The block ended: after a call, the whitespace around it is dropped and other text left in the
        block is content; a block that held no call is content as written (``rest`` then is all of it)."""
        self._state = "text"
        if self._not_call:
            return self.content.write(rest)
        self.content.call_ends()
        return self.content.write(rest)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "call":
            assert self._reader is not None
            out += self._reader.finish()
            self._not_call = self._reader.outcome == "not_call"
            out += self._end_block(START + self._reader.raw if self._not_call else "")
        elif self._state == "rest":
            out += self._end_block(self._buf)
        elif self._buf:
            out += self.content.write(self._buf)
        self._buf = ""
        return out + self.content.finish()


__all__ = ["END", "START", "ContentText", "HermesParser"]
