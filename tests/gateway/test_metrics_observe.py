"""``observe_many`` (a request's ITL gaps as one increment per bucket) gives the histogram that one
``observe`` per gap gives, in one process and in prometheus-client's multiprocess mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import _GAP_BUCKETS, observe_many

# on a bound (goes to that bucket), between bounds, zero, past the largest bound (+Inf), repeated
GAPS = [0.0, 0.001, 0.0010001, 0.0025, 0.003, 0.003, 0.05, 0.07, 2.5, 2.6, 40.0, 0.0005]


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        if fam.name == name:
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    out[(s.name, s.labels.get("le", ""))] = s.value
    return out


def test_observe_many_equals_one_observe_per_amount() -> None:
    reg_one, reg_many = CollectorRegistry(), CollectorRegistry()
    one = Histogram("gap_seconds", "g", buckets=_GAP_BUCKETS, registry=reg_one)
    many = Histogram("gap_seconds", "g", buckets=_GAP_BUCKETS, registry=reg_many)
    for gap in GAPS:
        one.observe(gap)
    observe_many(many, GAPS)
    observe_many(many, [])
    want = _samples(reg_one, "gap_seconds")
    assert _samples(reg_many, "gap_seconds") == want
    assert want[("gap_seconds_bucket", "0.001")] == 3  # 0.0, 0.0005 and 0.001 itself
    assert want[("gap_seconds_bucket", "+Inf")] == len(GAPS)
    assert want[("gap_seconds_bucket", "2.5")] == len(GAPS) - 2


_CHILD = """
import json, sys
from gateway.metrics import GatewayMetrics
from prometheus_client.parser import text_string_to_metric_families
m = GatewayMetrics(multiprocess_dir=sys.argv[1])
times = [1.0]
for gap in json.loads(sys.argv[2]):
    times.append(times[-1] + gap)
m.observe_tokens(0.5, times)
fam = {f.name: f for f in text_string_to_metric_families(m.render().decode())}["pdserve_itl_seconds"]
print(json.dumps({s.labels.get("le", s.name): s.value for s in fam.samples}))
"""


def test_multiprocess_itl_histogram_counts_every_gap(tmp_path: Path) -> None:
    """Through the multiprocess files (N gateway processes): the summed ITL histogram holds each gap
    in its bucket. Gaps of whole milliseconds so the float differences of token times stay in their
    bucket."""
    gaps = [0.0005, 0.002, 0.002, 0.004, 0.02, 0.3, 3.0]
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), json.dumps(gaps)], env=env,
                         capture_output=True, text=True, timeout=60, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    got = json.loads(out.stdout)
    assert got["0.001"] == 1
    assert got["0.0025"] == 3
    assert got["0.005"] == 4
    assert got["0.025"] == 5
    assert got["0.5"] == 6
    assert got["2.5"] == 6
    assert got["+Inf"] == len(gaps)
    assert abs(got["pdserve_itl_seconds_sum"] - sum(gaps)) < 1e-9


def test_a_nan_goes_to_no_bucket_as_with_observe() -> None:
    reg_one, reg_many = CollectorRegistry(), CollectorRegistry()
    one = Histogram("gap_seconds", "g", buckets=_GAP_BUCKETS, registry=reg_one)
    many = Histogram("gap_seconds", "g", buckets=_GAP_BUCKETS, registry=reg_many)
    for gap in (0.002, float("nan")):
        one.observe(gap)
    observe_many(many, [0.002, float("nan")])
    def buckets(reg: CollectorRegistry) -> dict[tuple[str, str], float]:
        return {k: v for k, v in _samples(reg, "gap_seconds").items() if k[0] == "gap_seconds_bucket"}

    assert buckets(reg_many) == buckets(reg_one)
    assert buckets(reg_one)[("gap_seconds_bucket", "+Inf")] == 1
