"""vLLM's basic server cases (``tests/entrypoints/openai/basic/test_basic.py``), ported to the live
disaggregated gateway serving the embedded SmolLM2: ``/health``, a request whose content type is not
JSON, and many requests cancelled by their clients' timeouts (the server then still answers at once,
and here every KV block is free again). Each case names its peer test."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.helpers import client, leak_check
from tests.conformance.peer.common import disagg, together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
STORY: Any = [{"role": "user", "content": "Write a long story"}]


# from vllm basic/test_basic.py::test_check_health
def test_check_health(live: SystemPair) -> None:
    resp = httpx.get(f"{live.disagg_url}/health", timeout=10,
                     headers={"Authorization": f"Bearer {live.api_key}"})
    assert resp.status_code == 200


# from vllm basic/test_basic.py::test_request_wrong_content_type
def test_request_wrong_content_type(live: SystemPair) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        disagg(live).chat.completions.create(
            model=MODEL, messages=STORY, max_tokens=5,
            extra_headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert 400 <= info.value.status_code < 500


# from vllm basic/test_basic.py::test_request_cancellation
def test_request_cancellation(live: SystemPair) -> None:
    """The peer sends 200 requests of 10 000 tokens with a 0.5 s client timeout; here 8 of 300 tokens
    (the live workers' KV holds them all at once). Every one times out at the client; the workers drop
    them (all KV blocks free), and a new request is answered."""
    impatient = openai.OpenAI(base_url=f"{live.disagg_url}/v1", api_key=live.api_key, max_retries=0,
                              timeout=0.5)

    def cancelled() -> str:
        try:
            impatient.chat.completions.create(model=MODEL, messages=STORY, max_tokens=300,
                                              extra_body={"ignore_eos": True})
        except openai.APITimeoutError:
            return "timed out"
        return "answered"

    assert together(*([cancelled] * 8)) == ["timed out"] * 8
    leak_check(live)
    r = client(live.disagg_url, live.api_key).chat.completions.create(model=MODEL, messages=STORY,
                                                                      max_tokens=10)
    assert len(r.choices) == 1
    leak_check(live)
