"""The README stays true: its flag reference is exactly what the CLI parser accepts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_reference_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_flag_reference_matches_parser() -> None:
    ref = _load_reference_module()
    readme = (ROOT / "README.md").read_text()
    assert ref.splice(readme) == readme, "run: .venv/bin/python scripts/cli_reference.py --write README.md"


def test_readme_names_both_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/pdserve up" in readme
    assert "bash scripts/test.sh" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci
