"""What ``pdserve up`` refuses before any child starts, each in one line naming the flag or the setting
and with exit code 2 (tensor parallel ranks beyond the GPUs, a CUDA device that is not there, a busy
port, a host it cannot bind, a model or quantization the workers cannot run, a tokenizer the gateway
could not use, a max model length beyond the model's positions, its sliding window or LongRoPE's original
context or the KV cache of an explicit --num-blocks, a model the tensor parallel ranks cannot split, an
attention backend the device cannot run), and the probes behind the port and host refusals
(``pdserve.ports``)."""

from __future__ import annotations

import re
import time

import pytest

from pdserve.ports import free_port
from pdserve.supervisor import Supervisor
from protocol.settings import UpSettings, WorkerSettings


def test_up_refuses_tensor_parallel_ranks_beyond_the_gpus_before_starting_anything(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve import launcher

    started: list[str] = []
    monkeypatch.setattr(launcher, "gpu_count", lambda: 2)
    monkeypatch.setattr(Supervisor, "start", lambda self, name, *a, **k: started.append(name))
    tp2 = WorkerSettings(role="colocated", tensor_parallel_size=2, insecure_control_plane=True)
    up = UpSettings(port=free_port(), insecure_control_plane=True, worker=tp2)
    assert launcher._supervise(up, Supervisor(), [], 1.0, None) == 2
    assert started == []
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pdserve up: --tensor-parallel-size: 2 workers need 4 GPUs (2+2 ranks), 2 visible"]


def test_up_refuses_a_busy_port_at_once_and_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from pdserve.launcher import run

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        start = time.monotonic()
        assert run(UpSettings(port=port, device="cpu"), ready_timeout=5) == 2
        assert time.monotonic() - start < 5  # refused before any child (and model load) started
    want = f"pdserve up: port {port} on 127.0.0.1 is in use; choose another with --port\n"
    assert capsys.readouterr().err == want


def test_up_refuses_in_one_json_event_with_json_logs(capsys: pytest.CaptureFixture[str]) -> None:
    """The same refusal under ``--log-format json``: one JSON log event of ``pdserve.up`` at level error,
    with the same words and ``refused: up``, nothing else on stderr."""
    import json
    import socket

    from pdserve.launcher import run
    from protocol.logging import configure_logging

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        configure_logging("info", "json")
        try:
            assert run(UpSettings(port=port, device="cpu", log_format="json"), ready_timeout=5) == 2
        finally:
            configure_logging("info", "text")
    [line] = capsys.readouterr().err.strip().splitlines()
    event = json.loads(line)
    assert (event["logger"], event["level"], event["msg"], event["refused"]) == (
        "pdserve.up", "error", f"port {port} on 127.0.0.1 is in use; choose another with --port", "up")


def test_bind_problem_ignores_time_wait_but_not_a_listener() -> None:
    """A port whose only socket is a closed connection in TIME_WAIT (the server closed first, as a stopped
    `pdserve up` gateway does) is free for a SO_REUSEADDR listener like uvicorn; a live listener is not.
    Found by a new-user trial: `pdserve up` refused to restart for ~1 min after a Ctrl-C during start-up."""
    import socket

    from pdserve.ports import bind_problem, free_port

    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    in_use = f"port {port} on 127.0.0.1 is in use; choose another with --port"
    assert bind_problem("127.0.0.1", port) == in_use
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    server.close()
    conn.close()  # the server side closes first: its end of the connection enters TIME_WAIT
    client.recv(1)
    client.close()
    plain = socket.socket()
    try:  # the state the old probe mistook for "in use"
        plain.bind(("127.0.0.1", port))
        time_wait = False
    except OSError:
        time_wait = True
    finally:
        plain.close()
    assert time_wait, "no TIME_WAIT was produced: the test would prove nothing"
    assert bind_problem("127.0.0.1", port) is None


def test_free_ports_are_distinct_and_skip_excluded(monkeypatch) -> None:
    """free_ports(n) never repeats a port (sequential free_port() calls did: a test system's gateway once
    got the same port for HTTP and its control socket, 'address already in use') and never returns one
    in `exclude`: here the kernel is made to hand out the excluded port first."""
    import socket as socket_mod

    from pdserve import ports as ports_mod

    ports = ports_mod.free_ports(64)
    assert len(set(ports)) == 64 and all(p > 0 for p in ports)

    blocker = socket_mod.socket()
    blocker.bind(("127.0.0.1", 0))
    taken = blocker.getsockname()[1]
    blocker.close()  # now free again: the next bind to port 0 may or may not get it; force it below
    real = socket_mod.socket

    class FirstGetsTaken(real):  # type: ignore[misc,valid-type]
        first = True

        def bind(self, addr):
            if FirstGetsTaken.first:
                FirstGetsTaken.first = False
                return super().bind((addr[0], taken))
            return super().bind(addr)

    monkeypatch.setattr(ports_mod.socket, "socket", FirstGetsTaken)
    got = ports_mod.free_ports(2, exclude=(taken,))
    assert taken not in got and len(set(got)) == 2


@pytest.mark.parametrize(("edit", "named"), [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "unsupported quantization method 'awq'"),
    ({"quantization_config": {"quant_method": "gptq"}}, "unsupported quantization method 'gptq'"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "unsupported quantization method 'bitsandbytes'"),
    # a new-user trial: these said "unsupported quantization method '<none>'"
    ({"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}},
     r"quantization_config in .*config.json has no quant_method \(load_in_4bit: it looks like bitsandbytes, "
     r"which is not supported\); supported: quant_method fp8"),
    ({"quantization_config": {"load_in_8bit": True}}, r"has no quant_method \(load_in_8bit: it looks like"),
    ({"quantization_config": {"bits": 4}}, r"has no quant_method; supported: quant_method fp8"),
    ({"quantization_config": "fp8"},
     r"quantization_config in .*config.json is not an object with a quant_method \(got 'fp8'\)"),
    ({"architectures": ["GPT2LMHeadModel"]}, r"unsupported architecture \['GPT2LMHeadModel'\]"),
    ({"architectures": ["Gemma2ForCausalLM"]},
     r"architecture Gemma2ForCausalLM .* not supported: its sliding-window attention .* soft-capping"),
    ({"architectures": ["Phi3ForCausalLM"], "quantization_config": {"quant_method": "fp8"}},
     "FP8 weights for Phi3ForCausalLM .* not supported"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}},
     "FP8 format 'e5m2'.*supported: e4m3"),
])
def test_up_refuses_an_unsupported_model_before_any_child(edit, named, tmp_path, capsys) -> None:
    """An architecture or a quantization method the workers cannot run is refused by the launcher in one
    line naming it and listing what is supported, before any worker starts (nothing listens)."""
    import json

    from pdserve.launcher import run
    from pdserve.ports import free_port

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, **edit}
    (tmp_path / "config.json").write_text(json.dumps(config))
    start = time.monotonic()
    assert run(UpSettings(model=str(tmp_path), port=free_port(), device="cpu"), ready_timeout=5) == 2
    assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert err.startswith("pdserve up: ") and len(err.strip().splitlines()) == 1
    assert re.search(named, err) and "supported: " in err
    if "architecture" in named:
        assert "Qwen3MoeForCausalLM" in err and "MixtralForCausalLM" in err


def test_up_refuses_static_fp8_for_a_mixture_of_experts_before_any_child(tmp_path, capsys) -> None:
    """An FP8 MoE checkpoint the FP8 expert kernels cannot run (static activation scales) is refused by
    the launcher's check in one line before any worker starts."""
    import json

    from pdserve.launcher import run
    from pdserve.ports import free_port
    from protocol.settings import WorkerSettings

    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64,
              "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    worker = WorkerSettings(role="colocated", worker_id="up", insecure_control_plane=True, quantization="fp8")
    assert run(UpSettings(model=str(tmp_path), port=free_port(), device="cpu", worker=worker),
               ready_timeout=5) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve up: FP8 mixture of experts Qwen3MoeForCausalLM with activation_scheme "
                          "'static'")
    assert len(err.strip().splitlines()) == 1 and "supported: activation_scheme dynamic" in err


def _refused_before_any_child(up: UpSettings, monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    """``launcher.run(up)`` with ``gpus`` CUDA devices visible (the model check passed): asserts exit code 2
    and that no child was started."""
    from engine.models import registry
    from pdserve import launcher

    started: list[str] = []
    monkeypatch.setattr(registry, "resolve_model", lambda name: name)
    monkeypatch.setattr(registry, "read_model_config", lambda path, quantization: None)
    monkeypatch.setattr(launcher, "gpu_count", lambda: gpus)
    monkeypatch.setattr(Supervisor, "start", lambda self, name, *a, **k: started.append(name))
    assert launcher.run(up, ready_timeout=1.0) == 2
    assert started == []


@pytest.mark.parametrize(("device", "gpus", "message"), [
    ("cuda", 0, "--device cuda: no CUDA device is visible to this process (torch.cuda.is_available() is "
                "False); use --device cpu or auto"),
    ("cuda:0", 0, "--device cuda:0: no CUDA device is visible"),
    ("cuda:1", 1, "--device cuda:1: 1 CUDA device(s) visible, cuda:0..cuda:0"),
])
def test_up_refuses_a_cuda_device_that_is_not_there(device: str, gpus: int, message: str,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A new-user trial: ``pdserve up --device cuda`` on a machine without CUDA started every process, and
    each worker died with a traceback (``Torch not compiled with CUDA enabled``)."""
    _refused_before_any_child(UpSettings(port=free_port(), device=device, insecure_control_plane=True),
                              monkeypatch, gpus)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"pdserve up: {message}"), line


@pytest.mark.parametrize(("device", "gpus"), [("cuda:1", 2), ("cuda", 1), ("auto", 0), ("cpu", 0)])
def test_up_takes_a_device_that_is_there(device: str, gpus: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve import launcher

    monkeypatch.setattr(launcher, "gpu_count", lambda: gpus)
    up = UpSettings(port=free_port(), device=device, insecure_control_plane=True)
    assert launcher.up_refusal(up) is None


@pytest.mark.parametrize(("host", "message"), [
    ("192.0.2.1", "--host 192.0.2.1 is not an address of this machine"),  # TEST-NET-1: never local
    ("no-such-host.invalid", "--host 'no-such-host.invalid' does not resolve to an address"),
])
def test_up_refuses_a_host_it_cannot_bind_naming_the_host(host: str, message: str,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A new-user trial: ``pdserve up --host 10.255.255.1`` (or a name that does not resolve) said the
    port was in use. The name lookup is patched to fail at once (no DNS query from a test)."""
    import socket

    from pdserve import ports

    real = socket.getaddrinfo

    def lookup(name, *args, **kwargs):
        if name.endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ports.socket, "getaddrinfo", lookup)
    _refused_before_any_child(UpSettings(host=host, port=free_port(), device="cpu",
                                         insecure_control_plane=True), monkeypatch, 0)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"pdserve up: {message}") and "in use" not in line, line


def test_bind_problem_probes_every_address_of_a_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """``localhost`` may resolve to ::1 and 127.0.0.1 (in that order): a listener on either makes the port
    busy, as asyncio binds both; ``""`` binds every address (0.0.0.0 and ::), and ``::`` alone is IPv6-only
    as asyncio binds it, so an IPv4 listener does not make it busy."""
    import socket

    from pdserve import ports

    real = socket.getaddrinfo
    port = free_port()

    def lookup(name, *args, **kwargs):
        if name == "two-addresses.test":
            return real("::1", *args, **kwargs) + real("127.0.0.1", *args, **kwargs)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ports.socket, "getaddrinfo", lookup)
    assert ports.bind_problem("two-addresses.test", port) is None
    assert ports.bind_problem("", port) is None
    with socket.socket() as held:  # IPv4 only
        held.bind(("127.0.0.1", port))
        held.listen()
        assert ports.bind_problem("two-addresses.test", port) == (
            f"port {port} on two-addresses.test is in use; choose another with --port")
        assert ports.bind_problem("", port) == (
            f"port {port} on every address is in use; choose another with --port")
        assert ports.bind_problem("::", port) is None


@pytest.mark.parametrize("host", ["::", "0.0.0.0", "", "127.0.0.1"])
def test_local_host_reaches_a_server_bound_as_uvicorn_binds(host: str) -> None:
    """``pdserve up`` polls /ready at ``local_host(--host)``. asyncio's ``create_server`` (uvicorn) binds
    ``::`` IPv6-only, so with ``--host ::`` polling 127.0.0.1 was refused and the launcher never saw the
    system ready (every worker was)."""
    import asyncio

    from pdserve.ports import local_host

    port = free_port()  # one port: with port 0 each address of "" would get its own

    async def reach() -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), host=host or None, port=port)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(local_host(host), port), 5)
            writer.close()
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(reach())


def _refused_through_the_cli(argv: list[str], monkeypatch: pytest.MonkeyPatch, gpus: int = 0) -> None:
    """``pdserve up ARGV`` (a free port, no CURVE keys made) with ``gpus`` CUDA devices visible: asserts
    exit code 2 and that no child was started."""
    from pdserve import launcher
    from pdserve.cli import main

    started: list[str] = []
    monkeypatch.setattr(launcher, "gpu_count", lambda: gpus)
    monkeypatch.setattr(Supervisor, "start", lambda self, name, *a, **k: started.append(name))
    monkeypatch.setattr(launcher, "wait_ready", lambda *a, **k: "not ready (stub: no child runs)")
    assert main(["up", "--port", str(free_port()), "--insecure-control-plane", *argv]) == 2
    assert started == []


@pytest.mark.parametrize("bad", ["/nonexistent", "no-such-alias", "EMPTY_DIR"])
def test_up_refuses_a_tokenizer_the_gateway_could_not_use(bad: str, tmp_path, monkeypatch, capsys) -> None:
    """A new operator's trial: ``pdserve up --tokenizer /nonexistent`` started every process, the gateway
    died with a traceback, exit 1."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    name = str(tmp_path) if bad == "EMPTY_DIR" else bad
    _refused_through_the_cli(["--model", "tiny-llama", "--device", "cpu", "--tokenizer", name], monkeypatch)
    [line] = capsys.readouterr().err.strip().splitlines()
    if bad == "EMPTY_DIR":
        assert line == f"pdserve up: --tokenizer {name}: directory {name} has no tokenizer.json"
    else:
        assert line.startswith(f"pdserve up: --tokenizer {name!r} does not exist and is not a model alias "
                               "(aliases: glm-4.5-air, llama3-8b, "), line


def test_up_refuses_a_max_model_len_beyond_the_models_positions(tmp_path, monkeypatch, capsys) -> None:
    """A new operator's trial: ``pdserve up --max-model-len 100000000`` started every process; each worker
    then refused it. The launcher reads the limit from the model's config.json (tiny-llama: 4096); the
    limit itself is accepted."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    _refused_through_the_cli(["--model", "tiny-llama", "--device", "cpu", "--max-model-len", "100000000"],
                             monkeypatch)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == ("pdserve up: --max-model-len 100000000: max_model_len=100000000 exceeds the model's "
                    "max_position_embeddings=4096")
    from engine.models.registry import DUMMY_CONFIGS, read_model_config, resolve_model
    from pdserve import launcher

    config = read_model_config(resolve_model("tiny-llama"))
    assert config["max_position_embeddings"] == DUMMY_CONFIGS["tiny-llama"]["max_position_embeddings"]
    at_limit = WorkerSettings(role="colocated", worker_id="up", insecure_control_plane=True,
                              max_model_len=4096)
    up = UpSettings(port=free_port(), device="cpu", insecure_control_plane=True, worker=at_limit)
    assert launcher.up_refusal(up, config) is None


@pytest.mark.parametrize(("backend", "device", "gpus", "interpret", "message"), [
    ("flash_attn", "cpu", 0, "1", "flash_attn backend needs CUDA, got device cpu"),
    ("flash_attn", "auto", 0, "1", "flash_attn backend needs CUDA, got device cpu"),
    ("triton", "cpu", 0, "0", "triton backend needs CUDA (or TRITON_INTERPRET=1), got device cpu"),
    ("flash_attn", "cuda", 1, "0",
     "flash_attn backend requested but the flash_attn package is not installed"),
])
def test_up_refuses_an_attention_backend_the_workers_device_cannot_run(
        backend: str, device: str, gpus: int, interpret: str, message: str, tmp_path, monkeypatch,
        capsys) -> None:
    """A new operator's trial: ``pdserve up --attention-backend flash_attn`` on a CPU-only host started every
    process; each worker then said ``flash_attn backend needs CUDA, got device cpu``. (The flash_attn
    package is made absent for the last case.)"""
    import engine.config

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(engine.config, "flash_attn_available", lambda: False)
    _refused_through_the_cli(["--model", "tiny-llama", "--device", device, "--attention-backend", backend],
                             monkeypatch, gpus)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"pdserve up: --attention-backend {backend}: {message}"


@pytest.mark.parametrize(("backend", "device", "gpus", "interpret"), [
    ("torch", "cpu", 0, "0"), ("auto", "auto", 0, "0"), ("triton", "cpu", 0, "1"), ("triton", "auto", 1, "0"),
    ("flash_attn", "cuda:0", 1, "0"),
])
def test_up_takes_an_attention_backend_the_device_runs(backend: str, device: str, gpus: int, interpret: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.config
    from pdserve import launcher

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(engine.config, "flash_attn_available", lambda: True)
    monkeypatch.setattr(launcher, "gpu_count", lambda: gpus)
    worker = WorkerSettings(role="colocated", worker_id="up", insecure_control_plane=True,
                            attention_backend=backend)
    up = UpSettings(port=free_port(), device=device, insecure_control_plane=True, worker=worker)
    assert launcher.up_refusal(up) is None


_PHI3_LONGROPE = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 64,
                  "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": 1024, "original_max_position_embeddings": 512,
                  "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                                   "long_factor": [4.0] * 4},
                  "partial_rotary_factor": 0.5}


@pytest.mark.parametrize(("config", "max_model_len", "message"), [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 64,
      "max_position_embeddings": 512, "sliding_window": 64}, None,
     "sliding_window=64 < max_model_len=512: sliding-window attention is not supported"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 64,
      "max_position_embeddings": 512, "sliding_window": 64}, 65, "sliding_window=64 < max_model_len=65"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 64,
      "max_position_embeddings": 512, "sliding_window": 64}, 64, None),
    # Qwen2's window counts only with use_sliding_window, as transformers reads the config
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 64,
      "max_position_embeddings": 512, "sliding_window": 64, "use_sliding_window": False}, None, None),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 64,
      "max_position_embeddings": 512, "sliding_window": 64, "use_sliding_window": True}, None,
     "sliding_window=64 < max_model_len=512"),
    (_PHI3_LONGROPE, None,
     "rope_scaling longrope with max_model_len=1024 > original_max_position_embeddings=512"),
    (_PHI3_LONGROPE, 512, None),
])
def test_up_refuses_a_context_beyond_the_models_window_or_longrope(config, max_model_len, message) -> None:
    """A new operator's trial: ``pdserve up`` on a model whose sliding window (or LongRoPE's original
    context) is shorter than its positions started every process; each worker then refused the model
    after loading it. The launcher now refuses it from config.json, naming the model and the flag."""
    from pdserve import launcher

    worker = WorkerSettings(role="colocated", worker_id="up", insecure_control_plane=True,
                            max_model_len=max_model_len)
    up = UpSettings(model="m", port=free_port(), device="cpu", insecure_control_plane=True, worker=worker)
    why = launcher.up_refusal(up, config)
    if message is None:
        assert why is None
    else:
        assert why is not None and why.startswith(f"--model m: {message}")
        assert why.endswith("(--max-model-len)")


def test_up_refuses_a_sliding_window_model_through_the_cli(tmp_path, monkeypatch, capsys) -> None:
    """The same refusal as a user meets it: one line, exit 2, no child started."""
    import json

    config = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 64,
              "max_position_embeddings": 512, "sliding_window": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _refused_through_the_cli(["--model", str(tmp_path), "--device", "cpu"], monkeypatch)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"pdserve up: --model {tmp_path}: sliding_window=64 < max_model_len=512: sliding-window "
                    "attention is not supported (every token would attend to the whole sequence); set "
                    "max_model_len <= 64 (--max-model-len)")


def test_the_context_check_imports_neither_transformers_nor_torch() -> None:
    """The launcher's context check read the config through transformers, which loaded torch into
    ``pdserve up`` itself (seconds on 2 cores, held for the supervisor's life); it reads the dict."""
    import subprocess
    import sys

    code = ("import sys; from engine.models.context_limits import context_problem; "
            "print(context_problem({'max_position_embeddings': 512.0, 'sliding_window': 64}, None)); "
            "print('transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["sliding_window=64 < max_model_len=512: sliding-window attention is not "
                                "supported (every token would attend to the whole sequence); set "
                                "max_model_len <= 64", "False False"]


_LLAMA_8K = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
             "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 8192}


def test_up_refuses_a_max_model_len_beyond_the_kv_cache_of_explicit_blocks(tmp_path, monkeypatch,
                                                                           capsys) -> None:
    """A new-user trial: ``pdserve up --max-model-len 4096 --num-blocks 64`` started with no message and
    served 1024 tokens (64 blocks x 16): the engine cut the explicit length to the KV cache's capacity.
    The launcher now refuses it (the workers do too, ``tests/engine/test_kv_capacity.py``); a length
    at the capacity, or none (the workers cap it), is taken."""
    import json

    from pdserve import launcher

    (tmp_path / "config.json").write_text(json.dumps(_LLAMA_8K))
    _refused_through_the_cli(["--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                              "--max-model-len", "4096", "--num-blocks", "64"], monkeypatch)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == ("pdserve up: --max-model-len 4096 exceeds the KV cache's capacity of 1024 tokens "
                    "(--num-blocks 64 x --block-size 16; one sequence's KV must fit a worker's cache): lower "
                    "--max-model-len or raise --num-blocks")
    for max_model_len, num_blocks, block_size in ((1024, 64, 16), (None, 64, 16), (4096, None, 16),
                                                  (4096, 128, 32)):
        worker = WorkerSettings(role="colocated", worker_id="up", insecure_control_plane=True,
                                max_model_len=max_model_len, num_blocks=num_blocks, block_size=block_size)
        up = UpSettings(port=free_port(), device="cpu", insecure_control_plane=True, worker=worker)
        assert launcher.up_refusal(up, _LLAMA_8K) is None


@pytest.mark.parametrize("off", [["--enable-prefix-caching", "false"], ["--decode-prefix-reuse", "false"]])
def test_up_refuses_a_host_kv_tier_without_the_prefix_cache(off: list[str], tmp_path, monkeypatch,
                                                            capsys) -> None:
    """A new-user trial: ``pdserve up --enable-prefix-caching false --kv-host-cache-gib 0.5`` started
    everything, then the workers failed with ``host_kv_bytes needs enable_prefix_caching`` (the engine's
    field names), exit 1 (``--decode-prefix-reuse false`` did the same to the decode workers). Now one line
    naming both flags, exit 2, before any child; a worker refuses it the same way itself (and the engine's
    own check names the flags too)."""
    import sys

    from engine.config import CacheConfig
    from pdserve.cli import main

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    _refused_through_the_cli(["--model", "tiny-llama", "--device", "cpu", "--kv-host-cache-gib", "0.5", *off],
                             monkeypatch)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pdserve up: --kv-host-cache-gib: the host KV tier holds blocks evicted from the "
                           "prefix cache") and f"{off[0]} true" in line, line
    roles = ["prefill", "colocated", "decode"] if off[0] == "--enable-prefix-caching" else ["decode"]
    for module in ("prefill_worker.main", "decode_worker.main", "workers.colocated"):
        monkeypatch.setitem(sys.modules, module, None)  # no worker may start
    for role in roles:
        assert main([role, "--kv-host-cache-gib", "0.5", *off, "--insecure-control-plane"]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"pdserve {role}: --kv-host-cache-gib: ") and f"{off[0]} true" in line, line
    with pytest.raises(ValueError, match=r"^host_kv_bytes \(--kv-host-cache-gib\) needs "
                                         r"enable_prefix_caching \(--enable-prefix-caching true; on a decode "
                                         r"worker also "
                                         r"--decode-prefix-reuse true\)"):
        CacheConfig(host_kv_bytes=1 << 20, enable_prefix_caching=False)


_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 256,
              "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
              "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
              "num_experts_per_tok": 2, "max_position_embeddings": 512}


def test_up_refuses_a_model_the_tensor_parallel_ranks_cannot_split(tmp_path, monkeypatch, capsys) -> None:
    """A new-user trial: ``pdserve up --model <qwen3-moe> --tensor-parallel-size 2 --colocated 1`` started
    the worker, whose second rank printed a multiprocessing traceback (mixtures of experts are not
    supported with tensor parallelism), exit 1. The launcher now refuses it from config.json; a dense model
    whose heads the ranks cannot split too, and one they can is taken."""
    import json

    from pdserve import launcher

    (tmp_path / "config.json").write_text(json.dumps(_QWEN3_MOE))
    _refused_through_the_cli(["--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                              "--tensor-parallel-size", "2", "--num-prefill", "0", "--num-decode", "0",
                              "--colocated", "1"], monkeypatch)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"pdserve up: --model {tmp_path}: --tensor-parallel-size 2: mixtures of experts "
                    "(Qwen3MoeForCausalLM) are not supported with tensor parallelism yet; use "
                    "--tensor-parallel-size 1")

    def refusal(config: dict, size: int) -> str | None:
        worker = WorkerSettings(role="colocated", worker_id="up", insecure_control_plane=True,
                                tensor_parallel_size=size)
        return launcher.up_refusal(UpSettings(model="m", port=free_port(), device="cpu",
                                              insecure_control_plane=True, worker=worker), config)

    assert refusal(_LLAMA_8K, 3) == ("--model m: --tensor-parallel-size 3 does not divide "
                                     "num_attention_heads=4")
    assert refusal({**_LLAMA_8K, "architectures": ["Phi3ForCausalLM"]}, 2).startswith(
        "--model m: --tensor-parallel-size 2: Phi3ForCausalLM is not supported with tensor parallelism")
    assert refusal(_LLAMA_8K, 2) is None and refusal(_QWEN3_MOE, 1) is None


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_worker_refuses_a_model_its_ranks_cannot_split_in_one_line(tmp_path, log_format: str) -> None:
    """The same trial's worker, started on its own: one line naming the flag, exit 2, no rank started (no
    multiprocessing traceback), the model's weights never read. With ``--log-format json`` (what a
    Kubernetes or docker-compose deployment runs workers with) that line is a JSON log event with the
    same words."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps(_QWEN3_MOE))
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "colocated", "--model", str(tmp_path),
                           "--load-format", "dummy", "--device", "cpu", "--tensor-parallel-size", "2",
                           "--insecure-control-plane", "--log-format", log_format], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    why = (f"--model {tmp_path}: --tensor-parallel-size 2: mixtures of experts (Qwen3MoeForCausalLM) are not "
           "supported with tensor parallelism yet; use --tensor-parallel-size 1")
    if log_format == "text":
        assert line == f"pdserve colocated: {why}", proc.stderr
    else:
        event = json.loads(line)
        assert (event["logger"], event["level"], event["msg"], event["refused"]) == (
            "pdserve.colocated", "error", why, "colocated"), proc.stderr


# 64 layers x K,V x 8 KV heads x 128 x 4 bytes (float32 on the CPU): 524288 bytes a token; the KV budget on
# the CPU, 0.9 x 1 GiB = 966367641 bytes, holds 1843 tokens of it
_LLAMA_WIDE_KV = {**_LLAMA_8K, "num_hidden_layers": 64, "hidden_size": 1024, "num_attention_heads": 8,
                  "num_key_value_heads": 8, "head_dim": 128}


def test_up_refuses_a_block_size_no_block_of_which_fits_before_any_child(tmp_path, monkeypatch,
                                                                          capsys) -> None:
    """A new-user trial: ``pdserve up --device cpu --block-size 100000`` started every process, then both
    workers failed ``KV cache budget of 966367641 bytes holds no block``, exit 1. The launcher now refuses
    a block longer than any sequence (the model's positions, or --max-model-len), and on the CPU a block
    larger than the KV budget, in one line, exit 2."""
    import json

    from pdserve import launcher

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    _refused_through_the_cli(["--model", "tiny-llama", "--device", "cpu", "--block-size", "100000"],
                             monkeypatch)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == ("pdserve up: --block-size 100000 exceeds the model's max_position_embeddings (4096): a "
                    "KV block holds one sequence's tokens, so it could never be filled; use at most 4096")
    _refused_through_the_cli(["--model", "tiny-llama", "--device", "cpu", "--block-size", "1024",
                              "--max-model-len", "512"], monkeypatch)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pdserve up: --block-size 1024 exceeds --max-model-len 512: "), line
    (tmp_path / "config.json").write_text(json.dumps(_LLAMA_WIDE_KV))
    _refused_through_the_cli(["--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                              "--block-size", "2048"], monkeypatch)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == ("pdserve up: --block-size 2048: one KV block takes 1073741824 bytes (524288 per token), "
                    "more than the KV cache budget on the CPU, 966367641 bytes (--kv-memory-fraction 0.9 of "
                    "1 GiB); at most 1843 tokens per block fit")

    def refusal(device: str, gpus: int, **worker_flags: object) -> str | None:
        monkeypatch.setattr(launcher, "gpu_count", lambda: gpus)
        worker = WorkerSettings(role="colocated", worker_id="up", insecure_control_plane=True,
                                **worker_flags)  # type: ignore[arg-type]
        return launcher.up_refusal(UpSettings(model="m", port=free_port(), device=device,
                                              insecure_control_plane=True, worker=worker), _LLAMA_WIDE_KV)

    assert refusal("cpu", 0, block_size=1843) is None  # the largest block that fits
    assert refusal("cpu", 0, block_size=1844) is not None
    assert refusal("auto", 0, block_size=2048) is not None  # auto without a GPU is the CPU
    assert refusal("cpu", 0, block_size=2048, dtype="bfloat16") is None  # 2 bytes an element
    assert refusal("cpu", 0, block_size=2048, kv_memory_fraction=0.5) is not None
    assert refusal("cpu", 0, block_size=4096, num_blocks=2) is None  # an explicit count: no budget
    # on CUDA the budget is the free memory when the worker starts: only the sequence bound is known
    assert refusal("auto", 1, block_size=8192) is None
    assert refusal("cuda", 1, block_size=8193) is not None
    assert refusal("cpu", 0, block_size=16, max_model_len=8) is not None


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
@pytest.mark.parametrize(("flags", "message"), [
    (["--max-model-len", "100000"],
     "--max-model-len 100000: max_model_len=100000 exceeds the model's max_position_embeddings=4096"),
    (["--block-size", "100000"],
     "--block-size 100000 exceeds the model's max_position_embeddings (4096): a KV block holds one "
     "sequence's tokens, so it could never be filled; use at most 4096"),
])
def test_a_worker_refuses_what_the_models_config_rules_out_before_loading_weights(
        role: str, flags: list[str], message: str, tmp_path, monkeypatch, capsys) -> None:
    """A new-user trial: ``pdserve prefill --device cpu --max-model-len 100000`` loaded the weights, then
    failed with exit 1; ``pdserve up`` refuses it before starting anything, exit 2. Each worker role now
    refuses it from the model's config.json before building its engine: one line, exit 2."""
    import workers.boot
    from pdserve.cli import main

    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine was built (weights loaded) before the refusal")

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(workers.boot, "build_core", no_engine)
    assert main([role, "--model", "tiny-llama", "--device", "cpu", *flags, "--insecure-control-plane"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"pdserve {role}: {message}"]
