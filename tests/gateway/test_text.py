"""Gateway text processing with SmolLM2's real tokenizer: chat template, incremental detokenization,
stop strings across token boundaries, multi-byte characters split across tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.text import TextProcessor, TokenizerNotFoundError, resolve_tokenizer_dir

TEXT = "Hello world, this is a fake reply. Ünïcödé 🎉 end."


@pytest.fixture(scope="module")
def proc(tokenizer_dir: Path) -> TextProcessor:
    return TextProcessor.from_dir(tokenizer_dir)


def test_chat_template_and_specials(proc: TextProcessor) -> None:
    text = proc.render_chat([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    assert proc.eos_token_id == 2
    assert proc.encode("<|im_start|>")[0] == 1


def test_incremental_equals_full_decode(proc: TextProcessor) -> None:
    ids = proc.encode(TEXT)
    detok = proc.detokenizer(proc.encode("prompt"))
    parts = [detok.add(t) for t in ids]
    assert "".join(parts) + detok.finish() == TEXT
    assert all("\ufffd" not in p for p in parts)  # the emoji's bytes never come out half-done


def test_stop_string_across_tokens(proc: TextProcessor) -> None:
    ids = proc.encode(TEXT)
    detok = proc.detokenizer([], ("fake re",))
    out, used = "", 0
    for t in ids:
        out += detok.add(t)
        used += 1
        if detok.stopped:
            break
    assert out == "Hello world, this is a "
    assert detok.stopped and detok.stop_reason == "fake re"
    # the stop string spans tokens " fake" and " reply": it matched on the token holding "re"
    assert proc.decode(ids[:used]).endswith("fake reply")
    assert detok.add(ids[used]) == "" and detok.finish() == ""


def test_hold_back_then_release(proc: TextProcessor) -> None:
    detok = proc.detokenizer([], ("world peace",))
    ids = proc.encode("Hello world, done")
    out = [detok.add(t) for t in ids]
    assert out[1] == " "  # "world" may start the stop string: held back, the space is safe
    assert out[2] == "world,"  # "," rules the stop string out: the held text comes out
    assert "".join(out) + detok.finish() == "Hello world, done" and not detok.stopped


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerNotFoundError, match=r"no tokenizer\.json"):
        TextProcessor.from_dir(tmp_path)
    with pytest.raises(TokenizerNotFoundError, match="no --tokenizer given"):
        resolve_tokenizer_dir(None, None)


def test_tokenizer_dir_from_flag_or_registered_model(tokenizer_dir: Path, tmp_path: Path) -> None:
    assert resolve_tokenizer_dir(None, str(tokenizer_dir)) == tokenizer_dir
    assert resolve_tokenizer_dir(str(tokenizer_dir), str(tmp_path)) == tokenizer_dir
    with pytest.raises(TokenizerNotFoundError, match=r"has no tokenizer\.json"):
        resolve_tokenizer_dir(None, str(tmp_path))


def test_tokenizer_alias_from_pdserve_cache(tokenizer_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An alias already converted in the cache is taken from there, with no child process."""
    import subprocess

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a child process was started"))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm2-135m").symlink_to(tokenizer_dir)
    assert resolve_tokenizer_dir("smollm2-135m", None) == tmp_path / "models" / "smollm2-135m"


def test_chat_template_kwargs_reach_the_template(proc: TextProcessor) -> None:
    """``chat_template_kwargs`` become template variables (e.g. Qwen3's ``enable_thinking``); the
    variables the gateway sets itself cannot be overridden."""
    from engine.text.tokenizer import TextTokenizer
    from gateway.errors import APIError
    from gateway.prepare import render_messages
    from gateway.text import TextProcessor as Proc

    tok = proc.tokenizer
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}")
    thinking = Proc(TextTokenizer(tok._tok, tok.special, template))
    msgs = [{"role": "user", "content": "Hi"}]
    assert render_messages(thinking, msgs, None) == "Hi"
    assert render_messages(thinking, msgs, {"enable_thinking": False}) == "Hi /no_think"
    assert render_messages(thinking, msgs, {"enable_thinking": True}) == "Hi"
    with pytest.raises(APIError) as info:
        render_messages(thinking, msgs, {"add_generation_prompt": False, "bos_token": "x"})
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs")
    assert "add_generation_prompt, bos_token" in info.value.message
