"""Gateway text processing: a thin adapter over ``engine.text`` (tokenizer, chat template, incremental
detokenization with stop strings), which imports no torch.

Tokenizer dir resolution (``resolve_tokenizer_dir``): ``--tokenizer`` if given (a dir, or a model alias
such as ``smollm2-135m`` whose converted dir already sits in the pdserve cache: the gateway never converts,
that would import torch), else the ``model_path`` the first worker registered (workers and gateway on
one host, or a shared volume). Only a dir with ``tokenizer.json`` is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.text.chat_template import ChatTemplateError, apply_chat_template
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["IncrementalDetokenizer", "TextProcessor", "TokenizerNotFoundError", "resolve_tokenizer_dir"]


class TokenizerNotFoundError(RuntimeError):
    """The tokenizer dir lacks ``tokenizer.json`` (or does not exist), or none is known yet."""


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


def resolve_tokenizer_dir(flag: str | None, registered_model_path: str | None) -> Path:
    """The tokenizer dir: ``--tokenizer`` if set, else a registered worker's ``model_path``.

    Raises:
        TokenizerNotFoundError: neither is set, or the chosen dir has no ``tokenizer.json``.
    """
    chosen = flag or registered_model_path
    if not chosen:
        raise TokenizerNotFoundError("no --tokenizer given and no worker has registered a model_path yet")
    path = Path(chosen).expanduser()
    if not path.exists() and flag and "/" not in flag:
        from engine.models.registry import cache_dir  # torch-free; aliases live under models/<alias>

        path = cache_dir() / "models" / flag
    if not (path / "tokenizer.json").is_file():
        raise TokenizerNotFoundError(f"tokenizer dir {path} has no tokenizer.json (for an alias, start a "
                                     "worker first so it converts the model, or pass a directory)")
    return path
