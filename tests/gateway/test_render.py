"""Pure helpers of the OpenAI surface: per-choice seed derivation (int64 wrap), the completions
``logprobs`` layout (``text_offset`` in characters), with an echoed prompt's entries first, and vLLM's
``prompt_logprobs`` shape."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import msgspec
import pytest

from gateway.openai_requests import INT64_MAX
from gateway.prepare import derived_seed
from gateway.render import chat_logprobs, completion_logprobs, echo_logprobs, joined, vllm_prompt_logprobs
from gateway.request_state import TokenLogprob
from gateway.text import TextProcessor
from protocol.messages import PromptLogprob, TopLogprob


@pytest.mark.parametrize(("seed", "sample", "want"), [
    (None, 3, None), (5, 0, 5), (5, 2, 7), (-1, 1, 0),
    (INT64_MAX, 1, -INT64_MAX - 1), (INT64_MAX - 1, 3, -INT64_MAX)])
def test_derived_seed_wraps_into_int64(seed: int | None, sample: int, want: int | None) -> None:
    assert derived_seed(seed, sample) == want


def test_logprob_layouts(tokenizer_dir: Path) -> None:
    text = TextProcessor.from_dir(tokenizer_dir)
    ids = text.encode(" Paris is")
    entries = [TokenLogprob(t, -0.5 * (i + 1), ((t, -0.5), (t + 1, -2.0))) for i, t in enumerate(ids)]
    comp = msgspec.to_builtins(completion_logprobs(text, entries, offset=7))
    pieces = [text.token_text(t) for t in ids]
    assert "".join(pieces) == " Paris is"
    assert comp["tokens"] == pieces and comp["token_logprobs"] == [-0.5 * (i + 1) for i in range(len(ids))]
    assert comp["text_offset"] == [7 + len("".join(pieces[:i])) for i in range(len(ids))]
    assert comp["top_logprobs"][0] == {pieces[0]: -0.5, text.token_text(ids[0] + 1): -2.0}
    chat = msgspec.to_builtins(chat_logprobs(text, entries[:1]))
    assert chat["content"][0]["bytes"] == list(pieces[0].encode()) and chat["refusal"] is None
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [-0.5, -2.0]


def _prompt_entries(ids: list[int]) -> list[PromptLogprob]:
    return [PromptLogprob(-1.0 - i, i + 2, [TopLogprob(7, -0.25), TopLogprob(t, -1.0 - i)])
            for i, t in enumerate(ids[1:])]


def test_echo_logprobs_lead_with_the_prompt_and_offsets_follow_the_echoed_text(tokenizer_dir: Path) -> None:
    text = TextProcessor.from_dir(tokenizer_dir)
    prompt = "The capital of France is"
    ids, out_ids = text.encode(prompt), text.encode(" Paris.")
    echo = echo_logprobs(text, ids, _prompt_entries(ids), top=1)
    out = completion_logprobs(text, [TokenLogprob(t, -0.5) for t in out_ids], offset=len(prompt))
    both = msgspec.to_builtins(joined(echo, out))
    full = prompt + " Paris."
    assert len(both["tokens"]) == len(ids) + len(out_ids)
    assert both["token_logprobs"][0] is None and both["top_logprobs"][0] is None
    assert both["token_logprobs"][1:len(ids)] == [-1.0 - i for i in range(len(ids) - 1)]
    # top=1: the best alternative, then the prompt token itself (OpenAI's up to logprobs + 1 entries)
    assert list(both["top_logprobs"][1].items()) == [(text.token_text(7), -0.25),
                                                     (text.token_text(ids[1]), -1.0)]
    assert both["top_logprobs"][len(ids)] == {text.token_text(out_ids[0]): -0.5}  # no alternatives sent
    for token, offset in zip(both["tokens"], both["text_offset"], strict=True):
        assert full[offset:offset + len(token)] == token  # every offset points at its token in the text
    with pytest.raises(ValueError, match="entries"):
        echo_logprobs(text, ids, _prompt_entries(ids)[1:], top=1)


def test_vllm_prompt_logprobs_shape(tokenizer_dir: Path) -> None:
    text = TextProcessor.from_dir(tokenizer_dir)
    ids = text.encode("Paris is big")
    shaped = msgspec.to_builtins(vllm_prompt_logprobs(text, ids, _prompt_entries(ids), top=2))
    assert shaped[0] is None and len(shaped) == len(ids)
    first = shaped[1]
    assert list(first) == [str(ids[1]), "7"]  # the prompt token first, then its alternatives
    assert first[str(ids[1])] == {"logprob": -1.0, "rank": 2, "decoded_token": text.token_text(ids[1])}
    assert first["7"] == {"logprob": -0.25, "rank": 1, "decoded_token": text.token_text(7)}
    one = msgspec.to_builtins(vllm_prompt_logprobs(text, ids, _prompt_entries(ids), top=0))
    assert all(len(e) == 1 for e in one[1:])


def test_completion_top_logprobs_keep_the_best_of_a_text_and_the_chosen_tokens_own(
        tokenizer_dir: Path) -> None:
    """``top_logprobs`` is keyed by token text: of two alternatives with one text the better one's value
    stays, and the chosen token's own logprob stands under its text even where an alternative of another
    id has that text (it is what a client looks up by ``tokens[i]``)."""
    real = TextProcessor.from_dir(tokenizer_dir)
    a, b = 111, 112

    class OneText:  # ids a and b shown alike, as a SentencePiece "▁Paris" and "Paris" are by token_text
        def logprob_token(self, token_id: int) -> tuple[str, bytes]:
            return real.logprob_token(a if token_id == b else token_id)

    text = cast(TextProcessor, OneText())
    assert text.logprob_token(a) == text.logprob_token(b) != text.logprob_token(7), "control"
    shown = text.logprob_token(a)[0]
    out = completion_logprobs(text, [TokenLogprob(a, -2.0, ((b, -0.5), (7, -1.0), (a, -2.0)))], offset=0)
    assert out.top_logprobs == [{shown: -2.0, real.token_text(7): -1.0}]
    lower = completion_logprobs(text, [TokenLogprob(7, -1.0, ((b, -0.5), (a, -0.75), (7, -1.0)))], offset=0)
    assert lower.top_logprobs == [{shown: -0.5, real.token_text(7): -1.0}]


def test_tokens_inside_a_character_show_their_own_bytes(tokenizer_dir: Path) -> None:
    """An emoji is several byte tokens in SmolLM2's vocabulary. Each token's ``bytes`` are its own (not
    U+FFFD's), so a completion's bytes joined are its UTF-8 text; a token that is not whole characters
    shows its bytes as ``\\xHH``; completions' ``text_offset`` counts characters of the text, every token
    of a split character starting at that character; whole tokens are shown as before."""
    text = TextProcessor.from_dir(tokenizer_dir)
    words = "Emoji: \U0001F600 é 中文"
    ids = text.encode(words)
    assert any("\ufffd" in text.token_text(t) for t in ids), "control: some token alone decodes to U+FFFD"
    entries = [TokenLogprob(t, -0.5, ((t, -0.5),)) for t in ids]
    chat = chat_logprobs(text, entries).content
    assert b"".join(bytes(e.bytes) for e in chat).decode("utf-8") == words
    assert b"".join(bytes(e.top_logprobs[0].bytes) for e in chat).decode("utf-8") == words
    assert all("\ufffd" not in e.token for e in chat)
    split = [e for e in chat if "\\x" in e.token]
    assert split and all(e.token == bytes(e.bytes).decode("utf-8", "backslashreplace") for e in split)
    assert [e.token for e in chat if e not in split] == [text.token_text(t) for t in ids
                                                          if "\ufffd" not in text.token_text(t)]
    out = completion_logprobs(text, entries, offset=3)
    assert out.tokens == [e.token for e in chat]
    emoji_at = 3 + words.index("\U0001F600")
    starts = [o for tok, o in zip(out.tokens, out.text_offset, strict=True) if "\\x" in tok]
    # the emoji's first token carries the space before it, so it starts there; the next ones at the emoji
    assert starts == [emoji_at - 1] + [emoji_at] * (len(starts) - 1) and len(starts) > 1
    assert out.text_offset[-1] == 3 + words.index("文")


def test_text_offsets_decode_incrementally() -> None:
    """Offsets by an incremental UTF-8 decoder: a stray continuation byte is one U+FFFD, a character cut
    over two tokens counts once, at the token completing it."""
    from gateway.render import text_offsets

    assert text_offsets([b"\x80\xf0\x9f", b"\x98\x80", b"a"], 0) == ([0, 1, 2], 3)  # "\ufffd\U0001F600a"
    assert text_offsets([b"ab", "é".encode(), b"\xe4", b"\xb8\xad"], 5) == ([5, 7, 8, 8], 9)


def test_an_id_past_the_tokenizers_vocabulary_shows_as_empty(tokenizer_dir: Path) -> None:
    """A model's padded logits can rank an id the tokenizer does not have: it shows as ``token_text``
    shows it (empty), in chat and completions logprobs alike, instead of failing the response."""
    text = TextProcessor.from_dir(tokenizer_dir)
    past = text.vocab_size + 3
    assert text.token_text(past) == "", "control: the tokenizer decodes it to nothing"
    chat = chat_logprobs(text, [TokenLogprob(7, -0.5, ((past, -0.5), (7, -0.6)))]).content
    assert (chat[0].top_logprobs[0].token, chat[0].top_logprobs[0].bytes) == ("", [])
    out = completion_logprobs(text, [TokenLogprob(past, -0.5, ((past, -0.5),))], offset=0)
    assert out.tokens == [""] and out.text_offset == [0]
