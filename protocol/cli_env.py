"""The ``PDSERVE_*`` variables of command-line flags, read and checked one way for every command
(``pdserve up``/``gateway``/workers/``keygen`` in pdserve/cli.py, ``pdserve bench`` in loadtest/cli.py).

Every flag ``--foo-bar`` also reads ``PDSERVE_FOO_BAR`` (the command line wins). ``EnvAdder`` converts a
variable's value with the flag's type (``parse_bool`` for a ``store_true`` flag), checks it against the
flag's choices, and notes a bad one on its ``OneLineParser``, which refuses it, in one line naming the
variable and the flag with exit status 2, when that parser parses (before ``--help``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from protocol.durations import parse_duration


def parse_bool(text: str | bool) -> bool:
    """``true/false/1/0/yes/no/on/off`` (any case) → bool. Raises ``argparse.ArgumentTypeError``."""
    if isinstance(text, bool):
        return text
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, ``"<prog>: error: <message> (see
    <prog> --help)"``, and exit status 2 (argparse prints the whole usage first: 47 lines for ``pdserve up``).
    Subparsers are of this class too (``add_subparsers`` takes the parent's class).

    ``env_problems``: the ``PDSERVE_*`` values this parser's command reads that could not be converted or are
    not among the flag's choices (variable → (flag, why), filled by ``EnvAdder``); ``env_refused``: variables
    set in the environment that this parser's command refuses whatever their value (variable → the line saying
    why and what to do instead: ``up``'s ``UP_SET_VARIABLES``). The first refused variable, else the first
    problem, is refused when this parser parses, in one line naming the variable and the flag with exit status
    2, before ``--help`` or any other flag. A subcommand's parser parses only when that subcommand is chosen,
    so the variables of another's flags stop nothing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_problems: dict[str, tuple[str, str]] = {}
        self.env_refused: dict[str, str] = {}

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if self.env_refused:
            self.exit(2, f"{self.prog}: {next(iter(self.env_refused.values()))}\n")
        if self.env_problems:
            variable, (flag, why) = next(iter(self.env_problems.items()))
            self.exit(2, f"{self.prog}: bad value for {variable} ({flag}): {why}\n")
        return super().parse_known_args(args, namespace)


class CommandLineAppend(argparse.Action):
    """A repeatable flag (``action="append"``) whose first use on the command line replaces its default
    (the list read from ``PDSERVE_<FLAG>``) rather than adding to it: the command line wins, as for every
    other flag."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        items = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*([] if items is None or items is self.default else items), values])


def env_variable(flag: str) -> str:
    """The environment variable of ``flag``: ``--foo-bar`` → ``PDSERVE_FOO_BAR``."""
    return "PDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def name_the_variable(message: str, argv: Sequence[str], env: Mapping[str, str]) -> str:
    """A settings check's ``--flag: problem`` message, said of ``PDSERVE_<FLAG>`` when the value came from
    that variable (set, and the flag not on the command line ``argv``): ``bad value for PDSERVE_FLAG
    (--flag): problem``, the wording of a variable refused at parse time. Any other message as it is."""
    flag, sep, problem = message.partition(": ")
    if not sep or not flag.startswith("--") or " " in flag:
        return message
    name = env_variable(flag)
    given = any(a == flag or a.startswith(flag + "=") for a in argv)
    if given or name not in env:
        return message
    return f"bad value for {name} ({flag}): {problem}"


class EnvAdder:
    """Adds flags to a parser, taking each default from ``PDSERVE_<FLAG>`` when set; a value that cannot be
    converted to the flag's type (``parse_bool`` for a ``store_true`` flag: ``PDSERVE_IGNORE_EOS=maybe`` is
    refused, not false), or whose converted value is not among the flag's ``choices`` (each entry of a
    repeatable flag's comma-separated list), leaves the flag's own default and is noted in the parser's
    ``env_problems`` (refused when that parser parses: ``OneLineParser``). argparse itself checks
    ``choices`` against command-line values only, never against a default.

    ``env_one_value=True`` (a keyword of this adder, not of argparse): the variable of a repeatable flag
    holds one entry, commas included (``PDSERVE_FAULT=at=5s,cmd=...``), rather than a comma-separated list.
    """

    def __init__(self, parser: OneLineParser, env: Mapping[str, str]) -> None:
        self.parser, self.env = parser, env

    def __call__(self, flag: str, **kw: Any) -> None:
        env_name = env_variable(flag)
        raw = self.env.get(env_name)
        one_value = kw.pop("env_one_value", False)
        if raw is not None:
            repeatable = kw.get("action") == "append"
            # empty entries of a repeatable flag kept: the settings refuse an empty key
            entries = [raw] if one_value or not repeatable else raw.split(",")
            try:
                values = [self._convert(entry, kw) for entry in entries]
                kw["default"] = values if repeatable else values[0]
            except (ValueError, argparse.ArgumentTypeError) as exc:  # refused if this command is chosen
                self.parser.env_problems[env_name] = (flag, str(exc))
        if kw.get("action") == "append":
            kw["action"] = CommandLineAppend
        shown = "" if kw.get("default") in (None, "", []) else " (default: %(default)s)"
        kw["help"] = (kw.get("help", "") + shown + f" [env {env_name}]").strip()
        self.parser.add_argument(flag, **kw)

    @staticmethod
    def _convert(entry: str, kw: dict[str, Any]) -> Any:
        """One value of a variable → the flag's value, as argparse would convert it on the command line.

        Raises:
            ValueError, argparse.ArgumentTypeError: not of the flag's type (``int`` and ``float`` said as
                argparse says them: ``invalid int value: 'abc'``), or not among its choices.
        """
        conv: Callable[[str], Any] = parse_bool if kw.get("action") == "store_true" else kw.get("type", str)
        try:
            value = conv(entry)
        except ValueError:
            if conv in (int, float):
                raise ValueError(f"invalid {conv.__name__} value: {entry!r}") from None
            raise
        choices = kw.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"invalid choice: {value!r} (choose from {', '.join(map(repr, choices))})")
        return value


def duration(text: str) -> float:
    """A duration flag's argparse ``type``: ``parse_duration`` whose error argparse prints as it is
    (``argument --request-timeout: bad duration 'abc': ...``), not as ``invalid parse_duration value``."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
