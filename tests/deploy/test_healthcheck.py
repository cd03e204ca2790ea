"""deploy/healthcheck.py: target selection from the command line/env, and real probes on 127.0.0.1."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.healthcheck import ProbeTarget, main, probe, probe_target


def test_gateway_defaults_to_http_health_on_8000() -> None:
    argv = ["/app/.venv/bin/python", "/app/.venv/bin/pdserve", "gateway", "--host", "0.0.0.0"]
    assert probe_target(argv, {}) == ProbeTarget("http", "127.0.0.1", 8000, "/health")


def test_worker_port_from_flag_beats_env() -> None:
    argv = ["pdserve", "decode", "--port=7300"]
    assert probe_target(argv, {"PDSERVE_PORT": "7201", "PDSERVE_HOST": "0.0.0.0"}) == ProbeTarget(
        "tcp", "127.0.0.1", 7300)
    assert probe_target(["pdserve", "prefill"], {"PDSERVE_PORT": "7200", "PDSERVE_HOST": "10.1.2.3"}) == (
        ProbeTarget("tcp", "10.1.2.3", 7200))


def test_worker_with_a_metrics_port_is_probed_on_its_health_endpoint() -> None:
    env = {"PDSERVE_PORT": "7200", "PDSERVE_METRICS_PORT": "7210", "PDSERVE_HOST": "0.0.0.0"}
    assert probe_target(["pdserve", "decode"], env) == ProbeTarget("http", "127.0.0.1", 7210, "/health")
    assert probe_target(["pdserve", "prefill", "--metrics-port", "7300"], env) == ProbeTarget(
        "http", "127.0.0.1", 7300, "/health")
    assert probe_target(["pdserve", "prefill"], {**env, "PDSERVE_METRICS_PORT": "0"}) == ProbeTarget(
        "tcp", "127.0.0.1", 7200)  # no metrics server: the control socket
    with pytest.raises(ValueError, match="outside"):
        probe_target(["pdserve", "decode"], {**env, "PDSERVE_METRICS_PORT": "70000"})


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["python", "-m", "http.server"], {}, "no pdserve role"),
    (["pdserve", "decode"], {}, "PDSERVE_PORT"),
    (["pdserve", "prefill"], {"PDSERVE_PORT": "0"}, "PDSERVE_PORT"),
    (["pdserve", "gateway", "--port", "http"], {}, "not an integer"),
    (["pdserve", "gateway"], {"PDSERVE_PORT": "70000"}, "outside"),
])
def test_bad_targets_raise_naming_the_problem(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        probe_target(argv, env)


SECRET_HEADER = "Bearer sekrit"


@pytest.fixture
def http_server() -> Iterator[tuple[int, list[int]]]:
    """A /health endpoint on 127.0.0.1: (port, [status it answers]). ``SECRET_HEADER`` as the status list's
    second item makes it answer 401 to a request without that Authorization header."""
    status: list[int] = [200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            unauthorized = len(status) > 1 and self.headers.get("Authorization") != SECRET_HEADER
            self.send_response(404 if self.path != "/health" else 401 if unauthorized else status[0])
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], status
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_http_probe_healthy_then_unhealthy(http_server: tuple[int, list[int]]) -> None:
    port, status = http_server
    probe(ProbeTarget("http", "127.0.0.1", port))
    status[0] = 503
    with pytest.raises(RuntimeError, match="503"):
        probe(ProbeTarget("http", "127.0.0.1", port))


def test_tcp_probe_listening_and_closed_port() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        probe(ProbeTarget("tcp", "127.0.0.1", listener.getsockname()[1]), timeout_s=2)
    with pytest.raises(OSError):
        probe(ProbeTarget("tcp", "127.0.0.1", _free_port()), timeout_s=2)


def test_main_with_role_argument_and_cmdline_file(
        http_server: tuple[int, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port, _ = http_server
    monkeypatch.setenv("PDSERVE_PORT", str(port))
    monkeypatch.setenv("PDSERVE_HOST", "0.0.0.0")
    assert main(["gateway"]) == 0
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"/app/.venv/bin/python\0/app/.venv/bin/pdserve\0gateway\0")
    assert main([], cmdline_file=str(cmdline)) == 0
    monkeypatch.setenv("PDSERVE_PORT", str(_free_port()))
    assert main(["decode"]) == 1
    assert main([], cmdline_file=str(tmp_path / "missing")) == 1


@pytest.mark.parametrize(("argv", "env", "key"), [
    (["pdserve", "up", "--public-health", "false", "--api-key", "k1", "--api-key", "k2"], {}, "k1"),
    (["pdserve", "gateway", "--public-health=no"], {"PDSERVE_API_KEY": "k1,k2"}, "k1"),
    (["pdserve", "gateway"], {"PDSERVE_PUBLIC_HEALTH": "off", "PDSERVE_API_KEY_FILE": "FILE"}, "from-file"),
    (["pdserve", "gateway", "--public-health", "--api-key", "k1"], {}, None),  # bare flag: true
    (["pdserve", "gateway", "--api-key", "k1"], {"PDSERVE_PUBLIC_HEALTH": "true"}, None),
    (["pdserve", "decode"],
     {"PDSERVE_PORT": "7201", "PDSERVE_PUBLIC_HEALTH": "false", "PDSERVE_API_KEY": "k"}, None),
])
def test_a_gateway_with_a_private_health_endpoint_is_probed_with_its_first_key(
        argv: list[str], env: dict[str, str], key: str | None, tmp_path: Path) -> None:
    """``--public-health false`` makes the gateway ask ``/health`` for a key: the probe sends the first one
    the gateway takes (flag, else environment, else key file); with a public endpoint, or for a worker,
    none."""
    keys = tmp_path / "keys"
    keys.write_text("# the fleet's keys\n\nfrom-file\nsecond\n")
    env = {k: str(keys) if v == "FILE" else v for k, v in env.items()}
    assert probe_target(argv, env).bearer == key


def test_probe_sends_the_key_a_private_health_endpoint_asks_for(http_server: tuple[int, list[int]]) -> None:
    port, status = http_server
    status.append(401)  # the endpoint asks for the key
    argv = ["pdserve", "up", "--port", str(port), "--public-health", "false"]
    probe(probe_target(argv, {"PDSERVE_API_KEY": "sekrit"}))
    with pytest.raises(RuntimeError, match="401"):
        probe(probe_target(argv, {}))
