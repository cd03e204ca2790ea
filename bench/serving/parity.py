"""Greedy-output parity between two live systems (disaggregated vs colocated): the same prompts, chat
and completion, ``temperature 0``, sent one at a time (idle systems, so both run each prompt with the
same batch shapes), must give identical text, finish reason and token count.

Prompts are model-agnostic: completions as token ids (ids 100..999 exist in every supported vocabulary),
chats as text (for the synthetic dummy tokenizer, words ``t<id>`` are tokens; other words map to unk).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

CHATS = ("t101 t2024 t333 What is the capital of France?", "Write a haiku about t512 rivers.",
         "t7 t8 t9 t10 t11 t12 Count on from here.", "Explain KV caches in one sentence.")
COMPLETIONS = ([101, 202, 303, 404, 505], [999, 998, 997], list(range(100, 164)),
               [150 + (i * 37) % 800 for i in range(200)])


@dataclass(frozen=True)
class ParityCase:
    """One prompt's answers. ``a``/``b``: (text, finish_reason, completion_tokens) of each system."""

    kind: str
    prompt: str
    a: tuple[str, str, int]
    b: tuple[str, str, int]

    @property
    def identical(self) -> bool:
        """Both systems gave the same text, finish reason and token count."""
        return self.a == self.b


def _ask(client: httpx.Client, url: str, kind: str, prompt: Any, model: str, max_tokens: int
         ) -> tuple[str, str, int]:
    """One greedy request; (text, finish_reason, completion_tokens). Raises httpx.HTTPStatusError."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    resp = client.post(f"{url}/v1/{'chat/completions' if kind == 'chat' else 'completions'}", json=body)
    resp.raise_for_status()
    data = resp.json()
    choice = data["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    return str(text), str(choice["finish_reason"]), int(data["usage"]["completion_tokens"])


def check_parity(url_a: str, url_b: str, model: str, max_tokens: int = 32, timeout_s: float = 120.0
                 ) -> list[ParityCase]:
    """Send the 8 prompts (4 chat, 4 completion), one at a time, to both gateways (``model`` is the
    served name) and return each pair of answers (``max_tokens`` output tokens at most, greedy).

    Raises:
        httpx.HTTPError: a request fails (non-2xx, connection error, ``timeout_s`` seconds passed).
    """
    cases = []
    prompts: list[tuple[str, Any]] = [("chat", c) for c in CHATS] + [("completion", p) for p in COMPLETIONS]
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        for kind, prompt in prompts:
            a = _ask(client, url_a, kind, prompt, model, max_tokens)
            b = _ask(client, url_b, kind, prompt, model, max_tokens)
            shown = prompt if kind == "chat" else f"{len(prompt)} token ids from {prompt[0]}"
            cases.append(ParityCase(kind, shown, a, b))
    return cases


def save_parity(cases: list[ParityCase], path: Path) -> None:
    """Write the cases (with ``identical`` per case) as JSON to ``path``."""
    rows = [{**asdict(c), "identical": c.identical} for c in cases]
    path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
