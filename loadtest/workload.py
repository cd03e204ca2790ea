"""Workloads: endless, seeded streams of sessions (one or more turns) to send.

Random prompts follow input/output `LengthDist`s, as token ids (exact lengths) or as text (one word
≈ one token, no tokenizer needed). ShareGPT files (a JSON list of ``{"conversations": [{"from": "human",
"value": ...}, {"from": "gpt", "value": ...}, ...]}``, the format vLLM's and SGLang's serving benchmarks
read) give human turns as prompts; the reference reply sets max_tokens at 4/3 tokens per word (OpenAI's
rule of thumb of 0.75 words per token). Multi-turn sessions send their turns one after another, each
carrying the whole conversation so far (a growing shared prefix).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtest.config import WorkloadConfig

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car"
)
WORDS = tuple(_WORD_TEXT.split())
_HUMAN = ("human", "user")
_GPT = ("gpt", "assistant", "chatgpt", "bard", "model")


@dataclass(frozen=True)
class Turn:
    """One request of a session: the new user content (text, or token ids) and max_tokens (tokens)."""

    prompt: str | tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """A conversation: turns sent in order, each after the previous one's reply."""

    session_id: int
    turns: tuple[Turn, ...]


def random_text(rng: random.Random, num_words: int) -> str:
    """``num_words`` words drawn from a fixed list of common English words (≈ one token each)."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _random_turn(cfg: WorkloadConfig, rng: random.Random) -> Turn:
    n_in, n_out = cfg.input_len.sample(rng), cfg.output_len.sample(rng)
    if cfg.prompt_format == "tokens":
        ids = tuple(rng.randrange(cfg.vocab_low, cfg.vocab_high) for _ in range(n_in))
        return Turn(ids, n_out)
    return Turn(random_text(rng, n_in), n_out)


def load_sharegpt(path: str | Path, max_turns: int) -> list[list[tuple[str, int | None]]]:
    """Read a ShareGPT JSON file into conversations of (human text, reference reply length in tokens).

    The reply length is None when a human turn has no following reply. Raises ValueError naming the
    flag (``--dataset-path``) and the file when it is not JSON, not a JSON list or holds no conversation
    with a human turn; OSError naming them if unreadable.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise OSError(f"--dataset-path {path}: cannot read it ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"--dataset-path {path}: not UTF-8 text ({exc.reason})") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--dataset-path {path}: not JSON ({exc})") from exc
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of conversations")
    out: list[list[tuple[str, int | None]]] = []
    for item in data:
        msgs = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(msgs, list):
            continue
        turns: list[tuple[str, int | None]] = []
        for i, msg in enumerate(msgs):
            if not isinstance(msg, dict) or msg.get("from") not in _HUMAN or not msg.get("value"):
                continue
            nxt = msgs[i + 1] if i + 1 < len(msgs) else None
            reply = nxt.get("value") if isinstance(nxt, dict) and nxt.get("from") in _GPT else None
            n_out = max(1, math.ceil(len(str(reply).split()) * 4 / 3)) if reply else None
            turns.append((str(msg["value"]), n_out))
            if len(turns) == max_turns:
                break
        if turns:
            out.append(turns)
    if not out:
        raise ValueError(f"--dataset-path {path}: no ShareGPT conversation with a human turn found")
    return out


def make_sessions(cfg: WorkloadConfig, seed: int) -> Iterator[Session]:
    """Endless stream of sessions, the same for the same ``cfg`` and ``seed``.

    ShareGPT conversations are shuffled with ``seed`` and cycled. Raises ValueError/OSError on a bad
    dataset (before yielding anything).
    """
    rng = random.Random(seed)
    if cfg.kind == "sharegpt":
        assert cfg.dataset_path is not None
        convs = load_sharegpt(cfg.dataset_path, cfg.num_turns)
        rng.shuffle(convs)
        return _sharegpt_sessions(convs, cfg, rng)
    turns = 1 if cfg.kind == "random" else cfg.num_turns
    return (
        Session(sid, tuple(_random_turn(cfg, rng) for _ in range(turns))) for sid in itertools.count()
    )


def _sharegpt_sessions(
    convs: list[list[tuple[str, int | None]]], cfg: WorkloadConfig, rng: random.Random
) -> Iterator[Session]:
    for sid, conv in enumerate(itertools.cycle(convs)):
        turns = tuple(Turn(text, n if n is not None else cfg.output_len.sample(rng)) for text, n in conv)
        yield Session(sid, turns)
