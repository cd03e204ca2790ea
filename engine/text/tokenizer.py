"""Load a Hugging Face tokenizer directory with the ``tokenizers`` library only (no transformers/torch).

Reads ``tokenizer.json`` (the fast-tokenizer file format of the ``tokenizers`` library) plus
``tokenizer_config.json`` / ``special_tokens_map.json`` for bos/eos/unk/pad tokens, added tokens,
``add_bos_token`` / ``add_eos_token`` and the chat template (also ``chat_template.jinja``), reproducing
what ``transformers.AutoTokenizer`` (5.x, ``TokenizersBackend``) does with the same files: tokenizer.json's
post-processor decides which special tokens ``encode`` adds. Only when tokenizer.json has no
post-processor do ``add_bos_token`` / ``add_eos_token`` build one (``[bos] $A [eos]``), as transformers
4.x did; transformers 5.24 ignores those keys whenever tokenizer.json exists.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors
from tokenizers.decoders import DecodeStream

from engine.text.segments import SegmentedEncoder
from engine.text.token_bytes import TokenBytes

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class SpecialTokens:
    """Named special token strings (None when the tokenizer has none)."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None


class TextTokenizer:
    """Encode/decode text ↔ token ids; a thin typed wrapper over ``tokenizers.Tokenizer``.

    Raises:
        ValueError: a named special token is missing from the vocabulary after loading.
    """

    def __init__(
        self, tokenizer: Tokenizer, special: SpecialTokens, chat_template: str | None = None
    ) -> None:
        self._tok = tokenizer
        self.special = special
        self.chat_template = chat_template
        self.bos_token_id = self._id_of("bos_token")
        self.eos_token_id = self._id_of("eos_token")
        self.pad_token_id = self._id_of("pad_token")
        # chat prompts re-encode a growing conversation: piecewise with cached pieces when that is exact
        self._segments = SegmentedEncoder(tokenizer) if SegmentedEncoder.applicable(tokenizer) else None
        self._token_bytes: TokenBytes | None = None  # built at the first logprobs request

    def _id_of(self, name: str) -> int | None:
        token = getattr(self.special, name)
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{name} {token!r} is not in the tokenizer's vocabulary")
        return int(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token(self) -> str | None:
        """The bos token string (a chat template variable)."""
        return self.special.bos_token

    @property
    def eos_token(self) -> str | None:
        """The eos token string (a chat template variable)."""
        return self.special.eos_token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (e.g. a bos). Without
        it, the text is encoded piece by piece between special tokens with the pieces' ids cached
        (engine/text/segments.py: the same ids) when the tokenizer allows that."""
        if not add_special_tokens and self._segments is not None:
            return self._segments.encode(text)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def clear_encode_cache(self) -> None:
        """Forget the pieces ``encode`` cached (the next encode of a text tokenizes all of it)."""
        if self._segments is not None:
            self._segments.clear()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Byte-level BPE pieces of an incomplete UTF-8 character decode to U+FFFD."""
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def decode_stream(self, context_ids: list[int],
                      skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """A native incremental decoder (the tokenizers library's ``DecodeStream``) primed with
        ``context_ids`` (never emitted): called with each next token id, it returns the text that token
        completes, or None while it only holds part of a UTF-8 character or adds no text.

        Raises (from the call):
            Exception: the stream's window text does not start with its previous window's.
        """
        stream, tok = DecodeStream(list(context_ids), skip_special_tokens), self._tok

        def step(token_id: int) -> str | None:
            piece = stream.step(tok, token_id)
            return None if piece is None else str(piece)

        return step

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (``engine.text.token_bytes``: a partial UTF-8 character's
        bytes where ``decode([token_id])`` gives U+FFFD).

        Raises:
            ValueError: ``token_id`` is not in the vocabulary.
        """
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self._tok)
        return self._token_bytes.of(token_id)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (None if out of range)."""
        token = self._tok.id_to_token(token_id)
        return None if token is None else str(token)


def load_tokenizer(model_dir: str | Path) -> TextTokenizer:
    """Load ``model_dir``'s tokenizer.json (+ tokenizer_config.json, special_tokens_map.json).

    Raises:
        FileNotFoundError: no ``tokenizer.json`` in ``model_dir``.
        ValueError: a config file is not valid JSON, or a special token is not in the vocabulary.
    """
    root = Path(model_dir)
    path = root / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {root} (only fast-tokenizer files are supported)")
    tok = Tokenizer.from_file(str(path))
    config = _read_json(root / "tokenizer_config.json")
    token_map = {**_read_json(root / "special_tokens_map.json"), **config}
    special = SpecialTokens(**{name: _token_str(token_map.get(name)) for name in _SPECIAL_NAMES})
    _add_missing_special_tokens(tok, special, config)
    if tok.post_processor is None and ("add_bos_token" in config or "add_eos_token" in config):
        add_bos, add_eos = bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
        _set_post_processor(tok, special, add_bos, add_eos)
    return TextTokenizer(tok, special, _chat_template(root, config))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_str(value: object) -> str | None:
    """A special token from config: a string or a serialized AddedToken ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _add_missing_special_tokens(tok: Tokenizer, special: SpecialTokens, config: dict[str, Any]) -> None:
    decoder = config.get("added_tokens_decoder", {})
    extra = [_token_str(v) for v in decoder.values()] if isinstance(decoder, dict) else []
    named = [getattr(special, name) for name in _SPECIAL_NAMES]
    missing = [t for t in dict.fromkeys(named + extra) if t is not None and tok.token_to_id(t) is None]
    if missing:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def _set_post_processor(tok: Tokenizer, special: SpecialTokens, add_bos: bool, add_eos: bool) -> None:
    bos, eos = special.bos_token, special.eos_token
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    pieces = [(t, tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=pieces)


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` if present, else tokenizer_config's ``chat_template`` (str, or the
    ``"default"`` entry of a list of ``{"name", "template"}``)."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {d.get("name"): d.get("template") for d in value if isinstance(d, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None
