"""pdserve: disaggregated prefill/decode LLM serving (CLI, settings, control-plane messages).

Importing this package is cheap: it imports nothing heavy (no torch, no zmq).
"""

__version__ = "0.1.0"
