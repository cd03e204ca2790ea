"""``engine.text.token_bytes``: the bytes a token stands for under each decoder kind (byte-level BPE,
SentencePiece byte fallback, plain), special tokens, and an id outside the vocabulary."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from engine.text.token_bytes import TokenBytes


def test_byte_level_vocabulary_maps_each_character_to_its_byte() -> None:
    # GPT-2's alphabet: "Ġ" is the space byte, "ð" 0xF0 (printable Latin-1, itself), "Ł" 0x9F, "ĺ" 0x98
    vocab = {"Ġhi": 0, "ðŁĺ": 1, "Ģ": 2, "Ã©": 3}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|end|>", special=True)])
    tb = TokenBytes(tok)
    assert tb.byte_level and not tb.byte_fallback
    assert tb.of(0) == b" hi"
    assert tb.of(1) == b"\xf0\x9f\x98" and tb.of(2) == b"\x80"
    assert (tb.of(1) + tb.of(2)).decode("utf-8") == "\U0001F600"
    assert tb.of(3) == "é".encode()
    end = tok.token_to_id("<|end|>")
    assert end is not None and tb.of(end) == b"<|end|>"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tb.of(10_000)


def test_byte_fallback_vocabulary_reads_byte_tokens_and_the_metaspace() -> None:
    vocab = {"<unk>": 0, "<0xF0>": 1, "<0x9F>": 2, "\u2581Hi": 3, "é": 4, "<0x0A>": 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tb = TokenBytes(tok)
    assert tb.byte_fallback and not tb.byte_level
    assert [tb.of(i) for i in range(1, 6)] == [b"\xf0", b"\x9f", b" Hi", "é".encode(), b"\n"]


def test_a_plain_vocabulary_is_its_strings_utf8() -> None:
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "Grüße": 1}, unk_token="[UNK]"))
    tb = TokenBytes(tok)
    assert not (tb.byte_level or tb.byte_fallback or tb.metaspace)
    assert tb.of(1) == "Grüße".encode()
