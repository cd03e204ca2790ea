"""What the bench's reports share (loadtest/report.py, loadtest/agent_report.py): a result written as
indented JSON and read back into its msgspec type, and the Markdown table with its latency cells."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

from loadtest.records import LatencyStats

T = TypeVar("T")


def write_json(result: msgspec.Struct, path: str | Path) -> None:
    """Write ``result`` (a msgspec Struct) as indented JSON."""
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=1))


def read_json(path: str | Path, kind: type[T], what: str) -> T:
    """Read a file written by ``write_json`` as a ``kind``. Raises ValueError naming the file and
    ``what`` it should have been when it is not one."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=kind)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: not a {what}: {exc}") from exc


def ms(stats: LatencyStats | None, field: str) -> str:
    """The ``field`` of latency ``stats`` (milliseconds) as a cell with one decimal, "-" without stats."""
    return "-" if stats is None else f"{getattr(stats, field):.1f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a Markdown table: the header, its separator, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]
