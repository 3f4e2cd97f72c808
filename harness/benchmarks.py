"""Benchmarks of the harness itself (not of the methods): how long the emulated cluster takes to build and remove,
what one TCP stream gets through the userspace delay line, and what emulating more sites costs this host."""

from __future__ import annotations

import resource
import secrets
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

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


# emulation_cost's runs: the tiny model at the smallest batch, long enough for steady steps, one evaluation.
EMULATION_RUN = {"model": "tiny", "batch_size": 2, "seq_len": 64, "eval_batches": 1, "throughput_warmup_steps": 5}


def emulation_cost(site_counts: list[int], method: str, profile: str, steps: int, out: Path) -> list[dict[str, Any]]:
    """What emulating each number of sites costs this host: one real run per count (one rank per site, the tiny
    model, `steps` steps on `profile`) into out/sites-<n>, and from its summary and this process's counters: the
    cluster's build and teardown, the whole run's wall time, every rank's peak resident memory, the harness
    process's own CPU time (per step and as a share of one core), and the step time and tokens/s the sites reach.
    The host's other work during each run is recorded beside it (harness/run/host_cpu.py)."""
    from harness.analysis.plan import build_config
    from harness.run import runner

    rows = []
    for sites in site_counts:
        config = build_config(method, profile, 0, {**EMULATION_RUN, "clusters": sites, "steps": steps,
                                                   "eval_every": steps})  # fmt: skip
        started = time.perf_counter()
        summary = runner.run(config, out / f"sites-{sites}")
        wall_s = time.perf_counter() - started
        rss = [b for b in summary.get("peak_rss_bytes_per_rank") or [] if b]
        harness_cpu_s = summary.get("harness_cpu_s") or 0.0
        rows.append(
            {
                "sites": sites,
                "status": summary["status"],
                "failure": summary.get("failure"),
                "run_wall_s": wall_s,
                "cluster_setup_s": summary.get("cluster_setup_s"),
                "cluster_teardown_s": summary.get("cluster_teardown_s"),
                "ranks_peak_rss_bytes": sum(rss),
                "rank_peak_rss_bytes_max": max(rss, default=0),
                # ru_maxrss is the process's peak so far: the largest of this and every earlier count.
                "harness_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "harness_cpu_s": harness_cpu_s,
                "harness_cpu_s_per_step": harness_cpu_s / steps,
                "harness_cores": harness_cpu_s / wall_s,
                "step_s": summary["tokens"] / summary["steps"] / summary["tokens_per_s"]
                if summary.get("tokens_per_s")
                else None,
                "tokens_per_s": summary.get("tokens_per_s"),
                # What each site's uplink carried per step, by the kernel's counters (all steps, warm-up included).
                "wire_bytes_per_site_per_step": (summary.get("wire_bytes") or 0) / sites / steps,
                "param_count": summary.get("param_count"),
                "host_other_cpu_share": summary.get("host_other_cpu_share"),
            }
        )
    return rows
