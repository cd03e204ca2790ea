"""A synthetic tokenizer for dummy-weight model aliases (no real vocabulary exists for them).

Built with the ``tokenizers`` library: a ``WordLevel`` model whose vocabulary maps every id
``0 .. vocab_size - 1`` to a distinct string (``t<id>``; the bos/eos/unk ids to ``<s>``, ``</s>``,
``<unk>``, any further eos id of a config listing several to the special ``<eos{id}>``), split on
whitespace, so ANY generated id detokenizes and ``"t5 t17"`` encodes back to ``[5, 17]``; unknown words
encode to the unk id. ``tokenizer_config.json`` names the special tokens and
holds a minimal chat template (``<s>role content</s>`` per message). The files are read by
``engine.text.load_tokenizer`` (and by ``transformers.AutoTokenizer``). No torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ bos_token }}{{ message['role'] }} {{ message['content'] }}"
    "{{ eos_token }} {% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant {% endif %}"
)


def extra_eos_word(token_id: int) -> str:
    """The special vocabulary string of an eos id after the first (a config listing several eos ids)."""
    return f"<eos{token_id}>"


def word_of(token_id: int, bos_id: int, eos_ids: tuple[int, ...], unk_id: int) -> str:
    """The vocabulary string of ``token_id``: ``<s>`` for bos, ``</s>`` for the first eos id,
    ``<eos{id}>`` for the other eos ids, ``<unk>`` for unk, else ``t<id>``."""
    if token_id == bos_id:
        return BOS
    if token_id == unk_id:
        return UNK
    if token_id in eos_ids:
        return EOS if token_id == eos_ids[0] else extra_eos_word(token_id)
    return f"t{token_id}"


def _id_in(value: object, name: str, vocab: int) -> int:
    """``value`` (``config[name]``) when it is an int in ``[0, vocab)``. Raises ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
        raise ValueError(f"dummy tokenizer needs {name} in [0, {vocab}), got {value!r}")
    return value


def _special_ids(config: dict[str, Any]) -> tuple[int, int, tuple[int, ...], int]:
    """(vocab_size, bos id, eos ids, unk id) of an HF ``config``; ``eos_token_id`` is an int or a non-empty
    list of ints (the first is the tokenizer's eos token); unk = the lowest id not bos/eos.

    Raises:
        ValueError: vocab_size < 3, or bos/eos missing, an eos id equal to bos, or outside
            ``[0, vocab_size)``.
    """
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 3:
        raise ValueError(f"dummy tokenizer needs an int vocab_size >= 3, got {vocab!r}")
    bos = _id_in(config.get("bos_token_id"), "bos_token_id", vocab)
    raw_eos = config.get("eos_token_id")
    listed = raw_eos if isinstance(raw_eos, list) and raw_eos else [raw_eos]
    eos = tuple(dict.fromkeys(_id_in(t, "eos_token_id", vocab) for t in listed))
    if bos in eos:
        raise ValueError(f"dummy tokenizer needs distinct bos and eos ids, got {bos} for both")
    unk = next(i for i in range(len(eos) + 2) if i != bos and i not in eos)
    return vocab, bos, eos, unk


def build_tokenizer_json(config: dict[str, Any]) -> str:
    """The ``tokenizer.json`` text for an HF model ``config`` dict (vocab_size, bos/eos_token_id).

    Raises:
        ValueError: see :func:`_special_ids`.
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab_size, bos, eos, unk = _special_ids(config)
    vocab = {word_of(i, bos, eos, unk): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = (BOS, EOS, UNK, *(extra_eos_word(t) for t in eos[1:]))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return str(tok.to_str())


def tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    """The ``tokenizer_config.json`` object: special tokens, no bos added by ``encode``, chat template."""
    _special_ids(config)
    return {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "add_bos_token": False,
            "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast"}


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temp file beside ``path`` and rename it over ``path`` (atomic on POSIX)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_dummy_tokenizer(out: Path, config: dict[str, Any]) -> None:
    """Write ``tokenizer_config.json`` then ``tokenizer.json`` (the file readers look for) into ``out``,
    each atomically, so concurrent writers (workers starting together) never expose a partial file.

    Raises:
        ValueError: the config lacks a usable vocab_size / bos / eos (see :func:`_special_ids`).
        OSError: ``out`` is not writable.
    """
    tokenizer_json = build_tokenizer_json(config)
    _write_atomic(out / "tokenizer_config.json", json.dumps(tokenizer_config(config), indent=2))
    _write_atomic(out / "tokenizer.json", tokenizer_json)
