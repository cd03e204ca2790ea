"""Incremental reading of tool-call JSON, character by character, so that a call's arguments stream as
the model writes them: ``CallReader`` reads one call object ``{"name": ..., "arguments": {...}}``,
``CallArrayReader`` a JSON array of them.

A call is *committed* (its ``ToolCallStart`` emitted) once its name is read and its arguments value
opens with ``{``; from then on each piece of the arguments object is a ``ToolCallArguments`` fragment,
the model's own text (not re-serialized), so the fragments of a call concatenate to its arguments
whatever the pieces were. Arguments written before the name, or as a JSON string holding an object,
are held and emitted whole when the object (or the string) closes; a call without arguments gets
``{}``. An object that closes without being a call (no string name, arguments neither an object nor a
string of one) is *not a call*: nothing was emitted for it, and the caller gives its text back as
content. Text that cannot continue an object (bad syntax) stops the reader there: before the commit
the object is not a call; after it, the call stands and the caller reads on from that character.

Only the structure the readers need is checked (strings with their escapes, bracket nesting, the
members of the outer object); the arguments object's inside is the model's, passed on as written: a
call cut short by ``max_tokens`` keeps the arguments read so far.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Literal

from gateway.tool_parsers.events import Event, ToolCallArguments

if TYPE_CHECKING:
    from gateway.tool_parsers.base import ToolCallParser

Outcome = Literal["call", "not_call"]
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")


class ValueEnd:
    """Where one JSON value ends, read character by character after its first character ``first``:
    strings (with escapes) and bracket nesting are followed, nothing else is validated."""

    def __init__(self, first: str) -> None:
        self.depth = 1 if first in "{[" else 0
        self.in_string = first == '"'
        self.escaped = False
        self.scalar = first not in '{["'

    def step(self, ch: str) -> Literal["in", "end", "before"]:
        """``in``: ``ch`` belongs to the value, which goes on; ``end``: ``ch`` is its last character;
        ``before``: the value (a number or literal) ended just before ``ch``, which is not part of it."""
        if self.scalar:
            return "in" if ch in _SCALAR_CHARS else "before"
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 0:
                    return "end"
            return "in"
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                return "end"
        return "in"


class CallReader:
    """Reads one call object for ``parser`` (whose ``start_call`` numbers the calls), the arguments
    under the first of ``argument_keys`` that appears. ``feed`` until it returns a stop position, or
    ``finish`` when the text ends first; then ``outcome`` says what the object was and ``raw`` holds the
    text read."""

    def __init__(self, parser: ToolCallParser, argument_keys: tuple[str, ...]) -> None:
        self._parser = parser
        self._keys = argument_keys
        self._state = "open"
        self._key = ""
        self._key_raw = ""
        self._value: ValueEnd | None = None
        self._value_raw = ""
        self._role = "skip"  # the value being read: name, args (streamed), held_args, skip
        self._name: str | None = None
        self._args: str | None = None  # held arguments text (object, or decoded from a string)
        self._args_seen = False
        self._args_bad = False
        self._index: int | None = None  # the call's index once committed
        self.raw = ""
        self.outcome: Outcome | None = None

    @property
    def committed(self) -> bool:
        """Whether the call's start has been emitted."""
        return self._index is not None

    @property
    def unread(self) -> str:
        """After a stop: the text read that is part of no call (all of it when not a call)."""
        return self.raw if self.outcome == "not_call" else ""

    def feed(self, text: str) -> tuple[list[Event], int | None]:
        """Events for ``text``, and None while the object goes on, else how many characters of ``text``
        it used (the object closed, or the next character cannot continue it); ``outcome`` is then set."""
        out: list[Event] = []
        fragment: list[str] = []
        for i, ch in enumerate(text):
            used = self._step(ch, out, fragment)
            if used is not None:
                self._flush(out, fragment)
                self.raw += text[:i + used]
                return out, i + used
        self._flush(out, fragment)
        self.raw += text
        return out, None

    def finish(self, named_stands: bool = False) -> list[Event]:
        """The text ended inside the object: a committed call stands as read; else it is not a call.
        ``named_stands``: a call whose name was read whole but whose arguments had not opened yet stands
        too (started now, its arguments the empty text: none were written)."""
        if named_stands and not self.committed and self._name is not None and not self._args_bad:
            events, self._index = self._parser.start_call(self._name)
            self.outcome = "call"
            return events
        self.outcome = "call" if self.committed else "not_call"
        return []

    def _flush(self, out: list[Event], fragment: list[str]) -> None:
        if fragment:
            assert self._index is not None
            out.append(ToolCallArguments(self._index, "".join(fragment)))
            fragment.clear()

    def _commit(self, out: list[Event], fragment: list[str], arguments: str | None) -> None:
        assert self._name is not None
        self._flush(out, fragment)
        events, self._index = self._parser.start_call(self._name)
        out += events
        if arguments:
            out.append(ToolCallArguments(self._index, arguments))

    def _close(self, out: list[Event], fragment: list[str]) -> None:
        """The object closed: a held call is emitted now, or the object is not a call."""
        if self.committed:
            self.outcome = "call"
            return
        if self._name is None or self._args_bad:
            self.outcome = "not_call"
            return
        self.outcome = "call"
        self._commit(out, fragment, "{}" if self._args is None else self._args)

    def _stop(self) -> int:
        """A character that cannot continue the object: stop before it."""
        self.outcome = "call" if self.committed else "not_call"
        return 0

    def _step(self, ch: str, out: list[Event], fragment: list[str]) -> int | None:
        """Read one character; the number of characters used (0 or 1) when the reader stops, else None."""
        state = self._state
        if state == "value" and self._value is not None:
            where = self._value.step(ch)
            if where == "before":
                self._end_value(out, fragment)
                return self._step(ch, out, fragment)
            self._value_raw += ch
            if self._role == "args":
                fragment.append(ch)
            if where == "end":
                self._end_value(out, fragment)
            return None
        if ch.isspace():
            return None
        if state == "open":
            if ch != "{":
                return self._stop()
            self._state = "key"
        elif state == "key":
            if ch == "}":
                self._close(out, fragment)
                return 1
            if ch != '"':
                return self._stop()
            self._state, self._key_raw = "key_string", ch
        elif state == "key_string":
            self._key_raw += ch
            if ch == '"' and not _ends_escaped(self._key_raw[:-1]):
                self._key = json.loads(self._key_raw)
                self._state = "colon"
        elif state == "colon":
            if ch != ":":
                return self._stop()
            self._state = "value"
        elif state == "value":
            if ch not in '{["' and ch not in _SCALAR_CHARS:
                return self._stop()
            self._start_value(ch, out, fragment)
        elif state == "after":
            if ch == ",":
                self._state = "key"
            elif ch == "}":
                self._close(out, fragment)
                return 1
            else:
                return self._stop()
        return None

    def _start_value(self, ch: str, out: list[Event], fragment: list[str]) -> None:
        self._value, self._value_raw = ValueEnd(ch), ch
        if self._key == "name" and ch == '"' and self._name is None:
            self._role = "name"
        elif self._key in self._keys and not self._args_seen:
            self._args_seen = True
            if ch == "{" and self._name is not None:
                self._role = "args"
                self._commit(out, fragment, None)
                fragment.append(ch)
            elif ch in '{"':
                self._role = "held_args"
            else:
                self._role, self._args_bad = "skip", True
        else:
            self._role = "skip"

    def _end_value(self, out: list[Event], fragment: list[str]) -> None:
        role, raw = self._role, self._value_raw
        self._value, self._value_raw, self._role, self._state = None, "", "skip", "after"
        if role == "name":
            try:
                name = json.loads(raw)
            except ValueError:
                return
            self._name = name if isinstance(name, str) else None
        elif role == "held_args":
            self._hold_arguments(raw)
            if self._args is not None and self._name is not None:
                self._commit(out, fragment, self._args)

    def _hold_arguments(self, raw: str) -> None:
        """Arguments read whole: an object's text, or a string holding one (decoded)."""
        try:
            value = json.loads(raw)
            text = value if isinstance(value, str) else raw
            ok = isinstance(json.loads(text), dict)
        except ValueError:
            ok = False
        if ok:
            self._args = text
        else:
            self._args_bad = True


def _ends_escaped(text: str) -> bool:
    """Whether ``text`` ends with an odd number of backslashes (its next character is escaped)."""
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1


class CallArrayReader:
    """Reads a JSON array of call objects (``[{...}, {...}]``) for ``parser``: each element through a
    ``CallReader``; ``feed`` / ``finish`` / ``outcome`` / ``raw`` as there. The array is a call list
    (``call``) as soon as one element is committed; an element that is not a call stops the reader at
    its start (before any commit: the whole array is ``not_call``)."""

    def __init__(self, parser: ToolCallParser, argument_keys: tuple[str, ...]) -> None:
        self._parser = parser
        self._keys = argument_keys
        self._state = "open"  # then element, between, done
        self._element: CallReader | None = None
        self._calls = 0
        self._given_back = ""
        self.raw = ""
        self.outcome: Outcome | None = None

    def feed(self, text: str) -> tuple[list[Event], int | None]:
        """As ``CallReader.feed``, for the whole array."""
        out: list[Event] = []
        pos = 0
        while pos < len(text):
            if self._element is not None:
                events, used = self._element.feed(text[pos:])
                out += events
                if used is None:
                    self.raw += text[pos:]
                    return out, None
                element, self._element = self._element, None
                self.raw += text[pos:pos + used]
                pos += used
                if element.outcome != "call":
                    self._given_back = element.raw
                    return out, self._stop(pos)
                self._calls += 1
                self._state = "between"
                continue
            ch = text[pos]
            if ch.isspace():
                pos += 1
                self.raw += ch
                continue
            if self._state == "open" and ch == "[":
                self._state = "element"
            elif self._state == "element" and ch == "{":
                self._element = CallReader(self._parser, self._keys)
                continue
            elif self._state == "between" and ch == ",":
                self._state = "element"
            elif self._state == "between" and ch == "]":
                self.raw += ch
                self.outcome = "call"
                return out, pos + 1
            else:
                return out, self._stop(pos)
            self.raw += ch
            pos += 1
        return out, None

    def _stop(self, at: int) -> int:
        self.outcome = "call" if self._calls else "not_call"
        return at

    @property
    def unread(self) -> str:
        """After a stop: the text read that is part of no call, for the caller to give back as content
        (``not_call``: all of it; else the element that was not a call)."""
        return self.raw if self.outcome == "not_call" else self._given_back

    def finish(self, named_stands: bool = False) -> list[Event]:
        """The text ended inside the array: the calls committed so far stand (a cut element too; with
        ``named_stands`` also one cut after its name, as ``CallReader.finish``)."""
        out: list[Event] = []
        if self._element is not None:
            out += self._element.finish(named_stands)
            if self._element.outcome == "call":
                self._calls += 1
        self.outcome = "call" if self._calls else "not_call"
        return out
