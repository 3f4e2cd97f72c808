"""Benchmarks of the harness itself (not of the methods): how long the emulated cluster takes to build and remove,
and what one TCP stream gets through the userspace delay line."""

from __future__ import annotations

import secrets
import statistics
import subprocess
import time

from harness.backends import make_backend
from harness.lock import RunLock
from harness.net.link import LinkSpec, Profile
from harness.net.topology import Topology


def cluster_lifecycle(profile: Profile, clusters: int, stages: int, repeats: int) -> dict[str, float]:
    """Median and max seconds to build (namespaces, bridge, veths, qdiscs) and tear down a cluster."""
    setup, teardown, total = [], [], []
    for _ in range(repeats):
        # A fresh run key each time, held like a run's: `harness cleanup` never takes a live benchmark's namespaces.
        run_key = "hx" + secrets.token_hex(3)
        backend = make_backend("netns", run_key, Topology(clusters, stages), profile)
        started = time.perf_counter()
        with RunLock(run_key):
            try:
                backend.up()
            finally:
                backend.down()
        total.append(time.perf_counter() - started)
        setup.append(backend.setup_s)
        teardown.append(backend.teardown_s)
    return {
        "setup_median_s": statistics.median(setup),
        "teardown_median_s": statistics.median(teardown),
        "total_median_s": statistics.median(total),
        "total_max_s": max(total),
    }


def delay_line_goodput(
    rate_bps: int | None,
    rtts_ms: list[float],
    seconds: float,
    repeats: int,
    loss_pct: float = 0.0,
    window_bytes: int | None = None,
) -> list[dict]:
    """One TCP stream between two clusters: without the delay line, then through it at each RTT; median goodput.

    With `loss_pct` > 0 the delay line handles wire-sized packets (GSO capped, harness/net/delayline.py): a tiny loss
    (0.0001%) measures its per-packet ceiling, a real one what TCP makes of it.

    Each row also gives the bound a single stream's window sets at that RTT: the smaller of the sender's and the
    receiver's largest socket buffers (net.ipv4.tcp_wmem and tcp_rmem as the clusters' namespaces see them) over
    the RTT. Linux charges a buffer with its packets' overhead too, so a stream gets somewhat less than that.
    `window_bytes` clamps the receiver's window to that (TCP_WINDOW_CLAMP), e.g. to the 2 MiB gloo's ring
    all-reduce keeps in flight; the bound is then that window over the RTT.
    """
    from harness.net.linkprobe import tcp_goodput_bps

    rows = []
    for emulator, rtt_ms in [(None, 0.0), *(("userspace", rtt) for rtt in rtts_ms)]:
        spec = LinkSpec(rate_bps=rate_bps, delay_ms=rtt_ms / 2, loss_pct=loss_pct if emulator else 0.0)
        profile = Profile("bench-delayline", "", inter_cluster=spec)
        topology = Topology(2)
        goodputs, window = [], None
        for _ in range(repeats):
            run_key = "hx" + secrets.token_hex(3)
            backend = make_backend("netns", run_key, topology, profile, link_emulator=emulator)
            with RunLock(run_key):
                try:
                    backend.up()
                    goodputs.append(tcp_goodput_bps(backend, topology, seconds, window_bytes=window_bytes))
                    receive = int(read_sysctl(backend.command_in(1), "net/ipv4/tcp_rmem").split()[-1])
                    send = int(read_sysctl(backend.command_in(0), "net/ipv4/tcp_wmem").split()[-1])
                    window = min(receive, send, window_bytes or receive)
                finally:
                    backend.down()
        rows.append(
            {
                "emulator": emulator or "none",
                "rate_bps": rate_bps,
                "rtt_ms": rtt_ms,
                "loss_pct": spec.loss_pct,
                "goodput_bps": statistics.median(goodputs),
                "goodput_min_bps": min(goodputs),
                "goodput_max_bps": max(goodputs),
                "window_bytes": window,
                "window_bound_bps": window * 8 / (rtt_ms / 1000) if rtt_ms and window else None,
            }
        )
    return rows


def read_sysctl(prefix: list[str], key: str) -> str:
    """A sysctl as a process started with `prefix` (e.g. in a cluster's namespace) sees it."""
    return subprocess.run([*prefix, "cat", f"/proc/sys/{key}"], capture_output=True, text=True, check=True).stdout
