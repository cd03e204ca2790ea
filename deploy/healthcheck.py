"""Container health probe for every pdserve role (Docker ``HEALTHCHECK``; stdlib only, no pdserve import).

The role and its flags are read from the container's main process (``/proc/1/cmdline``, i.e.
``pdserve <role> [flags]``) and its ``PDSERVE_*`` environment:

- ``gateway`` and ``up``: HTTP ``GET /health`` on the gateway port (``--port`` / ``PDSERVE_PORT``,
  default 8000) must answer 200. With ``--public-health false`` (or ``PDSERVE_PUBLIC_HEALTH``) the gateway
  asks ``/health`` for a key: the probe sends the first of its keys (``--api-key`` / ``PDSERVE_API_KEY``,
  else the first of ``--api-key-file`` / ``PDSERVE_API_KEY_FILE``) as ``Authorization: Bearer``.
- ``prefill``, ``decode``, ``colocated`` with a metrics port (``--metrics-port`` /
  ``PDSERVE_METRICS_PORT``, not 0): HTTP ``GET /health`` on it must answer 200, which the worker does
  while its engine loop ticks and the gateway has accepted it (``workers/health_server.py``).
- the same without a metrics port: a TCP connection to the worker's control port (``--port`` /
  ``PDSERVE_PORT``) must be accepted (the worker loaded its model; nothing about its engine loop).
  The port must be fixed (not 0 = pick) for the probe to find it.

Exit status 0 = healthy, 1 = unhealthy (the reason on stderr), as Docker's HEALTHCHECK expects
(https://docs.docker.com/reference/dockerfile/#healthcheck).
"""

from __future__ import annotations

import http.client
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

GATEWAY_ROLES = frozenset({"gateway", "up"})
WORKER_ROLES = frozenset({"prefill", "decode", "colocated"})
DEFAULT_GATEWAY_PORT = 8000
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


@dataclass(frozen=True)
class ProbeTarget:
    """What to probe: ``kind`` is ``"http"`` (GET ``path``, expect 200) or ``"tcp"`` (connect only)."""

    kind: str
    host: str
    port: int
    path: str = "/health"
    bearer: str | None = None  # the API key sent with the request (--public-health false), else none


def _flag(argv: Sequence[str], name: str) -> str | None:
    """Value of ``--name V`` or ``--name=V`` in ``argv`` (the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _public_health(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """The gateway's ``--public-health`` (``nargs="?"``: the bare flag is true; the last one wins, then
    ``PDSERVE_PUBLIC_HEALTH``, then true), read as pdserve reads it (``true/false/1/0/yes/no/on/off``)."""
    value: str | None = None
    for i, arg in enumerate(argv):
        if arg == "--public-health":
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            value = "true" if nxt is None or nxt.startswith("-") else nxt
        elif arg.startswith("--public-health="):
            value = arg.split("=", 1)[1]
    if value is None:
        value = env.get("PDSERVE_PUBLIC_HEALTH", "true")
    return value.strip().lower() not in ("0", "false", "no", "off")


def _api_key(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The first API key the gateway takes: ``--api-key`` (else ``PDSERVE_API_KEY``, comma-separated),
    else the first key line of ``--api-key-file`` (else ``PDSERVE_API_KEY_FILE``); None when there is none
    or the file cannot be read (the probe then goes without, and the 401 says why)."""
    keys = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--api-key"]
    keys += [a.split("=", 1)[1] for a in argv if a.startswith("--api-key=")]
    if not keys and env.get("PDSERVE_API_KEY"):
        keys = env["PDSERVE_API_KEY"].split(",")
    if keys:
        return keys[0].strip()
    path = _flag(argv, "--api-key-file") or env.get("PDSERVE_API_KEY_FILE")
    if not path:
        return None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((line.strip() for line in lines if line.strip() and not line.strip().startswith("#")), None)


def probe_target(argv: Sequence[str], env: Mapping[str, str]) -> ProbeTarget:
    """Decide what to probe from the main process's command line and environment.

    Args:
        argv: the command line, e.g. ``["/app/.venv/bin/python", "/app/.venv/bin/pdserve", "decode"]``.
        env: the environment (``PDSERVE_PORT``, ``PDSERVE_METRICS_PORT``, ``PDSERVE_HOST``, and for a gateway
            ``PDSERVE_PUBLIC_HEALTH``, ``PDSERVE_API_KEY``, ``PDSERVE_API_KEY_FILE`` are read).

    Raises:
        ValueError: no pdserve role in ``argv``, a port that is not an integer in 1..65535, or a
            worker whose control port is unset or 0 (the probe cannot know a port picked at random).
    """
    role = next((a for a in argv if a in GATEWAY_ROLES | WORKER_ROLES), None)
    if role is None:
        raise ValueError(f"no pdserve role ({', '.join(sorted(GATEWAY_ROLES | WORKER_ROLES))}) in {argv!r}")
    raw_metrics = _flag(argv, "--metrics-port") or env.get("PDSERVE_METRICS_PORT")
    worker_http = role in WORKER_ROLES and raw_metrics is not None and raw_metrics.strip() != "0"
    http = role in GATEWAY_ROLES or worker_http
    raw_port = raw_metrics if worker_http else _flag(argv, "--port") or env.get("PDSERVE_PORT")
    if raw_port is None and role in GATEWAY_ROLES:
        raw_port = str(DEFAULT_GATEWAY_PORT)
    if raw_port is None or raw_port.strip() == "0":
        raise ValueError(f"{role}: control port unset or 0; set PDSERVE_PORT (e.g. 7200) so it can be probed")
    try:
        port = int(raw_port)
    except ValueError:
        raise ValueError(f"{role}: port {raw_port!r} is not an integer") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"{role}: port {port} is outside 1..65535")
    host = _flag(argv, "--host") or env.get("PDSERVE_HOST", "127.0.0.1")
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    bearer = _api_key(argv, env) if role in GATEWAY_ROLES and not _public_health(argv, env) else None
    return ProbeTarget("http" if http else "tcp", host, port, bearer=bearer)


def probe(target: ProbeTarget, timeout_s: float = 3.0) -> None:
    """Probe ``target`` once.

    Raises:
        OSError: connection refused or timed out (after ``timeout_s`` seconds).
        RuntimeError: the HTTP health endpoint answered a status other than 200.
    """
    if target.kind == "tcp":
        with socket.create_connection((target.host, target.port), timeout=timeout_s):
            return
    conn = http.client.HTTPConnection(target.host, target.port, timeout=timeout_s)
    try:
        headers = {"Authorization": f"Bearer {target.bearer}"} if target.bearer else {}
        conn.request("GET", target.path, headers=headers)
        status = conn.getresponse().status
    finally:
        conn.close()
    if status != 200:
        raise RuntimeError(f"GET {target.path} answered {status}")


def main(argv: Sequence[str] | None = None, cmdline_file: str = "/proc/1/cmdline") -> int:
    """Probe this container's pdserve process; return 0 when healthy, 1 otherwise (reason on stderr).

    ``argv`` (default ``sys.argv[1:]``) may name the role (``healthcheck.py decode``); needed where the
    container shares the host's PID namespace (``pid: host``) and PID 1 is not pdserve. Without it the
    role and flags come from ``cmdline_file``. Host and port then come from ``PDSERVE_HOST`` /
    ``PDSERVE_PORT``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args:
            cmdline = ["pdserve", *args]
        else:
            cmdline = [a for a in Path(cmdline_file).read_bytes().decode().split("\0") if a]
        probe(probe_target(cmdline, os.environ))
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
