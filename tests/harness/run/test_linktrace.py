"""Replaying a trace and measuring it (harness/run/linktrace.py), without namespaces: busy windows and
link_trace_error on synthetic samples, the replay loop against fake links, link_trace.jsonl's reader, and the run
settings a trace refuses."""

from __future__ import annotations

import json
import os

import pytest

from harness.errors import UserError
from harness.net.link import LinkSpec, Profile
from harness.net.tracepoints import LinkTrace, TracePoint
from harness.run import runner
from harness.run.config import RunConfig
from harness.run.folder import RunPaths, UnreadableResults, read_link_trace
from harness.run.linktrace import (
    MAX_GAP_S,
    SAMPLE_S,
    LinkSample,
    Replayer,
    busy_windows,
    rate_changes,
    summarize_link_trace,
)

MBIT = 1_000_000
TRACE = LinkTrace("t.csv", (TracePoint(0.0, 10 * MBIT), TracePoint(2.0, 20 * MBIT)))


def steady(start_s: float, end_s: float, rate_bps: float, backlog: int = 3028, sent: int = 0) -> list[LinkSample]:
    """Samples every 0.1 s of an uplink sending `rate_bps` from `start_s`, with `backlog` bytes waiting."""
    steps = round((end_s - start_s) / 0.1)
    return [LinkSample(start_s + i * 0.1, sent + round(rate_bps / 8 * i * 0.1), backlog) for i in range(steps + 1)]


def test_a_busy_stretch_is_cut_into_one_second_windows_and_the_rest_left_out():
    windows = busy_windows(steady(0.0, 1.8, 10 * MBIT), TRACE, None)
    assert [(w.start_s, round(w.end_s, 6)) for w in windows] == [(0.0, 1.0)]
    assert windows[0].achieved_bps == pytest.approx(10 * MBIT)
    assert windows[0].error == pytest.approx(0.0)


def test_the_error_is_against_the_trace_s_rate_averaged_over_the_window():
    # 15 Mbit/s over [1.5, 2.5]: half at 10, half at 20 -> exactly the trace's mean.
    (window,) = busy_windows(steady(1.5, 2.5, 15 * MBIT), TRACE, None)
    assert window.trace_bps == pytest.approx(15 * MBIT)
    assert window.error == pytest.approx(0.0)
    (low,) = busy_windows(steady(3.0, 4.0, 18 * MBIT), TRACE, None)
    assert low.error == pytest.approx(0.1)


def test_an_empty_shaper_or_a_gap_in_the_samples_breaks_a_stretch():
    samples = steady(0.0, 2.0, 10 * MBIT)
    idle = [s if i != 8 else LinkSample(s.t_s, s.tx_bytes, 0) for i, s in enumerate(samples)]
    # Sample 8 (0.8 s) saw an empty tbf: [0, 0.8] is too short, [0.8, 2.0] starts only after it.
    assert [w.start_s for w in busy_windows(idle, TRACE, None)] == [pytest.approx(0.9)]
    gap = [s for s in samples if not 0.4 < s.t_s < 0.4 + MAX_GAP_S + 0.05]
    assert [round(w.start_s, 6) for w in busy_windows(gap, TRACE, None)] == [0.7]
    # Compute between two all-reduces: the shaper idles, nothing counts.
    assert busy_windows(steady(0.0, 5.0, 10 * MBIT, backlog=0), TRACE, None) == []


def test_without_a_rate_column_the_profile_s_rate_is_the_trace_s_and_unshaped_has_none():
    delay_only = LinkTrace("t.csv", (TracePoint(0.0, None, 10.0), TracePoint(1.0, None, 20.0)))
    (window,) = busy_windows(steady(0.0, 1.0, 9 * MBIT), delay_only, 10 * MBIT)
    assert window.error == pytest.approx(0.1)
    assert busy_windows(steady(0.0, 1.0, 9 * MBIT), delay_only, None) == []


def records(*clusters: list[LinkSample]) -> list[dict]:
    """link_trace.jsonl's records for these per-cluster samples (the same times for every cluster)."""
    out: list[dict] = [{"kind": "start", "t0_monotonic": 5.0, "t0_wall": 1e9, "clusters": len(clusters)}]
    for per_cluster in zip(*clusters, strict=True):
        out.append(
            {
                "kind": "sample",
                "t_s": per_cluster[0].t_s,
                "tx_bytes": [s.tx_bytes for s in per_cluster],
                "backlog_bytes": [s.backlog_bytes for s in per_cluster],
            }
        )
    return out


def test_link_trace_error_is_the_worst_window_of_every_cluster():
    profile = Profile("p", "", LinkSpec(rate_bps=10 * MBIT), trace=TRACE)
    fine, slow = steady(0.0, 2.0, 10 * MBIT), steady(0.0, 2.0, 8 * MBIT)
    summary = summarize_link_trace(profile, [*records(fine, slow), {"kind": "rate", "t_s": 2.0, "rate_bps": 1}])
    assert summary["link_trace_error"] == pytest.approx(0.2)
    assert summary["link_trace_windows"] == 4
    assert summary["link_trace_rate_changes"] == 1
    assert summary["link_trace_t0"] == 1e9
    assert summary["link_trace_replay_error"] is None
    idle = summarize_link_trace(profile, records(steady(0.0, 2.0, 1 * MBIT, backlog=0)))
    assert (idle["link_trace_error"], idle["link_trace_windows"]) == (None, 0)
    failed = summarize_link_trace(profile, [{"kind": "error", "error": "OSError: gone"}])
    assert failed["link_trace_replay_error"] == "OSError: gone" and failed["link_trace_t0"] is None
    assert summarize_link_trace(Profile("p", ""), records(fine)) == {}


def test_a_row_that_repeats_the_rate_is_no_change():
    trace = LinkTrace("t.csv", tuple(TracePoint(t, r * MBIT) for t, r in [(0, 10), (1, 10), (2, 20), (3, 20), (4, 5)]))
    assert [p.seconds for p in rate_changes(trace)] == [2, 4]
    assert rate_changes(LinkTrace("t.csv", (TracePoint(0.0, None, 5.0),))) == []


class FakeLinks:
    """Two clusters' uplinks: each sends 1 MB a read, its tbf empty at the first read of a sample and full after."""

    def __init__(self):
        self.rates: list[int] = []
        self.reads = 0
        self.closed = False

    def set_rate(self, rate_bps: int) -> None:
        self.rates.append(rate_bps)

    def read_uplinks(self) -> list[tuple[int, int]]:
        self.reads += 1
        return [(self.reads * 10**6, 0), (self.reads * 10**6, 0)]

    def read_backlogs(self) -> list[int]:
        return [1514, 3028]

    def close(self) -> None:
        self.closed = True


class VirtualClock:
    """Time that passes only when the replayer sleeps: its schedule checked exactly, however loaded the host.
    Stops the replayer once `until` seconds have passed."""

    def __init__(self, until: float):
        self.now, self.until, self.replayer = 1000.0, 1000.0 + until, None

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.now >= self.until:
            self.replayer.stopping = True


def _replayer(trace, links, fds, paths, until: float) -> Replayer:
    clock = VirtualClock(until)
    replayer = Replayer(Profile("p", "", LinkSpec(rate_bps=10 * MBIT), trace=trace), links, fds, paths, clock)
    clock.replayer = replayer
    return replayer


def test_the_replay_waits_for_training_then_re_rates_samples_and_starts_the_delay_lines(tmp_path):
    paths = RunPaths(tmp_path)
    paths.events_dir.mkdir()
    trace = LinkTrace(
        "t.csv", tuple(TracePoint(t, r * MBIT, 10.0) for t, r in [(0, 10), (0.3, 20), (0.4, 20), (0.6, 5)])
    )
    links = FakeLinks()
    read_end, write_end = os.pipe()
    _replayer(trace, links, [write_end], paths, until=5.0).run()
    assert not paths.link_trace.read_text() and links.rates == []  # no training in 5 s: no replay

    paths.events(0).write_text(json.dumps({"t": 1.0, "kind": "eval", "step": 0}) + "\n")
    _replayer(trace, links, [write_end], paths, until=0.95).run()
    start, *rest = read_link_trace(tmp_path)
    assert start["kind"] == "start" and start["clusters"] == 2
    assert os.read(read_end, 100).decode() == f"start {start['t0_monotonic']!r}\n"
    assert links.rates == [20 * MBIT, 5 * MBIT]  # 0.4 repeats 20 Mbit/s: no change
    assert [r["t_s"] for r in rest if r["kind"] == "rate"] == pytest.approx([0.3, 0.6])
    samples = [r for r in rest if r["kind"] == "sample"]
    # One every SAMPLE_S from t0, each read when due (its reads take no virtual time but the backlog re-read's).
    assert [s["t_s"] for s in samples] == pytest.approx([i * SAMPLE_S for i in range(len(samples))], abs=1e-9)
    assert len(samples) == 10
    # The tbfs read empty at first were read again: the backlog recorded is the one seen.
    assert samples[0]["backlog_bytes"] == [1514, 3028]
    assert [s["trace_rate_bps"] for s in samples] == [10 * MBIT] * 3 + [20 * MBIT] * 3 + [5 * MBIT] * 4
    assert samples[-1]["trace_delay_ms"] == 10.0


def test_link_trace_jsonl_is_read_as_events_are(tmp_path):
    assert read_link_trace(tmp_path) == []
    path = RunPaths(tmp_path).link_trace
    good = json.dumps({"kind": "rate", "t_s": 1.0, "rate_bps": 5})
    path.write_text(good + "\n" + good[:10])
    assert len(read_link_trace(tmp_path)) == 1  # a last line cut short by a killed replay
    path.write_text(json.dumps({"kind": "sample", "t_s": 1.0}) + "\n" + good + "\n")
    with pytest.raises(UnreadableResults, match="line 1: lacks backlog_bytes, tx_bytes"):
        read_link_trace(tmp_path)


# --- the settings a trace refuses ---------------------------------------------------------------------------------


def traced(rate: bool = True, delay: bool = True) -> Profile:
    points = (TracePoint(0.0, 10 * MBIT if rate else None, 10.0 if delay else None),)
    return Profile(
        "traced", "", LinkSpec(rate_bps=10 * MBIT, delay_ms=10.0 if delay else 0.0), trace=LinkTrace("t", points)
    )


def test_a_trace_needs_the_netns_backend():
    with pytest.raises(UserError, match="replays a trace, which needs the netns backend .*; use --backend netns"):
        RunConfig.build("allreduce", traced(), backend="docker", steps=3).validate()


def test_a_rate_fault_and_a_rate_trace_are_refused_together():
    with pytest.raises(UserError, match="--fault rate and profile 'traced''s trace both set the link's rate"):
        RunConfig.build("allreduce", traced(), steps=10, faults=("rate:3:5mbit",)).validate()


def test_a_delay_trace_takes_the_delay_line_and_refuses_netem(monkeypatch):
    monkeypatch.setattr(runner, "probe_qdiscs", lambda userns: {"netem": True})
    monkeypatch.setattr(runner, "tun_unavailable_reason", lambda: None)
    assert runner.resolve_link_emulator(RunConfig.build("allreduce", traced(), steps=3)) == "userspace"
    with pytest.raises(UserError, match="replays a delay trace, which only the userspace delay line does"):
        runner.resolve_link_emulator(RunConfig.build("allreduce", traced(), steps=3, link_emulator="netem"))
    # A rate-only trace leaves the choice as it was: no delay asked for, no emulator.
    assert runner.resolve_link_emulator(RunConfig.build("allreduce", traced(delay=False), steps=3)) is None


def test_the_run_folder_holds_the_trace_beside_the_summary(tmp_path):
    assert RunPaths(tmp_path).link_trace == tmp_path / "link_trace.jsonl"
