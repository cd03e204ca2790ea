"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``
(Mistral's v3 tokenizer format), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (the v11 format). Text
before the marker is content, streamed as it comes; after it, calls are read as they are written (their
arguments stream: ``call_reader``). When what follows the marker is not a call, it is given back as
content unchanged, the marker included; text after the last call that does not continue the calls is
content. ``[TOOL_CALLS]`` is a special token: where the detokenizer drops it, an answer that starts
with a JSON array of call objects is read as calls too.
"""

from __future__ import annotations

from gateway.tool_parsers.base import ToolCallParser
from gateway.tool_parsers.call_reader import CallArrayReader, ValueEnd
from gateway.tool_parsers.events import Event, ToolCallArguments, held_prefix

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
ARGUMENT_KEYS = ("arguments",)


class MistralParser(ToolCallParser):
    """Streaming parser of Mistral calls (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._seen_text = False
        # text (before the marker), format (after it: which one?), array, name, args, between (v11)
        self._state = "text"
        self._given = ""  # the text after the marker not yet part of a call (given back if none follows)
        self._array: CallArrayReader | None = None
        self._args: ValueEnd | None = None
        self._index = 0  # the v11 call whose arguments are being read

    def feed(self, text: str) -> list[Event]:
        if self._state != "text":
            return self._after_marker(text)
        self._buf += text
        out: list[Event] = []
        at = self._buf.find(MARKER)
        if at < 0 and not self._seen_text and self._buf.lstrip().startswith("[{"):
            body, self._buf = self._buf, ""  # the marker was a dropped special token
            self._state = "format"
            return self._after_marker(body)
        if at >= 0:
            out += self.content.write(self._buf[:at])
            body, self._buf = self._buf[at + len(MARKER):], ""
            self._state, self._given = "format", MARKER
            return out + self._after_marker(body)
        head = self._buf.lstrip()
        if not self._seen_text and (not head or "[{".startswith(head)):
            return out  # could still open a bare array of calls
        keep = held_prefix(self._buf, MARKER)
        written, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        self._seen_text = self._seen_text or bool(written.strip())
        return out + self.content.write(written)

    def _after_marker(self, text: str) -> list[Event]:
        out: list[Event] = []
        while text:
            if self._state == "content":
                return out + self.content.write(text)
            if self._state == "format":
                head = text.lstrip()
                self._given += text[:len(text) - len(head)]
                text = head
                if not head:
                    return out
                if head.startswith("["):
                    self._state, self._array = "array", CallArrayReader(self, ARGUMENT_KEYS)
                else:
                    self._state = "name"
            elif self._state == "array":
                assert self._array is not None
                events, used = self._array.feed(text)
                out += events
                if used is None:
                    return out
                array, self._array = self._array, None
                if array.outcome == "not_call":
                    return out + self._to_content(array.raw + text[used:])
                self.content.call_ends()
                self._given = ""
                return out + self._to_content(array.unread + text[used:])
            elif self._state == "name":
                self._buf += text
                text = ""
                at = self._buf.find(ARGS)
                if at < 0:
                    return out
                name, rest = self._buf[:at].strip(), self._buf[at + len(ARGS):]
                head = rest.lstrip()
                if not head:
                    return out  # the arguments have not begun
                if not name or not head.startswith("{"):
                    raw, self._buf = self._buf, ""
                    return out + self._to_content(raw)
                self._buf = ""
                events, self._index = self.start_call(name)
                out += events
                self._state, self._args = "args", ValueEnd("{")
                out.append(ToolCallArguments(self._index, "{"))
                text = head[1:]
            elif self._state == "args":
                assert self._args is not None
                used = next((i + 1 for i, ch in enumerate(text) if self._args.step(ch) == "end"), len(text))
                out.append(ToolCallArguments(self._index, text[:used]))
                if used == len(text) and self._args.depth > 0:
                    return out
                text, self._state, self._given = text[used:], "between", ""
                self.content.call_ends()
            elif self._state == "between":
                self._buf += text
                text = ""
                head = self._buf.lstrip()
                if MARKER.startswith(head):
                    return out
                if head.startswith(MARKER):
                    self._buf, self._state, self._given = "", "name", MARKER
                    text = head[len(MARKER):]
                else:
                    raw, self._buf = self._buf, ""
                    return out + self._to_content(raw)
        return out

    def _to_content(self, text: str) -> list[Event]:
        """What follows is content: the text after the marker not yet part of a call, then ``text``."""
        self._state, given, self._given = "content", self._given, ""
        return self.content.write(given + text)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "text":
            out += self.content.write(self._buf)
        elif self._state == "array":
            assert self._array is not None
            self._array.finish()
            if self._array.outcome == "not_call":
                out += self._to_content(self._array.raw)
            else:
                self.content.call_ends()
        elif self._state in ("format", "name") or (self._state == "between" and self._buf.strip()):
            out += self._to_content(self._buf)
        self._buf = ""
        return out + self.content.finish()
