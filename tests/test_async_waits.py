"""No ``asyncio.wait_for`` in the project's packages: on Python 3.11 it returns the awaited result when
the caller is cancelled in the same loop iteration as the result arrives, swallowing the cancellation
(a gateway request whose client had disconnected then ran on to max_tokens). ``asyncio.timeout`` raises
the cancellation. Read from the source with ``ast``, so every call form is caught.
"""

from __future__ import annotations

import ast

from tests.test_layering import PACKAGES, ROOT


def wait_for_calls(source: str, filename: str) -> list[int]:
    """Line numbers of every ``asyncio.wait_for(...)`` / ``wait_for(...)`` call and ``from asyncio import
    wait_for`` in ``source``."""
    lines: list[int] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name == "wait_for":
                lines.append(node.lineno)
        elif (isinstance(node, ast.ImportFrom) and node.module == "asyncio"
              and any(a.name == "wait_for" for a in node.names)):
            lines.append(node.lineno)
    return lines


def test_the_scanner_finds_every_form() -> None:
    src = ("import asyncio\nfrom asyncio import wait_for\n"
           "async def f(q):\n    await asyncio.wait_for(q.get(), 1)\n    await wait_for(q.get(), 1)\n"
           "    async with asyncio.timeout(1):\n        await q.get()\n")
    assert wait_for_calls(src, "<test>") == [2, 4, 5]


def test_no_wait_for_in_the_packages() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}"
             for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for line in wait_for_calls(path.read_text(), str(path))]
    assert found == [], "asyncio.wait_for swallows a cancellation on Python 3.11; use asyncio.timeout"
