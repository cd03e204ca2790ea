"""The worker runtime every role shares, and the colocated role.

``boot``: build the engine, warm it up, run the loop (what each role's ``run`` calls).
``control_client``: the pyzmq DEALER to the gateway's ROUTER (registration, heartbeats, messages).
``loop``: the worker's asyncio loop; engine steps run on one background thread so the control plane
never stalls. ``step``: one engine step with a per-step attention ``layer_hook``. ``outputs``: step
outputs → control-plane messages. ``setup``: settings → engine config, wire ↔ engine conversions.
``colocated``: the role that prefills and decodes in one process. ``rank_kv``: a KV transfer endpoint
on every other tensor parallel rank (the engine's rank hook), driven from rank 0. ``tp_kv``: a prefill or
decode worker's KV endpoint over all its ranks (``RankSender``, ``RankReceiver``). The prefill and
decode roles live in ``prefill_worker/`` and ``decode_worker/`` and build on this package. Imports
nothing heavy here.
"""
