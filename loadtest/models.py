"""Ask the server which model it serves (``GET /v1/models``, OpenAI API) when ``--model`` is not given."""

from __future__ import annotations

import httpx


async def first_model(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    """The ``id`` of the first model listed at ``base_url``/v1/models.

    Raises RuntimeError naming the problem (connection, HTTP status, empty or malformed list) and what to
    pass: ``--api-key`` after a 401 or 403 (the server asks for a key, or refused the one given), else
    ``--model``.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, trust_env=False) as client:
        try:
            resp = await client.get("/v1/models", timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"GET {base_url}/v1/models failed: {type(exc).__name__}: {exc}") from exc
    if resp.status_code in (401, 403):
        hint = ("it refused the --api-key given: pass one the server accepts" if api_key else
                "the server asks for an API key: pass --api-key (or PDSERVE_API_KEY)")
        raise RuntimeError(f"GET {base_url}/v1/models answered HTTP {resp.status_code}; {hint}")
    if resp.status_code != 200:
        raise RuntimeError(f"GET {base_url}/v1/models answered HTTP {resp.status_code}; pass --model")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"GET {base_url}/v1/models listed no model; pass --model") from None
