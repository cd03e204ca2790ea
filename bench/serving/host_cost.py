"""Host (CPU) time of one multi-turn chat request by piece, as the prompt grows: what a turn costs the
gateway, the prefill worker and the decode worker outside the model forward.

Run: ``python -m bench.serving.host_cost [--lengths 700,4000,8000,15400] [--turn-tokens 770]
[--repeats 30] [--warmup 3] [--clock wall|cpu] [--tokenizer llama3-8b] [--block-size 16]
[--json out.json]``.

For each target length a conversation is built the way ``bench.serving.agent_turns`` builds one (turns
of about ``--turn-tokens`` tokens of the tokenizer's own words, user text then a tool-result block, each
answered by an assistant reply) until the rendered prompt reaches the length. The prompt of the previous
turn (the conversation without its last user message) is held by both workers' prefix caches and
reported by both in the gateway's prefix index, as in a session with prefix reuse on. Then each piece is
timed with the project's own code on the current turn's request (median of ``--repeats`` calls after
``--warmup``, µs; ``--clock wall``: ``time.perf_counter``; ``cpu``: ``time.process_time``, the process's
CPU time, steadier than wall time on a machine other jobs share):

gateway
    ``parse``: the chat body's JSON into ``ChatCompletionRequest`` (pydantic, as the HTTP edge does);
    ``render``: ``render_messages`` (the chat template); ``tokenize``: ``encode_text``; ``route``:
    ``Router.route`` (block hashes of the prompt, prefix-index matches, pending entries) over one
    prefill and one decode worker; ``encode``: msgpack of the ``PrefillRequest`` and the ``ReserveKV``.
prefill worker
    ``decode``: the ``PrefillRequest`` frame; ``admit``: ``EngineCore.validate_prompt`` and the
    ``Sequence``; ``schedule``: ``Scheduler.add`` + ``schedule`` (prefix-cache match, block allocation);
    ``inputs``: ``StepBatch.from_output`` and ``ModelRunner._prepare_inputs`` on the CPU (token ids,
    positions, attention metadata: slot_mapping, block tables); ``update``: ``Scheduler.update`` (hashing
    the newly computed blocks into the prefix cache), then the sequence is released.
decode worker
    ``decode``: the ``ReserveKV`` frame; ``admit``: ``validate_prompt`` and the ``Sequence``;
    ``reserve``: ``Scheduler.add_waiting_for_kv`` with prefix reuse (prefix-cache match, contiguous run);
    ``landed``: ``Scheduler.kv_landed`` (hashing the received blocks), then the sequence is released.

Each repeat starts from the same cache state (a fresh block manager holding the previous turn).
The table prints µs per piece per length and the growth from the shortest length to the
longest. Needs no GPU (the runner's inputs are built on the CPU, as the host part of a step is).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import cast

import torch

from bench.argtypes import non_negative_int, positive_int, positive_int_list
from engine.block_manager import BlockManager
from engine.config import CacheConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.model_runner import ModelRunner
from engine.models.registry import resolve_model
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.step_batch import StepBatch
from gateway.openai_requests import ChatCompletionRequest
from gateway.prefix_index import PrefixIndex, block_hashes
from gateway.prepare import encode_text, render_messages
from gateway.registry import WorkerRegistry
from gateway.router import Router
from gateway.text import TextProcessor
from kvtransfer.compat import KVCompat
from protocol.messages import KVEvents, PrefillRequest, RegisterWorker, ReserveKV, WorkerLoad, decode, encode

PIECES = ("gw.parse", "gw.render", "gw.tokenize", "gw.tokenize.cold", "gw.route", "gw.encode",
          "pf.decode", "pf.admit", "pf.schedule", "pf.inputs", "pf.update",
          "dw.decode", "dw.admit", "dw.reserve", "dw.landed")


@dataclass(frozen=True)
class Case:
    """One request: the chat body (JSON bytes), its prompt's token ids and the previous turn's."""

    body: bytes
    prompt: list[int]
    previous: list[int]


def _words(text: TextProcessor, n: int, rng: random.Random) -> str:
    vocab = text.tokenizer.vocab_size
    return " ".join(f"t{rng.randrange(1000, min(vocab, 100000))}" for _ in range(n))


def build_case(text: TextProcessor, length: int, turn_tokens: int, seed: int = 0) -> Case:
    """A conversation whose rendered prompt has at least ``length`` tokens (each turn ~``turn_tokens``:
    1/8 user words, the rest a tool result, answered by a 64-word reply)."""
    rng = random.Random(seed)
    messages: list[dict[str, str]] = []
    while True:
        user = (_words(text, turn_tokens // 8, rng) + "\n\n[tool result]\n"
                + _words(text, turn_tokens * 7 // 8 - 64, rng))
        messages.append({"role": "user", "content": user})
        prompt = encode_text(text, render_messages(text, messages, None), False, "messages")
        if len(prompt) >= length:
            break
        messages.append({"role": "assistant", "content": _words(text, 64, rng)})
    previous = encode_text(text, render_messages(text, messages[:-2], None), False, "messages") \
        if len(messages) > 1 else []
    body = {"model": "m", "messages": messages, "max_tokens": 64, "temperature": 0.0}
    return Case(json.dumps(body).encode(), prompt, previous)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def _median_us(fn: Callable[[], object], repeats: int, warmup: int, clock: Callable[[], float]) -> float:
    times = []
    for i in range(warmup + repeats):
        t0 = clock()
        fn()
        dt = clock() - t0
        if i >= warmup:
            times.append(dt)
    return statistics.median(times) * 1e6


def _register(wid: str, role: str, block_size: int) -> RegisterWorker:
    return RegisterWorker(role=role, worker_id=wid, epoch=1, model="m", model_path="",  # type: ignore[arg-type]
                          compat=KVCompat(model_id="m", dtype="bfloat16", block_size=block_size),
                          load=WorkerLoad(num_running=0, num_free_blocks=10000, num_total_blocks=10000))


def _engine(block_size: int, num_blocks: int, prefill_only: bool) -> Scheduler:
    bm = BlockManager(num_blocks, block_size)
    bm.record_events()
    return Scheduler(SchedulerConfig(max_num_batched_tokens=32768, max_num_seqs=64),
                     CacheConfig(block_size=block_size), bm, prefill_only=prefill_only)


def _warm_cache(sched: Scheduler, tokens: list[int]) -> None:
    """Put ``tokens``' full blocks in the prefix cache (computed by an earlier request, now freed)."""
    if not tokens:
        return
    seq = Sequence("previous", tokens, SamplingParams(max_tokens=1), 0.0)
    sched.block_manager.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    sched.block_manager.cache_full_blocks(seq)
    sched.block_manager.free(seq)


def measure(text: TextProcessor, case: Case, block_size: int, repeats: int, warmup: int,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """µs per piece (median, timed by ``clock``, seconds) for one request."""
    out: dict[str, float] = {}

    def timed(fn: Callable[[], object]) -> float:
        return _median_us(fn, repeats, warmup, clock)

    params = SamplingParams(max_tokens=64, temperature=0.0, seed=1)
    num_blocks = 4 * (len(case.prompt) // block_size + 8)

    # gateway
    body = ChatCompletionRequest.model_validate_json(case.body)
    out["gw.parse"] = timed(lambda: ChatCompletionRequest.model_validate_json(case.body))
    messages = body.message_dicts()
    out["gw.render"] = timed(lambda: render_messages(text, body.message_dicts(), None))
    rendered = render_messages(text, messages, None)
    previous = render_messages(text, messages[:-2], None) if len(messages) > 1 else ""
    cold, warm = [], []
    for i in range(warmup + repeats):
        text.tokenizer.clear_encode_cache()
        t0 = clock()
        encode_text(text, rendered, False, "messages")
        t1 = clock()
        text.tokenizer.clear_encode_cache()
        encode_text(text, previous, False, "messages")  # the session's previous turn, as served before
        t2 = clock()
        encode_text(text, rendered, False, "messages")
        t3 = clock()
        if i >= warmup:
            cold.append(t1 - t0)
            warm.append(t3 - t2)
    out["gw.tokenize"] = statistics.median(warm) * 1e6
    out["gw.tokenize.cold"] = statistics.median(cold) * 1e6
    prompt = encode_text(text, rendered, False, "messages")
    assert prompt == case.prompt
    registry = WorkerRegistry(heartbeat_timeout=1e9)
    for wid, role in (("p", "prefill"), ("d", "decode")):
        registry.register(_register(wid, role, block_size), wid.encode())
    index = PrefixIndex()
    previous_chain = block_hashes(case.previous, block_size)
    for wid in ("p", "d"):
        index.apply(KVEvents(worker_id=wid, epoch=1, seq_no=0, snapshot=True, stored=previous_chain))
    router = Router(registry, index)
    for entry in registry.live("prefill") + registry.live("decode"):
        entry.requests.clear()
    out["gw.route"] = timed(lambda: router.route(prompt, 64))
    preq = PrefillRequest(request_id="r", prompt_token_ids=prompt, sampling=params, kv_handle=b"h" * 64,
                          decode_worker_id="d")
    rkv = ReserveKV(request_id="r", prompt_token_ids=prompt, sampling=params, prefill_worker_id="p",
                    prefill_sender_epoch=1)
    out["gw.encode"] = timed(lambda: (encode(preq), encode(rkv)))

    # prefill worker
    frame = encode(preq)
    out["pf.decode"] = timed(lambda: decode(frame))
    msg = cast(PrefillRequest, decode(frame))
    vocab = text.tokenizer.vocab_size
    core = cast(EngineCore, SimpleNamespace(runner=SimpleNamespace(vocab_size=vocab), max_model_len=1 << 20))

    def admit() -> Sequence:
        EngineCore.validate_prompt(core, msg.prompt_token_ids)
        return Sequence(msg.request_id, list(msg.prompt_token_ids), params, 0.0, ())

    out["pf.admit"] = timed(admit)
    runner = cast(ModelRunner, SimpleNamespace(kv_cache=SimpleNamespace(block_size=block_size),
                                               device=torch.device("cpu")))
    times: dict[str, list[float]] = {"pf.schedule": [], "pf.inputs": [], "pf.update": []}
    for i in range(warmup + repeats):
        sched = _engine(block_size, num_blocks, prefill_only=True)
        _warm_cache(sched, case.previous)
        seq = admit()
        t0 = clock()
        sched.add(seq)
        output = sched.schedule()
        t1 = clock()
        batch = StepBatch.from_output(output)
        ModelRunner._prepare_inputs(runner, batch, None)
        t2 = clock()
        sched.update(output, {seq.request_id: 1})
        t3 = clock()
        assert seq.num_computed_tokens == len(prompt) and (not case.previous or seq.num_cached_tokens)
        sched.release(seq)
        if i >= warmup:
            for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[key].append(dt)
    out.update({k: statistics.median(v) * 1e6 for k, v in times.items()})

    # decode worker
    frame = encode(rkv)
    out["dw.decode"] = timed(lambda: decode(frame))
    msg2 = cast(ReserveKV, decode(frame))

    def admit2() -> Sequence:
        EngineCore.validate_prompt(core, msg2.prompt_token_ids)
        return Sequence(msg2.request_id, list(msg2.prompt_token_ids), params, 0.0, ())

    out["dw.admit"] = timed(admit2)
    times = {"dw.reserve": [], "dw.landed": []}
    for i in range(warmup + repeats):
        sched = _engine(block_size, num_blocks, prefill_only=False)
        _warm_cache(sched, case.previous)
        seq = admit2()
        t0 = clock()
        assert sched.add_waiting_for_kv(seq, reuse_prefix=True)
        t1 = clock()
        sched.kv_landed(seq.request_id, 1)
        t2 = clock()
        assert not case.previous or seq.num_cached_tokens
        sched.abort(seq.request_id)
        if i >= warmup:
            times["dw.reserve"].append(t1 - t0)
            times["dw.landed"].append(t2 - t1)
    out.update({k: statistics.median(v) * 1e6 for k, v in times.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=positive_int_list, default="700,4000,8000,15400")
    p.add_argument("--turn-tokens", type=positive_int, default=770)
    p.add_argument("--repeats", type=positive_int, default=30)
    p.add_argument("--warmup", type=non_negative_int, default=3)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--tokenizer", default="llama3-8b")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    lengths: list[int] = args.lengths
    text = TextProcessor.from_dir(resolve_model(args.tokenizer))
    results: dict[int, dict[str, float]] = {}
    actual: dict[int, int] = {}
    for length in lengths:
        case = build_case(text, length, args.turn_tokens)
        actual[length] = len(case.prompt)
        results[length] = measure(text, case, args.block_size, args.repeats, args.warmup,
                                  CLOCKS[args.clock])
    print(f"µs per piece (median of {args.repeats}, {args.clock} clock), by prompt length:")
    print("| piece | " + " | ".join(f"{actual[n]} tok" for n in lengths) + " | growth |")
    print("|---|" + "---|" * (len(lengths) + 1))
    for piece in (*PIECES, "total"):
        vals = [sum(v for k, v in results[n].items() if k != "gw.tokenize.cold") if piece == "total"
                else results[n][piece] for n in lengths]
        print(f"| {piece} | " + " | ".join(f"{v:.0f}" for v in vals) + f" | {vals[-1] - vals[0]:+.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"clock": args.clock, "prompt_tokens": actual, "us": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
