"""bench.kvtransfer.trace: the --trace summary splits a round into its gaps (hand-off, post, DONE round
trip) from its events."""

from __future__ import annotations

import pytest

from bench.kvtransfer.trace import summarize, timeline

T0 = 100.0


def _ev(us: float, what: str, n: int = -1) -> tuple[float, str, str, int]:
    return (T0 + us * 1e-6, what, "r", n)


def test_summary_splits_take_up_post_and_tail():
    events = [_ev(-9, "idle_end"), _ev(-5, "step"), _ev(-4, "idle"), _ev(-1, "idle_end"), _ev(1, "step"),
              _ev(2, "nap"), _ev(60, "nap_end"), _ev(68, "step"), _ev(200, "step"),
              _ev(0, "sl_begin"), _ev(64, "sl_end"), _ev(70, "gather", 0), _ev(72, "gather", 1),
              _ev(80, "post:start"), _ev(90, "post:build", 2), _ev(93, "post:descs", 4),
              _ev(100, "post:init"), _ev(150, "post:transfer"), _ev(151, "post", 0), _ev(151, "post", 1),
              _ev(400, "done", 0), _ev(401, "done", 1), _ev(420, "notice", 0), _ev(425, "notice", 1),
              _ev(430, "done_sent"), _ev(500, "done_msg"), _ev(505, "DONE"), _ev(530, "wait_end")]
    lines = summarize(list(reversed(events)), T0, layers=2, requests=1)  # any order in, sorted inside
    assert lines[0] == ("# (a) send_layer loop 0..64 us (32.0 us per call, 2 calls); layers taken up by "
                        "the sender loop at 70..72")
    assert lines[1] == ("# (b) write 0: start 80, +build 10, +descs 3 (4 descriptors), +init 7, "
                        "+transfer() 50 → posted at 150 us")
    assert lines[2] == ("# (d) sender loop before the first post: steps at -5, 1, 68; naps 2-60; "
                        "idle polls -4--1")  # the step at 200 came after the post (150)
    assert lines[3] == ("# (c) writes complete (sender) 400..401; receiver read notices 420..425, sent Done "
                        "430; sender read Done 500, set DONE 505; wait() returned 530")
    assert len(lines) == 4


def test_summary_without_transport_events_still_reports_the_gaps():
    lines = summarize([_ev(0, "sl_begin"), _ev(10, "sl_end"), _ev(12, "gather", 0)], T0, 1, 1)
    assert len(lines) == 3 and "10.0 us per call" in lines[0] and "notices -" in lines[2]
    assert lines[1] == "# (d) sender loop before the first post: steps at -; naps -; idle polls -"


def test_summary_of_a_request_hand_off_counts_send_layers_calls():
    events = [_ev(0, "sl_begin"), _ev(30, "sl_end"), _ev(35, "gather", 0), _ev(36, "gather", 1)]
    lines = summarize(events, T0, layers=32, requests=2, handoff="request")
    assert lines[0] == ("# (a) send_layers loop 0..30 us (15.0 us per call, 2 calls); layers taken up by "
                        "the sender loop at 35..36")
    with pytest.raises(ValueError, match="handoff"):
        summarize(events, T0, 32, 2, handoff="block")


def test_timeline_lists_each_layer_gather_post_done():
    events = [_ev(70, "gather", 1), _ev(151, "post", 1), _ev(400, "done", 1), _ev(72, "gather", 0),
              _ev(80, "post:start"), _ev(160, "post", 0)]
    assert timeline(events, T0, 530e-6) == ["# trace: total 530 us; layer: gather / post / done (us)",
                                            "# 0: 72/160/-1; 1: 70/151/400"]


def test_summary_of_a_premade_write_has_no_descriptor_step():
    events = [_ev(0, "sl_begin"), _ev(5, "sl_end"), _ev(20, "post:start"), _ev(25, "post:build", 32),
              _ev(31, "post:init"), _ev(90, "post:transfer")]
    lines = summarize(events, T0, layers=32, requests=1, handoff="request")
    assert lines[1] == ("# (b) write 0: start 20, +build 5, pre-made write, +init 6, +transfer() 59 "
                        "→ posted at 90 us")
