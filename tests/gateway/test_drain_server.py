"""The gateway's HTTP server at a stop (gateway/server.py ``DrainingServer``), in a child process serving
a stand-in app whose one route streams a chunk every 50 ms for ``n`` chunks: at the first SIGTERM the
port stops taking connections while a stream in flight runs to its end; the drain's deadline
(``timeout_graceful_shutdown``, ``--drain-timeout``) cuts one that runs longer; a second SIGTERM cuts it
at once (uvicorn alone took only a second SIGINT)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdserve.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
SERVER = """
import asyncio, sys
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from gateway.server import DrainingServer
from protocol.logging import configure_logging
from protocol.settings import GatewaySettings

app = FastAPI()

@app.get("/stream/{n}")
async def stream(n: int):
    async def chunks():
        for i in range(n):
            yield f"{i}\\n"
            await asyncio.sleep(0.05)
    return StreamingResponse(chunks(), media_type="text/plain")

@app.get("/ping")
async def ping():
    return "pong"

port, drain = int(sys.argv[1]), float(sys.argv[2])
configure_logging("info", "text")
DrainingServer(app, GatewaySettings(host="127.0.0.1", port=port, log_level="warning", drain_timeout=drain,
                                    insecure_control_plane=True)).run()
"""


class Reader(threading.Thread):
    """Reads one stream to its end (or its cut); ``lines`` seen and whether it ended cleanly."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url, self.lines, self.clean, self.error = url, 0, False, ""

    def run(self) -> None:
        try:
            with httpx.stream("GET", self.url, timeout=30, trust_env=False) as r:
                for _ in r.iter_lines():
                    self.lines += 1
            self.clean = True
        except httpx.HTTPError as exc:
            self.error = type(exc).__name__


def _serve(drain_s: float, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    [port] = free_ports(1)
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(drain_s)], cwd=ROOT,
                                env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, stderr=err)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"{url}/ping", timeout=1, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/ping", timeout=1, trust_env=False)
    except httpx.ConnectError:
        return True
    return False


@pytest.mark.parametrize("how", ["drained", "ctrl-c", "deadline", "second signal", "no drain"])
def test_a_stop_drains_the_streams_in_flight_within_its_deadline(how: str, tmp_path: Path) -> None:
    """Whichever way the stream ends, the server says it in one line (``requests_cut``: how many and
    why) and logs no error or traceback."""
    log = tmp_path / "server.log"
    proc, url = _serve({"deadline": 1.0, "no drain": 0.0}.get(how, 30.0), log)
    try:
        n = 40 if how in ("drained", "ctrl-c") else 400  # 2 s, or 20 s of chunks
        reader = Reader(f"{url}/stream/{n}")
        reader.start()
        while reader.lines < 2:
            assert reader.is_alive(), reader.error
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        assert _refused(url)  # no new connection during the drain
        assert reader.is_alive() or how == "no drain"  # ... while the stream goes on
        if how == "second signal":
            proc.send_signal(signal.SIGTERM)
        reader.join(30)
        took = time.monotonic() - signalled
        proc.wait(30)
        text = log.read_text()
        assert "ERROR" not in text and "Traceback" not in text, text
        # 128 + the signal, as the process's own (a Ctrl-C raised KeyboardInterrupt with a traceback)
        assert proc.returncode == (130 if how == "ctrl-c" else -signal.SIGTERM), (
            proc.returncode)
        if how in ("drained", "ctrl-c"):
            assert (reader.clean, reader.lines) == (True, n) and took < 10
            assert "requests_cut" not in text
        else:
            assert not (reader.clean and reader.lines == n) and took < (5 if how == "deadline" else 3), (
                reader.lines, took)
            why = {"deadline": "the drain's deadline", "second signal": "a second stop signal",
                   "no drain": "--drain-timeout 0"}[how]
            assert f"requests_cut requests=1 why={why}" in text, text
        if how == "deadline":
            assert took > 0.9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
