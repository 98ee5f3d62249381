"""benchmarks/profile_step.py's idle-time measure: the union of kernels on all streams."""

import random

from benchmarks.profile_step import idle_gaps


def test_idle_gaps_are_the_stretches_no_stream_covers():
    # main stream: a [0, 10), c [30, 40); side stream: b [5, 25) overlaps a and leaves 25-30 idle
    spans = [(0.0, 10.0, "a"), (5.0, 25.0, "b"), (30.0, 40.0, "c"), (38.0, 39.0, "d")]
    assert idle_gaps(spans) == [(5.0, 25.0, "b", "c")]


def test_idle_time_plus_busy_time_is_the_span():
    rng = random.Random()
    spans = []
    for _ in range(300):
        start = rng.uniform(0, 1000)
        spans.append((start, start + rng.uniform(0.1, 20), "k"))
    spans.sort()
    # busy time by a sweep over start (+1) and end (-1) events: time with a kernel running
    events = sorted([(s, 1) for s, _, _ in spans] + [(e, -1) for _, e, _ in spans])
    busy, running, prev = 0.0, 0, events[0][0]
    for t, delta in events:
        if running:
            busy += t - prev
        running, prev = running + delta, t
    span = max(e for _, e, _ in spans) - spans[0][0]
    idle = sum(g for g, *_ in idle_gaps(spans))
    assert abs(span - idle - busy) < 1e-6 * span
