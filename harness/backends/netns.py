"""The default backend: one network namespace per cluster, joined through a bridge over shaped veths.

    cluster namespace <key>-c0              switch namespace <key>-sw              cluster namespace <key>-c1
    ranks of cluster 0 --lo (fast)--        +-----------------------+          --lo (fast)-- ranks of cluster 1
    <key>-u0 (tbf: uplink) ========= <key>-b0 (tbf: downlink)  bridge  <key>-b1 (tbf) ========= <key>-u1 (tbf)

The ranks of a cluster share its namespace, so traffic between them stays on loopback; traffic between clusters
leaves through the cluster's uplink veth and is shaped on both ends (the bridge-side end shapes what arrives, so
incast from several clusters is shaped too).

Delay, jitter and loss (a profile's WAN part) come from one of two link emulators, each applying half of the
profile's one-way figures per link so that the path between two clusters (two links) has them:
  netem      sch_netem on both veth ends, tbf as its child (harness/net/shaping.py);
  userspace  where the kernel has no sch_netem: the bridge-side veth end leaves the bridge, a TAP device
             <key>-t<c> takes its place, and a delay-line process per cluster (harness/net/delayline.py) forwards
             between them; with loss, the cluster's uplink sends one TCP segment per frame (GSO capped), so the
             delay line drops wire-sized packets (so do links of at most WIRE_FRAMES_MAX_RATE_BPS, so that tbf's
             queue drops packets, as a real bottleneck does). The processes die with the harness (parent-death
             signal), and their TAPs with them.

Every object carries the run key, so teardown removes exactly what this run made: deleting a namespace deletes its
veth ends, bridge and qdiscs with it; the delay lines are stopped by PID first.

Without root, the harness re-enters itself in a user namespace (`unshare --user --map-root-user --net --mount`)
where it may create namespaces, veths and qdiscs; everything it makes there vanishes with that namespace.
"""

from __future__ import annotations

import dataclasses
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from pyroute2 import NetNS, netns

from harness.lock import owner_alive
from harness.net.counters import interface_counters, received_bytes
from harness.net.delayline import TAP_PREFIX, delay_line_log_name
from harness.net.link import Profile
from harness.net.shaping import apply_link_spec, change_link_rate, read_qdiscs, tbf_backlog_bytes
from harness.net.topology import Topology
from harness.net.trace import hop_delay_schedule, replays_delay

NETNS_DIR = Path(netns.NETNS_RUN_DIR)
# The names this backend gives its namespaces: the run key ("hx" + 6 hex digits), then the switch or a cluster.
OWN_NETNS = re.compile(r"^(hx[0-9a-f]{6})-(sw|c[0-9]+)$")
# The uplinks' GSO cap: one full-size Ethernet frame, one TCP segment each.
GSO_WIRE_BYTES = 1514
# Links this slow carry wire-sized frames, as a real bottleneck sees them: with 64 KiB GSO frames a full tbf queue
# drops 44 packets at once, and one TCP stream at 2 Mbit/s retransmitted 6.4% of its segments (`harness calibrate`,
# 256 KiB queue). Faster links keep GSO: per-packet work on 2 cores (and through the delay line) would cost rate.
WIRE_FRAMES_MAX_RATE_BPS = 100 * 10**6
# How long a delay line may take to create its TAP device and say it is ready.
DELAY_LINE_START_S = 20.0


class NetnsCluster:
    """The emulated cluster of one run: created by `up()`, removed by `down()` (idempotent, always call it)."""

    def __init__(
        self,
        run_key: str,
        topology: Topology,
        profile: Profile,
        link_emulator: str | None = None,
        seed: int = 0,
        log_dir: Path | None = None,
    ):
        """`link_emulator`: "netem", "userspace" or None (the profile asks for no delay, jitter or loss); the
        runner resolves --link-emulator auto. `seed` seeds the delay lines' loss and jitter; they log into
        `log_dir` (delayline-c<cluster>.log)."""
        self.key = run_key
        self.topology = topology
        self.profile = profile
        self.link_emulator = link_emulator
        self.seed = seed
        self.switch_ns = f"{run_key}-sw"
        self._created: list[str] = []
        self.delay_lines: dict[int, subprocess.Popen] = {}
        # The runner reads the wire counter at every poll (4 times a second); a fresh netlink socket into the switch
        # namespace forks the harness to make one, which took 0.23 s of a core each time with training beside it.
        self._switch: NetNS | None = None
        self._downlink_indexes: list[int] = []
        self.log_dir = log_dir
        self.applied_qdiscs: list[dict] = []

    def cluster_ns(self, cluster: int) -> str:
        return f"{self.key}-c{cluster}"

    def uplink(self, cluster: int) -> str:
        """The cluster-side end of its veth: the interface its ranks bind to."""
        return f"{self.key}-u{cluster}"

    def downlink(self, cluster: int) -> str:
        """The bridge-side end of cluster `cluster`'s veth, in the switch namespace."""
        return f"{self.key}-b{cluster}"

    def tap(self, cluster: int) -> str:
        """With the userspace emulator: the bridge port of cluster `cluster`, behind its delay line."""
        return f"{self.key}-{TAP_PREFIX}{cluster}"

    def command_in(self, cluster: int) -> list[str]:
        """The prefix that runs a command in cluster `cluster`'s namespace."""
        return ["nsenter", f"--net={NETNS_DIR / self.cluster_ns(cluster)}", "--"]

    def _create_ns(self, name: str) -> None:
        netns.create(name)
        self._created.append(name)

    def up(self) -> None:
        started = time.perf_counter()
        intra = self.profile.intra_cluster
        netem = self.link_emulator == "netem"
        delay_line = self.link_emulator == "userspace"
        # With loss anywhere on the path or a slow link, every uplink sends wire-sized frames, so a drop loses one
        # packet.
        cap_gso = self.wire_sized_frames()
        self._create_ns(self.switch_ns)
        for c in range(self.topology.clusters):
            self._create_ns(self.cluster_ns(c))
        with NetNS(self.switch_ns, flags=0) as sw:
            sw.link("add", ifname="bridge", kind="bridge")
            bridge = sw.link_lookup(ifname="bridge")[0]
            sw.link("set", index=bridge, state="up")
            for c in range(self.topology.clusters):
                sw.link("add", ifname=self.downlink(c), kind="veth", peer=self.uplink(c))
                peer = sw.link_lookup(ifname=self.uplink(c))[0]
                sw.link("set", index=peer, net_ns_fd=self.cluster_ns(c))
                down = sw.link_lookup(ifname=self.downlink(c))[0]
                if delay_line:
                    sw.link("set", index=down, state="up")
                else:
                    sw.link("set", index=down, master=bridge, state="up")
                self.applied_qdiscs += apply_link_spec(sw, self.downlink(c), self.profile.downlink(c), netem)
        for c in range(self.topology.clusters):
            with NetNS(self.cluster_ns(c), flags=0) as ns:
                ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
                up = ns.link_lookup(ifname=self.uplink(c))[0]
                if cap_gso:
                    ns.link("set", index=up, gso_max_segs=1, gso_max_size=GSO_WIRE_BYTES)
                ns.addr(
                    "add",
                    index=up,
                    address=self.topology.cluster_address(c),
                    prefixlen=self.topology.prefix_len,
                )
                ns.link("set", index=up, state="up")
                self.applied_qdiscs += apply_link_spec(ns, self.uplink(c), self.profile.uplink(c), netem)
                # Ranks of one cluster reach each other's uplink address over loopback: that is the intra link.
                self.applied_qdiscs += apply_link_spec(ns, "lo", intra, netem, one_hop=True)
        if delay_line:
            for c in range(self.topology.clusters):
                self._start_delay_line(c)
            with NetNS(self.switch_ns, flags=0) as sw:
                bridge = sw.link_lookup(ifname="bridge")[0]
                for c in range(self.topology.clusters):
                    sw.link("set", index=sw.link_lookup(ifname=self.tap(c))[0], master=bridge, state="up")
        self.setup_s = time.perf_counter() - started

    def wire_sized_frames(self) -> bool:
        """Whether the uplinks send one TCP segment per frame: under the delay line with loss (so it drops
        packets, not GSO frames), and where any cluster's link is at most WIRE_FRAMES_MAX_RATE_BPS."""
        clusters = range(self.topology.clusters)
        lossy = self.link_emulator == "userspace" and any(self.profile.uplink(c).loss_fraction > 0 for c in clusters)
        rates = [link.rate_bps for c in clusters for link in (self.profile.uplink(c), self.profile.downlink(c))]
        return lossy or any(rate is not None and rate <= WIRE_FRAMES_MAX_RATE_BPS for rate in rates)

    def _start_delay_line(self, cluster: int) -> None:
        # The cluster's own hop: the inter_cluster link's half, or the site's (harness/net/link.py).
        spec = self.profile.uplink(cluster)
        argv = [
            sys.executable, "-m", "harness.net.delayline", "--run-key", self.key,
            "--veth", self.downlink(cluster), "--tap", self.tap(cluster),
            "--delay-ms", repr(spec.hop_delay_ms), "--jitter-ms", repr(spec.hop_jitter_ms),
            "--loss-pct", repr(spec.hop_loss_pct), "--seed", str(self.seed * 1000 + cluster),
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        if spec.reorder:
            argv.append("--reorder")
        model = spec.loss_model
        if model is not None:
            # Whole, not halved: the delay line runs it on what this cluster sends only (harness/net/delayline.py).
            argv += ["--ge-p", repr(model.p), "--ge-r", repr(model.r), "--ge-h", repr(model.h), "--ge-k", repr(model.k)]
        trace = self.profile.trace
        if trace is not None and replays_delay(trace):
            argv += ["--delay-trace", hop_delay_schedule(trace)]
        log_path = self.log_dir / delay_line_log_name(cluster) if self.log_dir else Path(os.devnull)
        with open(log_path, "wb") as log:
            # A session of its own: Ctrl-C reaches the harness only, which stops the delay lines after the ranks.
            process = subprocess.Popen(
                ["nsenter", f"--net={NETNS_DIR / self.switch_ns}", "--", *argv],
                # A delay schedule's start comes on stdin (harness/run/linktrace.py writes it).
                stdin=subprocess.PIPE if "--delay-trace" in argv else None,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        self.delay_lines[cluster] = process
        ready = _read_line(process, DELAY_LINE_START_S)
        if not ready.startswith("ready"):
            raise RuntimeError(
                f"the delay line of cluster {cluster} did not start (exit code {process.poll()}); "
                f"see logs/delayline-c{cluster}.log"
            )

    def set_link_up(self, up: bool) -> None:
        """Take every cluster's link down (all its traffic lost) or bring it back: the bridge-side veth ends."""
        with NetNS(self.switch_ns, flags=0) as sw:
            for c in range(self.topology.clusters):
                sw.link("set", index=sw.link_lookup(ifname=self.downlink(c))[0], state="up" if up else "down")

    def set_link_rate(self, rate_bps: int) -> None:
        """Give every cluster's link a new rate, both veth ends, tbf changed in place (burst re-derived for it)."""
        links = self.live_links()
        try:
            links.set_rate(rate_bps)
        finally:
            links.close()

    def live_links(self) -> LiveLinks:
        return LiveLinks(self)

    def trace_start_fds(self) -> list[int]:
        """Where the start of the delay lines' delay schedules (a trace's delay column) is written: their stdin."""
        return [process.stdin.fileno() for process in self.delay_lines.values() if process.stdin is not None]

    def kernel_qdiscs(self) -> list[dict]:
        """The qdiscs as the kernel reports them now, for environment.json."""
        found = []
        with NetNS(self.switch_ns, flags=0) as sw:
            for c in range(self.topology.clusters):
                found += [{"netns": self.switch_ns, **q} for q in read_qdiscs(sw, self.downlink(c))]
        for c in range(self.topology.clusters):
            with NetNS(self.cluster_ns(c), flags=0) as ns:
                for dev in (self.uplink(c), "lo"):
                    found += [{"netns": self.cluster_ns(c), **q} for q in read_qdiscs(ns, dev)]
        return found

    def wire_bytes(self) -> int:
        """Bytes the clusters have sent into the switch so far (each crossing byte counted once)."""
        if self._switch is None:
            switch = NetNS(self.switch_ns, flags=0)
            try:
                self._downlink_indexes = [
                    switch.link_lookup(ifname=self.downlink(c))[0] for c in range(self.topology.clusters)
                ]
            except Exception:
                switch.close()
                raise
            self._switch = switch
        return received_bytes(self._switch, self._downlink_indexes)

    def vanished(self) -> str | None:
        for cluster, process in self.delay_lines.items():
            code = process.poll()
            if code is not None:
                return f"the delay line of cluster {cluster} exited (code {code}) during the run"
        names = [(f"the switch namespace {self.switch_ns}", self.switch_ns)]
        names += [
            (f"the namespace of cluster {c} ({self.cluster_ns(c)})", self.cluster_ns(c))
            for c in range(self.topology.clusters)
        ]
        for what, name in names:
            if not (NETNS_DIR / name).exists():
                return f"{what} disappeared during the run (removed by another process)"
        return None

    def spawn(self, rank: int, argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
        cluster = self.topology.cluster_of(rank)
        uplink = self.uplink(cluster)
        env = {
            **os.environ,
            **env,
            # Bind every collective to the shaped uplink; NCCL must not find a faster path around it (ARCHITECTURE.md).
            "GLOO_SOCKET_IFNAME": uplink,
            "NCCL_SOCKET_IFNAME": uplink,
            "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1",
            "NCCL_IB_DISABLE": "1",
            "HARNESS_UPLINK": uplink,
        }
        command = ["nsenter", f"--net={NETNS_DIR / self.cluster_ns(cluster)}", "--", *argv]
        with open(log_path, "wb") as log:
            # A session of its own: Ctrl-C reaches the harness only, which then stops the ranks in order.
            return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def down(self) -> None:
        """Remove every namespace this run created (their veths, bridge and qdiscs go with them)."""
        started = time.perf_counter()
        # An open socket keeps its namespace, and the veths in it, alive after the name is removed.
        if self._switch is not None:
            self._switch.close()
            self._switch = None
        for process in self.delay_lines.values():
            if process.poll() is None:
                process.terminate()
        for process in self.delay_lines.values():
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.delay_lines.clear()
        for name in reversed(self._created):
            try:
                netns.remove(name)
            except OSError:
                pass
        self._created.clear()
        self.teardown_s = time.perf_counter() - started


class LiveLinks:
    """The links of a live run, re-rated and read through netlink sockets into the switch and every cluster
    namespace, held open: a rate change through fresh ones took 0.14-0.52 s on 2 cores busy training, too late for
    a trace's replay (harness/run/linktrace.py), which changes the rate every few seconds and samples every 0.1 s.
    Use it from one thread, and close it."""

    def __init__(self, cluster: NetnsCluster):
        self.cluster = cluster
        self.switch = NetNS(cluster.switch_ns, flags=0)
        self.namespaces = [NetNS(cluster.cluster_ns(c), flags=0) for c in range(cluster.topology.clusters)]

    def set_rate(self, rate_bps: int) -> None:
        """Every cluster's link at `rate_bps`, both veth ends (NetnsCluster.set_link_rate)."""
        cluster = self.cluster
        spec = dataclasses.replace(cluster.profile.inter_cluster, rate_bps=rate_bps, burst_bytes=None)
        netem = cluster.link_emulator == "netem"
        for c in range(len(self.namespaces)):
            cluster.applied_qdiscs.append(change_link_rate(self.switch, cluster.downlink(c), spec, netem))
        for c, ns in enumerate(self.namespaces):
            cluster.applied_qdiscs.append(change_link_rate(ns, cluster.uplink(c), spec, netem))

    def read_uplinks(self) -> list[tuple[int, int]]:
        """Per cluster: (bytes its uplink has sent so far, bytes waiting in its tbf)."""
        return [
            (interface_counters(ns, self.cluster.uplink(c))[0], tbf_backlog_bytes(ns, self.cluster.uplink(c)))
            for c, ns in enumerate(self.namespaces)
        ]

    def read_backlogs(self) -> list[int]:
        """Per cluster: the bytes waiting in its uplink's tbf."""
        return [tbf_backlog_bytes(ns, self.cluster.uplink(c)) for c, ns in enumerate(self.namespaces)]

    def close(self) -> None:
        for ns in [self.switch, *self.namespaces]:
            ns.close()


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    """The first line `process` writes on stdout, or "" if it exits or says nothing within `timeout_s`."""
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    return process.stdout.readline().decode(errors="replace") if ready else ""


def _processes_in(ns_path: Path) -> list[int]:
    """PIDs of the processes whose network namespace is the one bound at `ns_path` (raises OSError when it cannot be
    read, e.g. PermissionError for a user who is not root)."""
    ns = ns_path.stat()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                net = (entry / "ns" / "net").stat()
                if (net.st_dev, net.st_ino) == (ns.st_dev, ns.st_ino):
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _stop_delay_lines(run_key: str, switch_namespaces: list[Path]) -> None:
    """SIGKILL the delay lines of dead run `run_key` that outlived it (their parent-death signal normally stops them):
    only processes in its switch namespace that run harness.net.delayline for that run key, by PID."""
    for ns_path in switch_namespaces:
        try:
            pids = _processes_in(ns_path)
        except OSError:
            continue
        for pid in pids:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # harness.delayline is the module's name before harness/ was grouped into net/, run/, analysis/.
            if {b"harness.net.delayline", b"harness.delayline"} & set(argv) and run_key.encode() in argv:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def cleanup(run_key: str | None = None, not_checked: list[str] | None = None) -> list[str]:
    """Remove the namespaces of runs whose harness died without tearing down (SIGKILL); returns the names removed.

    Ownership decides, not emptiness (a run's switch namespace never has a process, nor do its cluster namespaces
    before the workers start): a run's namespaces, all of them, are removed when its lock file exists and is free
    (harness/lock.py: its owner is dead), or when it has no lock file (a harness of an older version) and no
    process lives in any of them. A run whose lock is held is never touched. With `run_key`, only that run's.

    /run/netns is root's: another user cannot tell whether their run lives nor remove them, so they are skipped and
    a sentence saying so is appended to `not_checked` (as is one for namespaces that could not be read or removed).
    """

    not_checked = [] if not_checked is None else not_checked
    try:
        names = sorted(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else []
    except OSError as err:
        not_checked.append(f"namespaces not checked: cannot list {NETNS_DIR} ({err.strerror})")
        names = []
    runs: dict[str, list[str]] = {}
    for name in names:
        match = OWN_NETNS.match(name)
        if match and (not run_key or match.group(1) == run_key):
            runs.setdefault(match.group(1), []).append(name)
    if runs and os.geteuid() != 0:
        listed = ", ".join(n for key in sorted(runs) for n in runs[key])
        not_checked.append(
            f"namespaces under {NETNS_DIR} not checked ({listed}): they belong to root, and only root can tell "
            "whether their run still lives and remove them; run `harness cleanup` as root (sudo)"
        )
        return []
    removed = []
    for key, own in sorted(runs.items()):
        alive = owner_alive(key)
        if alive is None:
            try:
                alive = any(_processes_in(NETNS_DIR / name) for name in own)
            except FileNotFoundError:
                alive = True  # a namespace vanished as we looked: whoever removes them is at work; look again later
            except OSError as err:
                not_checked.append(f"namespaces of run {key} not checked ({err.strerror}); they were kept")
                continue
        if alive:
            continue
        _stop_delay_lines(key, [NETNS_DIR / name for name in own if name.endswith("-sw")])
        # In the order down() removes them: the clusters', then the switch (their veths go with either end).
        for name in sorted(own, key=lambda n: n.endswith("-sw")):
            try:
                netns.remove(name)
                removed.append(name)
            except FileNotFoundError:
                pass
            except OSError as err:
                not_checked.append(f"namespace {name} not removed ({err.strerror})")
    return removed
