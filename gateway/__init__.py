"""OpenAI-compatible gateway: HTTP API, tokenization, worker registry, routing, metrics. Imports no torch."""
