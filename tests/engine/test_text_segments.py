"""Piecewise encoding between special tokens (engine/text/segments.py) gives exactly the ids of encoding
the whole text, on SmolLM2's byte-level BPE and on small built tokenizers; it is refused where it would
not; its cache is bounded and cannot be changed through a returned list."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from engine.text.chat_template import apply_chat_template
from engine.text.segments import SegmentedEncoder
from engine.text.tokenizer import TextTokenizer, load_tokenizer

PIECES = ["Hello", " world", "  ", "\n", "\n\n", "Ünïcödé", " 🎉", "t12", "<|im_start|>", "<|im_end|>",
          "<|endoftext|>", "<repo_name>", "<reponame>", "<|im_start", "im_end|>", " <", ">", "a\tb",
          "123 456"]


def _whole(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def test_smollm2_pieces_equal_whole_text(smollm2_tokenizer_dir: Path) -> None:
    text_tok = load_tokenizer(smollm2_tokenizer_dir)
    tok = Tokenizer.from_file(str(smollm2_tokenizer_dir / "tokenizer.json"))
    assert SegmentedEncoder.applicable(tok)
    enc = SegmentedEncoder(tok)
    rng = random.Random(0)
    for n in (0, 1, 2, 5, 40, 300):
        for _ in range(20):
            text = _random_text(rng, n)
            assert enc.encode(text) == _whole(tok, text), text
    # a growing conversation rendered by the chat template, as a chat request is
    assert text_tok.chat_template is not None
    messages: list[dict[str, str]] = []
    for turn in range(6):
        messages.append({"role": "user", "content": _random_text(rng, 30) + f" turn {turn}"})
        rendered = apply_chat_template(text_tok, messages, add_generation_prompt=True)
        assert text_tok.encode(rendered, add_special_tokens=False) == _whole(tok, rendered)
        messages.append({"role": "assistant", "content": _random_text(rng, 10)})
    assert text_tok.encode("Hi", add_special_tokens=True) == list(tok.encode("Hi").ids)


def _word_tokenizer(pre: pre_tokenizers.PreTokenizer) -> Tokenizer:
    vocab = {w: i for i, w in enumerate(["[unk]", "a", "b", "c", "▁a", "▁b", "▁c", "foo", "▁foo"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[unk]"))
    tok.pre_tokenizer = pre
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False),
                            AddedToken("<ss>", special=True, normalized=False)])
    tok.add_tokens([AddedToken("a b", normalized=True)])  # matched inside the pieces, after normalization
    return tok


def test_built_tokenizers_pieces_equal_whole_text() -> None:
    rng = random.Random(1)
    words = ["a", "b", "c", " ", "  ", "<s>", "<ss>", "<s", "s>", "foo", "a b", "x"]
    for pre in (pre_tokenizers.Whitespace(), pre_tokenizers.WhitespaceSplit(),
                pre_tokenizers.Metaspace(prepend_scheme="always"),
                pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits()])):
        tok = _word_tokenizer(pre)
        enc = SegmentedEncoder(tok)
        for _ in range(200):
            text = "".join(rng.choice(words) for _ in range(rng.randrange(0, 30)))
            assert enc.encode(text) == _whole(tok, text), (pre, text)


def test_refused_where_pieces_could_differ() -> None:
    first = _word_tokenizer(pre_tokenizers.Metaspace(prepend_scheme="first"))
    assert "pre-tokenizer" in SegmentedEncoder.refusal(first)
    with pytest.raises(ValueError, match="piecewise encoding does not apply: pre-tokenizer"):
        SegmentedEncoder(first)
    # it would differ: the second piece gets no prefix alone, one when encoded as a first piece
    assert _whole(first, "a<s>a") != [*_whole(first, "a"), 9, *_whole(first, "a")]
    strip = _word_tokenizer(pre_tokenizers.Whitespace())
    strip.add_special_tokens([AddedToken("<r>", special=True, normalized=False, rstrip=True)])
    assert "'<r>' has lstrip, rstrip or single_word" in SegmentedEncoder.refusal(strip)
    padded = _word_tokenizer(pre_tokenizers.Whitespace())
    padded.enable_truncation(8)
    assert SegmentedEncoder.refusal(padded) == "the tokenizer truncates or pads"


def test_cache_is_bounded_and_returned_lists_are_copies() -> None:
    tok = _word_tokenizer(pre_tokenizers.WhitespaceSplit())
    enc = SegmentedEncoder(tok, max_cached_chars=12)
    first = enc.encode("a b c<s>b c a<ss>c")
    assert first == _whole(tok, "a b c<s>b c a<ss>c")
    assert enc.cached_chars <= 12
    first.append(99)
    first[0] = 98
    assert enc.encode("a b c<s>b c a<ss>c") == _whole(tok, "a b c<s>b c a<ss>c")
    for i in range(50):
        text = " ".join("abc"[(i + k) % 3] for k in range(i % 7 + 1))
        assert enc.encode(text + "<s>" + text) == _whole(tok, text + "<s>" + text)
        assert enc.cached_chars <= 12
    grow = SegmentedEncoder(tok)
    grow.encode("a b<s>c")
    held = grow.cached_chars
    grow.encode("a b<s>c<s>b a")  # only the new piece is added
    assert grow.cached_chars == held + len("b a")
    with pytest.raises(ValueError, match="max_cached_chars"):
        SegmentedEncoder(tok, max_cached_chars=-1)


def test_encode_special_tokens_falls_back_to_the_whole_text(smollm2_tokenizer_dir: Path) -> None:
    """With ``encode_special_tokens`` set, ``<|im_start|>`` is encoded as its characters, not split out as
    one id: the piecewise encoder is refused then, and one built before the flag was set encodes the whole
    text while it is set."""
    tok = Tokenizer.from_file(str(smollm2_tokenizer_dir / "tokenizer.json"))
    text = "<|im_start|>user\nHello world<|im_end|>\n"
    split = _whole(tok, text)
    before = SegmentedEncoder(tok)
    tok.encode_special_tokens = True
    whole = _whole(tok, text)
    assert len(whole) > len(split) and tok.token_to_id("<|im_start|>") not in whole  # the flag matters
    assert SegmentedEncoder.refusal(tok) == ("the tokenizer's encode_special_tokens is set (special tokens' "
                                             "text is not split out)")
    with pytest.raises(ValueError, match="encode_special_tokens"):
        SegmentedEncoder(tok)
    assert before.encode(text) == whole
    assert before.cached_chars == 0  # nothing cached from the whole-text encodes
    # the engine's tokenizer built on it encodes the whole text
    special = load_tokenizer(smollm2_tokenizer_dir).special
    assert TextTokenizer(tok, special).encode(text, add_special_tokens=False) == whole
    tok.encode_special_tokens = False  # back to splitting: the pieces again
    assert before.encode(text) == split and before.cached_chars > 0
