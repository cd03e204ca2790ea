"""The bytes one token stands for, whatever its vocabulary spelling: what logprobs report as a token's
``bytes`` (OpenAI's field: joined over a completion's tokens they give its UTF-8 text, also where one
character spans several tokens, as emoji and many CJK characters do in byte-level vocabularies).

Decoding one token alone (``Tokenizer.decode([id])``) cannot give them: a token holding part of a UTF-8
character decodes to U+FFFD. The vocabulary string is mapped back by the tokenizer's decoder instead:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM: a ``ByteLevel`` decoder): each character of the token
  stands for one byte through GPT-2's byte-to-unicode table (every byte that is a printable, non-space
  Latin-1 character stands for itself; the 68 others for the characters from U+0100 on, in byte order;
  Radford et al., GPT-2's ``encoder.py``, ``bytes_to_unicode``);
- byte fallback (SentencePiece vocabularies, Llama 2, Mistral, Gemma: a ``ByteFallback`` decoder):
  ``<0xHH>`` is the byte ``HH``, and the metaspace ``▁`` (U+2581) a space;
- added tokens (special tokens such as ``<|im_end|>``): their content's UTF-8;
- anything else: the vocabulary string's UTF-8.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: character → the byte it stands for."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_OF = _unicode_to_byte()


def _decoder_types(decoder: Any) -> set[str]:
    """The ``type`` names in a tokenizer.json ``decoder`` tree (a ``Sequence`` lists its ``decoders``)."""
    if not isinstance(decoder, dict):
        return set()
    found = {str(decoder.get("type"))}
    for child in decoder.get("decoders") or []:
        found |= _decoder_types(child)
    return found


class TokenBytes:
    """Token id → the bytes it stands for (module docstring), cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        decoder = tokenizer.decoder  # its own JSON only: the whole tokenizer's can run to megabytes
        types = _decoder_types(json.loads(decoder.__getstate__()) if decoder is not None else None)
        self._tok = tokenizer
        self.byte_level = "ByteLevel" in types
        self.byte_fallback = "ByteFallback" in types
        self.metaspace = "Metaspace" in types or self.byte_fallback
        self._added = {int(i): t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}

    def of(self, token_id: int) -> bytes:
        """The bytes of ``token_id``.

        Raises:
            ValueError: ``token_id`` is not in the vocabulary.
        """
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        out = self._bytes(token_id, str(piece))
        self._cache[token_id] = out
        return out

    def _bytes(self, token_id: int, piece: str) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        if self.byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if self.byte_fallback and (m := _BYTE_TOKEN.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if self.metaspace:
            piece = piece.replace(_METASPACE, " ")
        return piece.encode("utf-8")
