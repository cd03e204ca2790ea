"""The flags of ``pdserve bench --workload agent`` and its run action (``loadtest.cli`` dispatches here).

The agent workload has its own flags (sessions, turns, user and tool-result lengths, think time, max
context, the systems under test, the KV size of a token); the open/closed-loop flags of the other
workloads do not apply to it and are refused when set, as the agent flags are with another workload.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtest.agent_config import AgentConfig, SystemTarget
from loadtest.config import SLOConfig
from loadtest.kv_size import kv_bytes_per_token, load_model_config
from loadtest.lengths import LengthDist
from protocol.cli_env import OneLineParser
from protocol.durations import flag_duration

# flag → (dest, default when not given)
AGENT_FLAGS: dict[str, tuple[str, Any]] = {
    "--sessions": ("sessions", 8), "--turns": ("turns", 20), "--user-tokens": ("user_tokens", "fixed:100"),
    "--tool-tokens": ("tool_tokens", "fixed:600"), "--think-time": ("think_time", "1s"),
    "--max-context": ("max_context", None), "--system": ("system", []),
    "--kv-bytes-per-token": ("kv_bytes_per_token", None), "--model-config": ("model_config", None),
    "--kv-dtype": ("kv_dtype", None), "--word-list": ("word_list", None),
}
# flags of the open/closed-loop workloads, which the agent workload does not read
OTHER_FLAGS = ("--input-len", "--dataset-path", "--num-turns", "--arrival", "--request-rate", "--burstiness",
               "--concurrency", "--num-requests", "--duration", "--warmup", "--fault", "--decode-metrics")


def add_agent_arguments(add: Callable[..., None]) -> None:
    """Add the agent workload's flags through ``add`` (the bench parser's ``protocol.cli_env.EnvAdder``)."""
    add("--sessions", type=int, help="agent: concurrent sessions (default 8)")
    add("--turns", type=int, help="agent: turns per session (default 20)")
    add("--user-tokens", help="agent: user-text words per turn, ~1 token each (default fixed:100)")
    add("--tool-tokens", help="agent: tool-result words per turn (default fixed:600)")
    add("--think-time", help="agent: wait between a session's turns, e.g. 2s (default 1s)")
    add("--max-context", type=int, help="agent: end a session before a turn that could pass this many "
                                        "tokens (prompt + answer); a limit no session's first turn fits "
                                        "is refused (exit 2)")
    add("--system", action="append", default=[], env_one_value=True,
        help="agent, repeatable: label=NAME,url=GATEWAY[,prefill=METRICS_URL+...][,decode=METRICS_URL+...]; "
             "each system runs the same workload in turn (default: --base-url, no worker counters). "
             "METRICS_URL: a worker's metrics page as `pdserve up` prints it (http://host:port/metrics; "
             "http://host:port reads the same page); one that cannot be read before the load ends the bench "
             "(exit 2), during a run gives exit 1 (PDSERVE_SYSTEM holds one)")
    add("--kv-bytes-per-token", type=int, help="agent: KV bytes of one token, for the new tokens' own KV")
    add("--model-config", help="agent: the model's config.json (or its directory): KV bytes per token "
                               "from it, with --kv-dtype")
    add("--kv-dtype", choices=("float32", "bfloat16", "float16"), help="agent: the workers' KV-cache dtype")
    add("--word-list", help="agent: file of whitespace-separated words the texts are drawn from (default: "
                            "common English words; a word-level tokenizer needs words of its vocabulary)")


def _defaults() -> dict[str, Any]:
    from loadtest.cli import add_bench_arguments

    parser = OneLineParser()
    add_bench_arguments(parser)
    return vars(parser.parse_args([]))


def check_flags(args: argparse.Namespace) -> None:
    """Refuse flags that do not apply: another workload's with ``agent``, the agent's with another,
    ``--dataset-path`` with any workload but ``sharegpt`` (the only one that reads it), and an arrival
    flag the chosen ``--arrival`` does not read (``_check_arrival_flags``). For ``--dataset-path``
    and the other workloads' flags with ``agent``, a value equal to the default (``PDSERVE_<FLAG>`` when
    set) is not refused: the workload ignores it.

    Raises ValueError naming the flag.
    """
    if (args.workload != "sharegpt" and args.dataset_path
            and args.dataset_path != _defaults()["dataset_path"]):
        raise ValueError(f"--dataset-path: only read by --workload sharegpt (got --workload {args.workload})")
    if args.workload != "agent":
        for flag, (dest, _) in AGENT_FLAGS.items():
            if getattr(args, dest) not in (None, []):
                raise ValueError(f"{flag} applies to --workload agent only (got --workload {args.workload})")
        _check_arrival_flags(args)
        return
    defaults = _defaults()
    for flag in OTHER_FLAGS:
        dest = flag.lstrip("-").replace("-", "_")
        if getattr(args, dest) != defaults[dest]:
            raise ValueError(f"{flag} does not apply to --workload agent (its turns run in lockstep: see "
                             "--sessions, --turns, --think-time)")
    if args.prompt_format == "tokens" and defaults["prompt_format"] != "tokens":
        raise ValueError("--prompt-format tokens: the agent workload sends text")
    if args.system and args.base_url != defaults["base_url"]:
        raise ValueError("--base-url and --system: give the gateway as url= of each --system")


def _check_arrival_flags(args: argparse.Namespace) -> None:
    """Refuse an arrival flag the chosen ``--arrival`` does not read, set to another value than its
    default (``PDSERVE_<FLAG>`` when set): ``--concurrency`` (the sessions of closed arrivals, and the
    warm-up's parallelism whatever the arrival: refused only without either), ``--request-rate`` (not
    closed) and ``--burstiness`` (gamma only). Raises ValueError naming the flag."""
    defaults = _defaults()
    if args.arrival != "closed" and not args.warmup and args.concurrency != defaults["concurrency"]:
        raise ValueError(f"--concurrency applies to --arrival closed and to the --warmup requests only (got "
                         f"--arrival {args.arrival} and no warm-up: requests are sent at --request-rate)")
    if args.arrival == "closed" and args.request_rate != defaults["request_rate"]:
        raise ValueError("--request-rate does not apply to --arrival closed (its --concurrency sessions send "
                         "back to back)")
    if args.arrival != "gamma" and args.burstiness != defaults["burstiness"]:
        raise ValueError(f"--burstiness applies to --arrival gamma only (got --arrival {args.arrival})")


def _kv_bytes(args: argparse.Namespace) -> int | None:
    if args.kv_bytes_per_token is not None and args.model_config:
        raise ValueError("--kv-bytes-per-token and --model-config: give one of them")
    if bool(args.model_config) != bool(args.kv_dtype):
        raise ValueError("--model-config and --kv-dtype go together (KV bytes per token = 2 x layers x KV "
                         "heads x head_dim x the dtype's bytes)")
    if args.model_config:
        try:
            return kv_bytes_per_token(load_model_config(args.model_config), args.kv_dtype)
        except OSError as exc:  # not "[Errno 2] No such file or directory: '...'"
            raise ValueError(f"--model-config {args.model_config}: cannot read {exc.filename or 'it'} "
                             f"({exc.strerror or exc})") from None
        except ValueError as exc:
            raise ValueError(f"--model-config {args.model_config}: {exc}") from exc
    return None if args.kv_bytes_per_token is None else int(args.kv_bytes_per_token)


def _words(path: str | None) -> tuple[str, ...] | None:
    if path is None:
        return None
    try:
        words = tuple(Path(path).read_text(encoding="utf-8").split())
    except OSError as exc:  # not "[Errno 2] No such file or directory: '...'"
        raise ValueError(f"--word-list {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--word-list {path}: not UTF-8 text") from None
    if not words:
        raise ValueError(f"--word-list {path}: no word in the file")
    return words


def _get(args: argparse.Namespace, flag: str) -> Any:
    dest, default = AGENT_FLAGS[flag]
    value = getattr(args, dest)
    return default if value is None else value


def agent_config_from_args(args: argparse.Namespace, model: str) -> AgentConfig:
    """Build and validate the agent config. Raises ValueError naming the bad flag value (a
    ``--max-context`` below what every session's first turn could reach: the run would send nothing; an
    unreadable ``--model-config`` or ``--word-list``)."""
    check_flags(args)
    systems = tuple(SystemTarget.parse(s) for s in args.system) or (
        SystemTarget("server", args.base_url.rstrip("/")),)
    max_context = _get(args, "--max-context")
    cfg = AgentConfig(
        model=model, systems=systems, endpoint=args.endpoint, api_key=args.api_key,
        sessions=int(_get(args, "--sessions")), turns=int(_get(args, "--turns")),
        user_tokens=LengthDist.parse_flag("--user-tokens", _get(args, "--user-tokens")),
        tool_tokens=LengthDist.parse_flag("--tool-tokens", _get(args, "--tool-tokens")),
        output_len=LengthDist.parse_flag("--output-len", args.output_len),
        think_time_s=flag_duration("--think-time", _get(args, "--think-time")),
        max_context=None if max_context is None else int(max_context), ignore_eos=bool(args.ignore_eos),
        temperature=float(args.temperature), seed=int(args.seed),
        request_timeout_s=flag_duration("--request-timeout", args.request_timeout),
        slo=SLOConfig(ttft_ms=float(args.slo_ttft_ms), tpot_ms=float(args.slo_tpot_ms)),
        kv_bytes_per_token=_kv_bytes(args), words=_words(args.word_list),
        metrics_path=args.metrics_path or None,
        leak_settle_s=flag_duration("--leak-settle", args.leak_settle),
        progress=not args.no_progress)
    _check_first_turn(cfg)
    return cfg


def _check_first_turn(cfg: AgentConfig) -> None:
    """Refuse a ``--max-context`` that no session's first turn fits (every session would end before it)."""
    from loadtest.agent_runner import TEMPLATE_SLACK_TOKENS, first_turn_tokens

    if cfg.max_context is None:
        return
    least = min(first_turn_tokens(cfg))
    if least > cfg.max_context:
        raise ValueError(f"--max-context {cfg.max_context}: no session's first turn fits (the smallest could "
                         f"reach {least} tokens: its user words and tool result (--user-tokens, "
                         f"--tool-tokens), {TEMPLATE_SLACK_TOKENS} of chat template and its max tokens "
                         f"(--output-len)); give at least {least}")


def run_agent_bench(args: argparse.Namespace) -> int:
    """Run the agent workload of ``args``; print the report, write the outputs; return the exit code.

    0: done; 1: a system completed no request, leaked KV blocks, or lost its worker pages (``--system
    ...,prefill=,decode=``) during its run; 2: bad arguments, or a worker page that cannot be read before
    any load is sent.
    """
    from loadtest.agent_report import agent_markdown, save_agent_json
    from loadtest.agent_runner import check_worker_pages, run_agent
    from loadtest.models import first_model

    try:
        cfg = agent_config_from_args(args, args.model or "placeholder")  # validate before any traffic
        model = args.model or asyncio.run(first_model(cfg.systems[0].url, args.api_key))
        cfg = agent_config_from_args(args, model)
        asyncio.run(check_worker_pages(cfg))
        result = asyncio.run(run_agent(cfg))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = agent_markdown(result)
    print(text, end="")
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_agent_json(result, out / "results.json")
        (out / "summary.md").write_text(text, encoding="utf-8")
        print(f"results written to {out}/ (results.json, summary.md)")
    bad = any(s.summary.completed == 0 or (s.kv.leaked or 0) > 0 for s in result.systems)
    for s in result.systems:  # say why the exit code is 1
        if s.summary.completed == 0:
            by_context = (f"; {s.sessions_ended_by_context} sessions ended by --max-context"
                          if s.sessions_ended_by_context else "")
            print(f"error: system {s.label}: no request completed{by_context}", file=sys.stderr)
        if (s.kv.leaked or 0) > 0:
            print(f"error: system {s.label}: {s.kv.leaked:g} KV blocks still used after the run",
                  file=sys.stderr)
    asked = {t.label for t in cfg.systems if t.has_counters}
    unread = [s for s in result.systems if s.label in asked and s.counters_error]
    for system in unread:  # asked for and not read: not a finished benchmark
        print(f"error: --system {system.label}: worker counters not read ({system.counters_error})",
              file=sys.stderr)
    return 1 if bad or unread else 0
