"""Print the Markdown reference of every `pdserve` subcommand flag, its variable and its default.

The README's "Commands, flags and environment variables" section is this output verbatim; the test
``tests/test_readme.py`` fails when they differ. Regenerate with::

    .venv/bin/python scripts/cli_reference.py --write README.md
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from pdserve.cli import build_parser

BEGIN = "<!-- cli-reference:begin -->"
END = "<!-- cli-reference:end -->"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise RuntimeError("pdserve parser has no subcommands")


def _row(action: argparse.Action) -> str:
    flag = action.option_strings[-1]
    env = "PDSERVE_" + flag.lstrip("-").replace("-", "_").upper()
    help_text = re.sub(r"\s*\[env [A-Z_]+\]", "", action.help or "")
    help_text = help_text.replace("(default: %(default)s)", "").strip()  # the table has its own column
    if action.choices:
        help_text = (help_text + "; " if help_text else "") + "one of " + ", ".join(map(str, action.choices))
    if action.nargs == "?" and isinstance(action.default, bool):
        help_text += " (`--flag false` turns it off)"
    default = "" if action.default in (None, "", []) else f"`{action.default}`"
    return f"| `{flag}` | `{env}` | {default} | {help_text.replace('|', '/')} |"


def reference() -> str:
    """The Markdown tables, one per subcommand, between the begin/end markers."""
    lines = [BEGIN]
    for name, sub in _subparsers(build_parser({})).items():
        lines += ["", f"### `pdserve {name}`", "", (sub.description or "").strip(), "",
                  "| flag | variable | default | meaning |", "|---|---|---|---|"]
        lines += [_row(a) for a in sub._actions if a.option_strings and a.dest != "help"]
    lines += ["", END]
    return "\n".join(line for i, line in enumerate(lines) if line or lines[i - 1] != "")


def splice(readme: str) -> str:
    """Replace the generated section of ``readme`` (between the markers) with a fresh one."""
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + reference() + readme[end:]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        path = Path(sys.argv[2])
        path.write_text(splice(path.read_text()))
    else:
        print(reference())
