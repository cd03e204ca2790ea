"""KV data-plane transports: `base.SendTransport` / `base.RecvTransport` (the interface) and their
implementations, imported only when chosen (backends.py): `loopback` (in-process copies, for tests),
`ucx` (ucxx two-sided tag send/receive), `nixl` (NIXL one-sided WRITE with the notice as its
notification; `nixl_prep`, `nixl_peers`: its descriptor lists and notification senders)."""
