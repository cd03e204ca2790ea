"""Gateway text processing: a thin adapter over ``engine.text`` (tokenizer, chat template, incremental
detokenization with stop strings), which imports no torch.

Tokenizer dir resolution (``resolve_tokenizer_dir``): ``--tokenizer`` if given, else the ``model_path``
the first worker registered (workers and gateway on one host, or a shared volume). ``--tokenizer`` is a
model alias of ``engine.models.registry`` (``smollm2-135m`` or a shape-only one such as ``tiny-llama``)
or a directory. An alias not in the pdserve cache yet is prepared there (``prepare_alias``): a shape-only
one in this process (it writes a synthetic tokenizer, no torch), the embedded model by a child process
(``python -m engine.models.prepare``) that converts it once (~20-30 s) under the conversion's file lock,
so this process never imports torch and concurrent preparations (several gateways, a worker on a shared
volume) leave one finished directory. Only a dir with ``tokenizer.json`` is needed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.text.chat_template import ChatTemplateError, apply_chat_template
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["IncrementalDetokenizer", "TextProcessor", "TokenizerNotFoundError", "TokenizerPrepareError",
           "prepare_alias", "resolve_tokenizer_dir", "tokenizer_flag_problem"]

log = logging.getLogger("pdserve.gateway")
PREPARE_TIMEOUT_S = 240.0  # the embedded model's conversion takes ~20-30 s on a 2-core machine


class TokenizerNotFoundError(RuntimeError):
    """The tokenizer dir lacks ``tokenizer.json`` (or does not exist), or none is known yet."""


class TokenizerPrepareError(TokenizerNotFoundError):
    """An alias's model directory could not be prepared in the cache (its conversion failed or ran past
    its deadline)."""


@dataclass(frozen=True)
class TextProcessor:
    """One model's tokenizer and chat template. Token ids are ``int`` vocabulary indices."""

    tokenizer: TextTokenizer

    @classmethod
    def from_dir(cls, path: str | Path) -> TextProcessor:
        """Load ``tokenizer.json`` (+ configs, chat template) from ``path``.

        Raises:
            TokenizerNotFoundError: no ``tokenizer.json`` in ``path``.
            ValueError: a config file is broken (from ``engine.text.load_tokenizer``).
        """
        try:
            return cls(load_tokenizer(path))
        except FileNotFoundError as exc:
            raise TokenizerNotFoundError(str(exc)) from exc

    @property
    def eos_token_id(self) -> int | None:
        """The eos token id (None if the tokenizer has none)."""
        return self.tokenizer.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text → token ids (chat prompts: no special tokens added, the template carries them)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids → text, by default skipping special tokens (e.g. eos)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The chat template's source (None: the model has none)."""
        return self.tokenizer.chat_template

    @property
    def vocab_size(self) -> int:
        """Number of token ids (valid ids are ``0 <= id < vocab_size``)."""
        return self.tokenizer.vocab_size

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens kept; a partial UTF-8 piece decodes to U+FFFD)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprob_token(self, token_id: int) -> tuple[str, bytes]:
        r"""One token as logprobs show it: ``(token, bytes)``. ``bytes`` is what the token stands for
        (``engine.text.token_bytes``; in a byte-level vocabulary a completion's tokens' bytes joined are its
        UTF-8 text, also where one character spans several tokens). ``token`` is ``token_text`` where those
        bytes are whole UTF-8 characters; else the bytes, each one outside a whole character written as
        ``\xHH`` (``" \xf0\x9f\x98"`` for the first three bytes of an emoji, where ``token_text`` gives
        ``" \ufffd"``; DeepSeek's OpenAI-compatible API writes them so). Where the bytes are whole
        characters, ``bytes`` is ``token``'s UTF-8, as before. An id outside the tokenizer's vocabulary
        (a model's padded logits can rank one: Qwen's 151936 rows against ~151665 tokens) shows as
        ``token_text`` shows it, ``("", b"")``.
        """
        try:
            raw: bytes | None = self.tokenizer.token_bytes(token_id)
        except ValueError:  # past the tokenizer's vocabulary
            raw = None
        if raw is not None:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return raw.decode("utf-8", errors="backslashreplace"), raw
        text = self.token_text(token_id)
        return text, text.encode("utf-8")

    def vocab_token(self, token_id: int) -> str:
        """One token's vocabulary string (what transformers' ``convert_ids_to_tokens`` gives: ``"Ġis"``
        where ``token_text`` gives ``" is"``). Raises ValueError for an id outside the vocabulary."""
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        return token

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """Apply the model's chat template to OpenAI-style messages; ``template_kwargs`` become template
        variables (transformers' ``apply_chat_template`` kwargs, e.g. ``enable_thinking=False``).

        Raises:
            ValueError: no chat template, or the template rejects the messages.
        """
        try:
            return apply_chat_template(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                       **template_kwargs)
        except ChatTemplateError as exc:
            raise ValueError(str(exc)) from exc

    def detokenizer(self, prompt_ids: list[int], stop: tuple[str, ...] = ()) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one request (``add``, ``finish``, ``stopped``)."""
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, tuple(s for s in stop if s))


def tokenizer_flag_problem(flag: str) -> str | None:
    """Why ``--tokenizer flag`` cannot be used (one line naming the flag), or None, without preparing
    anything: a name that is neither a model alias nor an existing directory, or a directory without
    ``tokenizer.json``. An alias is taken as one even when a directory of that name exists, as
    ``engine.models.registry.resolve_model`` (the workers' ``--model``) takes it."""
    from engine.models.registry import aliases  # torch-free

    if flag in aliases():
        return None
    path = Path(flag).expanduser()
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return None
        return f"--tokenizer {flag}: directory {path} has no tokenizer.json"
    what = "is not a directory" if path.exists() else "does not exist"
    return (f"--tokenizer {flag!r} {what} and is not a model alias (aliases: {', '.join(aliases())}); "
            "give a directory with tokenizer.json or an alias")


def prepare_alias(alias: str, timeout: float = PREPARE_TIMEOUT_S) -> Path:
    """The cache directory of model alias ``alias``, prepared if it is not there yet (module docstring):
    a shape-only alias's in this process, the embedded model's by ``python -m engine.models.prepare``
    in a child process given ``timeout`` seconds (killed after them). Logs one line when it converts.

    Raises:
        TokenizerNotFoundError: ``alias`` is not a model alias.
        TokenizerPrepareError: the child failed (its last stderr line is in the message) or ran past
            ``timeout``, or the directory it gave has no ``tokenizer.json``.
    """
    from engine.models import registry  # torch-free

    names = registry.aliases()
    if alias not in names:
        raise TokenizerNotFoundError(f"{alias!r} is not a model alias (aliases: {', '.join(names)})")
    if registry.is_dummy_alias(alias):  # config + synthetic tokenizer: no torch, milliseconds
        try:
            return registry.resolve_model(alias)
        except OSError as exc:
            raise TokenizerPrepareError(f"--tokenizer {alias}: cannot write it into the cache: {exc}") \
                from exc
    cached = registry.alias_dir(alias)
    if (cached / "tokenizer.json").is_file():  # the conversion renames a finished directory into place
        return cached
    log.info("gateway: preparing the tokenizer of %s: converting the model into %s (once, ~20-30 s)", alias,
             cached)
    root = str(Path(registry.__file__).resolve().parents[2])  # so the child imports this same engine
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run([sys.executable, "-m", "engine.models.prepare", alias], capture_output=True,
                              text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise TokenizerPrepareError(f"--tokenizer {alias}: preparing the model in {cached} did not finish "
                                    f"within {timeout:g} s") from exc
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        why = [line for line in done.stderr.splitlines() if line.strip()] or [f"exit code {done.returncode}"]
        raise TokenizerPrepareError(f"--tokenizer {alias}: preparing the model failed: {why[-1].strip()}")
    path = Path(lines[-1].strip())
    if not (path / "tokenizer.json").is_file():
        raise TokenizerPrepareError(f"--tokenizer {alias}: the prepared directory {path} has no "
                                    "tokenizer.json")
    return path


def resolve_tokenizer_dir(flag: str | None, registered_model_path: str | None,
                          timeout: float = PREPARE_TIMEOUT_S) -> Path:
    """The tokenizer dir: ``--tokenizer`` if set (a model alias, prepared in the cache when not there yet:
    ``prepare_alias`` with ``timeout``; else a directory), else a registered worker's ``model_path``.

    Raises:
        TokenizerNotFoundError: neither is set, the flag is unusable (``tokenizer_flag_problem``), or the
            chosen dir has no ``tokenizer.json``.
        TokenizerPrepareError: an alias could not be prepared (``prepare_alias``).
    """
    if flag:
        if (why := tokenizer_flag_problem(flag)) is not None:
            raise TokenizerNotFoundError(why)
        from engine.models.registry import aliases

        return prepare_alias(flag, timeout) if flag in aliases() else Path(flag).expanduser()
    if not registered_model_path:
        raise TokenizerNotFoundError("no --tokenizer given and no worker has registered a model_path yet")
    path = Path(registered_model_path).expanduser()
    if not (path / "tokenizer.json").is_file():
        raise TokenizerNotFoundError(f"tokenizer dir {path} has no tokenizer.json (the model_path a worker "
                                     "registered; give the gateway --tokenizer)")
    return path
