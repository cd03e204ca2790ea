"""What ``pdserve gateway`` (one process or ``--workers N``) refuses before uvicorn or any gateway process
starts, each in one line with exit code 2: a control port in use (each process's, P + i, with
``--workers``) and a ``--tokenizer`` that is neither a directory with tokenizer.json nor a model alias.
A new operator's trial found a busy ``--control-bind`` port a 34-line uvicorn traceback with exit code 3,
and ``--tokenizer /nonexistent`` an 18-line traceback with exit code 1. Also the probe behind the control
port refusal (``pdserve.ports.control_bind_problem``)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.ports import control_bind_problem, free_port_range, free_ports

ALIASES = "glm-4.5-air, llama3-8b, mixtral-8x7b, qwen3-30b-a3b, smollm2-135m, tiny-llama"


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the single-process server or the pool's first process starts."""
    import gateway.server
    from pdserve import gateway_pool

    monkeypatch.setattr(gateway.server, "serve", lambda settings: pytest.fail("the gateway started"))
    monkeypatch.setattr(gateway_pool.GatewayPool, "start",
                        lambda self, child: pytest.fail("a process started"))


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A socket listening on a free 127.0.0.1 port."""
    held = socket.socket()
    held.bind(("127.0.0.1", free_ports(1)[0]))
    held.listen()
    try:
        yield held
    finally:
        held.close()


@pytest.mark.parametrize("workers", [1, 3])
def test_a_control_port_in_use_is_one_line_and_exit_2(workers: int, nothing_starts: None,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """With ``--workers 3``, process 2's control port (P + 2) is the busy one."""
    first = free_port_range(3)
    busy = first + workers - 1
    [http] = free_ports(1, exclude=(first, first + 1, first + 2))
    with socket.socket() as held:
        held.bind(("127.0.0.1", busy))
        held.listen()
        code = main(["gateway", "--port", str(http), "--control-bind", f"tcp://127.0.0.1:{first}",
                     "--workers", str(workers), "--insecure-control-plane"])
    assert code == 2
    assert capsys.readouterr().err == (f"pdserve gateway: control socket tcp://127.0.0.1:{busy}: port {busy} "
                                       "on 127.0.0.1 is in use; choose another with --control-bind\n")


def test_the_pool_refuses_a_busy_control_port_before_any_process(nothing_starts: None,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``run_pool`` itself (not only the command line) checks every process's control port."""
    from pdserve.gateway_pool import run_pool
    from protocol.settings import GatewaySettings

    first = free_port_range(2)
    settings = GatewaySettings(port=free_ports(1, exclude=(first, first + 1))[0], workers=2,
                               control_bind=f"tcp://127.0.0.1:{first}", insecure_control_plane=True)
    with socket.socket() as held:
        held.bind(("127.0.0.1", first + 1))
        held.listen()
        assert run_pool(settings) == 2
    busy = first + 1
    assert capsys.readouterr().err == (f"pdserve gateway: control socket tcp://127.0.0.1:{busy}: port {busy} "
                                       "on 127.0.0.1 is in use; choose another with --control-bind\n")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_tokenizer_that_is_not_there_is_one_line_and_exit_2(workers: str, tmp_path: Path,
                                                              nothing_starts: None,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    first = free_port_range(2)
    flags = ["--port", str(free_ports(1, exclude=(first, first + 1))[0]), "--workers", workers,
             "--control-bind", f"tcp://127.0.0.1:{first}", "--insecure-control-plane"]
    assert main(["gateway", *flags, "--tokenizer", "/nonexistent"]) == 2
    assert capsys.readouterr().err == (
        f"pdserve gateway: --tokenizer '/nonexistent' does not exist and is not a model alias (aliases: "
        f"{ALIASES}); give a directory with tokenizer.json or an alias\n")
    assert main(["gateway", *flags, "--tokenizer", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"pdserve gateway: --tokenizer {tmp_path}: directory {tmp_path} has "
                                       "no tokenizer.json\n")


def test_an_alias_that_cannot_be_prepared_is_one_line_and_exit_1(tmp_path: Path, nothing_starts: None,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A known alias whose conversion fails (the cache root is a file) is not a bad value: exit 1, the
    reason one line naming the alias (after the log line that the tokenizer is being prepared)."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "file"))
    first = free_port_range(1)
    assert main(["gateway", "--port", str(free_ports(1, exclude=(first,))[0]), "--control-bind",
                 f"tcp://127.0.0.1:{first}", "--insecure-control-plane", "--tokenizer", "smollm2-135m"]) == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "preparing the tokenizer of smollm2-135m" in err and "Traceback" not in err
    assert line.startswith("pdserve gateway: --tokenizer smollm2-135m: preparing the model failed: "), line


def test_the_gateway_is_given_the_prepared_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An alias is resolved once by the command: the app (every ``--workers`` process) gets its directory."""
    import gateway.server

    served: list[str | None] = []
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gateway.server, "serve", lambda settings: served.append(settings.tokenizer))
    first = free_port_range(1)
    assert main(["gateway", "--port", str(free_ports(1, exclude=(first,))[0]), "--control-bind",
                 f"tcp://127.0.0.1:{first}", "--insecure-control-plane", "--tokenizer", "tiny-llama"]) == 0
    assert served == [str(tmp_path / "configs" / "tiny-llama")]


def test_control_bind_problem_probes_only_fixed_tcp_ports(listener: socket.socket,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A listener on the port is a problem at its address and at ``*`` (every IPv4 address); ipc and
    inproc endpoints, a wildcard port and a host that does not resolve (zmq also binds interface names)
    are left to zmq; a free port is no problem. The name lookup of ``.invalid`` fails at once (no DNS
    query from a test)."""
    from pdserve import ports

    real = socket.getaddrinfo

    def lookup(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(name).endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ports.socket, "getaddrinfo", lookup)
    port = listener.getsockname()[1]
    assert control_bind_problem(f"tcp://127.0.0.1:{port}") == (
        f"control socket tcp://127.0.0.1:{port}: port {port} on 127.0.0.1 is in use; choose another with "
        "--control-bind")
    assert "is in use" in str(control_bind_problem(f"tcp://*:{port}"))
    for endpoint in ("ipc:///tmp/pdserve-x", "inproc://x", "tcp://127.0.0.1:*", "tcp://127.0.0.1:0",
                     f"tcp://eth9.invalid:{port}", f"tcp://127.0.0.1:{free_ports(1, exclude=(port,))[0]}"):
        assert control_bind_problem(endpoint) is None, endpoint
