"""Wait until a server's ``/metrics`` shows a sample at or above a value: a ``--fault`` command's gate.

Usage: ``python wait_metric.py BASE_URL SAMPLE MIN DEADLINE_S`` — polls ``BASE_URL/metrics`` every 0.1 s for
the unlabelled sample ``SAMPLE`` (e.g. ``pdserve_e2e_seconds_count``, the gateway's count of finished
requests); exits 0 as soon as its value is >= ``MIN``, 1 once ``DEADLINE_S`` seconds passed without that
(an unreadable ``/metrics`` counts as not yet). Standard library only: the bench runs it as a plain script
through the shell, so ``wait_metric.py ... && kill -9 PID`` kills only once the condition held.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request


def sample(text: str, name: str) -> float | None:
    """The value of the unlabelled sample ``name`` in Prometheus text ``text``, or None if absent."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value.split()[0])
    return None


def main(argv: list[str]) -> int:
    url, name, minimum, deadline_s = argv[0], argv[1], float(argv[2]), float(argv[3])
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: never a proxy
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with opener.open(f"{url}/metrics", timeout=5) as resp:
                value = sample(resp.read().decode(), name)
        except (OSError, urllib.error.URLError):
            value = None
        if value is not None and value >= minimum:
            return 0
        if time.monotonic() >= deadline:
            print(f"{name} stayed below {minimum:g} for {deadline_s:g} s (last: {value})")
            return 1
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
