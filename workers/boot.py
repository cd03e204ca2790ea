"""Start a worker process: logging is already set by the CLI; build the engine, then run the loop.

``serve_worker(settings, factory)`` is what ``prefill_worker.main:run``, ``decode_worker.main:run`` and
``workers.colocated:run`` call. Returns a process exit status (0 clean, 1 start-up or run failure, 2 a
model or setting refused from the model's config.json before any weight is read: ``start_up_refusal``,
one line on stderr, as ``pdserve up`` refuses the same before starting any process).
Between building the engine and building the worker (so before it registers and logs ``worker_ready``)
the engine is warmed up per ``--engine-warmup`` (``engine.warmup``), and a prefill or colocated worker's
prefill rate is probed (``probe_core``): its first heartbeat already carries a rate gateways judge their
queues by.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from protocol.heap import freeze_start_up_heap
from protocol.logging import configure_logging, say_refused
from workers.control_client import RegistrationError

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from engine.warmup import PrefillProbe, WarmupReport
    from protocol.settings import WorkerSettings
    from workers.loop import WorkerLoop

log = logging.getLogger("pdserve.worker")

WorkerFactory = Callable[["WorkerSettings", "EngineCore", str], "WorkerLoop"]
_T = TypeVar("_T")


def start_up_refusal(settings: WorkerSettings) -> str | None:
    """Why this worker cannot serve ``--model`` with ``settings``, found from the model's ``config.json``
    before any weight is loaded or any rank process starts (the embedded alias is first converted from its
    GGUF file, once per machine: ``resolve_model``), as one line naming the flag, or None: a model that
    cannot be found or prepared, an architecture or quantization the engine cannot run
    (``read_model_config``), or what ``workers.setup.model_config_problem`` refuses (a ``--max-model-len``
    beyond the model's positions, a model ``--tensor-parallel-size`` ranks cannot split, a ``--block-size``
    no block of which fits, ...). ``--device auto`` is resolved as the engine resolves it (imports
    torch)."""
    from engine.models.registry import read_model_config, resolve_model
    from workers.setup import model_config_problem

    try:
        config = read_model_config(resolve_model(settings.model), settings.quantization)
    except (ValueError, FileNotFoundError) as exc:
        return str(exc)
    device = settings.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return model_config_problem(settings, config, device, settings.model)


def build_core(settings: WorkerSettings, *, prefill_only: bool = False) -> tuple[EngineCore, str]:
    """Set torch's intra-op threads (``--cpu-threads``, when not 0), load the model and size the KV cache;
    returns the engine and the local model directory. ``serve_worker`` has refused what the model's
    ``config.json`` rules out (``start_up_refusal``) before.

    Raises:
        ValueError / FileNotFoundError: bad settings or a model that cannot be found or loaded.
    """
    from engine.engine_core import EngineCore
    from engine.models.registry import resolve_model
    from workers.setup import engine_config_from_settings

    if settings.cpu_threads:  # before the model is built; the other tensor parallel ranks inherit it
        import torch

        torch.set_num_threads(settings.cpu_threads)
    path = str(resolve_model(settings.model))
    rank_hook = None
    if settings.role in ("prefill", "decode") and settings.tensor_parallel_size > 1:
        from workers.rank_kv import rank_kv_hook
        from workers.tp_kv import rank_kv_spec

        # every other rank runs its own KV endpoint, driven by the worker's RankSender / RankReceiver
        rank_hook = functools.partial(rank_kv_hook, rank_kv_spec(settings))
    # the other ranks are spawned: they log in the worker's format from their first line
    rank_setup = functools.partial(configure_logging, settings.log_level, settings.log_format)
    core = EngineCore(engine_config_from_settings(settings), prefill_only=prefill_only, rank_hook=rank_hook,
                      rank_setup=rank_setup)
    return core, path


def warm_up_core(settings: WorkerSettings, core: EngineCore) -> WarmupReport | None:
    """Run ``engine.warmup.warmup`` on ``core`` when ``settings.engine_warmup`` asks for it (``auto``: on
    CUDA only); returns its report, or None when skipped or failed.

    A warm-up that fails but leaves the engine clean (no request, every KV block free) is logged as a
    warning and the worker serves without it: warming up is an optimisation, never a reason not to start.

    Raises:
        ValueError: bad mode. RuntimeError: the warm-up failed and left the engine holding something.
    """
    from engine.warmup import should_warm_up, warmup

    if not should_warm_up(settings.engine_warmup, core.runner.device.type):
        return None
    return _optional_run(core, lambda: warmup(core), "warm-up", "warmup_failed", "serving without warm-up")


def _optional_run(core: EngineCore, run: Callable[[], _T], what: str, event: str, then: str) -> _T | None:
    """``run()``'s result; when it raises, None after a warning (``event``, the error, ``then``) if
    ``core`` holds nothing (an optional start-up step never stops the worker).

    Raises:
        RuntimeError: ``run`` failed and left ``core`` holding a request or KV blocks.
    """
    try:
        return run()
    except Exception as exc:  # any failure of an optional step is handled the same way
        try:
            core.check_no_leaks()
        except AssertionError as leak:
            raise RuntimeError(f"{what} failed ({exc!r}) and left the engine unclean: {leak}") from exc
        log.warning("%s error=%r: %s", event, exc, then)
        return None


def probe_core(settings: WorkerSettings, core: EngineCore) -> PrefillProbe | None:
    """Time a few throw-away prompts on ``core`` (``engine.warmup.probe_prefill``) when this worker
    computes prompts (``prefill``, ``colocated``); logs ``prefill_probe``. Returns None for a decode worker,
    or when the probe did not run or failed and left the engine clean (logged as a warning: the worker
    then reports no rate until it has served, and gateways admit without judging its queue).

    Raises:
        RuntimeError: the probe failed and left the engine holding something.
    """
    from engine.warmup import probe_prefill

    if settings.role not in ("prefill", "colocated"):
        return None
    probe = _optional_run(core, lambda: probe_prefill(core), "prefill probe", "prefill_probe_failed",
                          "no prefill rate until the first request")
    if probe is not None:
        log.info("prefill_probe", extra={"tokens": probe.tokens, "seconds": round(probe.seconds, 4),
                                         "tokens_per_s": round(probe.tokens / max(probe.seconds, 1e-9))})
    return probe


def serve_worker(settings: WorkerSettings, factory: WorkerFactory, *, prefill_only: bool = False) -> int:
    """Refuse what the model's config rules out (``start_up_refusal``: one line on stderr, 2), build the
    engine and the worker (``factory``), serve until SIGTERM/SIGINT. Returns an exit code."""
    from engine.compile_watch import CompileWatch
    from workers.setup import default_transport_env

    try:
        refused = start_up_refusal(settings)
    except (RuntimeError, OSError) as exc:  # e.g. the embedded model's conversion failed
        log.error("pdserve %s: cannot start: %s", settings.role, exc)
        return 1
    if refused is not None:
        say_refused(settings.role, refused)
        return 2
    default_transport_env(settings.advertise_host or settings.host)
    watch = CompileWatch().install()  # a Triton compile after start-up is logged as a first-use stall
    core: EngineCore | None = None
    try:
        core, path = build_core(settings, prefill_only=prefill_only)
        warm_up_core(settings, core)
        probe = probe_core(settings, core)
        core.structured_outputs.preload()  # the grammar engine's tokenizer, off the control loop
        worker = factory(settings, core, path)
        if probe is not None:
            worker.seed_prefill_rate(probe.tokens, probe.seconds, probe.ended)
        watch.serving()
        freeze_start_up_heap()
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        log.error("pdserve %s: cannot start: %s", settings.role, exc)
        if core is not None:
            core.close()
        return 1
    try:
        asyncio.run(worker.run())
    except (RegistrationError, OSError) as exc:  # OSError: --metrics-port could not be bound
        log.error("pdserve %s: %s", settings.role, exc)
        return 1
    finally:
        lost = core.ranks.dead_followers() if core.ranks is not None else []
        core.close()  # the other tensor parallel ranks end with this one
    if lost:
        log.error("pdserve %s: tensor parallel ranks lost: %s", settings.role, ", ".join(lost))
        return 1
    if worker.fatal is not None:
        log.error("pdserve %s: %s", settings.role, worker.fatal)
        return 1
    return 0
