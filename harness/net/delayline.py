"""The userspace delay line: delay, jitter and loss on one cluster's link where the kernel has no sch_netem.

Runs in the switch namespace of a run, one process per cluster link (started by harness/backends/netns.py):

    cluster namespace                      switch namespace
    <key>-u<c> ==veth== <key>-b<c> <-AF_PACKET-> [this process] <-TAP-> <key>-t<c> -- bridge -- other clusters

Frames the cluster sends arrive on the veth's switch end and are read through a packet socket; after their delay
they are written into the TAP device, which is the bridge's port for this cluster. Frames the bridge sends towards
the cluster are read from the TAP and, after their delay, sent out of the veth's switch end. tbf on both veth ends
still sets the rate: a frame is delayed after it left the sender's queue and before it enters the receiver's.

Each hop carries half of the profile's one-way delay, jitter and (composed) loss (harness/net/link.py: `hop_*`), so
the path between two clusters, which crosses two links, has the profile's. Without loss, frames cross as the kernel
made them: a TCP segmentation (GSO) frame of up to 64 KiB passes in one piece, described by its virtio-net header,
which keeps the per-frame cost of Python off the rate. With loss, the backend caps the cluster uplinks' GSO at one
segment, so every frame is wire-sized and loss drops what a real link drops (a packet, not 44 of them); the delay
line then forwards every packet itself, which caps the rate it can carry (docs/links.md, "Measured on this machine").

Jitter draws each frame's delay uniformly from delay +- jitter (netem's default distribution); unless reordering is
allowed, a frame never leaves before the one ahead of it in its direction (so jitter never reorders). Loss drops a
frame with the hop's probability, from a generator seeded per run and direction, so a rerun drops alike.

Bursty loss (a profile's loss model, harness/net/lossmodel.py: Gilbert-Elliott, --ge-p/-r/-h/-k) is a process with
memory, and two of them in a row are not one with other parameters: the path must cross exactly one. So it is not
split into hops: each cluster's delay line runs the whole model on the frames that cluster sends (to_switch) and
none on the frames it receives (to_cluster), and a packet between two clusters meets the sender's model once. The
model sees every frame in that direction (ARP and acknowledgements too, as netem on an egress would), wire-sized
because the backend caps GSO where there is loss, and draws from the direction's seeded generator.

Each direction counts the frames it saw, those it dropped (by either loss) and the bursts they formed (runs of
consecutive dropped frames); harness/run/summary.py sets them beside the configured figures.

A profile's trace (harness/net/trace.py) gives the delay as a schedule instead (--delay-trace): each frame gets the
row in force when it is read, counted from the start time the harness writes on stdin when training starts (before
it, the first row); a frame still never leaves before the one ahead of it, so a falling delay does not reorder.

The process creates its TAP device (it vanishes when the process exits), writes "ready <tap>" on stdout and then
forwards until SIGTERM, when it writes its counters as one JSON line on stderr. Its own ceiling is measured by
`harness bench-delayline` (docs/links.md, "Measured on this machine").
"""

from __future__ import annotations

import argparse
import bisect
import errno
import fcntl
import heapq
import json
import os
import pwd
import random
import selectors
import signal
import socket
import stat
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.net.lossmodel import GilbertElliott, GilbertElliottLoss
from harness.process import set_parent_death_signal

# The TAP device of cluster c is <run key>-<TAP_PREFIX><c> (harness/backends/netns.py).
TAP_PREFIX = "t"
SOL_PACKET = 263  # not exported by Python's socket module
ETH_P_ALL = 0x0003
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
# struct virtio_net_hdr, which both descriptors put before each frame (see DelayLine).
VNET_HDR_BYTES = 10
# The largest frame: a 64 KiB GSO frame with its Ethernet and virtio-net headers.
FRAME_BUFFER = 65536 + 64
# Frames read from one descriptor per wake-up before releasing what is due: keeps both directions moving under load.
READ_BATCH = 64
SOCKET_BUFFER_BYTES = 8 * 1024 * 1024


TUN_DEVICE = "/dev/net/tun"


def tun_unavailable_reason() -> str | None:
    """Why the userspace delay line cannot open the TUN device as this user, in one sentence naming the fix; None
    when it can. Opened for real: inside the harness's user namespace the host's permissions still apply, so a
    device only root may open (mode 0600) fails the delay line after the cluster is built."""
    try:
        os.close(os.open(TUN_DEVICE, os.O_RDWR | os.O_CLOEXEC))
    except FileNotFoundError:
        return (
            f"the userspace delay line needs TUN/TAP ({TUN_DEVICE}), which this machine lacks; load it (modprobe tun) "
            "or use a kernel with sch_netem"
        )
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM):
            return (
                f"the userspace delay line cannot open {TUN_DEVICE} ({err.strerror}); load TUN/TAP (modprobe tun) or "
                "use a kernel with sch_netem"
            )
        return (
            f"the userspace delay line needs to open {TUN_DEVICE} read-write, which user {_user()} may not "
            f"({_mode(TUN_DEVICE)}); run as root, give this user access to it (e.g. chmod 0666 {TUN_DEVICE}, as most "
            "distributions ship it), or use a kernel with sch_netem"
        )
    return None


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _mode(path: str) -> str:
    try:
        info = os.stat(path)
    except OSError:
        return "not readable"
    try:
        owner = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        owner = str(info.st_uid)
    return f"mode {stat.filemode(info.st_mode)}, owner {owner}"


def open_tap(name: str) -> int:
    """Create TAP device `name` in this process's namespace; returns its descriptor (the device lives as long)."""
    fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
    # Take checksum-less and TCP-segmentation-offloaded frames as they are: the virtio-net header describes them and
    # the kernel finishes them where they leave, so a GSO frame crosses here in one piece.
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    return fd


def open_packet_socket(ifname: str) -> socket.socket:
    """A raw socket that sees what arrives on `ifname` (not what this process sends out of it)."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.bind((ifname, 0))
    sock.setblocking(False)
    return sock


# A real-time priority above every training process (SCHED_OTHER) and below the kernel's own threads.
REALTIME_PRIORITY = 10


def use_realtime_priority(priority: int = REALTIME_PRIORITY) -> str:
    """Run under SCHED_FIFO where allowed, so a frame leaves when its delay is up, not when a busy CPU gets round
    to this process (on 2 loaded cores a normal priority added ~1 ms per hop). The loop sleeps in select whenever
    nothing is due, so it cannot starve the machine. Returns the policy in force, for the log. Linux applies it to
    the calling thread only."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        return "SCHED_FIFO"
    except (PermissionError, OSError):
        return "SCHED_OTHER"


@dataclass(frozen=True)
class DelaySchedule:
    """A hop's delay replayed from a profile's trace (harness/net/trace.py): `delays_s[i]` from `times_s[i]` seconds
    after the start until the next row, the last row after the trace ends, the first before the start."""

    times_s: tuple[float, ...]
    delays_s: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> DelaySchedule:
        """--delay-trace "seconds:ms,seconds:ms,..." (harness/net/trace.py hop_delay_schedule)."""
        rows = [row.split(":") for row in text.split(",")]
        return cls(tuple(float(t) for t, _ in rows), tuple(float(ms) / 1000 for _, ms in rows))

    def delay_s_at(self, elapsed_s: float | None) -> float:
        """The delay `elapsed_s` after the start; None: the start has not come yet."""
        if elapsed_s is None:
            return self.delays_s[0]
        return self.delays_s[max(0, bisect.bisect_right(self.times_s, elapsed_s) - 1)]


class Direction:
    """One way through the link: when each frame read may leave, and whether it is dropped."""

    def __init__(
        self, delay_s: float, jitter_s: float, loss: float, reorder: bool, seed: int,
        schedule: DelaySchedule | None = None, loss_model: GilbertElliott | None = None,
    ):  # fmt: skip
        self.delay_s, self.jitter_s, self.loss, self.reorder = delay_s, jitter_s, loss, reorder
        # With a schedule: its zero on CLOCK_MONOTONIC, which the harness sends when training starts.
        self.schedule, self.started_at = schedule, None
        self.random = random.Random(seed)
        self.bursty = GilbertElliottLoss(loss_model, self.random) if loss_model is not None else None
        self.last_release = 0.0
        self.frames = self.bytes = self.dropped = self.bursts = self.send_errors = 0
        # Whether the frame before was dropped: a burst (a run of drops) is counted at its first.
        self.dropping = False

    def release_time(self, now: float) -> float | None:
        """When a frame read at `now` leaves, or None when it is lost."""
        self.frames += 1
        lost = self.bursty.lost() if self.bursty is not None else bool(self.loss) and self.random.random() < self.loss
        self.bursts += lost and not self.dropping
        self.dropping = lost
        if lost:
            self.dropped += 1
            return None
        release = now + self.delay_at(now)
        if self.jitter_s:
            release += self.random.uniform(-self.jitter_s, self.jitter_s)
        if not self.reorder:
            release = max(release, self.last_release)
        self.last_release = release
        return release

    def delay_at(self, now: float) -> float:
        """The delay of a frame read at `now` (CLOCK_MONOTONIC): the fixed one, or the schedule's row in force."""
        if self.schedule is None:
            return self.delay_s
        return self.schedule.delay_s_at(None if self.started_at is None else now - self.started_at)

    def counters(self) -> dict:
        return {
            "frames": self.frames,
            "bytes": self.bytes,
            "dropped": self.dropped,
            "bursts": self.bursts,
            "send_errors": self.send_errors,
        }


class DelayLine:
    """Forward frames between a veth end and a TAP device, each after its direction's delay (module doc).

    Both descriptors carry a virtio-net header before each frame, passed through unchanged: a frame from the
    cluster's kernel leaves its checksum to the "hardware" (a veth never computes it), and the header is what tells
    the receiving side so; without it every forwarded TCP and UDP packet would arrive with a bad checksum.
    """

    def __init__(self, veth: str, tap: str, to_switch: Direction, to_cluster: Direction):
        self.packet = open_packet_socket(veth)
        self.tap_fd = open_tap(tap)
        self.tap = tap
        self.to_switch, self.to_cluster = to_switch, to_cluster
        # (release time, sequence, frame, direction): the sequence keeps equal times in arrival order.
        self.pending: list[tuple[float, int, bytes, Direction]] = []
        self.sequence = 0
        self.stopping = False

    def _read_packet(self) -> bytes | None:
        try:
            return self.packet.recv(FRAME_BUFFER)
        except BlockingIOError:
            return None
        except OSError as err:
            # The veth went down (a link-down fault): reported once; the socket rebinds when it comes back up.
            if err.errno != errno.ENETDOWN:
                raise
            return None

    def _read_tap(self) -> bytes | None:
        try:
            return os.read(self.tap_fd, FRAME_BUFFER)
        except BlockingIOError:
            return None

    def _admit(self, frame: bytes, direction: Direction, now: float) -> None:
        release = direction.release_time(now)
        if release is not None:
            heapq.heappush(self.pending, (release, self.sequence, frame, direction))
            self.sequence += 1

    def _send(self, frame: bytes, direction: Direction) -> None:
        try:
            if direction is self.to_switch:
                os.write(self.tap_fd, frame)
            else:
                self.packet.send(frame)
            direction.bytes += len(frame) - VNET_HDR_BYTES
        except OSError as err:
            # A full queue downstream (the tbf behind the veth, the bridge) drops the frame as a router would; so
            # does a TAP not up yet (EIO: frames can arrive before the harness has put it in the bridge).
            if err.errno not in (errno.ENOBUFS, errno.EAGAIN, errno.ENETDOWN, errno.EIO):
                raise
            direction.send_errors += 1

    def _read_start(self) -> None:
        """The harness's one line on stdin, "start <CLOCK_MONOTONIC seconds>": the delay schedule's zero (the same
        clock in every namespace of the host). Listened for once; an end of file (no start) leaves the first row."""
        words = os.read(0, 256).decode(errors="replace").split()
        self.selector.unregister(0)
        if len(words) == 2 and words[0] == "start":
            self.to_switch.started_at = self.to_cluster.started_at = float(words[1])

    def run(self) -> None:
        # select(2) sleeps to the microsecond; epoll (the default selector) rounds its timeout up to whole
        # milliseconds, which added 0-1 ms to every hop.
        selector = self.selector = selectors.SelectSelector()
        selector.register(self.packet, selectors.EVENT_READ, (self._read_packet, self.to_switch))
        selector.register(self.tap_fd, selectors.EVENT_READ, (self._read_tap, self.to_cluster))
        if self.to_switch.schedule is not None:
            selector.register(0, selectors.EVENT_READ, (self._read_start, None))
        while not self.stopping:
            now = time.monotonic()
            while self.pending and self.pending[0][0] <= now:
                _, _, frame, direction = heapq.heappop(self.pending)
                self._send(frame, direction)
            timeout = max(0.0, self.pending[0][0] - now) if self.pending else 0.5
            for key, _ in selector.select(timeout):
                read, direction = key.data
                for _ in range(READ_BATCH):
                    frame = read()
                    if frame is None:
                        break
                    self._admit(frame, direction, time.monotonic())

    def counters(self) -> dict:
        return {"to_switch": self.to_switch.counters(), "to_cluster": self.to_cluster.counters()}


def delay_line_log_name(cluster: int) -> str:
    """The delay line of cluster `cluster` logs here, in a run's logs/ (its counters are its last line)."""
    return f"delayline-c{cluster}.log"


def read_counters(log: Path) -> dict | None:
    """The counters a delay line wrote on its stderr (`log`) when it was stopped: {"to_switch": {...}, "to_cluster":
    {...}}; None when it wrote none (it never ran, or was killed)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            counters = json.loads(line)
        except ValueError:
            continue
        if isinstance(counters, dict) and {"to_switch", "to_cluster"} <= set(counters):
            return counters
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.net.delayline", description=__doc__.splitlines()[0])
    parser.add_argument("--run-key", required=True, help="the run this link belongs to (for `harness cleanup`)")
    parser.add_argument("--veth", required=True, help="the switch end of the cluster's veth")
    parser.add_argument("--tap", required=True, help="the TAP device to create and forward into")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="this hop's delay, each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--loss-pct", type=float, default=0.0, help="this hop's loss, each direction")
    parser.add_argument("--reorder", action="store_true", help="let jitter reorder frames")
    parser.add_argument(
        "--delay-trace",
        type=DelaySchedule.parse,
        help='this hop\'s delay over time, "seconds:ms,...", instead of --delay-ms; its zero comes on stdin',
    )
    parser.add_argument(
        "--ge-p", type=float, help="bursty loss (Gilbert-Elliott) of the frames the cluster sends: P(good -> bad)"
    )
    parser.add_argument("--ge-r", type=float, help="P(bad -> good); default 1 - p, as netem")
    parser.add_argument("--ge-h", type=float, default=0.0, help="P(a frame is delivered in the bad state)")
    parser.add_argument("--ge-k", type=float, default=1.0, help="P(a frame is delivered in the good state)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, help="the harness: exit if it is already gone")
    args = parser.parse_args(argv)
    set_parent_death_signal(signal.SIGTERM)
    if args.parent_pid is not None and os.getppid() != args.parent_pid:
        return 1  # the harness died before the parent-death signal was armed: nobody would stop this process
    scheduling = use_realtime_priority()

    def direction(offset: int, loss_model: GilbertElliott | None = None) -> Direction:
        return Direction(
            args.delay_ms / 1000, args.jitter_ms / 1000, args.loss_pct / 100, args.reorder, args.seed * 2 + offset,
            schedule=args.delay_trace, loss_model=loss_model,
        )  # fmt: skip

    bursty = None
    if args.ge_p is not None:
        bursty = GilbertElliott(args.ge_p, 1 - args.ge_p if args.ge_r is None else args.ge_r, args.ge_h, args.ge_k)
    # The loss model once per path direction: on what this cluster sends only (module doc).
    line = DelayLine(args.veth, args.tap, to_switch=direction(0, bursty), to_cluster=direction(1))

    def stop(signum: int, frame: object) -> None:
        line.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness stops us, in order, after its workers
    print(f"ready {line.tap} {scheduling}", flush=True)
    line.run()
    print(json.dumps(line.counters()), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
