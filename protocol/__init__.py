"""What every pdserve process shares: control-plane messages, settings, logging, durations.

A leaf: imports no other package of the project and no torch, so the gateway, the workers, the CLI and
the load harness all import it without cycles.
"""
