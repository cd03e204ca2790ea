"""engine/text tokenizer + chat templates: parity with transformers on the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.text.chat_template import ChatTemplateError, apply_chat_template, render_chat_template
from engine.text.tokenizer import load_tokenizer

TEXTS = ["Hello world", "  leading spaces\nand\ttabs", "naïve café 日本語 🎉",
         "<|im_start|>user\nhi<|im_end|>", ""]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
]


def test_encode_decode_match_transformers(smollm2_tokenizer_dir: Path, smollm2_hf_tokenizer: Any) -> None:
    tok = load_tokenizer(smollm2_tokenizer_dir)
    hf = smollm2_hf_tokenizer
    assert (tok.eos_token_id, tok.bos_token_id) == (hf.eos_token_id, hf.bos_token_id) == (2, 1)
    assert tok.vocab_size == len(hf) == 49152
    for text in TEXTS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", CHATS)
def test_chat_template_matches_transformers(smollm2_tokenizer_dir: Path, smollm2_hf_tokenizer: Any,
                                            chat: list[dict[str, str]], add_generation_prompt: bool) -> None:
    tok = load_tokenizer(smollm2_tokenizer_dir)
    text = apply_chat_template(tok, chat, add_generation_prompt=add_generation_prompt)
    expected = smollm2_hf_tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == expected
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    hf_ids = smollm2_hf_tokenizer.apply_chat_template(
        chat, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert tok.encode(text, add_special_tokens=False) == list(hf_ids)


CUSTOM = """{{ bos_token }}{% for m in messages %}
{% if m.role == 'bad' %}{{ raise_exception('role bad!') }}{% endif %}
  {% if loop.index > 2 %}{% break %}{% endif %}
{{ m.role }}: {% generation %}{{ m.content | tojson }}{% endgeneration %}{{ eos_token }}
{% endfor %}{% if add_generation_prompt %}A:{% endif %}"""


def test_custom_template_features_match_transformers(smollm2_tokenizer_dir: Path,
                                                     smollm2_hf_tokenizer: Any) -> None:
    tok = load_tokenizer(smollm2_tokenizer_dir)
    chat = [{"role": "user", "content": 'say "é" <b>'}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "dropped by break"}]
    ours = apply_chat_template(tok, chat, chat_template=CUSTOM)
    assert ours == smollm2_hf_tokenizer.apply_chat_template(
        chat, chat_template=CUSTOM, tokenize=False, add_generation_prompt=True)
    assert '"say \\"é\\" <b>"' in ours and "dropped" not in ours  # tojson: no HTML/ASCII escaping
    with pytest.raises(ChatTemplateError, match="role bad!"):
        apply_chat_template(tok, [{"role": "bad", "content": ""}], chat_template=CUSTOM)


def test_template_errors_are_clear() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        render_chat_template("{% for %}", [])
    with pytest.raises(ChatTemplateError, match="failed"):  # the sandbox refuses dunder access
        render_chat_template("{{ messages.__class__.__mro__ }}", [{"role": "u", "content": "c"}])


def test_missing_template_and_files(tmp_path: Path, smollm2_tokenizer_dir: Path) -> None:
    shutil.copy(smollm2_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path)  # no config at all: no special tokens, no template
    assert tok.chat_template is None and tok.eos_token_id is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        apply_chat_template(tok, CHATS[0])
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_tokenizer(tmp_path)


def _tokenizer_dir(dst: Path, src: Path, post_processor: bool, **config_update: Any) -> Path:
    data = json.loads((src / "tokenizer.json").read_text())
    if not post_processor:
        data["post_processor"] = None
    (dst / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(config_update)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_tokenizer_json_post_processor_wins_over_add_bos_token_like_transformers(
        tmp_path: Path, smollm2_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    d = _tokenizer_dir(tmp_path, smollm2_tokenizer_dir, post_processor=True, add_bos_token=True,
                       chat_template="{{ bos_token }}[{{ messages[0].content }}]")
    tok, hf = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text) == tok.encode(text, add_special_tokens=False)
    assert apply_chat_template(tok, CHATS[0]) == hf.apply_chat_template(CHATS[0], tokenize=False)
    assert apply_chat_template(tok, CHATS[0]).startswith("<|im_start|>[")  # tokenizer_config template


def test_add_bos_token_used_when_tokenizer_json_has_no_post_processor(
        tmp_path: Path, smollm2_tokenizer_dir: Path) -> None:
    d = _tokenizer_dir(tmp_path, smollm2_tokenizer_dir, post_processor=False, add_bos_token=True,
                       add_eos_token=True)
    tok = load_tokenizer(d)
    plain = tok.encode("Hello world", add_special_tokens=False)
    assert tok.encode("Hello world") == [1, *plain, 2]
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_text_package_imports_without_torch_or_transformers() -> None:
    code = ("import sys, engine.text.tokenizer, engine.text.chat_template, engine.text.detokenizer, "
            "engine.scheduler, engine.block_manager, engine.config; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
