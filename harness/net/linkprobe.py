"""The emulated WAN link, measured before training: RTT, one-way delay (jitter) and loss between two clusters.

A UDP echo: `serve` runs in cluster 1's namespace and echoes each probe with the time it arrived; `probe` runs in
cluster 0's, sends probes at a steady pace and reads the echoes. Both namespaces share the host's clock, so one-way
delay is arrival minus departure, with no clock sync to trust. Arrivals are the kernel's receive timestamps
(SO_TIMESTAMPNS), so how late a probe process is scheduled does not count as delay. Forward loss is 1 - (probes the
server received / probes sent), asked of the server at the end; RTT is each echoed probe's round trip.

Probes are small and paced at most at a twentieth of the link rate, so tbf never queues nor drops them: what is
measured is
the emulator's delay and loss, not the shaper's queue. `check_link` runs both, compares with the profile and
returns the summary's `link_*` fields; the histogram goes to link_check.json.

`loaded_link` (run by `harness calibrate` and `harness run --calibrate`) measures the same round trip while two
bulk TCP streams fill the link both ways, as a ring all-reduce does: the RTT behind both shapers' queues
(`link_loaded_rtt_ms`), each stream's goodput and the fraction of segments they retransmitted.

A run whose median RTT misses the profile's by more than max(5%, 1 ms) (plus twice the jitter, which a FIFO link
without reordering shifts upwards), or whose loss misses by more than 20% relative plus three binomial standard
errors (widened by a loss model's dispersion: bursty losses make the count vary more), is flagged
`link_check_ok: false` (the CLI says so; the run still trains).
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.net.counters import parse_tcp_snmp

PORT = 29431
# seq, departure (ns, CLOCK_REALTIME), arrival at the server (the kernel's timestamp), the echo's departure, then
# padding. RTT leaves out the time between the server's arrival and echo: a busy server is not a slow link.
SO_TIMESTAMPNS = 35  # = SCM_TIMESTAMPNS; not exported by Python's socket module
TIMESPEC = struct.Struct("qq")
PROBE = struct.Struct("!qqqq")
PROBE_BYTES = 200
REPORT_SEQ = -1  # a probe asking the server how many probes it received
MAX_PROBES = 10_000
PROBE_WINDOW_S = 2.0
RATE_SHARE = 0.05
RTT_TOLERANCE = 0.05
RTT_TOLERANCE_MS = 1.0
LOSS_TOLERANCE = 0.2
HISTOGRAM_BIN_MS = 0.25


def _stamped_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    return sock


def _receive(sock: socket.socket) -> tuple[bytes, Any, int]:
    """(datagram, sender, the kernel's arrival time in ns)."""
    data, ancillary, _, peer = sock.recvmsg(2048, 64)
    arrived = time.time_ns()
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            seconds, nanoseconds = TIMESPEC.unpack_from(payload)
            arrived = seconds * 1_000_000_000 + nanoseconds
    return data, peer, arrived


def serve(bind: str, port: int, idle_s: float) -> dict:
    """Echo probes until none arrived for `idle_s` after the first; returns how many arrived."""
    sock = _stamped_socket()
    sock.bind((bind, port))
    print("ready", flush=True)
    received = 0
    while True:
        try:
            data, peer, arrived = _receive(sock)
        except TimeoutError:
            return {"received": received}
        sock.settimeout(idle_s)
        seq, sent, _, _ = PROBE.unpack_from(data)
        if seq == REPORT_SEQ:
            sock.sendto(PROBE.pack(REPORT_SEQ, received, arrived, 0), peer)
        else:
            received += 1
            sock.sendto(PROBE.pack(seq, sent, arrived, time.time_ns()) + data[PROBE.size :], peer)


def probe(target: str, port: int, count: int, pps: float) -> dict:
    """Send `count` probes at `pps`, then ask for the server's count; every time in ms."""
    sock = _stamped_socket()
    sock.connect((target, port))
    padding = bytes(PROBE_BYTES - PROBE.size)
    rtt_ms: list[float] = []
    one_way_ms: list[float] = []

    def drain() -> None:
        while True:
            try:
                data, _, back = _receive(sock)
            except BlockingIOError:
                return
            seq, sent, arrived, echoed = PROBE.unpack_from(data)
            if seq >= 0:
                rtt_ms.append((back - sent - (echoed - arrived)) / 1e6)
                one_way_ms.append((arrived - sent) / 1e6)

    # One exchange before the clock starts: the first packets would otherwise wait for address resolution (ARP),
    # itself a round trip over the emulated link.
    _ask_count(sock)
    sock.setblocking(False)
    start = time.monotonic()
    for seq in range(count):
        due = start + seq / pps
        while (now := time.monotonic()) < due:
            drain()
            time.sleep(min(due - now, 0.001))
        try:
            sock.send(PROBE.pack(seq, time.time_ns(), 0, 0) + padding)
        except BlockingIOError:
            pass  # counted as lost: the sender's own buffer is full
    # Echoes still in flight: wait up to three times the slowest seen (at least 1 s).
    deadline = time.monotonic() + max(1.0, 3 * max(rtt_ms, default=0) / 1000)
    while time.monotonic() < deadline:
        drain()
        time.sleep(0.005)
    received = _ask_count(sock)
    return {"sent": count, "server_received": received, "rtt_ms": rtt_ms, "one_way_ms": one_way_ms}


def _ask_count(sock: socket.socket) -> int | None:
    """The server's count of probes received so far (asked up to 20 times, as the question may be lost)."""
    sock.setblocking(True)
    sock.settimeout(0.5)
    for _ in range(20):
        sock.send(PROBE.pack(REPORT_SEQ, 0, 0, 0))
        try:
            while True:
                seq, received, _, _ = PROBE.unpack_from(_receive(sock)[0])
                if seq == REPORT_SEQ:
                    return received
        except TimeoutError:
            continue
    return None


def plan(rate_bps: int | None) -> tuple[int, float]:
    """(probes, probes per second): at most MAX_PROBES within PROBE_WINDOW_S, at RATE_SHARE of the link rate."""
    pps = MAX_PROBES / PROBE_WINDOW_S
    if rate_bps:
        pps = min(pps, RATE_SHARE * rate_bps / (PROBE_BYTES * 8))
    return max(100, min(MAX_PROBES, int(pps * PROBE_WINDOW_S))), pps


def evaluate(
    measured: dict, rtt_target_ms: float, jitter_ms: float, loss_target: float, loss_dispersion: float = 1.0
) -> dict[str, Any]:
    """The summary's link_* fields from one probe's results; `loss_target` a fraction. `loss_dispersion`: how much
    more than binomially the count of lost probes varies (a loss model's bursts, harness/net/lossmodel.py)."""
    rtts = measured["rtt_ms"]
    sent, received = measured["sent"], measured["server_received"]
    rtt = statistics.median(rtts) if rtts else None
    loss = 1 - received / sent if received is not None and sent else None
    rtt_allowed = max(RTT_TOLERANCE * rtt_target_ms, RTT_TOLERANCE_MS) + 2 * jitter_ms
    rtt_ok = rtt is not None and abs(rtt - rtt_target_ms) <= rtt_allowed
    loss_allowed = LOSS_TOLERANCE * loss_target + 3 * math.sqrt(loss_dispersion * max(loss_target, 1 / sent) / sent)
    loss_ok = loss is not None and abs(loss - loss_target) <= loss_allowed
    one_way = sorted(measured["one_way_ms"])
    return {
        "link_rtt_ms": rtt,
        # The floor: a loaded host only makes an echo later, so the fastest one shows the delay the link was given.
        "link_rtt_min_ms": min(rtts) if rtts else None,
        "link_rtt_target_ms": rtt_target_ms,
        "link_one_way_delay_p50_ms": one_way[len(one_way) // 2] if one_way else None,
        "link_one_way_delay_p99_ms": one_way[int(len(one_way) * 0.99)] if one_way else None,
        "link_loss_measured": loss,
        "link_loss_target": loss_target,
        "link_probes": sent,
        "link_check_ok": rtt_ok and loss_ok,
    }


def histogram(values_ms: list[float], bin_ms: float = HISTOGRAM_BIN_MS) -> dict[str, list[float]]:
    """Counts per bin of width `bin_ms`, from the smallest value's bin up."""
    if not values_ms:
        return {"bin_start_ms": [], "count": []}
    first = math.floor(min(values_ms) / bin_ms)
    counts = [0] * (math.floor(max(values_ms) / bin_ms) - first + 1)
    for v in values_ms:
        counts[math.floor(v / bin_ms) - first] += 1
    return {"bin_start_ms": [(first + i) * bin_ms for i in range(len(counts))], "count": counts}


class LinkCheckFailed(Exception):
    """A probe of the link could not run; the message says why."""


def _between_clusters(
    cluster: Any, topology: Any, serve: list[str], send: list[str], timeout_s: float, server_ends: bool = False
) -> tuple[str, str]:
    """Run `python -m harness.net.linkprobe SERVE` in cluster 1, then `... SEND` in cluster 0; (sender's stdout, the
    server's). A server that ends by itself (`server_ends`) is waited for, any other is stopped once the sender is
    done."""
    module = [sys.executable, "-m", "harness.net.linkprobe"]
    server = subprocess.Popen(
        [*cluster.command_in(1), *module, *serve, "--bind", topology.cluster_address(1)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        if not server.stdout.readline().startswith("ready"):
            raise LinkCheckFailed(f"the link probe's server ({serve[0]}) did not start in cluster 1")
        try:
            sent = subprocess.run(
                [*cluster.command_in(0), *module, *send, "--target", topology.cluster_address(1)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=True,
            ).stdout
        except subprocess.CalledProcessError as err:
            last = (err.stderr or "").strip().splitlines()[-1:] or ["no output"]
            raise LinkCheckFailed(f"the link probe ({send[0]}) failed: {last[0]}") from None
        except subprocess.TimeoutExpired:
            raise LinkCheckFailed(f"the link probe ({send[0]}) took more than {timeout_s:.0f} s") from None
        if not server_ends:
            server.terminate()
        served, _ = server.communicate(timeout=30)
        return sent, served
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def check_link(cluster: Any, topology: Any, spec: Any, out: Path) -> dict[str, Any]:
    """Measure the link between clusters 0 and 1 of a netns cluster (`command_in`), write `out` (link_check.json:
    the histograms and raw figures) and return the summary's link_* fields."""
    count, pps = plan(spec.rate_bps)
    timeout_s = PROBE_WINDOW_S * 5 + 30 + 3 * spec.rtt_ms / 1000
    probe_args = ["probe", "--count", str(count), "--pps", repr(pps)]
    sent, _ = _between_clusters(cluster, topology, ["serve"], probe_args, timeout_s)
    measured = json.loads(sent)
    dispersion = spec.loss_model.loss_dispersion if spec.loss_model is not None else 1.0
    fields = evaluate(measured, spec.rtt_ms, spec.jitter_ms, spec.loss_fraction, dispersion)
    out.write_text(
        json.dumps(
            {
                **fields,
                "probe_bytes": PROBE_BYTES,
                "probes_per_s": pps,
                "rtt_histogram": histogram(measured["rtt_ms"]),
                "one_way_delay_histogram": histogram(measured["one_way_ms"]),
            },
            indent=2,
        )
    )
    return fields


# The loaded probe: two bulk TCP streams fill the link both ways, as a ring all-reduce does; the UDP probe then
# measures the round trip behind both queues, at a pace that adds nothing to them.
LOADED_PROBE_PPS = 50
LOADED_PROBE_S = 2.0
LOADED_PORTS = (PORT + 1, PORT + 2)


def loaded_link(cluster: Any, topology: Any, spec: Any) -> dict[str, Any]:
    """The link between clusters 0 and 1 under load. One TCP stream from 0 to 1 alone: its goodput
    (`link_single_stream_bps`), the fraction of segments retransmitted (`link_single_stream_retransmit_fraction`)
    and the round trip behind its queue (`link_loaded_rtt_one_way_ms`); then a stream each way, as a ring
    all-reduce loads the link: the round trip behind both queues (`link_loaded_rtt_ms`, idle RTT plus up to twice
    `queue_delay_ms`: a bufferbloated profile shows here)."""
    alone = _under_load(cluster, topology, spec, senders=(0,))
    both = _under_load(cluster, topology, spec, senders=(0, 1))
    return {
        "link_single_stream_bps": alone["goodputs_bps"][0],
        "link_single_stream_retransmit_fraction": alone["retransmitted"],
        "link_loaded_rtt_one_way_ms": alone["rtt_ms"],
        "link_loaded_rtt_ms": both["rtt_ms"],
    }


def _under_load(cluster: Any, topology: Any, spec: Any, senders: tuple[int, ...]) -> dict[str, Any]:
    """Bulk TCP streams from each of `senders` to the other cluster; once they had time to fill the queues, a paced
    UDP probe from cluster 0 measures the round trip behind them. The median RTT, each stream's goodput after the
    fill, and the fraction of segments the two clusters retransmitted meanwhile."""
    fill_s = max(1.0, 3 * (spec.queue_delay_ms or 0) / 1000)
    seconds = fill_s + LOADED_PROBE_S + 1.0
    module = [sys.executable, "-m", "harness.net.linkprobe"]
    address = [topology.cluster_address(0), topology.cluster_address(1)]
    processes: list[subprocess.Popen] = []

    def start(in_cluster: int, args: list[str], ready: bool) -> subprocess.Popen:
        process = subprocess.Popen(
            [*cluster.command_in(in_cluster), *module, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        processes.append(process)
        if ready and not process.stdout.readline().startswith("ready"):
            raise LinkCheckFailed(f"the loaded link probe's {args[0]} did not start in cluster {in_cluster}")
        return process

    try:
        sinks = [
            start(1 - sender, ["sink-tcp", "--bind", address[1 - sender], "--port", str(LOADED_PORTS[sender]),
                               "--warmup-s", repr(fill_s)], True)
            for sender in senders
        ]  # fmt: skip
        start(1, ["serve", "--bind", address[1]], True)
        before = [_tcp_counters(cluster, c) for c in (0, 1)]
        for sender in senders:
            start(sender, ["send-tcp", "--target", address[1 - sender], "--port", str(LOADED_PORTS[sender]),
                           "--seconds", repr(seconds)], False)  # fmt: skip
        time.sleep(fill_s)
        count = int(LOADED_PROBE_PPS * LOADED_PROBE_S)
        probe = start(
            0, ["probe", "--count", str(count), "--pps", repr(LOADED_PROBE_PPS), "--target", address[1]], False
        )
        rtts = json.loads(probe.communicate(timeout=seconds + 60)[0])["rtt_ms"]
        goodputs = [json.loads(sink.communicate(timeout=seconds + 60)[0])["goodput_bps"] for sink in sinks]
        after = [_tcp_counters(cluster, c) for c in (0, 1)]
    except (subprocess.TimeoutExpired, json.JSONDecodeError, KeyError) as err:
        raise LinkCheckFailed(f"the loaded link probe failed ({type(err).__name__}: {err})") from None
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    return {
        "rtt_ms": statistics.median(rtts) if rtts else None,
        "goodputs_bps": goodputs,
        "retransmitted": _retransmitted(before, after),
    }


def _tcp_counters(cluster: Any, in_cluster: int) -> dict[str, int]:
    """Cluster `in_cluster`'s namespace's TCP counters, read from inside it (/proc/net/snmp is per namespace)."""
    out = subprocess.run(
        [*cluster.command_in(in_cluster), "cat", "/proc/net/snmp"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return parse_tcp_snmp(out)


def _retransmitted(before: list[dict[str, int]], after: list[dict[str, int]]) -> float | None:
    """Retransmitted over sent segments in both clusters between two readings."""
    sent = sum(a["OutSegs"] - b["OutSegs"] for a, b in zip(after, before, strict=True))
    again = sum(a["RetransSegs"] - b["RetransSegs"] for a, b in zip(after, before, strict=True))
    return again / sent if sent else None


def tcp_goodput_bps(
    cluster: Any, topology: Any, seconds: float, warmup_s: float = 1.0, window_bytes: int | None = None
) -> float:
    """One TCP stream from cluster 0 to cluster 1: bits per second received after `warmup_s` (slow start).
    `window_bytes` clamps the receiver's advertised window (TCP_WINDOW_CLAMP): at most that much in flight."""
    sink = ["sink-tcp", "--warmup-s", repr(warmup_s), *(["--window-bytes", str(window_bytes)] if window_bytes else [])]
    send = ["send-tcp", "--seconds", repr(seconds + warmup_s)]
    _, received = _between_clusters(cluster, topology, sink, send, seconds + warmup_s + 60, server_ends=True)
    return json.loads(received)["goodput_bps"]


def sink_tcp(bind: str, port: int, warmup_s: float, window_bytes: int | None = None) -> dict:
    """Accept one TCP stream and read it to its end; bits per second after the first `warmup_s`."""
    listener = socket.create_server((bind, port))
    if window_bytes:
        # A fixed receive buffer stops autotuning, which would otherwise raise the clamp below as it grows the
        # buffer; set before the handshake, so the window scale can express it.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, window_bytes)
    print("ready", flush=True)
    connection, _ = listener.accept()
    if window_bytes:
        # The receiver never advertises more than this, so no more is ever in flight; its buffer stays fixed (and
        # autotuning off) on the connection too.
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, window_bytes)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, window_bytes)
    started = time.monotonic()
    counted = 0
    counting_from = None
    while data := connection.recv(1 << 20):
        now = time.monotonic()
        if now - started >= warmup_s:
            counting_from = counting_from or now
            counted += len(data)
    elapsed = time.monotonic() - counting_from if counting_from else 0
    return {"goodput_bps": counted * 8 / elapsed if elapsed else 0.0}


def send_tcp(target: str, port: int, seconds: float) -> None:
    """Send as fast as TCP lets for `seconds`."""
    chunk = bytes(1 << 20)
    with socket.create_connection((target, port)) as sock:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            sock.sendall(chunk)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.net.linkprobe", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("serve", "sink-tcp"):
        server = commands.add_parser(name)
        server.add_argument("--bind", required=True)
        server.add_argument("--port", type=int, default=PORT)
    commands.choices["serve"].add_argument("--idle-s", type=float, default=5.0)
    commands.choices["sink-tcp"].add_argument("--warmup-s", type=float, default=1.0)
    commands.choices["sink-tcp"].add_argument("--window-bytes", type=int)
    for name in ("probe", "send-tcp"):
        client = commands.add_parser(name)
        client.add_argument("--target", required=True)
        client.add_argument("--port", type=int, default=PORT)
    commands.choices["probe"].add_argument("--count", type=int, required=True)
    commands.choices["probe"].add_argument("--pps", type=float, required=True)
    commands.choices["send-tcp"].add_argument("--seconds", type=float, required=True)
    args = parser.parse_args(argv)
    if args.command == "serve":
        print(json.dumps(serve(args.bind, args.port, args.idle_s)), flush=True)
    elif args.command == "sink-tcp":
        print(json.dumps(sink_tcp(args.bind, args.port, args.warmup_s, args.window_bytes)), flush=True)
    elif args.command == "probe":
        print(json.dumps(probe(args.target, args.port, args.count, args.pps)))
    else:
        send_tcp(args.target, args.port, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
