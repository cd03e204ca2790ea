"""Reasoning parsers: a choice's ``<think>...</think>`` block becomes ``reasoning_content``, the rest
``content`` (which the tool-call parser then reads).

* ``qwen3``: reasoning only when the text starts (after whitespace) with ``<think>``; without it the whole
  text is content (Qwen3 with ``enable_thinking: false``, whose template closes an empty block itself).
* ``deepseek_r1``: the template opens the block in the prompt, so the text starts inside it (a leading
  ``<think>`` is skipped); everything up to ``</think>`` is reasoning, all of it when no ``</think>``
  comes.

After ``</think>``, leading whitespace of the content is dropped. A block cut short (``length``) leaves
its text as reasoning. Choice by template (``auto``): ``<think>`` with ``enable_thinking`` → ``qwen3``;
``<think>`` with DeepSeek's ``<｜Assistant｜>`` → ``deepseek_r1``; otherwise ``none``.
"""

from __future__ import annotations

from gateway.tool_parsers.events import ContentText, Event, ReasoningText, held_prefix

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")
CHOICES = ("auto", *REASONING_PARSERS, "none")


def select_reasoning_parser(flag: str, template: str | None) -> str:
    """The reasoning parser (one of ``REASONING_PARSERS`` or ``none``) for ``--reasoning-parser`` ``flag``
    and the model's chat template source."""
    if flag != "auto":
        return flag
    if template is None or START not in template:
        return "none"
    if "enable_thinking" in template:
        return "qwen3"
    if "<｜Assistant｜>" in template:
        return "deepseek_r1"
    return "none"


class ReasoningParser:
    """Streaming split of one choice's text into ``ReasoningText`` and ``ContentText`` events."""

    def __init__(self, kind: str) -> None:
        if kind not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {kind!r}")
        self._buf = ""
        # "start": before the opening tag is known; "reasoning"; "after": content, leading blanks dropped
        self._state = "start"
        self._opens_inside = kind == "deepseek_r1"

    def feed(self, text: str) -> list[Event]:
        """Events for the next piece of text (text that may be a tag's beginning is held)."""
        self._buf += text
        out: list[Event] = []
        if self._state == "start":
            head = self._buf.lstrip()
            if not head or (START.startswith(head) and head != START):
                return out
            if head.startswith(START):
                self._buf, self._state = head[len(START):], "reasoning"
            elif self._opens_inside:
                self._state = "reasoning"
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buf.find(END)
            if end < 0:
                keep = held_prefix(self._buf, END)
                piece, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return out + ([ReasoningText(piece)] if piece else [])
            if end:
                out.append(ReasoningText(self._buf[:end]))
            self._buf, self._state = self._buf[end + len(END):], "after"
        if self._state == "after":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return out
            self._state = "content"
        piece, self._buf = self._buf, ""
        return out + ([ContentText(piece)] if piece else [])

    def finish(self) -> list[Event]:
        """Events for the text still held when the choice ends."""
        buf, self._buf = self._buf, ""
        if not buf:
            return []
        if self._state == "reasoning" or (self._state == "start" and self._opens_inside):
            return [ReasoningText(buf)]
        return [ContentText(buf)] if self._state != "after" else []
