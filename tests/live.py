"""The live system that the system-level suites share, one per test session (``pdserve.live_system``).

Two gateways route every request deterministically, without an override inside the gateway:

* ``live.disagg`` (``--disagg-threshold 0``): one prefill and one decode worker, KV over NIXL;
* ``live.colo``: one colocated worker, the baseline the disaggregated answers are compared with.

Every worker serves the embedded SmolLM2 on the CPU with 256 KV blocks and logs at debug level (the
decode and prefill logs then show each control message received). Both gateways take the API key and
the caps of the fake-worker bad-input suite (``--max-n 4``, ``--max-stop 3``, ``--max-prompt-tokens 100``,
1 MiB body cap), so the conformance suite reuses that suite's cases as data. Heartbeat timeout 10 s: on
a loaded 2-core machine a busy worker can miss 2 s of heartbeats, which the gateway rightly treats as a
dead worker (a 502 mid-request).

``tests/conftest.py`` holds the fixtures (``live``) and, under pytest-xdist, runs every suite of
``LIVE_SUITES`` in one worker process, the one that starts the system.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from pdserve.live_system import SystemPair, live_pair, wait_all_free

API_KEY = "k-123"
BODY_CAP = 1 << 20
GATEWAY_FLAGS = ("--max-n", "4", "--max-stop", "3", "--max-prompt-tokens", "100",
                 "--max-body-bytes", str(BODY_CAP), "--request-timeout", "120", "--log-level", "info")
WORKER_FLAGS = ("--log-level", "debug")
# the suites that use it (node id prefixes): under pytest-xdist they run in one worker (tests/conftest.py)
LIVE_SUITES = ("tests/conformance/", "tests/loadtest/test_live.py", "tests/system/test_pipeline.py",
               "tests/system/test_control_auth_live.py", "tests/system/test_worker_metrics_live.py",
               "tests/system/test_openapi_fuzz_live.py", "tests/system/test_kv_events_live.py",
               "tests/system/test_decode_prefix_reuse_live.py")


@contextmanager
def start_live(logs: Path) -> Iterator[SystemPair]:
    """Start the shared pair with its worker logs under ``logs``; stop it on exit. Raises RuntimeError
    when a child dies during start-up or the gateways are not ready within 240 s."""
    with live_pair(logs, num_blocks=256, worker_flags=WORKER_FLAGS, gateway_flags=GATEWAY_FLAGS,
                   heartbeat_timeout_s=10.0, api_key=API_KEY) as pair:
        yield pair


def wait_all_free_at_once(checks: Iterable[tuple[str, frozenset[str] | set[str]]]) -> None:
    """``wait_all_free`` on each ``(gateway url, worker ids)`` of ``checks``, all at once (each in its own
    thread: each gateway's view lags by its own workers' heartbeats). Raises the first AssertionError
    (in the order given) once every wait has ended."""
    checks = list(checks)
    with ThreadPoolExecutor(max_workers=max(1, len(checks))) as pool:
        waits = [pool.submit(wait_all_free, url, workers) for url, workers in checks]
    for done in waits:
        done.result()
