"""``pdserve up``'s child plan, which needs no model: each child's command line and environment
(flags passed on, ports, keys, GPU placement and tensor parallel GPU sets), the refusals of settings
the plan cannot honour, and the example request. Refusals before any child starts:
test_up_refusals.py; the supervisor: test_supervisor.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtransfer.curve import generate_keys
from pdserve.launcher import example, keys_from_env, plan, run_keys
from pdserve.ports import free_port
from pdserve.supervisor import Supervisor
from protocol.settings import GatewaySettings, UpSettings, WorkerSettings


def test_plan_starts_gateway_first_and_binds_loopback() -> None:
    children = plan(UpSettings(port=9001, num_prefill=1, num_decode=2, colocated=1), control_port=7777,
                    keys_dir="/keys")
    names = [n for n, _ in children]
    assert names == ["gateway", "prefill-0", "decode-0", "decode-1", "colocated-0"]
    gateway = children[0][1]
    assert gateway[gateway.index("--host") + 1] == "127.0.0.1"
    assert gateway[gateway.index("--control-bind") + 1] == "tcp://127.0.0.1:7777"
    for name, args in children[1:]:
        assert args[args.index("--gateway-control") + 1] == "tcp://127.0.0.1:7777"
        assert args[args.index("--host") + 1] == "127.0.0.1"
        assert ("--transfer-backend" in args) == (not name.startswith("colocated"))
    assert "--tool-call-parser" not in gateway  # the default (auto) needs no flag
    given = GatewaySettings(tool_call_parser="hermes", reasoning_parser="qwen3", insecure_control_plane=True)
    parsers = plan(UpSettings(gateway=given), control_port=7777, keys_dir="/k")[0][1]
    assert parsers[parsers.index("--tool-call-parser") + 1] == "hermes"
    assert parsers[parsers.index("--reasoning-parser") + 1] == "qwen3"


def test_plan_with_several_gateway_processes_gives_every_worker_each_control_port() -> None:
    children = plan(UpSettings(port=9001, gateway_workers=3), control_port=7700, keys_dir="/keys")
    gateway = children[0][1]
    assert gateway[gateway.index("--workers") + 1] == "3"
    assert gateway[gateway.index("--control-bind") + 1] == "tcp://127.0.0.1:7700"
    want = "tcp://127.0.0.1:7700,tcp://127.0.0.1:7701,tcp://127.0.0.1:7702"
    for _, args in children[1:]:
        assert args[args.index("--gateway-control") + 1] == want
    assert "--workers" not in plan(UpSettings(port=9001), control_port=7700, keys_dir="/keys")[0][1]


@pytest.mark.parametrize(("kw", "flag"), [({"gateway_workers": 0}, "gateway-workers"),
                                          ({"gateway_workers": 65}, "gateway-workers"),
                                          ({"gateway_workers": 2, "port": 0}, "port")])
def test_up_refuses_bad_gateway_workers(kw: dict[str, int], flag: str) -> None:
    with pytest.raises(ValueError, match=f"--{flag}"):
        UpSettings(**kw)  # type: ignore[arg-type]


def test_plan_passes_the_gateway_and_worker_flags_given_to_up() -> None:
    """Every flag given to ``up`` reaches its child: the gateway's (host too) to the gateway, the workers'
    to every worker; the API key never on a command line; each child's argv parses back to the same
    settings."""
    from pdserve.cli import build_parser
    from protocol.settings import GatewaySettings, WorkerSettings, settings_from_args
    from workers.setup import engine_config_from_settings

    given = ["up", "--host", "0.0.0.0", "--model-name", "m1", "--api-key", "secret", "--max-retries", "0",
             "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "512", "--pdl", "false",
             "--quantization", "fp8", "--num-decode", "2", "--enable-prefix-caching", "false",
             "--insecure-control-plane"]
    up = settings_from_args(build_parser({}).parse_args(given))
    assert isinstance(up, UpSettings)
    children = plan(up, control_port=7777)
    assert all("secret" not in args for _, args in children)
    for name, args in children:
        child = settings_from_args(build_parser({}).parse_args(args))
        if name == "gateway":
            assert isinstance(child, GatewaySettings)
            assert (child.host, child.model_name, child.max_retries) == ("0.0.0.0", "m1", 0)
        else:
            assert isinstance(child, WorkerSettings)
            assert (child.dtype, child.max_num_seqs, child.max_model_len) == ("float32", 8, 512)
            assert child.pdl is False and child.quantization == "fp8"
            assert engine_config_from_settings(child).model.quantization == "fp8"
            assert child.enable_prefix_caching is False
            assert engine_config_from_settings(child).cache.enable_prefix_caching is False
            assert (child.host, child.port) == ("127.0.0.1", 0)  # internal sockets stay on loopback


def test_decode_prefix_reuse_flag_reaches_decode_workers_only_and_other_roles_refuse_it() -> None:
    """``--decode-prefix-reuse`` is a decode worker's flag: ``up`` passes it to its decode workers (their
    engines then keep no prefix cache) and to no other child; ``pdserve prefill`` / ``colocated`` refuse
    it before anything starts."""
    from pdserve.cli import build_parser
    from protocol.settings import WorkerSettings, settings_from_args
    from workers.setup import engine_config_from_settings

    up = settings_from_args(build_parser({}).parse_args(
        ["up", "--decode-prefix-reuse", "false", "--colocated", "1", "--insecure-control-plane"]))
    assert isinstance(up, UpSettings)
    for name, args in plan(up, control_port=7777)[1:]:
        assert ("--decode-prefix-reuse" in args) == name.startswith("decode"), name
        child = settings_from_args(build_parser({}).parse_args(args))
        assert isinstance(child, WorkerSettings)
        assert engine_config_from_settings(child).cache.enable_prefix_caching == (child.role != "decode")
    decode = settings_from_args(build_parser({}).parse_args(["decode", "--insecure-control-plane"]))
    assert isinstance(decode, WorkerSettings) and decode.decode_prefix_reuse
    for role in ("prefill", "colocated"):
        with pytest.raises(SystemExit):
            build_parser({}).parse_args([role, "--decode-prefix-reuse", "false", "--insecure-control-plane"])


def test_up_without_decode_workers_takes_a_host_kv_tier_beside_decode_prefix_reuse_false() -> None:
    """``--decode-prefix-reuse`` applies to decode workers only, so ``up --num-prefill 0 --num-decode 0
    --colocated 1 --decode-prefix-reuse false --kv-host-cache-gib 0.5`` (no decode worker) is taken and
    its colocated worker gets the tier; with decode workers the pair is refused naming the flags (once
    refused for every role)."""
    from pdserve.cli import build_parser
    from protocol.settings import WorkerSettings, settings_from_args
    from workers.setup import engine_config_from_settings

    flags = ["--decode-prefix-reuse", "false", "--kv-host-cache-gib", "0.5", "--insecure-control-plane"]
    up = settings_from_args(build_parser({}).parse_args(["up", "--num-prefill", "0", "--num-decode", "0",
                                                             "--colocated", "1", *flags]))
    assert isinstance(up, UpSettings) and up.worker.kv_host_cache_gib == 0.5
    [(name, args)] = plan(up, control_port=7777)[1:]
    child = settings_from_args(build_parser({}).parse_args(args))
    assert isinstance(child, WorkerSettings) and child.role == "colocated", name
    assert engine_config_from_settings(child).cache.host_kv_bytes == 1 << 29
    with pytest.raises(ValueError, match=r"^--kv-host-cache-gib: .*--decode-prefix-reuse true"):
        settings_from_args(build_parser({}).parse_args(["up", "--num-prefill", "1", "--num-decode", "1",
                                                        *flags]))


def test_up_passes_the_host_kv_tier_and_refuses_more_than_the_host_holds() -> None:
    """``--kv-host-cache-gib`` given to ``up`` reaches every worker (as bytes in its engine config); a
    budget summed over up's workers at or above this host's memory, a negative one and one with tensor
    parallelism are refused with the flag named."""
    from pdserve.cli import build_parser
    from protocol.settings import GIB, WorkerSettings, physical_memory_bytes, settings_from_args
    from workers.setup import engine_config_from_settings

    up = settings_from_args(build_parser({}).parse_args(
        ["up", "--num-decode", "2", "--kv-host-cache-gib", "0.5", "--insecure-control-plane"]))
    assert isinstance(up, UpSettings)
    for _, args in plan(up, control_port=7777)[1:]:
        child = settings_from_args(build_parser({}).parse_args(args))
        assert isinstance(child, WorkerSettings) and child.kv_host_cache_gib == 0.5
        assert engine_config_from_settings(child).cache.host_kv_bytes == GIB // 2
    assert engine_config_from_settings(WorkerSettings(role="decode", insecure_control_plane=True)
                                       ).cache.host_kv_bytes == 0
    third = physical_memory_bytes() / GIB / 3 + 0.01  # one worker fits, three do not
    WorkerSettings(role="prefill", kv_host_cache_gib=third, insecure_control_plane=True)
    with pytest.raises(ValueError, match="--kv-host-cache-gib: 3 workers x"):
        settings_from_args(build_parser({}).parse_args(
            ["up", "--kv-host-cache-gib", str(third), "--colocated", "3", "--num-prefill", "0",
             "--num-decode", "0", "--insecure-control-plane"]))
    for kw in ({"kv_host_cache_gib": -1.0}, {"kv_host_cache_gib": physical_memory_bytes() / GIB},
               {"kv_host_cache_gib": 1.0, "tensor_parallel_size": 2, "role": "colocated"}):
        with pytest.raises(ValueError, match="--kv-host-cache-gib"):
            WorkerSettings(**{"role": "decode", "insecure_control_plane": True, **kw})  # type: ignore[arg-type]


def test_plan_gives_each_worker_its_own_metrics_port() -> None:
    """``up`` assigns every worker a ``--metrics-port`` (its /metrics, /health, /live); a worker flag such as
    ``--engine-stall-timeout`` given to ``up`` reaches every worker; ``--metrics-port`` is up's own."""
    from pdserve.cli import build_parser
    from protocol.settings import WorkerSettings, settings_from_args

    up = settings_from_args(build_parser({}).parse_args(
        ["up", "--num-decode", "2", "--engine-stall-timeout", "90s", "--insecure-control-plane"]))
    assert isinstance(up, UpSettings)
    children = plan(up, control_port=7777, metrics_ports=[9101, 9102, 9103])
    ports = []
    for _, args in children[1:]:
        child = settings_from_args(build_parser({}).parse_args(args))
        assert isinstance(child, WorkerSettings) and child.engine_stall_timeout == 90.0
        ports.append(child.metrics_port)
    assert ports == [9101, 9102, 9103]
    assert "--metrics-port" not in children[0][1]
    with pytest.raises(ValueError, match="metrics ports"):
        plan(up, control_port=7777, metrics_ports=[9101])
    with pytest.raises(SystemExit):  # up sets each worker's metrics port itself
        build_parser({}).parse_args(["up", "--metrics-port", "9100"])


def test_up_settings_from_env_do_not_leak_into_children(tmp_path: Path) -> None:
    """``PDSERVE_PORT=18000 pdserve up`` (the HTTP port) reaches the children's environment: each child's
    command line must still give every worker a free KV port (``--port 0``), not 18000 (the gateway's
    port: the first worker died with "Address already in use" before)."""
    from pdserve.cli import build_parser
    from protocol.settings import GatewaySettings, WorkerSettings, settings_from_args

    env = {"PDSERVE_PORT": "18000", "PDSERVE_MODEL": "tiny-llama", "PDSERVE_NUM_DECODE": "2"}
    up = settings_from_args(build_parser(env).parse_args(["up"]))
    assert isinstance(up, UpSettings) and (up.port, up.num_decode) == (18000, 2)
    generate_keys(tmp_path / "keys")
    for name, args in plan(up, control_port=7777, keys_dir=str(tmp_path / "keys")):
        assert args[args.index("--curve-keys") + 1] == str(tmp_path / "keys")
        child = settings_from_args(build_parser(env).parse_args(args))
        if name == "gateway":
            assert isinstance(child, GatewaySettings) and child.port == 18000
        else:
            assert isinstance(child, WorkerSettings) and (child.port, child.model) == (0, "tiny-llama")


def test_example_request_is_valid_json_body() -> None:
    import json
    import shlex

    words = shlex.split(example("http://127.0.0.1:8000", "smollm2-135m"))
    body = json.loads(words[words.index("-d") + 1])
    assert body["model"] == "smollm2-135m" and body["messages"][0]["role"] == "user"
    assert not any(w.startswith("Authorization") for w in words)
    words = shlex.split(example("http://127.0.0.1:8000", "mymodel", needs_key=True, key_in_env=True))
    assert json.loads(words[words.index("-d") + 1])["model"] == "mymodel"
    assert "Authorization: Bearer $PDSERVE_API_KEY" in words  # the shell expands it when run
    # a key from --api-key: the user's shell has no such variable (or another key in it)
    words = shlex.split(example("http://127.0.0.1:8000", "mymodel", needs_key=True))
    assert "Authorization: Bearer <a key given to --api-key>" in words


def test_the_example_names_the_variable_only_when_it_holds_the_key() -> None:
    assert keys_from_env(("k1",), {"PDSERVE_API_KEY": "k1"})
    assert not keys_from_env(("b",), {"PDSERVE_API_KEY": "a"})  # --api-key b replaced the variable's a
    assert not keys_from_env(("b",), {})
    assert not keys_from_env(("a", "b"), {"PDSERVE_API_KEY": "a,b"})  # "$PDSERVE_API_KEY" would be "a,b"
    assert not keys_from_env((), {"PDSERVE_API_KEY": ""})


def test_plan_places_one_worker_per_gpu_and_shares_when_short() -> None:
    def devices(n_gpus: int, device: str = "auto") -> list[tuple[str, str | None]]:
        out = []
        for _, args in plan(UpSettings(device=device, num_prefill=1, num_decode=2), 7777, n_gpus, "/k")[1:]:
            frac = args[args.index("--kv-memory-fraction") + 1] if "--kv-memory-fraction" in args else None
            out.append((args[args.index("--device") + 1], frac))
        return out

    assert devices(0) == [("auto", None)] * 3  # CPU host: the workers resolve the device themselves
    assert devices(4) == [("cuda:0", "0.9"), ("cuda:1", "0.9"), ("cuda:2", "0.9")]
    assert devices(2) == [("cuda:0", "0.425"), ("cuda:1", "0.425"), ("cuda:0", "0.425")]
    assert devices(4, "cpu") == [("cpu", None)] * 3  # an explicit device is kept as given


def test_plan_gives_each_tensor_parallel_worker_gpus_of_its_own() -> None:
    from pdserve.cli import build_parser
    from pdserve.placement import worker_envs
    from protocol.settings import settings_from_args

    up = settings_from_args(build_parser({}).parse_args(
        ["up", "--tensor-parallel-size", "2", "--num-decode", "2", "--insecure-control-plane"]))
    assert isinstance(up, UpSettings)
    workers = plan(up, 7777, num_gpus=8)[1:]
    assert [name for name, _ in workers] == ["prefill-0", "decode-0", "decode-1"]
    for _, args in workers:  # rank r takes cuda:r of the GPUs the worker is shown
        assert args[args.index("--device") + 1] == "cuda"
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
    # its own GPUs first (rank r on cuda:r), then the others, which CUDA IPC to its peers needs to see
    assert worker_envs(up, 6) == {"prefill-0": {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"},
                                  "decode-0": {"CUDA_VISIBLE_DEVICES": "2,3,0,1,4,5"},
                                  "decode-1": {"CUDA_VISIBLE_DEVICES": "4,5,0,1,2,3"}}
    # the launcher's own CUDA_VISIBLE_DEVICES is honoured: its GPU k is the k-th entry
    assert worker_envs(up, 6, "7,6,5,4,3,2") == {"prefill-0": {"CUDA_VISIBLE_DEVICES": "7,6,5,4,3,2"},
                                                 "decode-0": {"CUDA_VISIBLE_DEVICES": "5,4,7,6,3,2"},
                                                 "decode-1": {"CUDA_VISIBLE_DEVICES": "3,2,7,6,5,4"}}
    assert worker_envs(up, 6, "GPU-a,GPU-b,GPU-c,GPU-d,GPU-e,GPU-f")["decode-1"] == {
        "CUDA_VISIBLE_DEVICES": "GPU-e,GPU-f,GPU-a,GPU-b,GPU-c,GPU-d"}
    assert worker_envs(up, 7)["decode-1"] == {"CUDA_VISIBLE_DEVICES": "4,5,0,1,2,3,6"}  # a spare GPU too
    # one rank per worker keeps sharing GPUs as before, with no CUDA_VISIBLE_DEVICES of its own
    one = UpSettings(num_prefill=1, num_decode=2, insecure_control_plane=True)
    assert worker_envs(one, 2) == {"prefill-0": {}, "decode-0": {}, "decode-1": {}}
    # CPU host: no GPUs, nothing placed; the workers run their ranks on the CPU as before
    assert worker_envs(up, 0) == {"prefill-0": {}, "decode-0": {}, "decode-1": {}}
    assert all(args[args.index("--device") + 1] == "auto" for _, args in plan(up, 7777, 0)[1:])


def test_one_worker_draws_the_weight_loading_progress_bar() -> None:
    """Found by a new-user trial: two workers' "Loading weights" bars overwrote each other on one line."""
    from pdserve.launcher import progress_bar_envs

    quiet = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    assert progress_bar_envs(["prefill-0", "decode-0", "decode-1"]) == {
        "prefill-0": {}, "decode-0": quiet, "decode-1": quiet}
    assert progress_bar_envs(["colocated-0"]) == {"colocated-0": {}}


def test_placements_refuse_ranks_the_gpus_cannot_hold() -> None:
    from pdserve.placement import Placement, placements

    assert placements("auto", [2, 1, 3], 6) == [
        Placement(("--device", "cuda", "--kv-memory-fraction", "0.9"), (0, 1)),
        Placement(("--device", "cuda", "--kv-memory-fraction", "0.9"), (2,)),
        Placement(("--device", "cuda", "--kv-memory-fraction", "0.9"), (3, 4, 5))]
    with pytest.raises(ValueError, match=r"--tensor-parallel-size: 3 workers need 6 GPUs .*5 visible"):
        placements("cuda", [2, 2, 2], 5)
    with pytest.raises(ValueError, match="--device cuda:1 names one GPU"):
        placements("cuda:1", [2, 2], 8)
    assert placements("cpu", [2, 2], 8) == [Placement(("--device", "cpu"))] * 2
    tp2 = WorkerSettings(role="colocated", tensor_parallel_size=2, insecure_control_plane=True)
    up = UpSettings(worker=tp2, insecure_control_plane=True)
    with pytest.raises(ValueError, match="need 4 GPUs"):
        plan(up, 7777, num_gpus=3)


def test_cpu_workers_share_the_cores_out_and_an_explicit_cpu_threads_wins() -> None:
    """On the CPU each worker's ranks get an equal share of the launcher's cores (at least one thread
    each); on GPUs, or without a core count, no ``--cpu-threads``; ``--cpu-threads`` given to ``up``
    comes later in each worker's argv and reaches its settings."""
    from pdserve.cli import build_parser
    from pdserve.placement import Placement, placements
    from protocol.settings import settings_from_args

    assert placements("cpu", [1, 1], 0, cpu_cores=16) == [
        Placement(("--device", "cpu", "--cpu-threads", "8"))] * 2
    assert placements("auto", [2, 2, 2], 0, cpu_cores=16) == [
        Placement(("--device", "auto", "--cpu-threads", "2"))] * 3  # 6 ranks: 16 // 6
    assert placements("auto", [1, 1, 1], 0, cpu_cores=2) == [
        Placement(("--device", "auto", "--cpu-threads", "1"))] * 3
    assert placements("auto", [1, 1], 2, cpu_cores=16) == [
        Placement(("--device", f"cuda:{i}", "--kv-memory-fraction", "0.9")) for i in range(2)]  # GPUs
    assert placements("cuda:1", [1], 2, cpu_cores=16) == [Placement(("--device", "cuda:1"))]
    assert placements("cpu", [1, 1], 0) == [Placement(("--device", "cpu"))] * 2  # no core count given
    up = UpSettings(num_prefill=1, num_decode=1, colocated=1, insecure_control_plane=True)
    for _, argv in plan(up, 7777, 0, cpu_cores=4)[1:]:
        child = settings_from_args(build_parser({}).parse_args(argv))
        assert isinstance(child, WorkerSettings) and child.cpu_threads == 1  # 4 cores, 3 workers
    given = settings_from_args(build_parser({}).parse_args(
        ["up", "--cpu-threads", "3", "--insecure-control-plane"]))
    assert isinstance(given, UpSettings)
    for _, argv in plan(given, 7777, 0, cpu_cores=16)[1:]:
        child = settings_from_args(build_parser({}).parse_args(argv))
        assert isinstance(child, WorkerSettings) and child.cpu_threads == 3
    with pytest.raises(ValueError, match="--cpu-threads"):
        WorkerSettings(role="decode", cpu_threads=-1, insecure_control_plane=True)
    from pdserve.placement import usable_cores

    assert usable_cores() == len(os.sched_getaffinity(0))  # what up shares out on this Linux host


def test_up_gives_every_child_one_private_per_run_key_pair_or_the_insecure_flag(tmp_path: Path) -> None:
    """Without --curve-keys, ``pdserve up`` makes a key pair in a private (0700) temp dir for the run and
    removes it afterwards; --insecure-control-plane reaches every child instead of keys."""
    import stat

    from kvtransfer.curve import KEY_FILE, load_keys

    with run_keys(UpSettings()) as keys_dir:
        assert keys_dir is not None
        assert stat.S_IMODE(Path(keys_dir).stat().st_mode) == 0o700
        load_keys(keys_dir)
        children = plan(UpSettings(), 7777, 0, keys_dir)
        assert all(args[args.index("--curve-keys") + 1] == keys_dir for _, args in children)
    assert not (Path(keys_dir) / KEY_FILE).exists()
    with run_keys(UpSettings(insecure_control_plane=True)) as none:
        assert none is None
        children = plan(UpSettings(insecure_control_plane=True), 7777, 0, none)
        assert all("--insecure-control-plane" in args and "--curve-keys" not in args for _, args in children)


def test_up_starts_each_tensor_parallel_worker_with_its_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pdserve up`` hands each worker a ``CUDA_VISIBLE_DEVICES`` that starts with its GPU set (kept for
    restarts: ``Supervisor.envs``); the gateway gets none."""
    from pdserve import launcher

    started: dict[str, dict[str, str]] = {}

    def start(self: Supervisor, name: str, args: list[str], log_path: str | None = None,
              env: dict[str, str] | None = None) -> None:
        started[name] = dict(env or {})

    monkeypatch.setattr(launcher, "gpu_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setattr(Supervisor, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", lambda *a, **k: "interrupted")
    tp2 = WorkerSettings(role="colocated", tensor_parallel_size=2, insecure_control_plane=True)
    up = UpSettings(port=free_port(), insecure_control_plane=True, worker=tp2)
    assert launcher._supervise(up, Supervisor(), [], 1.0, None) == 0
    assert started == {"gateway": {}, "prefill-0": {"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
                       "decode-0": {"CUDA_VISIBLE_DEVICES": "6,7,4,5", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}}


def test_up_hands_its_keys_to_the_gateway_in_its_environment_and_nothing_without(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway child gets ``PDSERVE_API_KEY`` with up's keys, which its parser reads back to the same
    keys; without keys it gets no variable at all (an empty one is refused by the gateway, not read as "no
    key"), and the workers never get one."""
    from pdserve import launcher
    from pdserve.cli import build_parser
    from protocol.settings import settings_from_args

    started: dict[str, dict[str, str]] = {}

    def start(self: Supervisor, name: str, args: list[str], log_path: str | None = None,
              env: dict[str, str] | None = None) -> None:
        started[name] = dict(env or {})

    monkeypatch.setattr(Supervisor, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", lambda *a, **k: "interrupted")
    assert launcher.gateway_env(()) == {}
    for keys in ((), ("k1",), ("k1", "k2")):
        started.clear()
        up = UpSettings(port=free_port(), device="cpu", insecure_control_plane=True,
                        gateway=GatewaySettings(api_keys=keys, insecure_control_plane=True))
        assert launcher._supervise(up, Supervisor(), [], 1.0, None) == 0
        want = {"PDSERVE_API_KEY": ",".join(keys)} if keys else {}
        assert started == {"gateway": want, "prefill-0": {},
                           "decode-0": {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}}  # one progress bar
        child = settings_from_args(build_parser({**want, "PDSERVE_INSECURE_CONTROL_PLANE": "1"})
                                   .parse_args(["gateway"]))
        assert isinstance(child, GatewaySettings) and child.api_keys == keys
