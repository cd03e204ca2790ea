"""pdserve's load-test harness (`pdserve bench`, or `python -m loadtest`).

One request's path through the harness: a workload (`workload.py`) yields sessions of turns; an arrival
process (`arrivals.py`) or a closed loop decides when each session starts (`runner.py`); `client.py`
streams each turn to the server's OpenAI-compatible endpoint and times it into a `RequestRecord`
(`records.py`); `metrics.py` turns records into TTFT/TPOT/ITL/E2E summaries and goodput; `faults.py`
runs scheduled fault commands and splits the run into phases; `scrape.py` reads the server's KV-block
gauge before and after; `report.py` and `plots.py` write JSON, Markdown and PNG; `cli.py` is the CLI.

Importing this package imports nothing heavy.
"""
