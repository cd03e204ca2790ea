"""``pdserve up``: a gateway plus prefill/decode (and optionally colocated) workers on this host.

Steps: convert/locate the model once (so workers do not race on the cache), pick a free 127.0.0.1 port
for the control socket, start the gateway, then the workers (each a ``python -m pdserve.cli <role>``
child), wait until the gateway's ``/ready`` answers 200, print the URL and an example request, and
supervise: on Ctrl-C / SIGTERM / SIGHUP the gateway gets SIGTERM first and drains (no new request; those
in flight finish on the workers for up to ``--drain-timeout`` seconds), then the workers get SIGTERM
(SIGKILL after ``grace`` seconds); a second signal stops everything at once. One line is printed per
child stopped, and the exit code is 128 + the signal number (130 for Ctrl-C). Once
the system is ready, a worker that exits is restarted after a backoff (``RestartPolicy``: 1 s, doubling
up to 30 s) as a new incarnation (a new epoch: the gateway replaces its old entry and pairs it again)
while the rest keep serving; a worker that exits ``max_exits`` times within ``window_s`` is given up on,
in one line: the rest keep serving while the workers left can (a prefill and a decode worker, or a
colocated worker, among those ``up`` still runs: ``supervisor.serving_problem``), else everything stops
(exit code 1, so a process manager's restart policy takes over). The gateway's exit stops everything
(exit code 1), as does a child that dies during start-up. Each child runs in a process group of
its own, so a terminal's Ctrl-C (sent to the whole foreground group) reaches only the launcher: a child
still importing torch is stopped by the launcher's SIGTERM, not interrupted mid-import with a
KeyboardInterrupt traceback. Internal ports bind 127.0.0.1 only, and the control plane is CURVE
(kvtransfer/curve.py) with ``--curve-keys`` or, by default, a key pair made for this run in a private
temporary directory (0700, removed at exit): another local user's process cannot join the fleet.
On Linux the children stop also when the launcher is killed with SIGKILL (each gets SIGTERM from the
kernel: ``pdserve.supervisor``), but nothing removes that key directory then: a ``pdserve-keys-*``
directory of the dead run stays in the temporary directory (its key pair serves no fleet any more;
delete it by hand). Elsewhere the children of a launcher killed with SIGKILL keep running.
On CPU the KV transport is ``nixl`` (measured working on the 2-core machines; ``ucx`` also works).
Ports come from pdserve/ports.py, each worker's device, GPUs and cores from pdserve/placement.py; the
children are started, stopped and restarted by pdserve/supervisor.py.

Every child runs with the settings ``up`` decided: each of the gateway's and the workers' flags given to
``up``, on its command line or in its ``PDSERVE_*`` variable, is passed on the child's command line
(``plan``; a value equal to the flag's default is left out), and no child inherits a ``PDSERVE_*``
variable of a pdserve flag (``CHILD_UNSET_VARIABLES``), so none can put back a value ``up``'s command line
replaced or a flag ``up`` sets itself. A child's environment is this process's without those, plus what
``up`` gives it: the gateway's ``PDSERVE_API_KEY`` (``gateway_env``) and a worker's
``CUDA_VISIBLE_DEVICES`` (``worker_envs``); other variables (``PDSERVE_CACHE_DIR``, ``CUDA_*``, ``NCCL_*``)
pass through. The ``pdserve up`` command refuses a variable of a child's flag that ``up`` sets itself
(``PDSERVE_WORKERS``: use ``--gateway-workers``; ``PDSERVE_METRICS_PORT``, ...: ``pdserve.cli``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields
from types import FrameType
from typing import Any

import httpx

from kvtransfer.curve import generate_keys
from pdserve.cli import SETTINGS_COMMANDS, flag_variables
from pdserve.cuda_mps import PIPE_VARIABLE, mps_problem, private_mps
from pdserve.placement import (
    gpu_count,
    num_workers,
    shared_gpus,
    usable_cores,
    worker_envs,
    worker_placements,
    worker_roles,
)
from pdserve.ports import bind_problem, free_port_range, free_ports, local_host
from pdserve.supervisor import STOP_MARGIN_S, RestartPolicy, Supervisor, say_up, supervise
from protocol.logging import say
from protocol.settings import (
    DECODE_ONLY_WORKER_FIELDS,
    UP_MANAGED_GATEWAY_FIELDS,
    UP_MANAGED_WORKER_FIELDS,
    GatewaySettings,
    UpSettings,
    WorkerSettings,
)

log = logging.getLogger("pdserve.up")
# the PDSERVE_* variables of every flag of up, the gateway and the workers: no child inherits them (each
# child's settings are on its command line)
CHILD_UNSET_VARIABLES = frozenset().union(*(flag_variables(command) for command in SETTINGS_COMMANDS))


def device_problem(device: str, num_gpus: int) -> str | None:
    """Why the workers could not run on ``--device device`` with ``num_gpus`` CUDA devices visible (one
    line naming the flag), or None: ``cuda`` or ``cuda:N`` without a CUDA device, or ``cuda:N`` beyond
    the visible ones. ``auto`` and ``cpu`` always run."""
    if not device.startswith("cuda"):
        return None
    if num_gpus == 0:
        return (f"--device {device}: no CUDA device is visible to this process (torch.cuda.is_available() "
                "is False); use --device cpu or auto")
    index = int(device.partition(":")[2] or 0)
    if index >= num_gpus:
        return f"--device {device}: {num_gpus} CUDA device(s) visible, cuda:0..cuda:{num_gpus - 1}"
    return None


def up_refusal(settings: UpSettings, model_config: Mapping[str, Any] | None = None) -> str | None:
    """Why ``pdserve up`` cannot start with ``settings``, found before any child starts (one line naming the
    flag), or None: an HTTP address it cannot bind (``bind_problem``), a CUDA device that is not there
    (``device_problem``; counting the GPUs imports torch unless ``--device cpu``), a ``--tokenizer`` the
    gateway could not use (``tokenizer_flag_problem``), what the workers would refuse from the model's
    ``config.json`` (``model_config``; None: not checked) before loading weights
    (``workers.setup.model_config_problem``: a ``--max-model-len`` beyond the model's positions, its
    sliding window or LongRoPE's original context, or the KV cache of an explicit ``--num-blocks``, a model
    ``--tensor-parallel-size`` ranks cannot split, a ``--block-size`` longer than a sequence or, on the
    CPU, larger than the KV budget), an ``--attention-backend`` the workers' device cannot run
    (``attention_backend_problem``), or a ``--cuda-mps`` without GPUs or its control program
    (``pdserve.cuda_mps.mps_problem``)."""
    from engine.config import attention_backend_problem, kv_capacity_problem
    from gateway.text import tokenizer_flag_problem
    from workers.setup import model_config_problem

    gpus = gpu_count() if settings.device != "cpu" else 0
    why = bind_problem(settings.host, settings.port) or device_problem(settings.device, gpus)
    if why is not None:
        return why
    if settings.gateway.tokenizer and (why := tokenizer_flag_problem(settings.gateway.tokenizer)) is not None:
        return why
    worker = settings.worker
    device = "cpu" if settings.device == "auto" and gpus == 0 else settings.device.replace("auto", "cuda")
    if model_config is not None and (
            why := model_config_problem(worker, model_config, device, settings.model)) is not None:
        return why
    if model_config is None and worker.num_blocks is not None and (  # else model_config_problem's
            why := kv_capacity_problem(worker.max_model_len, worker.num_blocks, worker.block_size)):
        return why
    if (why := attention_backend_problem(worker.attention_backend, device)) is not None:
        return f"--attention-backend {worker.attention_backend}: {why}"
    if settings.cuda_mps:
        if device == "cpu":
            return "--cuda-mps: needs CUDA devices, and --device auto found no GPU"
        if (why := mps_problem(os.environ)) is not None:
            return why
    return None


def changed_flags(settings: GatewaySettings | WorkerSettings, skip: frozenset[str]) -> list[str]:
    """The command-line flags that give a child ``settings``: one ``--flag value`` per field not in
    ``skip`` whose value differs from the field's default (booleans as true/false; ``api_keys`` never:
    keys travel in the child's environment, not its command line, which any local user can read)."""
    out: list[str] = []
    defaults = (WorkerSettings(role="colocated", insecure_control_plane=True)
                if isinstance(settings, WorkerSettings) else GatewaySettings(insecure_control_plane=True))
    for f in fields(settings):
        value = getattr(settings, f.name)
        if f.name in skip or f.name == "api_keys" or value == getattr(defaults, f.name) or value is None:
            continue
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        out += ["--" + f.name.replace("_", "-"), text]
    return out


def plan(settings: UpSettings, control_port: int, num_gpus: int = 0,
         keys_dir: str | None = None, metrics_ports: Sequence[int] = (),
         cpu_cores: int = 0) -> list[tuple[str, list[str]]]:
    """The children to start, in order: (name, argv after ``python -m pdserve.cli``). Gateway first.
    ``control_port``: the first of ``settings.gateway_workers`` consecutive free ports, one per gateway
    process (every worker is given all of them). ``num_gpus``: visible GPUs, used to place workers (see
    ``placements``; a worker's ``CUDA_VISIBLE_DEVICES`` comes from ``worker_envs``). ``keys_dir``: the
    CURVE key directory every child gets (default ``settings.curve_keys``). The gateway's and the
    workers' settings given to ``up`` follow as flags (``changed_flags``); a worker's own flags come
    last, so an explicit ``--kv-memory-fraction`` wins over the share ``placements`` gives.
    ``metrics_ports``: one ``--metrics-port`` per worker, in start order (empty: none). ``cpu_cores``:
    the cores the workers share when they run on the CPU (``placements``; 0: no ``--cpu-threads``).

    Raises:
        ValueError: no key directory and no ``--insecure-control-plane``, ``metrics_ports`` neither
            empty nor one per worker, or the workers' tensor parallel ranks do not fit the GPUs
            (``placements``).
    """
    n = settings.gateway_workers
    control = f"tcp://127.0.0.1:{control_port}"
    workers_flag = ["--workers", str(n)] if n > 1 else []
    # gateway process i binds control_port + i (GatewaySettings.control_endpoints); each worker gets them all
    gateway_controls = ",".join(f"tcp://127.0.0.1:{control_port + i}" for i in range(n))
    keys = keys_dir or settings.curve_keys
    if settings.insecure_control_plane:
        secure = ["--insecure-control-plane"]
    elif keys:
        secure = ["--curve-keys", keys]
    else:
        raise ValueError("plan: no CURVE key directory and no --insecure-control-plane")
    common = ["--log-level", settings.log_level, "--log-format", settings.log_format, *secure]
    children = [("gateway", ["gateway", "--host", settings.host, "--port", str(settings.port),
                             "--control-bind", control, *workers_flag, *common,
                             *changed_flags(settings.gateway, UP_MANAGED_GATEWAY_FIELDS)])]
    # --port 0: a worker's --port is its KV control port (up's --port is the gateway's HTTP port)
    worker = ["--model", settings.model, "--gateway-control", gateway_controls, "--host", "127.0.0.1",
              "--port", "0",
              *common]
    given = changed_flags(settings.worker, UP_MANAGED_WORKER_FIELDS)
    given_not_decode = changed_flags(settings.worker, UP_MANAGED_WORKER_FIELDS | DECODE_ONLY_WORKER_FIELDS)
    transfer = ["--transfer-backend", settings.transfer_backend]
    roles = worker_roles(settings)
    if metrics_ports and len(metrics_ports) != len(roles):
        raise ValueError(f"plan: {len(metrics_ports)} metrics ports for {len(roles)} workers")
    places = worker_placements(settings, num_gpus, cpu_cores)
    for k, ((role, name), place) in enumerate(zip(roles, places, strict=True)):
        extra = transfer if role != "colocated" else []
        metrics = ["--metrics-port", str(metrics_ports[k])] if metrics_ports else []
        children.append((name, [role, "--worker-id", f"up-{name}", *worker, *metrics, *place.flags, *extra,
                                *(given if role == "decode" else given_not_decode)]))
    return children


def progress_bar_envs(names: Sequence[str]) -> dict[str, dict[str, str]]:
    """The environment that leaves one weight-loading progress bar on the shared terminal: the first
    worker of ``names`` draws transformers' "Loading weights" bar, every other one gets
    ``HF_HUB_DISABLE_PROGRESS_BARS=1`` (bars of several processes on one line overwrite each other)."""
    return {name: {} if i == 0 else {"HF_HUB_DISABLE_PROGRESS_BARS": "1"} for i, name in enumerate(names)}


def gateway_env(keys: Sequence[str]) -> dict[str, str]:
    """The environment the gateway child gets on top of the launcher's (which lacks every ``PDSERVE_*``
    variable of a flag: ``CHILD_UNSET_VARIABLES``): its API keys, comma-separated, in ``PDSERVE_API_KEY``
    (not on its command line, which any local user can read); nothing without keys (never an empty value,
    which the gateway refuses)."""
    return {"PDSERVE_API_KEY": ",".join(keys)} if keys else {}


def wait_ready(sup: Supervisor, url: str, timeout: float, stop: list[int],
               api_key: str | None = None) -> str | None:
    """Poll ``url``/ready (with ``api_key`` as bearer token when given) until 200. Returns None when
    ready, else why not (child died, timeout, signal)."""
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=2.0, headers=headers) as client:
        while time.monotonic() < deadline:
            if stop:
                return "interrupted"
            if sup.dead():
                name, code = sup.dead()[0]
                return f"{name} exited with code {code} during start-up"
            try:
                if client.get(f"{url}/ready").status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    return f"not ready after {timeout:.0f} s"


def keys_from_env(keys: tuple[str, ...], env: Mapping[str, str]) -> bool:
    """True when ``keys`` (the gateway's) begin with the first key of ``env``'s ``PDSERVE_API_KEY``, so
    that ``$PDSERVE_API_KEY`` in a shell holding that environment is a valid bearer token (a one-key
    variable; the command line's ``--api-key`` replaces the variable's keys)."""
    first = env.get("PDSERVE_API_KEY", "").split(",")[0]
    return bool(keys) and first == keys[0] and "," not in env.get("PDSERVE_API_KEY", "")


def example(url: str, model: str, needs_key: bool = False, key_in_env: bool = False) -> str:
    """The curl command printed once the system is ready (``model``: the served name; ``needs_key``: the
    gateway wants an API key: ``$PDSERVE_API_KEY`` in the command when ``key_in_env`` (the keys came from
    that variable, so the user's shell has it), else a placeholder naming ``--api-key``)."""
    body = json.dumps({"model": model, "max_tokens": 32, "temperature": 0,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    token = "$PDSERVE_API_KEY" if key_in_env else "<a key given to --api-key>"
    auth = f' -H "Authorization: Bearer {token}"' if needs_key else ""
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stopped(BaseException):
    """The first stop signal while ``up`` converts the model, raised like ``KeyboardInterrupt`` (once) so
    the conversion unwinds and removes what it wrote."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run(settings: UpSettings, ready_timeout: float = 600.0) -> int:
    """Entry point of ``pdserve up``: start, wait for /ready, supervise (restarting workers that exit)
    until a signal, the gateway's exit, or no worker left that can serve.

    Returns 128 + the signal number after a stop by signal (130: Ctrl-C, 143: SIGTERM, 129: SIGHUP; also
    when it comes during start-up or the model conversion); 2 when something is refused before any child
    starts (a model, quantization, device, host, port, tokenizer, max model length, attention backend
    or tensor parallel size that cannot be used: one line on stderr); 1 when the gateway exited or a
    child died during start-up, or a worker was given up on and the workers left cannot serve, or the
    MPS daemon of ``--cuda-mps`` did not start (before any child; one line).

    Signals: from the start every stop signal is recorded (SIGHUP not where it is ignored, as under
    ``nohup``); the first one during the model conversion also unwinds it (``_Stopped``: the conversion
    removes its partial directory on any exception); one before any child started ends ``up`` with
    "interrupted". The handlers stay until the MPS daemon, which outlives every child, was told to quit.

    What it tells the user (a child stopped, why it stops, the ready block, the supervisor's restarts)
    goes through ``protocol.logging.say``: text as printed lines, ``--log-format json`` as one JSON log
    event each. A refusal (exit 2) is one plain ``pdserve up: ...`` line in either format, as the CLI's
    usage errors are.
    """
    stop: list[int] = []
    converting = [True]

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.append(signum)
        if converting[0]:
            converting[0] = False
            raise _Stopped(signum)

    handled: dict[signal.Signals, Any] = {}
    for stop_signal in STOP_SIGNALS:
        if stop_signal == signal.SIGHUP and signal.getsignal(stop_signal) is signal.SIG_IGN:
            continue  # nohup: closing the terminal is not a stop
        handled[stop_signal] = signal.signal(stop_signal, on_signal)
    try:
        return _start(settings, ready_timeout, stop, converting)
    except _Stopped:  # before any child started
        say_up("interrupted", logging.WARNING)
        return 128 + stop[0]
    finally:
        for stop_signal, handler in handled.items():
            signal.signal(stop_signal, handler)


def _start(settings: UpSettings, ready_timeout: float, stop: list[int], converting: list[bool]) -> int:
    """``run`` once its signal handlers are on: convert and check the model, then start and supervise."""
    try:
        from engine.models.registry import read_model_config, resolve_model

        # convert the embedded model once, before the workers race for it; refuse an architecture or a
        # quantization method the workers cannot run before any of them starts
        model_config = read_model_config(resolve_model(settings.model), settings.worker.quantization)
    except (ValueError, FileNotFoundError) as exc:
        converting[0] = False
        say_up(str(exc), logging.ERROR, refused="up")
        return 2
    converting[0] = False  # from here a signal is only recorded
    refused = up_refusal(settings, model_config)  # now, not after the workers loaded the model
    if refused is not None:
        say_up(refused, logging.ERROR, refused="up")
        return 2
    if stop:  # during the checks
        say_up("interrupted", logging.WARNING)
        return 128 + stop[0]
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per /ready poll
    sup = Supervisor(unset_env=CHILD_UNSET_VARIABLES, announce=say_up)
    with run_keys(settings) as keys_dir, contextlib.ExitStack() as daemons:
        try:
            wanted = settings.cuda_mps and _mps_has_work(settings)
            mps_env = daemons.enter_context(private_mps()) if wanted else {}
        except RuntimeError as exc:
            say_up(str(exc), logging.ERROR, refused="up")
            return 1
        try:
            code = _supervise(settings, sup, stop, ready_timeout, keys_dir, mps_env)
        finally:
            drain = settings.gateway.drain_timeout
            if stop and sup.children.get("gateway") is not None:
                say_up(f"stopping: the gateway takes no new request and lets those in flight finish (up to "
                       f"{drain:g} s, --drain-timeout); a second Ctrl-C or SIGTERM stops at once" if drain > 0
                       else "stopping at once (--drain-timeout 0): the requests in flight are cut",
                       drain_timeout_s=drain)
            stopped = sup.stop_all(gateway_grace=drain + 2 * STOP_MARGIN_S, signals=stop)
    for name, pid, how in stopped:
        say_up(f"{how} {name} (pid {pid})", child=name, pid=pid, how=how)
    return 128 + stop[0] if stop else code


def _mps_has_work(settings: UpSettings) -> bool:
    """Whether ``--cuda-mps`` has work: two or more workers placed on one GPU (``shared_gpus``). False also
    for ranks the GPUs cannot hold, which ``_supervise`` refuses before any child starts."""
    try:
        return bool(shared_gpus(settings, gpu_count()))
    except ValueError:
        return False


def _supervise(settings: UpSettings, sup: Supervisor, stop: list[int], ready_timeout: float,
               keys_dir: str | None, mps_env: Mapping[str, str] | None = None) -> int:
    reach = local_host(settings.host)
    url = f"http://{reach if ':' not in reach else f'[{reach}]'}:{settings.port}"
    gpus = gpu_count() if settings.device != "cpu" else 0
    keys = settings.gateway.api_keys
    metrics_ports = free_ports(num_workers(settings), exclude=(settings.port,))
    control_port = free_port_range(settings.gateway_workers, exclude=(settings.port, *metrics_ports))
    try:  # a tensor parallel size the GPUs cannot hold is refused before any child starts
        children = plan(settings, control_port, gpus, keys_dir, metrics_ports, usable_cores())
        workers = worker_envs(settings, gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
        bars = progress_bar_envs(list(workers))
        envs = {"gateway": gateway_env(keys),
                **{name: {**env, **(mps_env or {}), **bars[name]} for name, env in workers.items()}}
    except ValueError as exc:
        say_up(str(exc), logging.ERROR, refused="up")
        return 2
    if gpus:
        shared = shared_gpus(settings, gpus)
        pipe = (mps_env or {}).get(PIPE_VARIABLE, "")
        if settings.cuda_mps and not shared:
            say_up("--cuda-mps: no two workers share a GPU here, so MPS has nothing to run side by side; no "
                   "daemon started")
        elif settings.cuda_mps:
            for device, names in shared.items():
                say_up(f"--cuda-mps: {' and '.join(names)} share {device} through this run's MPS daemon "
                       f"({PIPE_VARIABLE}={pipe})", device=device, workers=names, pipe_directory=pipe)
        elif not settings.cuda_mps and mps_problem(os.environ) is None:
            for device, names in shared.items():
                say_up(f"{' and '.join(names)} share {device}: --cuda-mps would run their kernels side by "
                       "side instead of taking turns (docs/gpu.md)", device=device, workers=names)
    for name, args in children:
        if stop:
            return 0  # interrupted while starting: start no more children
        sup.start(name, args, env=envs[name])
    why = wait_ready(sup, url, ready_timeout, stop, keys[0] if keys else None)
    if why == "interrupted":
        return 0
    if why is not None:
        say_up(f"{why}; stopping everything", logging.ERROR)
        return 1
    served = settings.gateway.model_name or settings.model
    metrics = {name: f"http://127.0.0.1:{args[args.index('--metrics-port') + 1]}/metrics"
               for name, args in children if "--metrics-port" in args}
    scrape = "  ".join(f"{name} {address}" for name, address in metrics.items())
    curl = example(url, served, bool(keys), keys_from_env(keys, os.environ))
    say(log, "ready", f"pdserve is ready at {url}  (OpenAI API under {url}/v1)\nWorker metrics: {scrape}\n"
        f"Try:\n  {curl}", stream=sys.stdout, url=url, openai_api=f"{url}/v1", worker_metrics=metrics,
        example=curl)
    return supervise(sup, stop, RestartPolicy(), {name: role for role, name in worker_roles(settings)})


@contextlib.contextmanager
def run_keys(settings: UpSettings) -> Iterator[str | None]:
    """The CURVE key directory of this run: ``--curve-keys`` as given, None with
    ``--insecure-control-plane`` (a warning is logged), else a fresh key pair in a private temporary
    directory (``mkdtemp``: 0700), removed when the block ends (the children have stopped by then); a
    SIGKILL of this process leaves it behind."""
    if settings.insecure_control_plane:
        log.warning("--insecure-control-plane: the control sockets accept any process that reaches them")
        yield None
    elif settings.curve_keys:
        yield settings.curve_keys
    else:
        tmp = tempfile.mkdtemp(prefix="pdserve-keys-")
        try:
            generate_keys(tmp)
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
