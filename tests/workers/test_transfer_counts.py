"""The prefill worker's KV transfer totals (heartbeat ``WorkerLoad.kv_transfer_bytes`` / ``_seconds``):
only DONE transfers count, with blocks × bytes per block (all layers, K and V) and the seconds from the
first layer handed to the sender to DONE. A scripted fake receiver decides when a transfer ends."""

from __future__ import annotations

import time

import pytest

from kvtransfer import TransferStatus
from kvtransfer import wire as km
from protocol.messages import PrefillRequest
from tests.workers.helpers import assert_clean, close, prefill_worker, pump, wire

PROMPT = list(range(10, 20))  # 10 tokens = 3 blocks of 4


@pytest.fixture
def prefill(model_dir):
    w = prefill_worker(model_dir)
    yield w
    close(w)




def _start(prefill, fake, rid: str, blocks: list[int]) -> None:
    """Deliver a request and serve until every layer has landed (the transfer is still in flight)."""
    prefill.deliver(PrefillRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=wire(4, ignore_eos=True),
                                   kv_handle=fake.handle(rid, blocks), decode_worker_id="d"))
    pump([prefill], lambda: (fake.serve(), fake.layers.get(rid) == {0, 1})[1])
    assert prefill.sender.status(rid) is TransferStatus.TRANSFERRING


def _finish(prefill, fake, msg: km.Message) -> None:
    fake.send(msg)
    pump([prefill], lambda: (fake.serve(), not prefill.sending)[1])


def test_done_transfers_add_bytes_and_seconds_failed_ones_do_not(prefill, fake):
    per_block = prefill.core.runner.kv_cache.bytes_per_block
    assert per_block == 2 * 2 * 4 * 2 * 16 * 4  # layers × (K, V) × block_size × kv heads × head_dim × fp32
    assert prefill.load().kv_transfer_bytes == 0 and prefill.load().kv_transfer_seconds == 0.0

    t0 = time.monotonic()
    _start(prefill, fake, "a", [0, 1, 2])
    time.sleep(0.05)
    assert prefill.load().kv_transfer_bytes == 0  # still in flight: nothing counted yet
    _finish(prefill, fake, km.Done("a"))
    first = prefill.load()
    assert first.kv_transfer_bytes == 3 * per_block
    assert 0.05 <= first.kv_transfer_seconds <= time.monotonic() - t0

    _start(prefill, fake, "b", [3, 4, 5])
    _finish(prefill, fake, km.Fail("b", "checksum mismatch"))
    assert prefill.load().kv_transfer_bytes == first.kv_transfer_bytes  # FAILED: not counted
    assert prefill.load().kv_transfer_seconds == first.kv_transfer_seconds

    _start(prefill, fake, "c", [6, 7, 8])
    _finish(prefill, fake, km.Done("c"))
    second = prefill.load()
    assert second.kv_transfer_bytes == 6 * per_block
    assert second.kv_transfer_seconds > first.kv_transfer_seconds
    assert prefill.registration().load.kv_transfer_bytes == 6 * per_block  # what heartbeats carry
    sent = prefill.metrics.registry.get_sample_value("pdserve_worker_kv_sent_bytes_total",
                                                     {"model_name": prefill.settings.model, "engine": "0"})
    assert sent == 6 * per_block  # the worker's own /metrics: the same DONE transfers only
    assert not prefill._transfer_bytes and not prefill._first_layer_at
    assert_clean(prefill)
