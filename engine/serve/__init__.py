"""Machinery shared by the pdserve worker processes (prefill, decode, colocated).

``control``: the control-plane client (pyzmq DEALER to the gateway's ROUTER: registration, heartbeats,
message loop). ``setup``: worker settings → engine config, wire ↔ engine conversions. ``step``: one engine
step with a per-step attention ``layer_hook``. ``loop``: the worker's asyncio loop that runs engine steps
on one background thread so the control plane never stalls. Imports nothing heavy here.
"""
