"""IncrementalDetokenizer: UTF-8 split across tokens, stop strings across tokens, held-back text; the
native stream path (tokenizers' DecodeStream) gives the window-decode path's text, delta for delta."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.text.detokenizer import IncrementalDetokenizer, SupportsDecodeStream
from engine.text.tokenizer import TextTokenizer, load_tokenizer


class ByteTokenizer:
    """Hand-built byte-level tokenizer: id i < 256 is byte i; ids ≥ 256 are the pieces in ``extra``."""

    def __init__(self, extra: list[bytes] | None = None) -> None:
        self.extra = extra or []

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(bytes([i]) if i < 256 else self.extra[i - 256] for i in ids)
        return data.decode("utf-8", errors="replace")


def _run(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids]


def test_plain_text_is_emitted_token_by_token() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("Hi: "))
    assert _run(detok, tok.encode("abc")) == ["a", "b", "c"]
    assert detok.finish() == "" and detok.output_text == "abc" and not detok.stopped


def test_multibyte_character_split_across_tokens_never_emits_replacement() -> None:
    tok = ByteTokenizer()
    text = "é€😀x"
    detok = IncrementalDetokenizer(tok, [])
    deltas = _run(detok, tok.encode(text))
    assert all("\ufffd" not in d for d in deltas)
    # "é" is 2 bytes, "€" 3, "😀" 4: each appears exactly when its last byte arrives
    assert deltas == ["", "é", "", "", "€", "", "", "", "😀", "x"]
    assert detok.finish() == ""


def test_incomplete_character_at_the_end_is_flushed_by_finish() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [])
    assert _run(detok, [ord("a"), 0xE2, 0x82]) == ["a", "", ""]
    assert detok.finish() == "\ufffd"  # what decode() of the full ids gives, too
    assert detok.output_text == tok.decode([ord("a"), 0xE2, 0x82])


def test_stop_string_across_two_tokens_is_not_emitted() -> None:
    tok = ByteTokenizer([b"Hello ST", b"OP tail"])
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    assert detok.add(256) == "Hello "  # "ST" may start "STOP": held back
    assert detok.add(257) == ""
    assert detok.stopped and detok.stop_reason == "STOP" and detok.output_text == "Hello "
    assert detok.add(ord("z")) == "" and detok.finish() == ""


def test_released_and_decoded_lengths_with_and_without_stop_strings() -> None:
    tok = ByteTokenizer([b"Hello ST", b"OP tail"])
    held = IncrementalDetokenizer(tok, [], stop=["STOP"])
    held.add(256)  # "ST" held back
    assert (held.released_length, held.decoded_length) == (len(held.output_text), 8) == (6, 8)
    plain = IncrementalDetokenizer(tok, [])
    plain.add(256)
    assert (plain.released_length, plain.decoded_length) == (len(plain.output_text), 8) == (8, 8)


def test_held_back_text_released_when_it_is_not_a_stop() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["</end>"])
    assert _run(detok, tok.encode("a</e")) == ["a", "", "", ""]
    assert detok.add(ord("x")) == "</ex"  # the prefix broke: all released at once
    assert _run(detok, tok.encode("</")) == ["", ""]
    assert detok.finish() == "</"  # end of generation: held-back text flushed
    assert detok.output_text == "a</ex</" and not detok.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    tok = ByteTokenizer([b"xxBBAA"])
    detok = IncrementalDetokenizer(tok, [], stop=["AA", "BB"])
    assert detok.add(256) == "xx"
    assert detok.stop_reason == "BB"


def test_stop_strings_are_not_matched_in_the_prompt() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("say STOP"), stop=["STOP"])
    assert detok.add(ord("!")) == "!" and not detok.stopped


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        IncrementalDetokenizer(ByteTokenizer(), [], stop=["ok", ""])


def test_real_byte_level_bpe_matches_full_decode(smollm2_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(smollm2_tokenizer_dir)
    prompt = tok.encode("Translate:")
    text = " naïve café — 日本語のテキスト 🎉👩‍💻 done."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish() == tok.decode(ids) == text


def test_real_tokenizer_stop_string(smollm2_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(smollm2_tokenizer_dir)
    ids = tok.encode("The answer is 42. Question: next", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["Question:"])
    out = "".join(detok.add(i) for i in ids) + detok.finish()
    assert out == "The answer is 42. " and detok.stop_reason == "Question:"


class WindowOnly:
    """The same tokenizer without ``decode_stream``: the detokenizer's window-decode path."""

    def __init__(self, tok: TextTokenizer) -> None:
        self.tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens)


TRICKY = [" naïve café — 日本語のテキスト 🎉👩‍💻 done.", "  two  spaces\tand\ttabs\n\nnew lines  ",
          "x\u200dy é\u0301 🇫🇷 𝕏 ok", "Hello world"]


def _deltas(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids] + [detok.finish()]


@pytest.mark.parametrize("skip", [True, False])
def test_native_stream_matches_window_decodes_and_full_decode(smollm2_tokenizer_dir: Path,
                                                              skip: bool) -> None:
    tok = load_tokenizer(smollm2_tokenizer_dir)
    assert isinstance(tok, SupportsDecodeStream) and not isinstance(WindowOnly(tok), SupportsDecodeStream)
    specials = [i for i in (tok.eos_token_id, tok.bos_token_id) if i is not None]
    specials += [tok.encode("<|im_start|>", add_special_tokens=False)[0]]
    assert len(set(specials)) >= 2 and all(i >= 0 for i in specials)
    prompt = tok.encode("Translate:")
    for text in TRICKY:
        pieces = [tok.encode(part, add_special_tokens=False) for part in text.split(" ")]
        ids = [i for k, p in enumerate(pieces) for i in [*p, specials[k % len(specials)]]]  # specials inside
        native = _deltas(IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip), ids)
        window = _deltas(IncrementalDetokenizer(WindowOnly(tok), prompt, skip_special_tokens=skip), ids)
        assert native == window  # token by token, the same text
        assert all("\ufffd" not in d for d in native)
        assert "".join(native) == tok.decode(ids, skip_special_tokens=skip)
        if skip:
            assert "".join(native) == text.replace(" ", "")


def test_native_stream_matches_window_decodes_on_random_ids_and_stops(smollm2_tokenizer_dir: Path) -> None:
    """Random ids (byte pieces that form no character included) and stop strings: both paths agree on
    every delta, the held-back text and the stop."""
    tok = load_tokenizer(smollm2_tokenizer_dir)
    rng = random.Random(7)
    for trial in range(40):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        stop = ["e", "the", "\ufffd"][: trial % 4]
        skip = trial % 2 == 0
        a = IncrementalDetokenizer(tok, [1, 2, 3], stop, skip_special_tokens=skip)
        b = IncrementalDetokenizer(WindowOnly(tok), [1, 2, 3], stop, skip_special_tokens=skip)
        assert _deltas(a, ids) == _deltas(b, ids)
        assert (a.stopped, a.stop_reason, a.output_text) == (b.stopped, b.stop_reason, b.output_text)
