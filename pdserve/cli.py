"""The ``pdserve`` command line: ``up``, ``gateway``, ``prefill``, ``decode``, ``colocated``, ``keygen``,
``bench``.

Every flag ``--foo-bar`` also reads the environment variable ``PDSERVE_FOO_BAR`` (the command line wins;
repeatable flags take a comma-separated env value, except ``bench``'s ``--fault`` and ``--system``, one
entry each; empty entries are kept for the settings to refuse:
``PDSERVE_API_KEY=`` is an error, not "no key"). A subcommand reads, and refuses bad values of, only the
variables of its own flags. ``up`` has the gateway's and the workers' flags too and passes their values on
its children's command lines (its children inherit no variable of a pdserve flag: pdserve/launcher.py);
a variable of a child's flag that ``up`` sets itself (``UP_SET_VARIABLES``: ``PDSERVE_WORKERS``,
``PDSERVE_METRICS_PORT``, ...) is refused by ``up`` whatever its value. The variables are read and checked
by protocol/cli_env.py, for ``bench`` too. Flags and defaults: docs/contracts.md.
Worker roles and ``up`` dispatch lazily to ``prefill_worker.main:run``, ``decode_worker.main:run``,
``workers.colocated:run`` and ``pdserve.launcher:run``; ``bench`` to ``loadtest.cli``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from protocol.cli_env import EnvAdder as _EnvAdder
from protocol.cli_env import OneLineParser as _OneLineParser
from protocol.cli_env import duration, env_variable, name_the_variable, parse_bool
from protocol.logging import say_refused
from protocol.settings import ATTENTION_BACKENDS, REASONING_PARSERS, TOOL_CALL_PARSERS

_RUNNERS = {
    "prefill": "prefill_worker.main:run",
    "decode": "decode_worker.main:run",
    "colocated": "workers.colocated:run",
    "up": "pdserve.launcher:run",
}


_Adder = Callable[..., None]  # adds one flag: (flag, **argparse keywords)


def _bool_flag(add: _Adder, flag: str, default: bool, help: str) -> None:
    add(flag, type=parse_bool, nargs="?", const=True, default=default, help=help)


def _add_common(add: _Adder) -> None:
    add("--log-level", default="info", type=str.lower,
        choices=["debug", "info", "warning", "error", "critical"], help="any case (INFO = info)")
    add("--log-format", default="text", choices=["text", "json"], help="json: one JSON object per line")
    add("--drain-timeout", type=duration, default=30.0,
        help="on SIGTERM or Ctrl-C, stop taking requests and let those in flight finish for up to this "
             "long (seconds, or e.g. 2m; 0: no wait), then stop; a second signal stops at once")


def _add_parsers(add: _Adder) -> None:
    add("--tool-call-parser", default="auto", choices=list(TOOL_CALL_PARSERS),
        help="format of the model's tool calls (auto: from its chat template; none: tools only with "
             "tool_choice none)")
    add("--reasoning-parser", default="auto", choices=list(REASONING_PARSERS),
        help="split <think> blocks into reasoning_content (auto: from the chat template, else none)")


def _add_control_plane(add: _Adder, up: bool) -> None:
    add("--curve-keys", default=None,
        help=("directory with the fleet's CURVE key pair fleet.key_secret (default: a fresh pair in a "
              "private temp dir, for this run only)" if up else
              "directory with the fleet's CURVE key pair fleet.key_secret (`pdserve keygen DIR`); "
              "required unless --insecure-control-plane"))
    _bool_flag(add, "--insecure-control-plane", False,
               "no CURVE on the control sockets: any process that reaches them may join (logs a warning)")


def _add_gateway(add: _Adder) -> None:
    add("--host", default="127.0.0.1",
        help="address the OpenAI HTTP API listens on (0.0.0.0 or :: for every interface)")
    add("--port", type=int, default=8000, help="TCP port of the OpenAI HTTP API")
    add("--control-bind", default="tcp://127.0.0.1:7100",
        help="zmq ROUTER endpoint for workers (with --workers N: tcp://host:P, process i binds P + i)")
    add("--workers", type=int, default=1,
        help="gateway processes serving --port together (SO_REUSEPORT), each with its own control "
             "socket; a worker given any one control address registers with all (each names the others)")
    add("--model-name", default=None, help="served model name (default: from workers)")
    add("--tokenizer", default=None,
        help="tokenizer dir, or a model alias (e.g. smollm2-135m: converted into the cache on first use, "
             "~20-30 s) (default: the registered model_path)")
    add("--api-key", action="append", default=None, help="accepted bearer key (repeatable)")
    add("--api-key-file", default=None, help="file with one key per line")
    _bool_flag(add, "--public-health", True, "serve /health and /ready without a key")
    _bool_flag(add, "--public-metrics", True, "serve /metrics without a key")
    add("--disagg-threshold", type=int, default=0, help="prompts shorter (tokens) go colocated")
    _bool_flag(add, "--allow-local-prefill", False, "no prefill worker → colocated instead of 503")
    add("--max-queue", type=int, default=1024, help="requests in flight before 429")
    add("--request-timeout", type=duration, default=600.0, help="seconds, or e.g. 30s, 500ms, 10m")
    add("--max-body-bytes", type=int, default=4 << 20, help="request body bytes before 413")
    add("--max-prompt-tokens", type=int, default=None,
        help="prompt tokens per request before 400 (default: only the context length limits)")
    add("--max-n", type=int, default=16, help="choices per request (n) before 400")
    add("--max-stop", type=int, default=16,
        help="stop strings, and stop_token_ids, per request before 400 (OpenAI allows 4)")
    add("--heartbeat-timeout", type=duration, default=5.0,
        help="silence (seconds, or e.g. 1500ms) → worker dead")
    add("--max-retries", type=int, default=2,
        help="times a request is routed again to other workers when one fails it before its first token")
    add("--max-migrations", type=int, default=1,
        help="times a stream continues on other workers when its worker fails it mid-stream (0: off)")
    add("--admission-budget", type=duration, default=30.0,
        help="429 when a request's prefill would wait longer (estimated; seconds, or e.g. 10s; 0: off)")
    add("--kv-canary-period", type=duration, default=60.0,
        help="re-measure each pair's KV path with a canary transfer this often (0: only at pairing)")
    add("--kv-canary-timeout", type=duration, default=10.0,
        help="a canary not landed in this time takes its pair out of routing")
    add("--kv-canary-mib", type=float, default=64.0,
        help="size of a canary transfer in MiB (at least one KV block; capped at 1/8 of the decode "
             "worker's free blocks and at the blocks of max_model_len - 1 tokens; 0: one block)")
    _add_parsers(add)


def _add_worker(add: _Adder, role: str) -> None:
    add("--model", default="smollm2-135m",
        help="HF model dir or alias (smollm2-135m; dummy shapes: llama3-8b, qwen3-30b-a3b, mixtral-8x7b, "
        "glm-4.5-air, tiny-llama)")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache dtype (auto: bf16 on GPU, fp32 on CPU)")
    add("--load-format", default="auto", choices=["auto", "dummy"],
        help="dummy: random weights, the same (seed 0) on every worker (auto: dummy for a dummy alias)")
    add("--quantization", default=None, choices=["fp8"],
        help="fp8: quantize a bf16/fp16/fp32 checkpoint's decoder projections to FP8 per output channel on "
        "load, and a mixture of experts' experts per row (FP8 GEMMs on Hopper; weight-only FP8 expert "
        "kernels). An FP8 checkpoint (quantization_config fp8) is FP8 without it; any other "
        "quantization_config is refused")
    add("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda if present)")
    add("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
        help="attention kernels (auto: flash_attn on a GPU when installed, else triton; torch on a CPU)")
    _bool_flag(add, "--enforce-eager", False, "never replay CUDA graphs for decode steps")
    _bool_flag(add, "--async-scheduling", True,
               "launch each decode graph step before the last one's tokens reach the host (rows without "
               "logprobs or penalties; needs CUDA graphs: no effect on a CPU or with --enforce-eager)")
    add("--fused-ops", default="auto", choices=["auto", "on", "off"],
        help="merged QKV/gate-up GEMMs and fused RMSNorm/rotary/SiLU kernels (auto: on CUDA, if supported)")
    _bool_flag(add, "--pdl", True,
               "programmatic dependent launch of the Triton kernels (Hopper and newer GPUs; else no effect)")
    add("--block-size", type=int, default=16, help="tokens per KV block")
    add("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-memory-fraction)")
    add("--kv-memory-fraction", type=float, default=0.9,
        help="share of free GPU memory (CPU: of a 1 GiB budget) for the KV cache")
    add("--kv-host-cache-gib", type=float, default=0.0,
        help="host-memory KV tier (GiB, pinned beside a GPU): prefix-cache blocks evicted from the KV cache "
             "are copied there and copied back on a prefix hit instead of recomputed (0: off; one rank "
             "only)")
    add("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
        help="auto: K/V in the model's dtype; fp8: float8_e4m3fn, one byte per element (twice the blocks "
             "of bf16), static per-layer K and V scales of 1.0; triton or torch attention backend, compute "
             "capability >= 8.9 on a GPU. Prefill and decode workers must agree (a bf16/fp8 pair is "
             "refused)")
    add("--max-num-seqs", type=int, default=256, help="sequences running at once")
    add("--max-num-batched-tokens", type=int, default=2048,
        help="token budget per step (chunked prefill splits prompts to fit)")
    _bool_flag(add, "--enable-prefix-caching", True,
               "keep full prompt blocks as a prefix cache and reuse them for later prompts that start with "
               "the same tokens (false: every prompt is computed in full; a benchmark's reuse-off baseline)")
    add("--prefill-grid", type=int, default=0,
        help="deterministic prefix cache: cut every prefill at multiples of this many tokens (a multiple "
             "of --block-size, at most --max-num-batched-tokens), one chunk per sequence per step, round "
             "prefix-cache hits down to it and reuse only whole prefill chunks' KV, so a cache hit gives "
             "the same bits as a fresh prefill of a request run alone (0: off)")
    if role in ("decode", "up"):
        _bool_flag(add, "--decode-prefix-reuse", True,
                   "decode workers: keep finished requests' KV blocks as a prefix cache and take a new "
                   "request's cached leading blocks from it, so only the rest of its prompt's KV is sent by "
                   "the prefill worker (false: no prefix cache on the decode worker, every request's whole "
                   "prompt KV is sent)")
    add("--max-model-len", type=int, default=None,
        help="tokens per sequence, prompt and output, at most what the KV cache holds (--num-blocks x "
             "--block-size; default: the model's context length, cut to that with one log line)")
    add("--gateway-control", default="tcp://127.0.0.1:7100",
        help="the gateways' --control-bind addresses, comma-separated (tcp://h1:7100,tcp://h2:7100); a host "
             "name stands for every address it resolves to (a Kubernetes headless Service): the worker "
             "registers with, heartbeats to and streams to each")
    add("--gateway-resolve-interval", type=duration, default=5.0,
        help="how often --gateway-control's host names are looked up again: a new address is a new "
             "gateway, one gone from DNS a dead one")
    add("--host", default="127.0.0.1", help="address this worker binds its sockets to")
    add("--advertise-host", default=None, help="address peers use to reach this worker (default --host)")
    add("--port", type=int, default=0, help="this worker's KV control port (0: any free port)")
    add("--worker-id", default="", help="default hostname-pid")
    add("--metrics-port", type=int, default=0,
        help="serve GET /metrics (vLLM-compatible names), /health and /live on this TCP port at --host "
             "(0: no such server)")
    add("--engine-stall-timeout", type=duration, default=60.0,
        help="/health and /live answer 503 once the engine loop has not ticked for this long")
    add("--cpu-threads", type=int, default=0,
        help="torch intra-op threads of each rank for its CPU work, all of a model's on a CPU device "
             "(0: torch's default, one per core; pdserve up gives each CPU worker's rank an equal share "
             "of its cores, as worker processes sharing cores with a thread per core slow each other down)")
    add("--tensor-parallel-size", type=int, default=1,
        help="processes (one GPU each: cuda:0..N-1 of the visible devices) sharing the model; on a "
             "prefill or decode worker every rank runs its own KV endpoint (the two sides may differ in N)")
    add("--engine-warmup", default="auto", choices=["auto", "on", "off"],
        help="run throw-away requests before registering, so kernels compile first (auto: on CUDA only; "
             "the prefill-rate probe of prefill and colocated workers runs either way)")
    if role != "colocated":
        add("--transfer-backend", default="nixl", choices=["nixl", "ucx", "loopback"],
            help="KV transport between prefill and decode workers")


class _Skipping:
    """An adder that leaves out the flags in ``skip`` (``pdserve up`` sets those itself)."""

    def __init__(self, add: _Adder, skip: set[str]) -> None:
        self.add, self.skip = add, skip

    def __call__(self, flag: str, **kw: Any) -> None:
        if flag not in self.skip:
            self.add(flag, **kw)


# flags of `pdserve gateway` and of the workers that `pdserve up` sets itself (the rest pass through)
_UP_OWN_GATEWAY_FLAGS = {"--control-bind", "--workers", "--log-level", "--log-format"}
_UP_OWN_WORKER_FLAGS = {"--model", "--device", "--transfer-backend", "--gateway-control",
                        "--gateway-resolve-interval", "--host",
                        "--advertise-host", "--port", "--metrics-port", "--worker-id", "--log-level",
                        "--log-format"}


def _add_up(add: _Adder) -> None:
    add("--model", default="smollm2-135m", help="HF model dir or alias for every worker")
    add("--device", default="auto",
        help="cpu, cuda or cuda:N (auto: one worker per GPU when present; with --tensor-parallel-size N each "
             "worker gets N GPUs of its own, refused when they do not fit; a CUDA device that is not there "
             "is refused before anything starts)")
    add("--transfer-backend", default="nixl", choices=["nixl", "ucx", "loopback"],
        help="KV transport between prefill and decode workers")
    add("--num-prefill", type=int, default=1, help="prefill workers to start")
    add("--num-decode", type=int, default=1, help="decode workers to start")
    add("--colocated", type=int, default=0, help="colocated workers to start")
    add("--gateway-workers", type=int, default=1,
        help="gateway processes on the one HTTP port (pdserve gateway --workers); every worker registers "
             "with each")
    _bool_flag(add, "--cuda-mps", False,
               help="run the workers under a CUDA MPS daemon of this run's own (started before them where "
                    "two of them share a GPU, told to quit after them): workers sharing a GPU run their "
                    "kernels side by side instead of "
                    "taking turns (a prefill and a decode worker on one H100, 8 streams: 1.15x the "
                    "requests/s, TTFT 0.55-0.69x, TPOT 0.91-0.94x; docs/gpu.md)")
    _add_gateway(_Skipping(add, _UP_OWN_GATEWAY_FLAGS))
    _add_worker(_Skipping(add, _UP_OWN_WORKER_FLAGS), "up")


SETTINGS_COMMANDS = ("up", "gateway", "prefill", "decode", "colocated")  # the commands with settings flags


def _add_command(add: _Adder, name: str) -> None:
    """Adds the flags of ``pdserve <name>`` (one of ``SETTINGS_COMMANDS``)."""
    _add_common(add)
    _add_control_plane(add, up=name == "up")
    if name == "gateway":
        _add_gateway(add)
    elif name == "up":
        _add_up(add)
    else:
        _add_worker(add, name)


def flag_variables(command: str) -> frozenset[str]:
    """The ``PDSERVE_*`` variables ``pdserve <command>`` reads, one per flag (``command``: up, gateway,
    prefill, decode or colocated)."""
    names: list[str] = []
    _add_command(lambda flag, **kw: names.append(env_variable(flag)), command)
    return frozenset(names)


# The variables of the gateway's and the workers' flags that `pdserve up` sets itself, none of which is a
# flag of up's → the end of the line refusing it: what up does instead, and what to do. `pdserve up`
# refuses each (whatever its value) rather than ignore a value meant for its children (build_parser).
UP_SET_VARIABLES: dict[str, str] = {
    "PDSERVE_WORKERS": ": unset it and use --gateway-workers (PDSERVE_GATEWAY_WORKERS)",
    "PDSERVE_CONTROL_BIND": " (a free 127.0.0.1 port per gateway process): unset it",
    "PDSERVE_GATEWAY_CONTROL": " (its gateway's control addresses): unset it",
    "PDSERVE_GATEWAY_RESOLVE_INTERVAL": " (its gateway's addresses are 127.0.0.1: no name to look up): "
                                        "unset it",
    "PDSERVE_ADVERTISE_HOST": " (its workers bind and advertise 127.0.0.1): unset it",
    "PDSERVE_METRICS_PORT": " (a free port per worker, listed once ready): unset it",
    "PDSERVE_WORKER_ID": " (up-prefill-0, up-decode-0, ...): unset it",
}


def _up_set_variables() -> dict[str, str]:
    """Each variable of a child's flag that ``pdserve up`` does not read (a flag it sets itself) → the line
    refusing it, e.g. ``PDSERVE_WORKERS is the gateway's --workers, which pdserve up sets itself: ...``."""
    gateway = flag_variables("gateway")
    workers = flag_variables("prefill") | flag_variables("decode") | flag_variables("colocated")
    lines = {}
    for variable in sorted((gateway | workers) - flag_variables("up")):
        flag = "--" + variable.removeprefix("PDSERVE_").lower().replace("_", "-")
        whose = "the gateway's" if variable in gateway else "the workers'"
        lines[variable] = (f"{variable} is {whose} {flag}, which pdserve up sets itself"
                           + UP_SET_VARIABLES.get(variable, ": unset it"))
    return lines


def _add_parser(subs: Any, name: str, **kw: Any) -> _OneLineParser:
    """``subs.add_parser(name, **kw)``: a subcommand's parser, of the top-level parser's class."""
    sub = subs.add_parser(name, **kw)
    assert isinstance(sub, _OneLineParser)
    return sub


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The full ``pdserve`` parser; ``env`` (default ``os.environ``) supplies ``PDSERVE_*`` defaults.

    A value that cannot be converted to its flag's type, or is not one of its choices, is refused only when
    the subcommand that reads it parses (``SystemExit`` code 2 after one line on stderr naming the variable
    and the flag): its own flags' (``up`` has the gateway's and the workers' flags too). ``up`` also refuses,
    whatever its value, a variable of a child's flag it sets itself (``UP_SET_VARIABLES``; one line naming the
    variable, the child's flag and up's flag to use where it has one). Another subcommand's variables neither
    stop nor change a command.
    """
    env = os.environ if env is None else env
    parser = _OneLineParser(prog="pdserve", description="Disaggregated prefill/decode serving")
    subs = parser.add_subparsers(dest="command", required=True)
    roles: dict[str, _OneLineParser] = {}
    for name, help_text in (("up", "gateway + workers on this host"), ("gateway", "OpenAI API gateway"),
                            ("prefill", "prefill worker"), ("decode", "decode worker"),
                            ("colocated", "prefill+decode worker")):
        epilog = None if name != "up" else (
            "--host and --port are the gateway's HTTP address; the gateway's other flags and the workers' "
            "pass through to them (each worker gets the same), given here or in their PDSERVE_* variables "
            "(the children inherit none of these); a variable of a flag pdserve up sets itself "
            "(PDSERVE_WORKERS, PDSERVE_METRICS_PORT, ...) is refused.")
        roles[name] = _add_parser(subs, name, help=help_text, epilog=epilog)
        _add_command(_EnvAdder(roles[name], env), name)
    roles["up"].env_refused = {variable: line for variable, line in _up_set_variables().items()
                               if variable in env}
    keygen = _add_parser(subs, "keygen", help="make the fleet's CURVE key pair (for --curve-keys)")
    keygen.add_argument("directory", help="where to write fleet.key_secret and fleet.key (made 0700)")
    _bool_flag(_EnvAdder(keygen, env), "--exist-ok", False,
               "a valid key pair already there is kept (exit 0) instead of an error")
    # no argparse help: add_bench_arguments adds one that is compare's after `bench compare`
    bench = _add_parser(subs, "bench", help="load test a running server", add_help=False)
    try:
        from loadtest.cli import add_bench_arguments
    except ImportError:
        bench.add_argument("-h", "--help", action="help", help="show this help message and exit")
        bench.set_defaults(bench_missing=True)
    else:
        add_bench_arguments(bench, env)
    return parser


def _load_runner(spec: str) -> Callable[[Any], int | None]:
    module_name, func = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise SystemExit(f"pdserve: {module_name} is not available ({exc}); is this build complete?") from exc
    runner: Callable[[Any], int | None] = getattr(module, func)
    return runner


def _run_gateway(settings: Any) -> int:
    """Refuse, in one line before uvicorn or any gateway process starts, an HTTP address or a control
    socket that cannot be bound (2; uvicorn would print a traceback and exit 3) and an unusable
    ``--tokenizer`` (2), or an alias whose model could not be prepared (1); then serve."""
    from gateway.text import TokenizerNotFoundError, TokenizerPrepareError, resolve_tokenizer_dir
    from pdserve.ports import gateway_bind_problem

    if (why := gateway_bind_problem(settings.host, settings.port, settings.control_endpoints())) is not None:
        say_refused("gateway", why)
        return 2
    if settings.tokenizer:  # an alias is prepared once here; the app (each --workers process) gets its dir
        try:
            tokenizer = resolve_tokenizer_dir(settings.tokenizer, None)
        except TokenizerNotFoundError as exc:
            say_refused("gateway", str(exc))
            return 1 if isinstance(exc, TokenizerPrepareError) else 2
        settings = dataclasses.replace(settings, tokenizer=str(tokenizer))
    if settings.workers > 1:
        from pdserve.gateway_pool import run_pool

        return run_pool(settings)
    from gateway.server import serve

    serve(settings)
    return 0


def _keygen(directory: str, exist_ok: bool) -> int:
    """Make (or with ``exist_ok`` keep) the key pair in ``directory``; 2 after one line on stderr when it
    cannot: ``directory`` is not a directory, cannot be made or written (the path and why, not an
    ``[Errno 13]``), or already holds a key pair (without ``exist_ok``) or, with it, an invalid one."""
    from kvtransfer.curve import KEY_FILE, generate_keys, load_keys

    try:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"{directory} is not a directory (give a directory to write the key pair in)")
        if exist_ok and os.path.exists(os.path.join(directory, KEY_FILE)):
            keys = load_keys(directory)
            print(f"kept {directory}/{KEY_FILE} (public key {keys.public.decode()})")
            return 0
        keys = generate_keys(directory)
    except (OSError, ValueError) as exc:
        why = str(exc) if not isinstance(exc, OSError) or exc.strerror is None else \
            f"cannot write {exc.filename or directory}: {exc.strerror}"
        print(f"pdserve keygen: {why}", file=sys.stderr)
        return 2
    print(f"wrote {directory}/fleet.key_secret (public key {keys.public.decode()})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pdserve``; returns the process exit status (2: a usage error or a value refused
    before anything starts, in one line on stderr; for ``gateway``, 1 also when the ``--tokenizer`` alias's
    model could not be prepared)."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # named with the subcommand, whose --help lists its flags
        print(f"pdserve {args.command}: error: unrecognized arguments: {' '.join(unknown)} (see pdserve "
              f"{args.command} --help)", file=sys.stderr)
        return 2
    if args.command == "bench":
        if getattr(args, "bench_missing", False):
            print("pdserve: loadtest is not available", file=sys.stderr)
            return 2
        from loadtest.cli import run_bench

        return int(run_bench(args))
    if args.command == "keygen":
        return _keygen(args.directory, args.exist_ok)
    from protocol.logging import configure_logging
    from protocol.settings import settings_from_args

    configure_logging(args.log_level, args.log_format)
    try:
        settings = settings_from_args(args)
    except (ValueError, OSError) as exc:
        line = name_the_variable(str(exc), sys.argv[1:] if argv is None else list(argv), os.environ)
        say_refused(args.command, line)
        return 2
    if args.command == "gateway":
        return _run_gateway(settings)
    return int(_load_runner(_RUNNERS[args.command])(settings) or 0)


if __name__ == "__main__":
    sys.exit(main())
