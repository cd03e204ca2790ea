"""Request bodies for the OpenAI completions/chat APIs, and a session's growing conversation prefix."""

from __future__ import annotations

from typing import Any

from loadtest.workload import Turn

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class Conversation:
    """The history of one session; each turn's request carries the whole conversation so far.

    Chat: ``messages`` grows by the user turn and the assistant's reply. Completions: the prompt text
    grows by the turn and the reply (token-id turns are never multi-turn, so they are sent as is).
    """

    def __init__(self, endpoint: str) -> None:
        if endpoint not in PATHS:
            raise ValueError(f"endpoint must be one of {sorted(PATHS)}, got {endpoint!r}")
        self.endpoint = endpoint
        self.messages: list[dict[str, str]] = []
        self.text = ""

    def body(self, turn: Turn, model: str, *, ignore_eos: bool, temperature: float) -> dict[str, Any]:
        """The JSON body (streaming, with usage) of ``turn`` on top of the history."""
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": turn.max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True  # vLLM/SGLang extension: pin the output length to max_tokens
        if self.endpoint == "chat":
            body["messages"] = [*self.messages, {"role": "user", "content": _as_text(turn)}]
        elif isinstance(turn.prompt, tuple):
            body["prompt"] = list(turn.prompt)
        else:
            body["prompt"] = self.text + turn.prompt
        return body

    def add_reply(self, turn: Turn, reply: str) -> None:
        """Append ``turn`` and the server's ``reply`` text to the history (token-id turns: nothing)."""
        if isinstance(turn.prompt, tuple):
            return  # token-id prompts are single-turn: there is no text history to grow
        if self.endpoint == "chat":
            self.messages.append({"role": "user", "content": _as_text(turn)})
            self.messages.append({"role": "assistant", "content": reply})
        else:
            self.text += _as_text(turn) + reply + "\n"


def _as_text(turn: Turn) -> str:
    if isinstance(turn.prompt, tuple):
        raise ValueError("token-id prompts cannot be sent to the chat endpoint")
    return turn.prompt
