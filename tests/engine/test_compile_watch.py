"""CompileWatch: Triton compiles are logged (DEBUG at start-up, WARNING once serving), timed, counted, and
hooks already installed by someone else keep working."""

from __future__ import annotations

import logging

import pytest
from triton import knobs

from engine.compile_watch import CompileWatch


class _Fn:
    name = "_decode_split_kernel"


@pytest.fixture
def restore_hooks():
    rt = knobs.runtime
    saved = (rt.jit_cache_hook, rt.jit_post_compile_hook)
    yield
    rt.jit_cache_hook, rt.jit_post_compile_hook = saved


def test_compiles_are_logged_and_counted(restore_hooks, caplog):
    seen: list[str] = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append("before") or False
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append("after")
    watch = CompileWatch().install()
    rt = knobs.runtime
    key = ("sig", "i32:16")
    caplog.set_level(logging.DEBUG, logger="pdserve.compile")
    assert rt.jit_cache_hook(key=key, fn=_Fn(), repr="k(a: i32)") is False  # the compile goes ahead
    rt.jit_post_compile_hook(key=key, fn=_Fn(), repr="k(a: i32)")
    watch.serving()
    rt.jit_cache_hook(key=key, fn=_Fn(), repr="k(a: i32:16)")
    rt.jit_post_compile_hook(key=key, fn=_Fn(), repr="k(a: i32:16)")
    assert seen == ["before", "after", "before", "after"]  # the earlier hooks still run
    assert [(name, serving) for name, _, serving in watch.compiles] == [
        ("_decode_split_kernel", False), ("_decode_split_kernel", True)]
    assert all(0 <= seconds < 5 for _, seconds, _ in watch.compiles)
    levels = [r.levelno for r in caplog.records if r.name == "pdserve.compile"]
    assert levels == [logging.DEBUG, logging.WARNING]
    assert "serving=True spec=k(a: i32:16)" in caplog.records[-1].getMessage()


def test_a_chained_hook_can_still_skip_the_compile(restore_hooks):
    knobs.runtime.jit_cache_hook = lambda **kw: True  # e.g. a tool that only collects signatures
    knobs.runtime.jit_post_compile_hook = None
    CompileWatch().install()
    assert knobs.runtime.jit_cache_hook(key=1, fn=_Fn(), repr="") is True
