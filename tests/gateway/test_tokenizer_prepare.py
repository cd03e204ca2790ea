"""``--tokenizer`` given a model alias that is not in the pdserve cache yet: the gateway prepares it there
itself (the embedded model converted by a child process, so the gateway never imports torch), refuses a
name that is neither an alias nor a directory in one line listing the aliases, and reports a preparation
that fails or runs past its deadline in one line naming the alias. Found by a new operator's trial: the
compose ``cpu`` profile and the Kubernetes ``cpu`` overlay could not start on an empty cache (the
gateway, given ``--tokenizer smollm2-135m``, exited asking for a worker to convert the model first)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.text import (
    TokenizerNotFoundError,
    TokenizerPrepareError,
    prepare_alias,
    resolve_tokenizer_dir,
    tokenizer_flag_problem,
)

ROOT = Path(__file__).resolve().parents[2]
ALIASES = "glm-4.5-air, llama3-8b, mixtral-8x7b, qwen3-30b-a3b, smollm2-135m, tiny-llama"


def test_a_name_neither_alias_nor_directory_is_refused_listing_the_aliases(tmp_path: Path) -> None:
    for name in ("/nonexistent", "smollm2-135M"):
        with pytest.raises(TokenizerNotFoundError) as info:
            resolve_tokenizer_dir(name, None)
        assert str(info.value) == (f"--tokenizer {name!r} does not exist and is not a model alias (aliases: "
                                   f"{ALIASES}); give a directory with tokenizer.json or an alias")
        assert not isinstance(info.value, TokenizerPrepareError)
    with pytest.raises(TokenizerNotFoundError, match=f"--tokenizer {tmp_path}: directory {tmp_path} has no "
                                                     r"tokenizer\.json"):
        resolve_tokenizer_dir(str(tmp_path), None)
    (tmp_path / "file").write_text("")
    not_dir = str(tokenizer_flag_problem(str(tmp_path / "file")))
    assert "is not a directory and is not a model alias" in not_dir
    assert tokenizer_flag_problem("tiny-llama") is None and tokenizer_flag_problem("smollm2-135m") is None


def test_a_shape_only_alias_is_written_into_an_empty_cache(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A dummy-shape alias gets its config and synthetic tokenizer in this process (torch-free, no child);
    the old lookup searched ``models/<alias>``, where nothing ever writes one."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a child process was started"))
    path = resolve_tokenizer_dir("tiny-llama", None)
    assert path == tmp_path / "configs" / "tiny-llama" and (path / "tokenizer.json").is_file()


def test_a_preparation_that_fails_is_one_line_naming_the_alias(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's error (here: the cache root is a file, so the conversion cannot make its directory)
    comes back as one line naming the alias, not as the child's traceback."""
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(blocker))
    with pytest.raises(TokenizerPrepareError) as info:
        prepare_alias("smollm2-135m", timeout=120)
    message = str(info.value)
    assert message.startswith("--tokenizer smollm2-135m: preparing the model failed: NotADirectoryError: ")
    assert "\n" not in message and "Traceback" not in message


def test_a_preparation_past_its_deadline_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing waits on the conversion without a deadline: past it the child is killed and the error says
    so; no directory is left in the cache's place of the model."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(TokenizerPrepareError, match=r"did not finish within 0\.2 s"):
        prepare_alias("smollm2-135m", timeout=0.2)
    assert not (tmp_path / "models" / "smollm2-135m").exists()


PREPARE = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from gateway.text import resolve_tokenizer_dir
path = resolve_tokenizer_dir("smollm2-135m", None)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(path, heavy)
"""


@pytest.mark.slow
def test_the_embedded_alias_is_converted_on_an_empty_cache_without_torch_in_the_gateway(
        tmp_path: Path) -> None:
    """Two gateway processes at once on one empty cache (as several gateway processes, or a gateway and a
    worker on a shared volume): both get the one converted directory with tokenizer.json (the
    conversion's file lock lets one convert while the other waits), neither imports torch, and no
    half-written directory is left beside it."""
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", PREPARE], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    want = tmp_path / "models" / "smollm2-135m"
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-3000:]
        assert out.strip() == f"{want} []", out
        assert "preparing the tokenizer of smollm2-135m" in err
    assert (want / "tokenizer.json").is_file() and (want / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]
