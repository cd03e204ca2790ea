"""Frozen per-role settings built from parsed CLI arguments (``settings_from_args``).

Every field mirrors a flag of ``pdserve.cli`` (flag ``--foo-bar`` → field ``foo_bar``; env
``PDSERVE_FOO_BAR``). Validation happens in ``__post_init__`` and raises ``ValueError`` naming the flag.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvtransfer.curve import CurveKeys, load_keys
from protocol.endpoints import parse_endpoints
from protocol.messages import MAX_TENSOR_PARALLEL_SIZE

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # --device: what the workers place a model on
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
MAX_GATEWAY_PROCESSES = 64  # ``pdserve gateway --workers``: processes on one host

GIB = 1 << 30


def physical_memory_bytes() -> int:
    """This host's physical memory in bytes (``sysconf``: pages x page size)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check(cond: bool, flag: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"--{flag}: {msg}")


def _check_seconds(value: float, flag: str, zero: str | None = None) -> None:
    """A duration flag: a finite number of seconds, > 0 (``zero`` None) or >= 0 (``zero``: what 0 means).
    nan and inf are named as not finite (``nan`` fails every comparison: "must be >= 0, got nan" said
    nothing; ``inf`` passed a bare ``> 0``)."""
    ok = math.isfinite(value) and (value >= 0 if zero is not None else value > 0)
    bound = f">= 0 ({zero})" if zero is not None else "> 0"
    _check(ok, flag, f"must be a finite number of seconds {bound}, got {value}")


def _check_device(device: str) -> None:
    _check(_DEVICE.fullmatch(device) is not None, "device",
           f"must be auto, cpu, cuda or cuda:N, got {device!r}")


TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "none")
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", "none")


def _check_parsers(tool_call_parser: str, reasoning_parser: str) -> None:
    _check(tool_call_parser in TOOL_CALL_PARSERS, "tool-call-parser",
           f"must be one of {', '.join(TOOL_CALL_PARSERS)}, got {tool_call_parser!r}")
    _check(reasoning_parser in REASONING_PARSERS, "reasoning-parser",
           f"must be one of {', '.join(REASONING_PARSERS)}, got {reasoning_parser!r}")


def _check_control_plane(curve_keys: str | None, insecure: bool) -> None:
    """Exactly one of ``--curve-keys DIR`` (whose key pair must load) and ``--insecure-control-plane``.

    Raises:
        ValueError: neither, both, or a key directory without a valid key pair (the message names it).
    """
    _check(not (curve_keys and insecure), "insecure-control-plane", "cannot be combined with --curve-keys")
    _check(bool(curve_keys) or insecure, "curve-keys",
           "required: a directory with the fleet's CURVE key pair (make one with `pdserve keygen DIR`; "
           "`pdserve up` makes its own), or --insecure-control-plane to accept any peer")
    if curve_keys:
        try:
            load_keys(curve_keys)
        except ValueError as exc:
            raise ValueError(f"--curve-keys: {exc}") from exc


# An empty key would mean "no key" to the gateway and silently serve without one: refused instead
EMPTY_API_KEY = ("a key must not be empty (an --api-key '' or an --api-key \"$VAR\" with VAR unset, or "
                 "PDSERVE_API_KEY set to '' or with an empty entry); to serve without a key, give no "
                 "--api-key and unset PDSERVE_API_KEY")

# The key deploy/k8s/base/secret.yaml ships in place of a real one: public, so refused like an empty key
PLACEHOLDER_API_KEY = "REPLACE-ME-WITH-A-REAL-KEY"


@dataclass(frozen=True)
class GatewaySettings:
    """``pdserve gateway``: HTTP front-end, worker registry and router. Times in seconds, sizes in bytes."""

    host: str = "127.0.0.1"
    port: int = 8000
    control_bind: str = "tcp://127.0.0.1:7100"
    model_name: str | None = None
    tokenizer: str | None = None
    api_keys: tuple[str, ...] = ()
    public_health: bool = True
    public_metrics: bool = True
    disagg_threshold: int = 0
    allow_local_prefill: bool = False
    max_queue: int = 1024
    request_timeout: float = 600.0
    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None
    max_n: int = 16
    max_stop: int = 16
    heartbeat_timeout: float = 5.0
    max_retries: int = 2
    max_migrations: int = 1
    admission_budget: float = 30.0
    kv_canary_period: float = 60.0  # seconds between canaries of a usable pair (0: only at pairing)
    kv_canary_timeout: float = 10.0  # seconds a canary has to land before its pair leaves routing
    kv_canary_mib: float = 64.0  # size of a canary transfer in MiB (at least one block)
    tool_call_parser: str = "auto"  # auto: by the chat template (gateway/tool_parsers)
    reasoning_parser: str = "auto"  # auto: by the chat template (gateway/reasoning.py)
    curve_keys: str | None = None  # directory with the fleet's CURVE key pair (kvtransfer/curve.py)
    insecure_control_plane: bool = False  # no CURVE: any peer that reaches the control socket may join
    workers: int = 1  # gateway processes sharing the HTTP port, each with its own control socket
    drain_timeout: float = 30.0  # seconds a stop signal lets the requests in flight finish (0: none)
    log_level: str = "info"
    log_format: str = "text"

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        _check(all(key.strip() for key in self.api_keys), "api-key", EMPTY_API_KEY)
        spaced = [key for key in self.api_keys if key != key.strip() or any(c.isspace() for c in key)]
        _check(not spaced, "api-key", "a key must not hold whitespace (no Authorization header can carry "
               f"it; PDSERVE_API_KEY takes 'k1,k2' without spaces), got {spaced[0]!r}" if spaced else "")
        _check(PLACEHOLDER_API_KEY not in self.api_keys, "api-key",
               f"{PLACEHOLDER_API_KEY} is the placeholder of deploy/k8s/base/secret.yaml, known to anyone: "
               "replace it with a key of your own")
        _check_parsers(self.tool_call_parser, self.reasoning_parser)
        _check(self.control_bind.startswith(("tcp://", "ipc://", "inproc://")), "control-bind",
               f"must be a zmq endpoint like tcp://host:port, got {self.control_bind!r}")
        _check(1 <= self.workers <= MAX_GATEWAY_PROCESSES, "workers",
               f"must be in [1, {MAX_GATEWAY_PROCESSES}] gateway processes, got {self.workers}")
        if self.workers > 1:
            _check(self.port != 0, "port", f"must be a fixed port with --workers {self.workers}: every "
                   "process serves the same one (0 would give each a different port)")
            self.control_endpoints()  # raises when the control ports do not fit
        _check(self.disagg_threshold >= 0, "disagg-threshold", "must be >= 0")
        _check(self.max_queue >= 1, "max-queue", "must be >= 1")
        _check_seconds(self.request_timeout, "request-timeout")
        _check(self.max_body_bytes > 0, "max-body-bytes", "must be > 0")
        _check(self.max_prompt_tokens is None or self.max_prompt_tokens > 0, "max-prompt-tokens",
               "must be > 0")
        _check(self.max_n >= 1, "max-n", "must be >= 1")
        _check(self.max_stop >= 0, "max-stop", "must be >= 0")
        _check_seconds(self.heartbeat_timeout, "heartbeat-timeout")
        _check_seconds(self.drain_timeout, "drain-timeout", "0: stop at once")
        _check(self.max_retries >= 0, "max-retries", f"must be >= 0, got {self.max_retries}")
        _check(self.max_migrations >= 0, "max-migrations", f"must be >= 0, got {self.max_migrations}")
        _check_seconds(self.admission_budget, "admission-budget", "0 turns the queue check off")
        _check_seconds(self.kv_canary_period, "kv-canary-period", "0: only at pairing")
        _check_seconds(self.kv_canary_timeout, "kv-canary-timeout")
        _check(0 <= self.kv_canary_mib <= 1024, "kv-canary-mib",
               f"must be in [0, 1024] MiB (0: one block), got {self.kv_canary_mib}")
        _check_control_plane(self.curve_keys, self.insecure_control_plane)
        _check(self.log_level in _LOG_LEVELS, "log-level", f"must be one of {_LOG_LEVELS}")
        _check(self.log_format in ("text", "json"), "log-format", "must be text or json")

    def control_endpoints(self) -> tuple[str, ...]:
        """The control socket of each gateway process: ``--control-bind`` itself for one process; for
        ``--workers N`` > 1, ``tcp://host:P`` gives process i the port P + i (P .. P + N - 1); a worker
        given any one of them learns the others from its ``RegisterAck`` (``sibling_ports``).

        Raises:
            ValueError: N > 1 with a control endpoint that is not ``tcp://host:port`` with a fixed port,
                or whose last port would pass 65535 (the message names ``--control-bind``).
        """
        if self.workers == 1:
            return (self.control_bind,)
        head, _, port_text = self.control_bind.rpartition(":")
        _check(self.control_bind.startswith("tcp://") and port_text.isdigit() and len(head) > len("tcp://"),
               "control-bind", f"must be tcp://host:port with a fixed port with --workers {self.workers} "
               f"(process i binds port + i), got {self.control_bind!r}")
        first = int(port_text)
        _check(first > 0 and first + self.workers - 1 < 65536, "control-bind",
               f"ports {first}..{first + self.workers - 1} (one per gateway process) must lie in "
               f"[1, 65535]")
        return tuple(f"{head}:{first + i}" for i in range(self.workers))


HOST_TIER_NEEDS_DECODE_REUSE = (
    "the host KV tier holds blocks evicted from the prefix cache, which a decode worker keeps only with "
    "--decode-prefix-reuse true (or --kv-host-cache-gib 0)")


@dataclass(frozen=True)
class WorkerSettings:
    """``pdserve prefill|decode|colocated``: one engine process. ``block_size`` in tokens."""

    role: str
    model: str = "smollm2-135m"
    dtype: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    async_scheduling: bool = True
    fused_ops: str = "auto"
    pdl: bool = True
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_fraction: float = 0.9
    kv_host_cache_gib: float = 0.0  # host-memory KV tier budget (GiB); 0: off (engine/kv_host_tier.py)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8: float8_e4m3fn (engine.config.CacheConfig)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True  # engine.config.CacheConfig.enable_prefix_caching
    prefill_grid: int = 0  # tokens; 0: off (engine.config.SchedulerConfig.prefill_grid)
    decode_prefix_reuse: bool = True  # decode workers only (DECODE_ONLY_WORKER_FIELDS)
    max_model_len: int | None = None
    gateway_control: str = "tcp://127.0.0.1:7100"  # comma-separated; a DNS name: each of its addresses
    gateway_resolve_interval: float = 5.0  # seconds between DNS lookups of --gateway-control's names
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = 0
    worker_id: str = ""
    transfer_backend: str = "nixl"
    engine_warmup: str = "auto"
    metrics_port: int = 0  # /metrics, /health, /live on this TCP port (0: no such server)
    engine_stall_timeout: float = 60.0  # seconds without an engine-loop tick before /health is 503
    cpu_threads: int = 0  # torch intra-op threads of each rank (0: torch's default, every core)
    tensor_parallel_size: int = 1
    curve_keys: str | None = None  # directory with the fleet's CURVE key pair (kvtransfer/curve.py)
    insecure_control_plane: bool = False  # no CURVE on the gateway and KV control sockets
    drain_timeout: float = 30.0  # seconds a stop signal lets the requests this worker holds finish (0: none)
    log_level: str = "info"
    log_format: str = "text"

    def __post_init__(self) -> None:
        _check(self.role in ("prefill", "decode", "colocated"), "role", f"unknown role {self.role!r}")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", f"bad {self.dtype!r}")
        _check(self.load_format in ("auto", "dummy"), "load-format",
               f"must be auto or dummy, got {self.load_format!r}")
        _check(self.quantization in (None, "fp8"), "quantization",
               f"must be fp8 (or unset), got {self.quantization!r}")
        _check(self.fused_ops in ("auto", "on", "off"), "fused-ops",
               f"must be auto, on or off, got {self.fused_ops!r}")
        _check_device(self.device)
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention-backend",
               f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        _check(self.block_size >= 1, "block-size", "must be >= 1")
        _check(self.num_blocks is None or self.num_blocks >= 1, "num-blocks", "must be >= 1")
        _check(0 < self.kv_memory_fraction <= 1, "kv-memory-fraction",
               f"must be in (0, 1], got {self.kv_memory_fraction}")
        _check(math.isfinite(self.kv_host_cache_gib) and self.kv_host_cache_gib >= 0, "kv-host-cache-gib",
               f"must be a finite number of GiB >= 0 (0: no host KV tier), got {self.kv_host_cache_gib}")
        _check(self.kv_host_cache_gib * GIB < physical_memory_bytes(), "kv-host-cache-gib",
               f"{self.kv_host_cache_gib} GiB is not below this host's memory "
               f"({physical_memory_bytes() / GIB:.1f} GiB)")
        _check(self.kv_host_cache_gib == 0 or self.tensor_parallel_size == 1, "kv-host-cache-gib",
               "the host KV tier runs with one rank only (--tensor-parallel-size 1)")
        # the tier holds blocks evicted from the prefix cache: without one it would hold nothing
        _check(self.kv_host_cache_gib == 0 or self.enable_prefix_caching, "kv-host-cache-gib",
               "the host KV tier holds blocks evicted from the prefix cache: it needs "
               "--enable-prefix-caching true (or --kv-host-cache-gib 0)")
        # --decode-prefix-reuse applies to decode workers only (workers/setup.py)
        _check(self.role != "decode" or self.kv_host_cache_gib == 0 or self.decode_prefix_reuse,
               "kv-host-cache-gib", HOST_TIER_NEEDS_DECODE_REUSE)
        _check(self.kv_cache_dtype in ("auto", "fp8"), "kv-cache-dtype",
               f"must be auto or fp8, got {self.kv_cache_dtype!r}")
        _check(self.kv_cache_dtype == "auto" or self.attention_backend in ("auto", "triton", "torch"),
               "kv-cache-dtype", f"fp8 needs --attention-backend auto, triton or torch, got "
               f"{self.attention_backend!r}")
        _check(self.max_num_seqs >= 1, "max-num-seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max-num-batched-tokens", "must be >= 1")
        _check(self.prefill_grid == 0 or (2 <= self.prefill_grid <= self.max_num_batched_tokens
                                          and self.prefill_grid % self.block_size == 0), "prefill-grid",
               f"must be 0 (off) or a multiple of --block-size ({self.block_size}) in [2, "
               f"--max-num-batched-tokens ({self.max_num_batched_tokens})], got {self.prefill_grid}")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max-model-len",
               f"must be >= 2 tokens, got {self.max_model_len}")
        _check(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        parse_endpoints(self.gateway_control, "gateway-control")
        _check(0 < self.gateway_resolve_interval <= 3600, "gateway-resolve-interval",
               f"must be in (0, 3600] seconds, got {self.gateway_resolve_interval}")
        _check(0 <= self.metrics_port < 65536, "metrics-port",
               f"must be in [0, 65535] (0: no metrics server), got {self.metrics_port}")
        _check(self.metrics_port == 0 or self.metrics_port != self.port, "metrics-port",
               f"must differ from --port ({self.port})")
        _check(self.cpu_threads >= 0, "cpu-threads",
               f"must be >= 0 (0: torch's default), got {self.cpu_threads}")
        _check_seconds(self.engine_stall_timeout, "engine-stall-timeout")
        _check_seconds(self.drain_timeout, "drain-timeout", "0: stop at once")
        _check(self.transfer_backend in ("nixl", "ucx", "loopback"), "transfer-backend",
               f"must be nixl, ucx or loopback, got {self.transfer_backend!r}")
        _check(self.engine_warmup in ("auto", "on", "off"), "engine-warmup",
               f"must be auto, on or off, got {self.engine_warmup!r}")
        _check(1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE, "tensor-parallel-size",
               f"must be in [1, {MAX_TENSOR_PARALLEL_SIZE}], got {self.tensor_parallel_size}")
        _check_control_plane(self.curve_keys, self.insecure_control_plane)
        _check(self.log_level in _LOG_LEVELS, "log-level", f"must be one of {_LOG_LEVELS}")
        _check(self.log_format in ("text", "json"), "log-format", "must be text or json")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{socket.gethostname()}-{os.getpid()}")


def _template_worker() -> WorkerSettings:
    return WorkerSettings(role="colocated", worker_id="up", insecure_control_plane=True)


def _template_gateway() -> GatewaySettings:
    return GatewaySettings(insecure_control_plane=True)


# WorkerSettings fields `pdserve up` sets itself for each worker (UpSettings.worker leaves them alone)
UP_MANAGED_WORKER_FIELDS = frozenset({"role", "model", "device", "transfer_backend", "gateway_control",
                                      "gateway_resolve_interval",
                                      "host", "advertise_host", "port", "metrics_port", "worker_id",
                                      "log_level", "log_format", "curve_keys", "insecure_control_plane"})
# WorkerSettings fields only a decode worker has a flag for (`pdserve up` passes them to its decode workers)
DECODE_ONLY_WORKER_FIELDS = frozenset({"decode_prefix_reuse"})
# GatewaySettings fields `pdserve up` sets itself (host and port are UpSettings.host and .port)
UP_MANAGED_GATEWAY_FIELDS = frozenset({"host", "port", "control_bind", "workers", "log_level", "log_format",
                                       "curve_keys", "insecure_control_plane"})


@dataclass(frozen=True)
class UpSettings:
    """``pdserve up``: gateway + workers on one host. ``host``/``port``: the gateway's HTTP address (its
    internal sockets bind 127.0.0.1); ``gateway``: the gateway's other settings and ``worker``: every
    worker's, each as given to ``up`` (the fields in ``UP_MANAGED_GATEWAY_FIELDS`` and
    ``UP_MANAGED_WORKER_FIELDS`` are set by the launcher instead)."""

    model: str = "smollm2-135m"
    port: int = 8000
    host: str = "127.0.0.1"
    device: str = "auto"
    transfer_backend: str = "nixl"
    num_prefill: int = 1
    num_decode: int = 1
    colocated: int = 0
    gateway_workers: int = 1  # gateway processes on the one HTTP port (``pdserve gateway --workers``)
    cuda_mps: bool = False  # the workers under a CUDA MPS daemon of up's own (pdserve/cuda_mps.py)
    curve_keys: str | None = None  # default: a fresh key pair in a private temp dir, for this run only
    insecure_control_plane: bool = False
    log_level: str = "info"
    log_format: str = "text"
    gateway: GatewaySettings = field(default_factory=_template_gateway)
    worker: WorkerSettings = field(default_factory=_template_worker)

    def __post_init__(self) -> None:
        _check(self.port != 0, "port", "must be a fixed port (up waits for /ready on it and prints its URL; "
               "0 would let the gateway pick one up cannot learn)")
        _check(0 < self.port < 65536, "port", f"must be in [1, 65535], got {self.port}")
        _check_device(self.device)
        _check(all("," not in key for key in self.gateway.api_keys), "api-key",
               "a key must not contain a comma (pdserve up hands keys to the gateway in PDSERVE_API_KEY)")
        _check(self.num_prefill >= 0, "num-prefill", "must be >= 0")
        _check(self.num_decode >= 0, "num-decode", "must be >= 0")
        _check(self.colocated >= 0, "colocated", "must be >= 0")
        _check(1 <= self.gateway_workers <= MAX_GATEWAY_PROCESSES, "gateway-workers",
               f"must be in [1, {MAX_GATEWAY_PROCESSES}], got {self.gateway_workers}")
        _check(not self.cuda_mps or self.device != "cpu", "cuda-mps",
               "needs CUDA devices (--device cuda, cuda:N or auto on a host with GPUs), got --device cpu")
        _check(self.colocated > 0 or (self.num_prefill > 0 and self.num_decode > 0),
               "num-prefill" if self.num_prefill == 0 else "num-decode",
               f"need at least one prefill and one decode worker, or --colocated >= 1 (got --num-prefill "
               f"{self.num_prefill}, --num-decode {self.num_decode}, --colocated {self.colocated})")
        _check(self.num_decode == 0 or self.worker.kv_host_cache_gib == 0 or self.worker.decode_prefix_reuse,
               "kv-host-cache-gib", HOST_TIER_NEEDS_DECODE_REUSE)
        num_workers = self.num_prefill + self.num_decode + self.colocated
        host_tiers = num_workers * self.worker.kv_host_cache_gib
        _check(host_tiers * GIB < physical_memory_bytes(), "kv-host-cache-gib",
               f"{num_workers} workers x {self.worker.kv_host_cache_gib} GiB = {host_tiers:g} GiB of host KV "
               f"tiers is not below this host's memory ({physical_memory_bytes() / GIB:.1f} GiB)")
        if self.curve_keys or self.insecure_control_plane:  # neither: up makes a per-run key pair
            _check_control_plane(self.curve_keys, self.insecure_control_plane)


Settings = GatewaySettings | WorkerSettings | UpSettings


def control_keys(settings: GatewaySettings | WorkerSettings) -> CurveKeys | None:
    """The fleet's CURVE key pair from ``--curve-keys``; None with ``--insecure-control-plane``.

    Raises:
        ValueError: the key directory no longer holds a valid key pair (the message names the file).
    """
    return load_keys(settings.curve_keys) if settings.curve_keys else None


def _read_api_key_file(path: str | None) -> tuple[str, ...]:
    """The keys of ``--api-key-file`` (one per line; blank lines and lines starting with ``#`` skipped);
    none without the flag (``path`` None).

    Raises:
        ValueError: the file cannot be read; the path is empty (``--api-key-file "$VAR"`` with VAR unset)
            or the file holds no key: either would serve without a key where one was meant; or it holds
            ``PLACEHOLDER_API_KEY`` (the message names the flag and the file).
    """
    if path is None:
        return ()
    _check(path != "", "api-key-file", "must not be empty (an --api-key-file \"$VAR\" with VAR unset, or "
           "PDSERVE_API_KEY_FILE set to ''); to serve without a key, give no --api-key-file")
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:  # one line naming the flag, not "[Errno 2] No such file or directory: '...'"
        raise ValueError(f"--api-key-file {path}: cannot read it ({exc.strerror or exc})") from None
    keys = tuple(key for key in (line.strip() for line in lines) if key and not key.startswith("#"))
    _check(bool(keys), "api-key-file", f"{path} holds no key (only blank lines and # comments); give no "
           "--api-key-file to serve without a key")
    _check(PLACEHOLDER_API_KEY not in keys, "api-key-file",
           f"{path} holds the placeholder key {PLACEHOLDER_API_KEY} (deploy/k8s/base/secret.yaml), known to "
           "anyone: replace it with a key of your own")
    return keys


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Build the settings of ``args.command`` (``gateway``, ``prefill``, ``decode``, ``colocated``, ``up``).

    Raises:
        ValueError: unknown command, a flag value out of range (the message names the flag), e.g. an empty
            API key or the Kubernetes placeholder key, or an ``--api-key-file`` that cannot be read or holds
            no key.
    """
    values: dict[str, Any] = dict(vars(args))
    command = values.pop("command", None)
    if command == "gateway":
        keys = tuple(values.pop("api_key", None) or ()) + _read_api_key_file(values.pop("api_key_file"))
        values["api_keys"] = keys
        cls: type[Settings] = GatewaySettings
    elif command in ("prefill", "decode", "colocated"):
        values["role"] = command
        cls = WorkerSettings
    elif command == "up":
        return _up_settings(values)
    else:
        raise ValueError(f"no settings for command {command!r}")
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def _up_settings(values: dict[str, Any]) -> UpSettings:
    """``pdserve up``'s settings from its parsed flags: its own, the gateway's and the workers'."""
    keys = tuple(values.pop("api_key", None) or ()) + _read_api_key_file(values.pop("api_key_file", None))
    gateway_names = {f.name for f in fields(GatewaySettings)} - UP_MANAGED_GATEWAY_FIELDS
    worker_names = {f.name for f in fields(WorkerSettings)} - UP_MANAGED_WORKER_FIELDS
    # the control-plane fields are the launcher's (every child gets up's keys): templates say insecure
    gateway = GatewaySettings(api_keys=keys, insecure_control_plane=True,
                              **{k: v for k, v in values.items() if k in gateway_names and k != "api_keys"})
    worker = WorkerSettings(role="colocated", worker_id="up", insecure_control_plane=True,
                            **{k: v for k, v in values.items() if k in worker_names})
    names = {f.name for f in fields(UpSettings)} - {"gateway", "worker"}
    return UpSettings(gateway=gateway, worker=worker, **{k: v for k, v in values.items() if k in names})
