"""Replaying a profile's trace during a run (harness/net/trace.py), and how closely the link followed it.

The replay is a process of its own (`python -m harness.run.linktrace`), started by the runner with the ranks
(`TraceReplay`) and stopped before teardown: a thread of the harness waited for the GIL behind the harness's own
work on cores busy training, and changed the rate up to 0.25 s late. Under SCHED_FIFO where allowed (below the delay
lines), it waits for training to start (rank 0's step-0 evaluation event, after which every rank enters its
training loop; looked for every START_POLL_S) and takes that moment as t0, on CLOCK_MONOTONIC (one clock for every
namespace of the host) and on the wall clock. From t0 it

- starts the delay lines' delay schedules at t0 (a trace with a delay column: it writes the start into their stdin,
  harness/net/delayline.py),
- re-rates the link at each row whose rate differs from the one before (tbf changed in place on both ends of every
  cluster's veth through netlink sockets it holds open, as `--fault rate` does: harness/backends/netns.py),
- samples every cluster's uplink every SAMPLE_S: its transmit byte counter and the bytes waiting in its tbf (a tbf
  found empty is read again, up to BACKLOG_READS times),

each a line of link_trace.jsonl (harness/run/folder.py): {"kind": "start", t0_monotonic, t0_wall, clusters},
{"kind": "rate", t_s, rate_bps, applied_s}, {"kind": "sample", t_s, tx_bytes and backlog_bytes (one per cluster),
trace_rate_bps, trace_delay_ms}, with t_s the seconds since t0, and {"kind": "error", error} if the replay failed
(the link then keeps the rate it had). Its rate changes are there, not in environment.json.

link_trace_error measures how far the achieved rate strayed from the trace's while the link was busy. A cluster's
uplink is busy over a stretch of consecutive samples, none more than MAX_GAP_S after the one before, at each of
which its tbf held packets: the shaper, not compute, the protocol's pauses or the sender's own pacing, was what
limited the traffic. Each busy stretch is cut into consecutive windows of at least WINDOW_S from its first sample
(a rest shorter than that is left out). In each window, achieved = bytes sent x 8 / the window's length and
expected = the trace's rate averaged over the window, and its error is |achieved / expected - 1|.
link_trace_error is the largest over every cluster's windows, link_trace_windows their number; None and 0 where no
window was busy (or the link has no rate).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from harness.backends import make_backend
from harness.net.delayline import use_realtime_priority
from harness.net.link import Profile
from harness.net.topology import Topology
from harness.net.trace import delay_ms_at, mean_rate_bps, rate_bps_at, replays_rate
from harness.net.tracepoints import LinkTrace, TracePoint
from harness.process import set_parent_death_signal, stop_process
from harness.run.config import RunConfig
from harness.run.events import EventTail
from harness.run.folder import RunPaths

SAMPLE_S = 0.1
START_POLL_S = 0.02
WINDOW_S = 1.0
# Samples further apart than this (the replay was descheduled) say nothing of the link between them.
MAX_GAP_S = 2.5 * SAMPLE_S
# A sample reads a tbf found empty again, up to this many times in all this far apart: TCP small queues keep only
# a packet or two in the sender's own qdisc, which tbf may just have sent, and an empty moment of a few ms costs no
# rate (the bucket holds more). On trace-consumer-uplink (tiny AllReduce, 50 steps) one read found 2 busy windows,
# five reads 8, all within 3% of the trace.
BACKLOG_READS = 5
BACKLOG_READ_GAP_S = 0.001
# The replay's SCHED_FIFO priority, where allowed: below the delay lines', above training, so that rate changes and
# samples come on time on cores busy training (it sleeps between them).
REPLAY_PRIORITY = 5
# How long the replay gets to finish its last line when stopped, before SIGKILL.
STOP_GRACE_S = 5.0


class TracedCluster(Protocol):
    """What the runner's side of the replay needs of the backend (harness/backends/netns.py)."""

    def trace_start_fds(self) -> list[int]: ...


class LiveLinks(Protocol):
    """A live run's links, held open (harness/backends/netns.py)."""

    def set_rate(self, rate_bps: int) -> None: ...

    def read_uplinks(self) -> list[tuple[int, int]]:
        """Per cluster: (bytes its uplink has sent so far, bytes waiting in its shaper)."""

    def read_backlogs(self) -> list[int]:
        """Per cluster: the bytes waiting in its uplink's shaper."""

    def close(self) -> None: ...


class TraceReplay:
    """The runner's handle on a run's replay process (module doc): `start()` it with the ranks, `stop()` it before
    the cluster is removed."""

    def __init__(self, cluster: TracedCluster, run_dir: Path, link_emulator: str | None):
        self.cluster, self.run_dir, self.link_emulator = cluster, run_dir, link_emulator
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        fds = self.cluster.trace_start_fds()
        argv = [
            sys.executable, "-m", "harness.run.linktrace", "--run-dir", str(self.run_dir),
            "--start-fds", ",".join(map(str, fds)), "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        if self.link_emulator:
            argv += ["--link-emulator", self.link_emulator]
        with open(RunPaths(self.run_dir).logs_dir / "linktrace.log", "wb") as log:
            # A session of its own: Ctrl-C reaches the harness only, which stops the replay in order.
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, pass_fds=fds, start_new_session=True
            )

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        stop_process(self.process, STOP_GRACE_S)


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class Replayer:
    """The replay process's work (module doc): wait for training, then replay and sample until `stopping`."""

    def __init__(self, profile: Profile, links: LiveLinks, start_fds: list[int], paths: RunPaths, clock: Clock = time):
        """`clock` (monotonic, sleep) is the time module's; tests give a virtual one, to check the schedule exactly
        on a machine too loaded to keep it."""
        self.trace: LinkTrace = profile.trace
        self.default_rate_bps = profile.inter_cluster.rate_bps
        self.links, self.start_fds, self.paths, self.clock = links, start_fds, paths, clock
        self.stopping = False

    def run(self) -> None:
        with self.paths.link_trace.open("a", buffering=1) as log:
            try:
                t0 = self._training_started()
                if t0 is not None:
                    self._replay(t0, log)
            except Exception as err:
                # The run goes on at the rate in force; the summary reports the replay as failed.
                _write(log, {"kind": "error", "error": f"{type(err).__name__}: {err}"})
                raise

    def _training_started(self) -> float | None:
        tail = EventTail(self.paths.events(0))
        while not self.stopping:
            if any(event["kind"] in ("eval", "step") for event in tail):
                return self.clock.monotonic()
            self.clock.sleep(START_POLL_S)
        return None

    def _replay(self, t0: float, log: IO[str]) -> None:
        for fd in self.start_fds:
            os.write(fd, f"start {t0!r}\n".encode())
            os.close(fd)
        uplinks = self.links.read_uplinks()
        _write(log, {"kind": "start", "t0_monotonic": t0, "t0_wall": time.time(), "clusters": len(uplinks)})
        changes = rate_changes(self.trace)
        next_sample = t0
        while not self.stopping:
            now = self.clock.monotonic()
            if changes and now >= t0 + changes[0].seconds:
                point = changes.pop(0)
                self.links.set_rate(point.rate_bps)
                applied_s = self.clock.monotonic() - now
                _write(log, {"kind": "rate", "t_s": now - t0, "rate_bps": point.rate_bps, "applied_s": applied_s})
                continue
            if now >= next_sample:
                self._sample(t0, log)
                # A late sample does not make the next ones come faster.
                next_sample = max(next_sample + SAMPLE_S, now)
            due = min([next_sample, *([t0 + changes[0].seconds] if changes else [])])
            self.clock.sleep(max(0.0, due - self.clock.monotonic()))

    def _sample(self, t0: float, log: IO[str]) -> None:
        before = self.clock.monotonic()
        uplinks = self.links.read_uplinks()
        t_s = (before + self.clock.monotonic()) / 2 - t0
        backlogs = [backlog for _, backlog in uplinks]
        for _ in range(BACKLOG_READS - 1):
            if all(backlogs):
                break
            self.clock.sleep(BACKLOG_READ_GAP_S)
            backlogs = [max(seen, now) for seen, now in zip(backlogs, self.links.read_backlogs(), strict=True)]
        _write(
            log,
            {
                "kind": "sample",
                "t_s": t_s,
                "tx_bytes": [tx for tx, _ in uplinks],
                "backlog_bytes": backlogs,
                "trace_rate_bps": rate_bps_at(self.trace, t_s, self.default_rate_bps),
                "trace_delay_ms": delay_ms_at(self.trace, t_s),
            },
        )


def _write(log: IO[str], record: dict[str, Any]) -> None:
    log.write(json.dumps(record) + "\n")


def rate_changes(trace: LinkTrace) -> list[TracePoint]:
    """The rows after the first that change the rate: a row that repeats it is no change (a tbf change refills the
    bucket, a burst the trace does not have)."""
    if not replays_rate(trace):
        return []
    changes, rate = [], trace.points[0].rate_bps
    for point in trace.points[1:]:
        if point.rate_bps != rate:
            changes.append(point)
            rate = point.rate_bps
    return changes


@dataclass(frozen=True)
class LinkSample:
    """One cluster's uplink at one sample: `t_s` after t0, bytes sent so far, bytes seen waiting in its tbf."""

    t_s: float
    tx_bytes: int
    backlog_bytes: int


@dataclass(frozen=True)
class TraceWindow:
    """A busy window (module doc) of one cluster's uplink: the rate it achieved and the trace's over it."""

    cluster: int
    start_s: float
    end_s: float
    achieved_bps: float
    trace_bps: float

    @property
    def error(self) -> float:
        return abs(self.achieved_bps / self.trace_bps - 1)


def busy_windows(
    samples: Sequence[LinkSample], trace: LinkTrace, default_rate_bps: int | None, cluster: int = 0
) -> list[TraceWindow]:
    """The busy windows of one cluster's samples (module doc); none where the link has no rate."""
    windows = []
    for first, last in busy_spans(samples):
        expected = mean_rate_bps(trace, first.t_s, last.t_s, default_rate_bps)
        if expected is None:
            return []
        achieved = (last.tx_bytes - first.tx_bytes) * 8 / (last.t_s - first.t_s)
        windows.append(TraceWindow(cluster, first.t_s, last.t_s, achieved, expected))
    return windows


def busy_spans(samples: Sequence[LinkSample]) -> list[tuple[LinkSample, LinkSample]]:
    """The (first, last) samples of every busy window (module doc), in time order."""
    spans = []
    first = None
    for before, sample in itertools.pairwise(samples):
        if sample.t_s - before.t_s > MAX_GAP_S or not (before.backlog_bytes and sample.backlog_bytes):
            first = None
            continue
        if first is None:
            first = before
        if sample.t_s - first.t_s >= WINDOW_S:
            spans.append((first, sample))
            first = sample
    return spans


def cluster_samples(records: Sequence[dict[str, Any]]) -> list[list[LinkSample]]:
    """link_trace.jsonl's samples (harness/run/folder.py read_link_trace), one list per cluster, in time order."""
    samples = [r for r in records if r["kind"] == "sample"]
    clusters = len(samples[0]["tx_bytes"]) if samples else 0
    return [[LinkSample(s["t_s"], s["tx_bytes"][c], s["backlog_bytes"][c]) for s in samples] for c in range(clusters)]


def summarize_link_trace(profile: Profile, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's link_trace_* figures (module doc); nothing for a profile without a trace."""
    if profile.trace is None:
        return {}
    windows = [
        window
        for cluster, samples in enumerate(cluster_samples(records))
        for window in busy_windows(samples, profile.trace, profile.inter_cluster.rate_bps, cluster)
    ]
    starts = [r for r in records if r["kind"] == "start"]
    errors = [r["error"] for r in records if r["kind"] == "error"]
    return {
        "link_trace": profile.trace.source,
        "link_trace_error": max((w.error for w in windows), default=None),
        "link_trace_windows": len(windows),
        "link_trace_t0": starts[0]["t0_wall"] if starts else None,
        "link_trace_rate_changes": sum(1 for r in records if r["kind"] == "rate"),
        "link_trace_replay_error": errors[0] if errors else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.run.linktrace", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="the run's (staging) folder")
    parser.add_argument("--link-emulator", help="netem or userspace, as the runner resolved it")
    parser.add_argument("--start-fds", default="", help="the delay lines' stdin, where the start goes")
    parser.add_argument("--parent-pid", type=int, help="the harness: exit if it is already gone")
    args = parser.parse_args(argv)
    set_parent_death_signal(signal.SIGTERM)
    if args.parent_pid is not None and os.getppid() != args.parent_pid:
        return 1  # the harness died before the parent-death signal was armed: nobody would stop this process
    paths = RunPaths(args.run_dir)
    config = RunConfig.load(paths.config)
    topology = Topology(config.clusters, config.stages)
    cluster = make_backend(config.backend, config.run_key, topology, config.profile, link_emulator=args.link_emulator)
    links = cluster.live_links()
    fds = [int(fd) for fd in args.start_fds.split(",") if fd]
    replayer = Replayer(config.profile, links, fds, paths)

    def stop(signum: int, frame: object) -> None:
        replayer.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness stops us, in order
    use_realtime_priority(REPLAY_PRIORITY)
    try:
        replayer.run()
    finally:
        links.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
