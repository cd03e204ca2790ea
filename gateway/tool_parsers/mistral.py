"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``
(Mistral's v3 tokenizer format), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (the v11 format). Text
before the marker is content, streamed as it comes; everything after it is held to the end and, when it
does not decode, given back as content unchanged. ``[TOOL_CALLS]`` is a special token: where the
detokenizer drops it, an answer that starts with a JSON array of call objects is read as calls too.
"""

from __future__ import annotations

import json

from gateway.tool_parsers.base import ToolCallParser, call_from_json
from gateway.tool_parsers.events import Event, held_prefix

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


def _decode_calls(body: str) -> list[tuple[str, str]] | None:
    """The calls after the marker(s), or None when ``body`` is neither format."""
    body = body.strip()
    if body.startswith("["):
        try:
            items = json.loads(body)
        except ValueError:
            return None
        calls = [call_from_json(item) for item in items] if isinstance(items, list) and items else [None]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]
    out = []
    for part in body.split(MARKER):
        name, sep, args = part.partition(ARGS)
        if not sep or not name.strip():
            return None
        call = call_from_json({"name": name.strip(), "arguments": args.strip()})
        if call is None:
            return None
        out.append(call)
    return out


class MistralParser(ToolCallParser):
    """Streaming parser of Mistral calls (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._seen_text = False
        self._in_calls = False
        self._bare = False  # the calls came without the marker

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        if self._in_calls:
            return []
        out: list[Event] = []
        at = self._buf.find(MARKER)
        if at < 0 and not self._seen_text and self._buf.lstrip().startswith("[{"):
            self._in_calls = self._bare = True  # the marker was a dropped special token
            return []
        if at >= 0:
            out += self.content.write(self._buf[:at])
            self._in_calls, self._buf = True, self._buf[at + len(MARKER):]
            return out
        head = self._buf.lstrip()
        if not self._seen_text and (not head or "[{".startswith(head)):
            return out  # could still open a bare array of calls
        keep = held_prefix(self._buf, MARKER)
        written, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        self._seen_text = self._seen_text or bool(written.strip())
        return out + self.content.write(written)

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if not self._in_calls:
            return self.content.write(buf) + self.content.finish()
        calls = _decode_calls(buf)
        if calls is None:
            raw = buf if self._bare else MARKER + buf
            return self.content.write(raw) + self.content.finish()
        self.content.call_starts()
        out: list[Event] = []
        for name, arguments in calls:
            out += self.emit_call(name, arguments)
        return out
