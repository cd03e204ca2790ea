"""Log Triton kernel compilations, so a compile on the serving path (a first-use stall) is visible.

Triton compiles a kernel variant the first time it meets a new specialisation (constexpr values, integer
arguments equal to 1 or divisible by 16, dtypes); on an H200 one compile costs ~0.3–1.5 s and blocks the
step that needed it. ``CompileWatch`` installs Triton's ``knobs.runtime.jit_cache_hook`` (called before a
compile) and ``jit_post_compile_hook`` (after it) — Triton's documented runtime hooks
(``triton/knobs.py``) — and logs each compile with its kernel, signature and duration: at DEBUG while the
worker starts (CUDA-graph capture, warm-up), at WARNING once ``serving()`` was called. Hooks set by
someone else are chained, not replaced.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("pdserve.compile")


class CompileWatch:
    """Counts and logs Triton compilations of this process (see the module docstring).

    Attributes:
        compiles: ``(kernel name, seconds, after serving() was called)`` per compile, in order.
    """

    def __init__(self) -> None:
        self.compiles: list[tuple[str, float, bool]] = []
        self._serving = False
        self._started: dict[Any, float] = {}
        self._prev: tuple[Any, Any] = (None, None)

    def install(self) -> CompileWatch:
        """Set the Triton hooks (chaining any already set); returns self. No-op without Triton."""
        try:
            from triton import knobs
        except ImportError:  # pragma: no cover - triton ships with torch on every supported platform
            return self
        rt = knobs.runtime
        self._prev = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        rt.jit_cache_hook = self._before
        rt.jit_post_compile_hook = self._after
        return self

    def serving(self) -> None:
        """From now on a compile is a first-use stall on the serving path: logged at WARNING."""
        self._serving = True

    def _before(self, **kw: Any) -> bool:
        self._started[id(kw.get("key"))] = time.perf_counter()
        prev = self._prev[0]
        return bool(prev(**kw)) if prev is not None else False  # True would skip the compile

    def _after(self, **kw: Any) -> None:
        seconds = time.perf_counter() - self._started.pop(id(kw.get("key")), time.perf_counter())
        fn = kw.get("fn")
        name = str(getattr(fn, "name", "?"))
        self.compiles.append((name, seconds, self._serving))
        level = logging.WARNING if self._serving else logging.DEBUG
        log.log(level, "triton_compiled kernel=%s seconds=%.3f serving=%s spec=%s", name, seconds,
                self._serving, kw.get("repr", ""))
        prev = self._prev[1]
        if prev is not None:
            prev(**kw)
