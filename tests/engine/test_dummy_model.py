"""Dummy-weight aliases end to end on CPU without processes: the synthetic tokenizer written by
``resolve_model``, the ``--load-format`` flag from the CLI to ``ModelConfig``, and dummy weights that are
identical for the same seed (so prefill, decode and colocated workers hold the same model)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.config import ModelConfig
from engine.engine_core import eos_ids
from engine.models.dummy_tokenizer import build_tokenizer_json, tokenizer_config
from engine.models.loader import load_hf_config, load_model
from engine.models.registry import DUMMY_CONFIGS, is_dummy_alias, resolve_model
from engine.text.chat_template import apply_chat_template
from engine.text.tokenizer import load_tokenizer
from pdserve.cli import build_parser
from protocol.settings import settings_from_args
from workers.setup import engine_config_from_settings


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_tiny_llama_tokenizer_covers_every_id(cache: Path) -> None:
    path = resolve_model("tiny-llama")
    assert path == cache / "configs" / "tiny-llama"
    tok = load_tokenizer(path)
    cfg = DUMMY_CONFIGS["tiny-llama"]
    assert tok.vocab_size == cfg["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    words = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    assert len(set(words)) == tok.vocab_size and None not in words
    ids = [3, 4095, 9999, cfg["vocab_size"] - 1]
    assert tok.decode(ids) == "t3 t4095 t9999 t16383"
    assert tok.encode(tok.decode(ids)) == ids                      # round trip, no bos added
    assert tok.decode([5, cfg["eos_token_id"]]) == "t5"            # eos is special: skipped
    assert tok.encode("t7 nonsense") == [7, 0]                     # unknown word → unk (id 0)


def test_chat_template_renders_and_tokenizes(cache: Path) -> None:
    tok = load_tokenizer(resolve_model("tiny-llama"))
    text = apply_chat_template(tok, [{"role": "user", "content": "t10 t11"}])
    assert text == "<s>user t10 t11</s> <s>assistant "
    assert tok.encode(text, add_special_tokens=False) == [1, 0, 10, 11, 2, 1, 0]


def test_llama3_8b_special_ids_match_config(cache: Path) -> None:
    tok = load_tokenizer(resolve_model("llama3-8b"))
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (128256, 128000, 128001)
    assert tok.decode([128255, 127999]) == "t128255 t127999"


def test_glm_45_air_stops_at_its_three_published_eos_ids(cache: Path) -> None:
    """zai-org/GLM-4.5-Air lists eos_token_id [151329, 151336, 151338] (<|endoftext|>, <|user|>,
    <|observation|>): the alias keeps all three, the engine stops on each, and its synthetic tokenizer
    makes each a special token (skipped when decoding)."""
    glm = [151329, 151336, 151338]
    assert DUMMY_CONFIGS["glm-4.5-air"]["eos_token_id"] == glm
    path = resolve_model("glm-4.5-air")
    assert eos_ids(load_hf_config(path)) == tuple(glm)
    tok = load_tokenizer(path)
    assert tok.eos_token_id == glm[0]
    assert tok.decode([5, *glm, 6]) == "t5 t6"
    assert tok.decode([151330, 151337]) == "t151330 t151337"  # neighbours stay plain words


def test_eos_ids_of_a_config() -> None:
    assert eos_ids(SimpleNamespace(eos_token_id=2)) == (2,)
    assert eos_ids(SimpleNamespace(eos_token_id=[9, 4, 9])) == (9, 4)
    assert eos_ids(SimpleNamespace(eos_token_id=None)) == eos_ids(SimpleNamespace()) == ()
    with pytest.raises(ValueError, match="eos_token_id"):
        eos_ids(SimpleNamespace(eos_token_id="2"))
    for flag in (True, [2, False]):  # a bool is an int to Python, not a token id
        with pytest.raises(ValueError, match="eos_token_id"):
            eos_ids(SimpleNamespace(eos_token_id=flag))


def test_stale_cached_config_is_rewritten_with_its_tokenizer(cache: Path) -> None:
    out = cache / "configs" / "tiny-llama"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({**DUMMY_CONFIGS["tiny-llama"], "vocab_size": 7}))
    (out / "tokenizer.json").write_text("stale")
    resolve_model("tiny-llama")
    assert json.loads((out / "config.json").read_text()) == DUMMY_CONFIGS["tiny-llama"]
    assert load_tokenizer(out).vocab_size == DUMMY_CONFIGS["tiny-llama"]["vocab_size"]
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temp file behind


@pytest.mark.parametrize(("change", "match"), [({"vocab_size": 2}, "vocab_size"),
                                                ({"eos_token_id": 99999}, "eos_token_id"),
                                                ({"bos_token_id": None}, "bos_token_id"),
                                                ({"eos_token_id": 1}, "distinct"),
                                                ({"eos_token_id": [2, 99999]}, "eos_token_id"),
                                                ({"eos_token_id": [2, 1]}, "distinct")])
def test_bad_config_is_refused(change: dict[str, object], match: str) -> None:
    cfg = {**DUMMY_CONFIGS["tiny-llama"], **change}
    with pytest.raises(ValueError, match=match):
        build_tokenizer_json(cfg)
    with pytest.raises(ValueError, match=match):
        tokenizer_config(cfg)


def test_load_format_flag_reaches_model_config(monkeypatch: pytest.MonkeyPatch) -> None:
    open_ = {"PDSERVE_INSECURE_CONTROL_PLANE": "1"}  # no key directory: this test is about --load-format
    args = build_parser(open_).parse_args(["decode", "--model", "tiny-llama", "--load-format", "dummy"])
    assert engine_config_from_settings(settings_from_args(args)).model.load_format == "dummy"  # type: ignore[arg-type]
    env_args = build_parser({"PDSERVE_LOAD_FORMAT": "dummy", **open_}).parse_args(["colocated"])
    assert settings_from_args(env_args).load_format == "dummy"  # type: ignore[union-attr]
    default = build_parser(open_).parse_args(["prefill"])
    assert settings_from_args(default).load_format == "auto"  # type: ignore[union-attr]
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["prefill", "--load-format", "gguf"])
    from protocol.settings import WorkerSettings

    with pytest.raises(ValueError, match="--load-format"):
        WorkerSettings(role="prefill", load_format="gguf", insecure_control_plane=True)


def test_dummy_alias_loads_with_auto_format_and_same_seed_same_weights(cache: Path) -> None:
    assert is_dummy_alias("tiny-llama") and not is_dummy_alias("smollm2-135m")
    a, _ = load_model(ModelConfig("tiny-llama", device="cpu"))                # auto → dummy for an alias
    b, _ = load_model(ModelConfig("tiny-llama", device="cpu", load_format="dummy"))
    c, _ = load_model(ModelConfig("tiny-llama", device="cpu", load_format="dummy", seed=1))
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert next(iter(pa.values())).dtype == torch.float32
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"])
