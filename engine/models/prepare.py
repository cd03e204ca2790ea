"""``python -m engine.models.prepare NAME``: resolve a model alias or directory with
``engine.models.registry.resolve_model`` (converting the embedded model into the cache on first use) and
print the directory on stdout.

The gateway runs it as a child process (``gateway.text.prepare_alias``) to get a model's tokenizer without
importing torch into its own process. Exit status 0: the directory is the last line of stdout; 1: it
could not be resolved, the reason one line on stderr (the last); 2: usage.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Resolve ``argv[0]`` (default ``sys.argv[1:]``) and print its directory; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m engine.models.prepare NAME", file=sys.stderr)
        return 2
    from engine.models.registry import resolve_model

    try:
        path = resolve_model(args[0])
    except Exception as exc:  # any failure (a missing package, a conversion error) becomes one line
        print(f"{type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr, flush=True)
        return 1
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
