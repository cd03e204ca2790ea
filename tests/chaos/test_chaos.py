"""The chaos suite: every scenario of bench/serving/chaos.py against one live system of real processes
(a gateway, two prefill and two decode workers on the CPU, KV over NIXL), each asserting the rules of
honest failure: no HTTP 200 that carries an error before its first token, no 429/503 without
Retry-After, no request past its deadline, no leaked KV block on any worker, and the scenario's own
outcome (migrated streams equal to an unbroken run, retried requests invisible to their clients, 429s
within the admission budget). A killed child is started again after its scenario (same worker id, a new
epoch), so the scenarios share one start-up. The streams are a third as long as the benchmark's (a stream
cut by a fault still runs past it). ``python -m bench.serving.chaos`` runs them longer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.serving.chaos import Chaos, ScenarioResult, chaos_spec
from pdserve.live_system import live_systems

pytestmark = pytest.mark.slow
ABORTS = 300  # client_aborts' streams: 100 of each way of leaving (at once, after one token, after two)
OUTPUT_SCALE = 1 / 3  # kill_decode_mid_stream's streams: 16 tokens, killed once each has 2


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    logs: Path = tmp_path_factory.mktemp("chaos") / "logs"
    with live_systems([chaos_spec(logs)], ready_timeout_s=300) as (system,):
        yield Chaos(system, scale=1, aborts=ABORTS, output_scale=OUTPUT_SCALE)


def _honest(res: ScenarioResult) -> None:
    assert res.bad_200 == 0, res
    assert res.past_deadline == 0, res
    assert res.leaked_blocks == 0, res


def test_kill_decode_mid_stream_migrates_every_stream(chaos: Chaos) -> None:
    res = chaos.run("kill_decode_mid_stream", chaos.kill_decode_mid_stream)
    _honest(res)
    assert res.completed == res.sent and not res.notes, res  # every text equals the unbroken run's
    assert res.migrated >= 1, res


def test_kill_prefill_mid_transfer_retries_before_the_first_token(chaos: Chaos) -> None:
    res = chaos.run("kill_prefill_mid_transfer", chaos.kill_prefill_mid_transfer)
    _honest(res)
    # no client sees the dead prefill worker: its requests are retried (admission may refuse some at once)
    assert res.completed + res.statuses.get("429", 0) == res.sent and res.retried >= 1, res


def test_same_address_replacement_serves_once_registered(chaos: Chaos) -> None:
    res = chaos.run("same_address_replacement", chaos.same_address_replacement)
    _honest(res)
    assert res.completed == res.sent, res


def test_gateway_restart_frees_the_old_gateways_blocks(chaos: Chaos) -> None:
    res = chaos.run("gateway_restart", chaos.gateway_restart)
    _honest(res)
    assert res.completed + res.connection_lost == res.sent and res.completed >= 4, res


def test_burst_above_capacity_gets_429_not_timeouts(chaos: Chaos) -> None:
    res = chaos.run("burst_above_capacity", chaos.burst_above_capacity)
    _honest(res)
    assert res.completed + res.statuses.get("429", 0) == res.sent, res
    assert res.max_status_after_s < 1.0, res


def test_decode_blocks_exhausted_gets_429_at_once(chaos: Chaos) -> None:
    res = chaos.run("decode_blocks_exhausted", chaos.decode_blocks_exhausted)
    _honest(res)
    assert res.statuses.get("429", 0) >= 1 and res.completed + res.statuses["429"] == res.sent, res
    assert res.max_status_after_s < 1.0, res


def test_client_aborts_leak_nothing(chaos: Chaos) -> None:
    res = chaos.run("client_aborts", chaos.client_aborts)
    _honest(res)
    assert res.sent == ABORTS, res
