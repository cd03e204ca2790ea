"""One streaming request against the fake server: timings within known bounds, every error kind.

Tolerances: the fake sleeps exactly ttft = 50 ms then itl = 10 ms per token (asyncio.sleep never wakes
early), so token k arrives at least 50 + 10 k ms after the send (1 ms slack for clock granularity); the
upper slack (+150 ms TTFT, +20 ms mean ITL) absorbs the 2-core CI machine's scheduling noise.
"""

from __future__ import annotations

import httpx
import pytest

from loadtest.client import RequestIds, chunk_text, send_request
from loadtest.conversation import Conversation
from loadtest.workload import Turn
from tests.loadtest.fake_server import FakeState

IDS = RequestIds(0, 0, 0, 0.0)


async def _send(url: str, turn: Turn, endpoint: str = "completions", timeout_s: float = 5.0):
    body = Conversation(endpoint).body(turn, "fake-model", ignore_eos=True, temperature=0.0)
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
        return await send_request(client, path, body, IDS, timeout_s)


async def test_ok_stream_timings(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    rec, text = await _send(url, Turn((11, 12, 13), 8))
    assert rec.success and rec.error_kind is None
    assert text == "".join(f" t{i}" for i in range(8))
    assert rec.usage_reported and rec.output_tokens == 8 and rec.prompt_tokens == 3
    assert rec.ttft_s is not None and 0.049 <= rec.ttft_s <= 0.2
    assert len(rec.itl_s) == 7
    # token k leaves the server >= 50 + 10 k ms after the request came in (one late chunk can make the
    # next gap short, so only cumulative times are bounded below)
    for k in range(8):
        assert rec.ttft_s + sum(rec.itl_s[:k]) >= 0.05 + 0.01 * k - 1e-3
    assert sum(rec.itl_s) / 7 <= 0.03
    assert rec.e2e_s is not None and rec.e2e_s >= rec.ttft_s + sum(rec.itl_s) - 1e-9
    assert state.bodies[0]["ignore_eos"] is True and state.bodies[0]["prompt"] == [11, 12, 13]


async def test_chat_role_delta_is_not_a_token(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    rec, text = await _send(url, Turn("one two", 4), endpoint="chat")
    assert rec.success and rec.output_tokens == 4 and len(rec.itl_s) == 3
    assert rec.ttft_s is not None and rec.ttft_s >= 0.049  # the role-only delta arrives at once
    assert state.paths == ["/v1/chat/completions"] and text == " t0 t1 t2 t3"


async def test_without_usage_counts_chunks(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    state.plan = ["nousage"]
    rec, _ = await _send(url, Turn((1,), 5))
    assert rec.success and not rec.usage_reported and rec.output_tokens == 5 and rec.prompt_tokens is None


async def test_http_500(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    state.plan = ["500"]
    rec, _ = await _send(url, Turn((1,), 5))
    assert not rec.success and rec.error_kind == "http_status" and rec.http_status == 500
    assert rec.error == "internal boom" and rec.ttft_s is None


@pytest.mark.parametrize("behaviour", ["midstream", "drop"])
async def test_stream_error_mid_way(fake: tuple[str, FakeState], behaviour: str) -> None:
    url, state = fake
    state.plan = [behaviour]
    rec, text = await _send(url, Turn((1,), 8))
    assert not rec.success and rec.error_kind == "stream_error", rec.error
    assert text == " t0 t1 t2" and rec.ttft_s is not None and rec.e2e_s is None
    assert ("worker died" in rec.error) == (behaviour == "midstream")


async def test_hang_times_out(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    state.plan = ["hang"]
    rec, _ = await _send(url, Turn((1,), 4), timeout_s=0.3)
    assert not rec.success and rec.error_kind == "timeout" and "0.3" in rec.error
    assert rec.ttft_s is None


async def test_connection_refused() -> None:
    rec, _ = await _send("http://127.0.0.1:9", Turn((1,), 4), timeout_s=2.0)
    assert not rec.success and rec.error_kind == "connection"


def test_chunk_text_shapes() -> None:
    assert chunk_text({"choices": [{"text": "a"}]}) == "a"
    assert chunk_text({"choices": [{"delta": {"content": "b"}}]}) == "b"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
